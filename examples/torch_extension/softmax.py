"""A torch extension source file (softmax.cu: a kernel, TORCH_LIBRARY registration with a Meta
kernel) built by vitrail.jit.load, as torch.utils.cpp_extension.load would: its op is
torch.ops.vitrail_example.softmax, and torch.compile traces it."""
from __future__ import annotations

from pathlib import Path

import torch

from vitrail import jit

SOURCE = Path(__file__).with_name("softmax.cu")


def module(build_only: bool = False):
    """Build (first use) and load the extension, which registers its op; build_only: the built
    library's path (no GPU needed)."""
    return (jit.extension.build if build_only else jit.load)("vitrail_example_softmax",
                                                              [str(SOURCE)])


def softmax(x: torch.Tensor) -> torch.Tensor:
    module()
    return torch.ops.vitrail_example.softmax(x)
