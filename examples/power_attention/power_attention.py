"""A chunked power-attention layer on vitrail's fused sympow matmuls, trained a few steps.

Power attention replaces softmax(q.k) with (q.k)^p. With phi = sympow (duplicate-corrected),
phi(q).phi(k) = (q.k)^p, so causal attention splits into chunks of c positions:

    state of chunk j   S_j = sum over chunks i < j of phi(K_i)^T [V_i, 1]    (sympow_mma, expand M)
    output of chunk j  Y_j = phi(Q_j) S_j  +  causal((Q_j K_j^T)^p) [V_j, 1]  (sympow_mma, expand K)

and the last column (the ones appended to V) is the normaliser. The expanded features phi(.)
(D = C(d/t + p - 1, p) t^p per head) are never stored: the state update and the query multiply
build them tile by tile in shared memory. Run: python examples/power_attention/power_attention.py
"""
from __future__ import annotations

import math

import torch
from torch import nn

from vitrail import ops
from vitrail.ops.sympow.reference import sympow_reference


def power_attention(q, k, v, *, power=2, d_tile=8, chunk=128, fused=True):
    """q, k [B, H, T, d], v [B, H, T, e] -> [B, H, T, e] (causal, normalised)."""
    B, H, T, d = q.shape
    e = v.shape[-1]
    n = T // chunk
    assert n * chunk == T, "T must be a multiple of chunk"
    ones = torch.ones(v.shape[:-1] + (1,), dtype=v.dtype, device=v.device)
    v1 = torch.cat([v, ones], -1)                                  # [B, H, T, e+1]
    qc = q.reshape(B * H * n, chunk, d)
    kc = k.reshape(B * H * n, chunk, d)
    vc = v1.reshape(B * H * n, chunk, e + 1)
    if fused:
        states = ops.sympow_mma(kc.transpose(1, 2), vc, -2, power, d_tile)  # [BHn, D, e+1]
    else:
        states = sympow_reference(kc, power, d_tile, dim=-1).transpose(1, 2).to(v.dtype) @ vc
    D = states.shape[1]
    states = states.reshape(B * H, n, D, e + 1)
    # exclusive prefix sum over chunks: chunk j sees the states of chunks before it
    prev = torch.cumsum(states.float(), 1) - states.float()
    prev = prev.to(q.dtype).reshape(B * H * n, D, e + 1)
    if fused:
        inter = ops.sympow_mma(qc, prev, -1, power, d_tile)                # [BHn, c, e+1]
    else:
        inter = sympow_reference(qc, power, d_tile).to(q.dtype) @ prev
    scores = (qc @ kc.transpose(1, 2)).float() ** power
    mask = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    intra = (scores.masked_fill(~mask, 0.0).to(v.dtype) @ vc)
    y = (inter.float() + intra.float())
    y = y[..., :e] / (y[..., e:] + 1e-6)
    return y.to(v.dtype).reshape(B, H, T, e)


class PowerAttention(nn.Module):
    def __init__(self, width=256, heads=4, head_dim=32, power=2, d_tile=8, chunk=128,
                 fused=True):
        super().__init__()
        self.h, self.d, self.p, self.t, self.c, self.fused = heads, head_dim, power, d_tile, \
            chunk, fused
        self.qkv = nn.Linear(width, 3 * heads * head_dim, bias=False)
        self.out = nn.Linear(heads * head_dim, width, bias=False)

    def forward(self, x):                                          # x [B, T, width]
        B, T, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, T, 3, self.h, self.d).permute(2, 0, 3, 1, 4)
        # unit-norm q, k scaled so that (q.k)^p stays in a friendly range
        q = nn.functional.normalize(q, dim=-1) * self.d ** 0.25
        k = nn.functional.normalize(k, dim=-1) * self.d ** 0.25
        y = power_attention(q.contiguous(), k.contiguous(), v.contiguous(), power=self.p,
                            d_tile=self.t, chunk=self.c, fused=self.fused)
        return self.out(y.transpose(1, 2).reshape(B, T, self.h * self.d))


def train(steps=5, fused=True, dtype=torch.bfloat16, seed=0, T=512, width=128):
    """A few Adam steps on random data; returns the losses."""
    torch.manual_seed(seed)
    model = PowerAttention(width=width, fused=fused).cuda().to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    x = torch.randn(2, T, width, device="cuda", dtype=dtype)
    target = torch.randn(2, T, width, device="cuda", dtype=dtype)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x).float(), target.float())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    losses = train(steps=10)
    print("losses:", " ".join(f"{v:.4f}" for v in losses))
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
