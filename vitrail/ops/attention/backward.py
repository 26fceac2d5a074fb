"""The attention backward on torch's batched matmuls: flash attention's recomputation, one block
of query rows at a time, so memory stays bounded at any sequence length.

For a block of query rows (all the query heads that share a key/value head, GQA's group, stacked
as rows), with P recomputed from the forward's log-sum-exp and Di = rowsum(dO * O) - dlse:

    S  = Q K^T                 (fp32 out of bf16/fp16 operands)
    P  = exp(S * scale - lse)  (0 where the causal mask or the window hides the key; with a
                                softcap, exp(c tanh(S * scale / c) - lse))
    dV += P^T dO               (P rounded to the input dtype, as the fused kernels do; fp32 sums)
    dP = dO V^T                (fp32)
    dS = P * (dP - Di)         (softcap: times 1 - tanh^2, the cap's derivative)
    dQ = dS K * scale,  dK += dS^T Q * scale

The products take operands in the input dtype and give fp32 (``torch.bmm(..., out_dtype=)``),
so S and dP are exact to fp32 accumulation, and dK, dV accumulate in fp32 across the blocks.
Causal blocks stop at the last key any of their rows sees, windowed ones start at the first.
On a CPU tensor (the tests' fp64 reference runs) the same algebra runs in fp32 or better.
"""
from __future__ import annotations

import torch
from torch import Tensor

TILE_ELEMENTS = 1 << 26  # fp32 elements of one block's S (256 MiB): sets the rows per block


def _mm(a: Tensor, b: Tensor, acc: Tensor | None = None) -> Tensor:
    """a @ b (batched) in fp32 from operands in their own dtype; added to acc when given."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        out = torch.bmm(a, b, out_dtype=torch.float32)
    else:
        wide = torch.promote_types(a.dtype, torch.float32)
        out = torch.bmm(a.to(wide), b.to(wide))
    return out if acc is None else acc.add_(out)


def rows_per_block(batch_heads: int, seqlen_k: int, seqlen_q: int) -> int:
    """Query rows per block so that one fp32 S of the block holds TILE_ELEMENTS at most."""
    rows = TILE_ELEMENTS // max(1, batch_heads * seqlen_k)
    return max(1, min(seqlen_q, rows))


def attention_backward(grad_o: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
                       o: Tensor, lse: Tensor, scale: float, causal: bool,
                       causal_offset: int, local: bool = False, local_offset: int = 0,
                       softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of ``attention``'s forward, in the layouts and dtypes of q, k and v. The
    mask as the forward's: key j visible to query i where j <= i + causal_offset (causal) and
    j >= i + local_offset (local); softcap > 0: the scores were capped with tanh.

    q: (B, Sq, H, D); k: (B, Sk, Hkv, D); v: (B, Sk, Hkv, Dv); o, grad_o: (B, Sq, H, Dv); lse,
    grad_lse: (B, H, Sq), fp32. Dv may differ from D."""
    b, sq, h, d = q.shape
    sk, hk, d_v = k.shape[1], k.shape[2], v.shape[3]
    g = h // hk
    wide = torch.promote_types(q.dtype, torch.float32)  # S, P, dS and the sums over blocks
    dq = q.new_zeros(q.shape)
    dk32 = k.new_zeros((b * hk, sk, d), dtype=wide)
    dv32 = k.new_zeros((b * hk, sk, d_v), dtype=wide)
    if min(q.numel(), k.numel()) > 0:
        # a query head's rows next to the others of its group: (B * Hkv, G, Sq, D or Dv)
        def grouped(t: Tensor) -> Tensor:
            w = t.shape[3]
            return t.reshape(b, sq, hk, g, w).permute(0, 2, 3, 1, 4).reshape(b * hk, g, sq, w)

        kk = k.permute(0, 2, 1, 3).reshape(b * hk, sk, d)
        vv = v.permute(0, 2, 1, 3).reshape(b * hk, sk, d_v)
        qq, dd = grouped(q), grouped(grad_o)
        di = (grad_o.to(wide) * o.to(wide)).sum(-1).permute(0, 2, 1)  # (B, H, Sq)
        if grad_lse is not None:
            di = di - grad_lse
        di = di.reshape(b * hk, g, sq)
        ll = lse.reshape(b * hk, g, sq)
        dq_grouped = q.new_empty((b * hk, g, sq, d))
        step = rows_per_block(b * h, sk, sq)
        for i0 in range(0, sq, step):
            i1 = min(sq, i0 + step)
            n = i1 - i0
            # the keys any row of the block sees: [kbeg, kend)
            kend = max(0, min(sk, i1 + causal_offset)) if causal else sk
            kbeg = min(kend, max(0, i0 + local_offset)) if local else 0
            if kend == kbeg:
                dq_grouped[:, :, i0:i1].zero_()
                continue
            m = kend - kbeg
            qc = qq[:, :, i0:i1].reshape(b * hk, g * n, d)
            dc = dd[:, :, i0:i1].reshape(b * hk, g * n, d_v)
            kc, vc = kk[:, kbeg:kend], vv[:, kbeg:kend]
            p = _mm(qc, kc.transpose(1, 2)).view(b * hk, g, n, m).mul_(scale)
            lse_c = ll[:, :, i0:i1, None]
            if softcap > 0:
                t = p.div_(softcap).tanh_()
                p = t * softcap
            p.sub_(lse_c).exp_()
            i = torch.arange(i0, i1, device=q.device)[:, None]
            j = torch.arange(kbeg, kend, device=q.device)[None, :]
            if causal:
                p.masked_fill_(j > i + causal_offset, 0.0)
            if local:
                p.masked_fill_(j < i + local_offset, 0.0)
            p.masked_fill_(torch.isinf(lse_c), 0.0)  # a row that sees no key: lse -inf
            p = p.view(b * hk, g * n, m)
            p_low = p.to(q.dtype)
            _mm(p_low.transpose(1, 2), dc, dv32[:, kbeg:kend])
            ds = _mm(dc, vc.transpose(1, 2)).view(b * hk, g, n, m)
            ds.sub_(di[:, :, i0:i1, None]).mul_(p.view(b * hk, g, n, m))
            if softcap > 0:
                ds.mul_(1 - t * t)
            ds_low = ds.view(b * hk, g * n, m).to(q.dtype)
            _mm(ds_low.transpose(1, 2), qc, dk32[:, kbeg:kend])
            dq_c = _mm(ds_low, kc).mul_(scale)
            dq_grouped[:, :, i0:i1] = dq_c.view(b * hk, g, n, d).to(q.dtype)
        dq.copy_(dq_grouped.reshape(b, hk, g, sq, d).permute(0, 3, 1, 2, 4).reshape(b, sq, h, d))
    dk = (dk32 * scale).to(k.dtype).reshape(b, hk, sk, d).permute(0, 2, 1, 3)
    dv = dv32.to(v.dtype).reshape(b, hk, sk, d_v).permute(0, 2, 1, 3)
    return dq, dk.contiguous(), dv.contiguous()
