"""Plain-torch references of softmax and log_softmax, forward and backward, computed in fp64."""
from __future__ import annotations

import torch


def softmax(x: torch.Tensor, dim: int = -1, log: bool = False) -> torch.Tensor:
    xd = x.double()
    return (torch.log_softmax(xd, dim) if log else torch.softmax(xd, dim))


def softmax_backward(y: torch.Tensor, dy: torch.Tensor, dim: int = -1,
                     log: bool = False) -> torch.Tensor:
    """dx from the forward output y and the output gradient dy."""
    yd, gd = y.double(), dy.double()
    if log:
        return gd - torch.exp(yd) * gd.sum(dim, keepdim=True)
    return yd * (gd - (gd * yd).sum(dim, keepdim=True))
