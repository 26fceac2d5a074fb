"""vitrail.ops.conv2d on a Hopper GPU against an fp64 reference (torch's conv2d in float64):
fprop with bias and activations, dgrad and wgrad through autograd and through the gemm-level
ConvArguments, odd sizes (H, W of 1, 7, 33), strides 1 and 2, padding, dilation. Skipped
without CUDA; the kernels are sm_90a."""
from __future__ import annotations

import warnings

import pytest
import torch

from tests.conftest import has_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not has_gpu() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs a Hopper (sm_90) GPU"),
    pytest.mark.warm_cache]  # --kernel-cache: the conv kernels (about 60 s each) built once

SIZES = [(1, 1), (7, 7), (33, 7), (1, 33), (33, 33)]
GEOMETRY = [  # (R, S, stride, padding, dilation); 1x1 unpadded: vitrail's GEMM (at stride 1)
    (1, 1, 1, 0, 1), (1, 1, 2, 0, 1), (3, 3, 1, 1, 1), (3, 3, 2, 1, 1), (3, 3, 1, 2, 2),
    (5, 3, 2, (2, 1), 1), (2, 2, 2, 0, 1)]


def _tensors(N, C, H, W, K, R, S, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(N, C, H, W, device="cuda", generator=g).to(dtype)
    w = (torch.randn(K, C, R, S, device="cuda", generator=g) / (C * R * S) ** 0.5).to(dtype)
    cl = torch.channels_last
    return x.contiguous(memory_format=cl), w.contiguous(memory_format=cl)


def _fits(H, W, R, S, padding, dilation) -> bool:
    p = padding if isinstance(padding, tuple) else (padding, padding)
    d = dilation if isinstance(dilation, tuple) else (dilation, dilation)
    return all(n + 2 * pp - dd * (k - 1) - 1 >= 0
               for n, pp, dd, k in zip((H, W), p, d, (R, S)))


def _close(got, want, dtype, what):
    tol = 2e-2 if dtype is torch.bfloat16 else 4e-3
    err = (got.double() - want).abs().max().item()
    scale = want.abs().max().item() + 1.0
    assert err <= tol * scale, f"{what}: max error {err} (scale {scale})"


def _against_fp64(op, reference, x, w, b):
    """op(x, w, b) (bf16) and its gradients of x, w and b against reference's on fp64 copies,
    through one upstream gradient: y channels-last, every value within _close."""
    x, w, b = (t.detach().requires_grad_(True) for t in (x, w, b))
    x64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (x, w, b))
    y, y64 = op(x, w, b), reference(x64, w64, b64)
    assert y.shape == y64.shape and y.is_contiguous(memory_format=torch.channels_last)
    _close(y, y64, torch.bfloat16, "y")
    g = torch.randn_like(y64).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    y.backward(g)
    y64.backward(g.double())
    for got, want, what in ((x.grad, x64.grad, "dx"), (w.grad, w64.grad, "dw"),
                            (b.grad, b64.grad, "dbias")):
        _close(got, want, torch.bfloat16, what)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H, W", SIZES)
@pytest.mark.parametrize("R, S, stride, padding, dilation", GEOMETRY)
def test_fprop_dgrad_wgrad_against_fp64(dtype, H, W, R, S, stride, padding, dilation):
    from vitrail.ops import conv2d
    if not _fits(H, W, R, S, padding, dilation):
        pytest.skip("the dilated filter is larger than the padded input")
    N, C, K = 2, 16, 24
    x, w = _tensors(N, C, H, W, K, R, S, dtype)
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = conv2d(x, w, stride=stride, padding=padding, dilation=dilation)
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    y64 = torch.nn.functional.conv2d(x64, w64, None, stride, padding, dilation)
    assert y.shape == y64.shape and y.is_contiguous(memory_format=torch.channels_last)
    _close(y, y64, dtype, "y")
    g = torch.randn_like(y64).to(dtype).contiguous(memory_format=torch.channels_last)
    y.backward(g)
    y64.backward(g.double())
    _close(x.grad, x64.grad, dtype, "dx")
    _close(w.grad, w64.grad, dtype, "dw")


@pytest.mark.parametrize("config", ["wide", "narrow", "narrow, 3 stages", "wide, cooperative",
                                    "narrow, cooperative"])
@pytest.mark.parametrize("C, K", [(16, 24), (72, 136), (136, 64), (64, 200)])
def test_every_tile_and_stage_count(C, K, config, monkeypatch):
    """Each config of the space (configs.space: the wide tile, the narrow one with a deep and with
    a short pipeline, the persistent cooperative kernel on tiles of 128 rows), whatever the
    heuristic would take, runs every kernel of conv2d's forward and backward (fprop with bias
    and relu, dgrad, wgrad) against fp64 through autograd."""
    from vitrail.op import Op
    from vitrail.ops import conv2d
    from vitrail.ops.conv import configs
    bf = torch.bfloat16
    tile, _, rest = config.partition(", ")

    def forced(self, problem_key, problem, args=()):
        kind = self.name.split(".")[1]
        narrow = configs.NARROW[kind]
        # wgrad's narrow tile has 64 rows, and chunked or phased launches are not persistent:
        # those keep the non-persistent kernel
        coop = rest == "cooperative" and (tile == "wide" or narrow.startswith("128")) and \
            not any(p in self.name for p in ("partials", "phased"))
        return self.space.config(tile=configs.WIDE if tile == "wide" else narrow,
                                 stages=max(configs.STAGES) if rest == "3 stages" else 0,
                                 schedule="cooperative" if coop else "warpspecialized")
    monkeypatch.setattr(Op, "config", forced)
    x, w = _tensors(3, C, 33, 7, K, 3, 3, bf, seed=9)
    b = torch.randn(K, device="cuda").to(bf)
    _against_fp64(lambda x, w, b: conv2d(x, w, b, padding=1, activation="relu"),
                  lambda x, w, b: torch.relu(torch.nn.functional.conv2d(x, w, b, 1, 1)), x, w, b)


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "silu", "leaky_relu", "tanh"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bias_and_activation(activation, dtype):
    from vitrail.ops import conv2d
    from vitrail.ops.conv import reference
    N, C, H, W, K = 3, 32, 33, 7, 40
    x, w = _tensors(N, C, H, W, K, 3, 3, dtype, seed=1)
    b = torch.randn(K, device="cuda").to(dtype).requires_grad_(True)
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = conv2d(x, w, b, stride=2, padding=1, activation=activation)
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    b64 = b.detach().double().requires_grad_(True)
    y64 = reference(x64, w64, b64, stride=2, padding=1, activation=activation)
    _close(y, y64, dtype, "y")
    g = torch.randn_like(y64).to(dtype).contiguous(memory_format=torch.channels_last)
    y.backward(g)
    y64.backward(g.double())
    for got, want, what in ((x.grad, x64.grad, "dx"), (w.grad, w64.grad, "dw"),
                            (b.grad, b64.grad, "dbias")):
        _close(got, want, dtype, what)


def test_padding_same_is_asymmetric_as_torch():
    from vitrail.ops import conv2d
    x, w = _tensors(2, 16, 7, 33, 16, 2, 4, torch.float16, seed=2)
    y = conv2d(x, w, padding="same", dilation=(1, 2))
    want = torch.nn.functional.conv2d(x.double(), w.double(), padding="same", dilation=(1, 2))
    _close(y, want, torch.float16, "same")


def test_an_input_expanded_over_the_batch():
    """x broadcast over N (stride 0): copied once for TMA, the values as torch's."""
    from vitrail.ops import conv2d
    x, w = _tensors(1, 16, 9, 9, 16, 3, 3, torch.bfloat16, seed=3)
    x = x.expand(3, -1, -1, -1)
    with warnings.catch_warnings():  # said once a process: another test may have heard it
        warnings.simplefilter("ignore")
        y = conv2d(x, w, padding=1)
    _close(y, torch.nn.functional.conv2d(x.double(), w.double(), padding=1), torch.bfloat16,
           "expanded")


def test_one_kernel_serves_every_size():
    """Static config, dynamic shapes: every problem of a kind and tile class (here more than 64
    output channels) runs the one compiled kernel."""
    from vitrail.ops import conv2d
    from vitrail.ops.conv import kernel, kernel_problem
    keys = set()
    for H, W, C, K in ((7, 7, 16, 96), (33, 1, 64, 80), (1, 33, 8, 128)):
        x, w = _tensors(1, C, H, W, K, 3, 3, torch.bfloat16)
        _close(conv2d(x, w, padding=1),
               torch.nn.functional.conv2d(x.double(), w.double(), padding=1), torch.bfloat16,
               f"C{C} K{K} {H}x{W}")
        problem, _ = kernel_problem("fprop", 1, C, (H, W), K, (3, 3), (1, 1), (1, 1), (1, 1),
                                    (1, 1))
        keys.add(kernel("fprop", torch.bfloat16, problem).compile().key)
    assert len(keys) == 1


def test_gemm_level_arguments_fprop_with_residual():
    """vitrail.gemm: a ConvOperation on NHWC/KRSC tensors, y = conv(x, w) + beta * c."""
    from vitrail.gemm import (ConvArguments, ConvOperation, LinearCombination, MathInstruction,
                              TensorDescription)
    from vitrail.gemm.conv import default_tile
    t = TensorDescription("bf16")
    op = ConvOperation("fprop", t, t, t, MathInstruction("bf16", "bf16"), default_tile(),
                       LinearCombination("bf16", element_source="bf16"))
    x, w = _tensors(2, 16, 33, 7, 32, 3, 3, torch.bfloat16, seed=3)
    c = torch.randn(2, 33, 7, 32, device="cuda").to(torch.bfloat16)  # NPQK
    args = ConvArguments.from_tensors(op, x.permute(0, 2, 3, 1), w.permute(0, 2, 3, 1), c=c,
                                      padding=1, beta=0.5)
    assert op.can_implement(args) == []
    op.run(args)
    want = torch.nn.functional.conv2d(x.double(), w.double(), padding=1).permute(0, 2, 3, 1) \
        + 0.5 * c.double()
    _close(args.output, want, torch.bfloat16, "y + 0.5 c")


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
def test_cooperative_kernels(kind):
    """TileDescription(kernel_schedule='cooperative'): the conv mainloop under the GEMM's
    persistent cooperative kernel (include/vitrail/sm90_conv_cooperative.cuh), on problems of
    more tiles than SMs (each CTA loops) with partial tiles at both edges: every element of a
    NaN-filled output written, each against fp64. fprop with its bias and relu and a strided,
    dilated, padded geometry; dgrad at unit stride; wgrad's long K (N P Q)."""
    from vitrail.gemm import (ConvArguments, ConvOperation, LinearCombination, MathInstruction,
                              TensorDescription, TileDescription)
    t = TensorDescription("bf16")
    tile = TileDescription((128, 128, 64), kernel_schedule="cooperative")
    fprop = kind == "fprop"
    op = ConvOperation(kind, t, t, t, MathInstruction("bf16", "bf16"), tile,
                       LinearCombination("bf16", bias="col" if fprop else None,
                                         activation="relu" if fprop else None))
    assert "_coop" in op.name
    N, C, H, W, K = 9, 40, 37, 29, 200
    stride, dilation = (2, 2) if fprop else (1, 1)
    x, w = _tensors(N, C, H, W, K, 3, 3, torch.bfloat16, seed=11)
    b = torch.randn(K, device="cuda").to(torch.bfloat16)
    nhwc = (lambda v: v.permute(0, 2, 3, 1))
    x64, w64 = x.double(), w.double()
    y64 = torch.nn.functional.conv2d(x64, w64, padding=2, stride=stride, dilation=dilation)
    dy = torch.randn(y64.shape, device="cuda").to(torch.bfloat16).contiguous(
        memory_format=torch.channels_last)
    if fprop:
        d = torch.full(nhwc(y64).shape, float("nan"), device="cuda", dtype=torch.bfloat16)
        args = ConvArguments.from_tensors(op, nhwc(x), nhwc(w), d, bias=b, padding=2,
                                          stride=stride, dilation=dilation)
        want = torch.relu(y64 + b.double()[None, :, None, None])
    elif kind == "dgrad":
        d = torch.full(nhwc(x).shape, float("nan"), device="cuda", dtype=torch.bfloat16)
        args = ConvArguments.from_tensors(op, nhwc(dy), nhwc(w), d, padding=2)
        want = torch.nn.grad.conv2d_input(x.shape, w64, dy.double(), padding=2)
    else:
        d = torch.full(nhwc(w).shape, float("nan"), device="cuda", dtype=torch.bfloat16)
        args = ConvArguments.from_tensors(op, nhwc(dy), nhwc(x), d, padding=2)
        want = torch.nn.grad.conv2d_weight(x64, w.shape, dy.double(), padding=2)
    assert op.can_implement(args) == [], op.can_implement(args)
    op.run(args)
    assert not d.isnan().any(), f"{kind}: {int(d.isnan().sum())} elements not written"
    _close(d, nhwc(want), torch.bfloat16, f"cooperative {kind}")


@pytest.mark.parametrize("stride", [1, 2])
def test_gemm_level_tf32_fprop_with_bias_and_relu(stride):
    """vitrail.gemm: fp32 tensors through TF32's wgmma (fprop, whose operands are K-major),
    y = relu(conv(x, w) + bias) in fp32, against fp64 at TF32's precision (10-bit mantissa,
    like fp16's)."""
    from vitrail.gemm import (ConvArguments, ConvOperation, LinearCombination, MathInstruction,
                              TensorDescription, TileDescription)
    f32, tf32 = TensorDescription("f32"), TensorDescription("tf32")
    op = ConvOperation("fprop", tf32, tf32, f32, MathInstruction("tf32", "tf32"),
                       TileDescription((128, 128, 32), kernel_schedule="warpspecialized"),
                       LinearCombination("f32", bias="col", activation="relu"))
    x, w = _tensors(2, 20, 33, 7, 36, 3, 3, torch.float32, seed=4)
    b = torch.randn(36, device="cuda")
    args = ConvArguments.from_tensors(op, x.permute(0, 2, 3, 1), w.permute(0, 2, 3, 1),
                                      bias=b, padding=1, stride=stride)
    assert op.can_implement(args) == []
    op.run(args)
    want = torch.relu(torch.nn.functional.conv2d(x.double(), w.double(), b.double(), padding=1,
                                                 stride=stride)).permute(0, 2, 3, 1)
    assert args.output.dtype == torch.float32 and args.output.shape == want.shape
    _close(args.output, want, torch.float16, f"tf32 fprop, stride {stride}")


FP32_GEOMETRY = [  # (R, S, stride, padding, dilation, groups): the kernel, a stride's, an even
    # filter's 'same' (asymmetric: torch's backward of a padded x), dilation, two groups, a 1x1
    (3, 3, 1, 1, 1, 1), (3, 3, 2, 1, 1, 1), (2, 4, 1, "same", 1, 1), (3, 3, 1, 2, 2, 2),
    (1, 1, 1, 0, 1, 1)]


@pytest.mark.parametrize("R, S, stride, padding, dilation, groups", FP32_GEOMETRY)
def test_fp32_runs_as_tf32_against_fp64(R, S, stride, padding, dilation, groups):
    """fp32 tensors: the forward through TF32's kernel (bias and silu fused), dx and dw through
    torch's backward (a 1x1's through vitrail's GEMM), against fp64 at TF32's precision (10-bit
    mantissas, as fp16's); three calls on fresh data (the second and third replay the plan)."""
    from vitrail.ops import conv2d
    from vitrail.ops.conv import reference
    N, C, H, W, K = 2, 32, 17, 11, 48
    for seed in range(3):
        x, w = _tensors(N, C, H, W, K, R, S, torch.float32, seed=seed)
        w = w[:, :C // groups].contiguous(memory_format=torch.channels_last)
        b = torch.randn(K, device="cuda")
        x, w, b = (t.requires_grad_(True) for t in (x, w, b))
        y = conv2d(x, w, b, stride, padding, dilation, groups, activation="silu")
        assert y.dtype == torch.float32
        x64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (x, w, b))
        y64 = reference(x64, w64, b64, stride, padding, dilation, groups, activation="silu")
        _close(y, y64, torch.float16, f"y, call {seed}")
        g = torch.randn_like(y64).float().contiguous(memory_format=torch.channels_last)
        y.backward(g)
        y64.backward(g.double())
        for got, want, what in ((x.grad, x64.grad, "dx"), (w.grad, w64.grad, "dw"),
                                (b.grad, b64.grad, "dbias")):
            _close(got, want, torch.float16, f"{what}, call {seed}")


def test_fp32_with_tf32_off_is_refused(monkeypatch):
    """torch.backends.cudnn.allow_tf32 off asks for full fp32 products, which the kernels do
    not compute: refused, also for a signature that ran before (fp32 calls keep to Python,
    where the check runs)."""
    from vitrail.ops import conv2d
    x, w = _tensors(1, 16, 8, 8, 16, 3, 3, torch.float32, seed=5)
    _close(conv2d(x, w, padding=1), torch.nn.functional.conv2d(x.double(), w.double(),
                                                               padding=1), torch.float16, "y")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    with pytest.raises(NotImplementedError, match="allow_tf32 is False"):
        conv2d(x, w, padding=1)


@pytest.mark.parametrize("C, K, R, stride, padding, dtype", [
    (3, 64, 7, 2, 3, torch.bfloat16), (3, 24, 4, 4, 0, torch.float16), (4, 40, 3, 1, 1,
    torch.bfloat16), (40, 4, 3, 1, 1, torch.bfloat16), (12, 20, 3, 2, 1, torch.bfloat16),
    (3, 16, 3, 1, 1, torch.float32)])
def test_channels_short_of_a_vector_run_zero_padded(C, K, R, stride, padding, dtype):
    """One group of C or K not a multiple of 8 (ResNet's 7x7/2 stem, ConvNeXt's 4x4/4 one, a
    U-Net's 4-channel conv_in and conv_out, odd counts at stride 2, fp32's TF32): the kernels
    on zero-padded channels, or, for fewer than 8 input channels, fprop and wgrad as GEMMs over
    x's patches; y with a bias and silu, dx and dw against fp64 through autograd, three calls
    each on new values."""
    from vitrail.ops import conv2d
    from vitrail.ops.conv import reference
    for seed in range(3):
        x, w = _tensors(2, C, 19, 13, K, R, R, dtype, seed=seed)
        b = torch.randn(K, device="cuda").to(dtype)
        x, w, b = (t.requires_grad_(True) for t in (x, w, b))
        y = conv2d(x, w, b, stride, padding, activation="silu")
        x64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (x, w, b))
        y64 = reference(x64, w64, b64, stride, padding, activation="silu")
        assert y.shape == y64.shape and y.is_contiguous(memory_format=torch.channels_last)
        tol = torch.float16 if dtype is torch.float32 else dtype  # TF32: fp16's mantissa
        _close(y, y64, tol, f"y, call {seed}")
        g = torch.randn_like(y64).to(dtype).contiguous(memory_format=torch.channels_last)
        y.backward(g)
        y64.backward(g.double())
        for got, want, what in ((x.grad, x64.grad, "dx"), (w.grad, w64.grad, "dw"),
                                (b.grad, b64.grad, "dbias")):
            _close(got, want, tol, f"{what}, call {seed}")


def test_refusals_are_not_implemented_errors():
    from vitrail.ops import conv2d
    x, w = _tensors(1, 16, 8, 8, 16, 3, 3, torch.bfloat16)
    with pytest.raises(NotImplementedError, match="groups of one input channel"):
        conv2d(x, w[:, :2].contiguous(memory_format=torch.channels_last), groups=8)


@pytest.mark.parametrize("C, m, R, S, stride, padding, dilation, dtype", [
    (32, 1, 3, 3, 1, 1, 1, torch.bfloat16),  # 8 channels a thread
    (48, 1, 7, 7, 1, 3, 1, torch.bfloat16),  # ConvNeXt's 7x7
    (20, 1, 3, 3, 2, 1, 1, torch.float16),  # 4 channels a thread, stride 2
    (13, 1, 5, 3, (2, 1), (2, 0), (1, 2), torch.bfloat16),  # odd channels: one a thread
    (8, 3, 3, 3, 1, 1, 1, torch.bfloat16),  # 3 filters a channel (K = 24)
    (16, 2, 4, 4, 3, 0, 1, torch.float16),  # an even filter, stride 3, no padding
    (24, 1, 3, 3, 1, "same", 2, torch.bfloat16),  # dilated: tap by tap
    (24, 1, 4, 4, 1, "same", 1, torch.bfloat16),  # asymmetric padding of its own
    (40, 1, 5, 9, 1, (2, 4), (2, 1), torch.float16),  # rows dilated, 9 columns compiled in
])
def test_depthwise_against_fp64(C, m, R, S, stride, padding, dilation, dtype):
    """Depthwise convolutions (groups = C) run the depthwise kernels: forward with a bias and
    an activation, dx and dw against torch's in fp64, eager (y through the public function, dx
    and dw through the custom ops) and under autograd, on new values each call (the later calls
    replay the plans of the first: the three kinds' C++ plans exist). 70 columns: dw's rows in
    runs of outputs."""
    from vitrail.ops import conv2d
    from vitrail.ops.conv import _dgrad, _wgrad_of
    from vitrail.plan import native
    native.load(wait=True)
    H, W = 17, 70
    sh, sw = (stride, stride) if isinstance(stride, int) else stride
    dh, dw = (dilation, dilation) if isinstance(dilation, int) else dilation
    if padding == "same":
        pad = [(dh * (R - 1)) // 2, (dw * (S - 1)) // 2]
        hi = [dh * (R - 1) - pad[0], dw * (S - 1) - pad[1]]
    else:
        pad = hi = [padding, padding] if isinstance(padding, int) else list(padding)
    geometry = ([sh, sw], pad, hi, [dh, dw], C)
    for seed in (11, 12, 13):
        x, w = _tensors(2, C, H, W, C * m, R, S, dtype, seed=seed)
        w = (w[:, :1].float() * C ** 0.5).to(dtype).contiguous(memory_format=torch.channels_last)
        b = torch.randn(C * m, device="cuda").to(dtype)
        x64, w64 = x.double(), w.double()
        z64 = torch.nn.functional.conv2d(torch.nn.functional.pad(x64, (pad[1], hi[1], pad[0],
                                                                        hi[0])),
                                         w64, b.double(), (sh, sw), 0, (dh, dw), C)
        y = conv2d(x, w, b, stride, padding, dilation, C, activation="silu")
        _close(y, torch.nn.functional.silu(z64), torch.bfloat16, f"y, call {seed}")
        dy = torch.randn_like(z64).to(dtype).contiguous(memory_format=torch.channels_last)
        x64.requires_grad_(True)
        w64.requires_grad_(True)
        torch.nn.functional.conv2d(torch.nn.functional.pad(x64, (pad[1], hi[1], pad[0], hi[0])),
                                   w64, None, (sh, sw), 0, (dh, dw), C).backward(dy.double())
        dx = torch.ops.vitrail.conv2d_dgrad(dy, w, [H, W], *geometry)
        dwt = torch.ops.vitrail.conv2d_wgrad(dy, x, [R, S], *geometry)
        _close(dx, x64.grad, torch.bfloat16, f"dx, call {seed}")
        _close(dwt, w64.grad, torch.bfloat16, f"dw, call {seed}")
        _against_fp64(lambda x, w, b: conv2d(x, w, b, stride=stride, padding=padding,
                                             dilation=dilation, groups=C, activation="silu"),
                      lambda x, w, b: torch.nn.functional.silu(torch.nn.functional.conv2d(
                          x, w, b, stride, padding, dilation, C)), x, w, b)
    if native.loaded() is None:
        return
    assert conv2d.front.call(x, w, b, stride, padding, dilation, C, "silu") is not native.MISS
    assert _dgrad.front.call(dy, w, H, W, sh, sw, *pad, *hi, dh, dw, C) is not native.MISS
    assert _wgrad_of.front.call(dy, x, R, S, sh, sw, *pad, *hi, dh, dw, C) is not native.MISS


@pytest.mark.parametrize("C, K, stride", [(12, 20, 1), (60, 40, 2), (64, 36, 2), (3, 8, 1)])
def test_a_1x1_convolution_of_any_channel_count_runs_the_gemm(C, K, stride):
    """1x1 unpadded convolutions of unit stride, or of channels TMA cannot read, are GEMMs over
    pixels (vitrail's GEMM, which copies what TMA cannot read): channel counts that are not
    multiples of 8 run too; forward with a bias and an activation, dx and dw against torch's in
    fp64."""
    from vitrail.ops import conv2d
    from vitrail.ops.conv import reasons
    x, w = _tensors(3, C, 11, 6, K, 1, 1, torch.bfloat16, seed=8)
    assert reasons(x, w, stride=stride) == []
    b = torch.randn(K, device="cuda").to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the GEMM's aligned copies, said once a process
        _against_fp64(lambda x, w, b: conv2d(x, w, b, stride=stride, activation="silu"),
                      lambda x, w, b: torch.nn.functional.silu(
                          torch.nn.functional.conv2d(x, w, b, stride)), x, w, b)


@pytest.mark.parametrize("groups, C, K, stride", [(2, 32, 48, 1), (4, 64, 32, 2), (3, 24, 24, 1)])
def test_groups_run_a_kernel_a_group(groups, C, K, stride):
    """Grouped convolution, each group's channel slices in place (wgrad's dy copied a group),
    forward, dx and dw against torch's in fp64, with a bias."""
    from vitrail.ops import conv2d
    x, w = _tensors(2, C, 13, 9, K, 3, 3, torch.bfloat16, seed=6)
    w = w[:, :C // groups].contiguous(memory_format=torch.channels_last)
    b = torch.randn(K, device="cuda").to(torch.bfloat16)
    _against_fp64(lambda x, w, b: conv2d(x, w, b, stride=stride, padding=1, groups=groups,
                                         activation="relu"),
                  lambda x, w, b: torch.relu(torch.nn.functional.conv2d(x, w, b, stride, 1, 1,
                                                                        groups)), x, w, b)


@pytest.mark.parametrize("N, C, K, H, W, stride, groups, dtype", [
    (16, 64, 64, 28, 28, 1, 1, torch.bfloat16),  # ResNet's 3x3 C64 K64: 5 tiles of dw
    (13, 32, 48, 63, 63, 2, 1, torch.float16),  # chunks of 1 or 2 images (13 is prime)
    (12, 64, 64, 40, 40, 1, 2, torch.bfloat16),  # each group's dw in chunks
])
def test_a_small_dw_runs_the_batch_in_chunks(N, C, K, H, W, stride, groups, dtype):
    """wgrad of a dw of few tiles over a batch of many pixels: the chunked kernel (the batch in
    chunks of whole images, one launch) and the fp32 sum of the partials; dw and the other
    gradients against fp64."""
    import importlib
    from vitrail.device import sm_count
    from vitrail.ops import conv2d
    conv = importlib.import_module("vitrail.ops.conv")
    P = (H + 2 - 3) // stride + 1
    assert conv.wgrad_chunks(K // groups, 9 * C // groups, N, P * P, sm_count()) > 1
    x, w = _tensors(N, C, H, W, K, 3, 3, dtype, seed=7)
    w = w[:, :C // groups].contiguous(memory_format=torch.channels_last)
    b = torch.randn(K, device="cuda").to(dtype)
    _against_fp64(lambda x, w, b: conv2d(x, w, b, stride=stride, padding=1, groups=groups),
                  lambda x, w, b: torch.nn.functional.conv2d(x, w, b, stride, 1, 1, groups),
                  x, w, b)


def test_each_chunk_writes_its_own_partial():
    """The chunked wgrad kernel at every chunk count of a batch of 5 (chunks of 5, 3, 2, 1
    images, the last shorter): into partials filled with NaN, each chunk's rows equal the fp64
    weight gradient of its own images; the chunks of chunk 0's size after it took its
    parameters with their descriptors' addresses replaced (0 + 0 + 1 + 4 of them); and the
    launch replays from a CUDA graph."""
    from vitrail.gemm import ConvArguments
    from vitrail.ops.conv import operation
    N, C, K, H, W = 5, 16, 24, 33, 7
    x, w = _tensors(N, C, H, W, K, 3, 3, torch.bfloat16, seed=8)
    dy = torch.randn(N, K, H, W, device="cuda").to(torch.bfloat16).contiguous(
        memory_format=torch.channels_last)
    nhwc = (lambda t: t.permute(0, 2, 3, 1))
    op = operation("wgrad", torch.bfloat16, partials=True)
    readdressed = op.compile().function("vitrail_conv_readdressed")
    before = readdressed()
    for splits in (1, 2, 3, 5):
        chunk = -(-N // splits)
        d = torch.full((splits * K, 3, 3, C), float("nan"), device="cuda")
        args = ConvArguments.from_tensors(op, nhwc(dy).contiguous(), nhwc(x), d, padding=1,
                                          splits=splits)
        assert op.can_implement(args) == []
        op.run(args)
        assert not d.isnan().any(), f"{splits} chunks: {int(d.isnan().sum())} not written"
        for i in range(splits):
            rows = slice(i * chunk, (i + 1) * chunk)
            want = torch.nn.grad.conv2d_weight(x[rows].double(), (K, C, 3, 3),
                                               dy[rows].double(), padding=1)
            _close(d[i * K:(i + 1) * K], nhwc(want), torch.float16, f"chunk {i} of {splits}")
    assert readdressed() - before == 5  # every address 16-byte aligned: the driver took them
    d.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op.run(args)
    graph.replay()
    torch.cuda.synchronize()
    assert not d.isnan().any()
    _close(d[-K:], nhwc(want), torch.float16, "replayed")


REPLAYED = [(3, 3, 1, 1, 1), (3, 3, 2, 1, 2), (5, 3, 2, (2, 1), 1), (2, 2, 3, 0, 1),
            (1, 1, 2, 0, 1)]


@pytest.mark.parametrize("R, S, stride, padding, groups", REPLAYED)
def test_eager_calls_replay_their_plans(R, S, stride, padding, groups):
    """A signature's first call plans its launches (vitrail.plan); later calls on fresh data
    replay them: y, dx and dw equal the fp64 reference's at every call, eager (y through the
    public function, dx and dw through the custom ops) and under autograd. The 3x3 and 5x3
    calls have C++ plans (the stride-2 dx one a stride phase each, on views of the filter);
    the 2x2 stride-3 dx has pixels no tap reaches (zeros: the general path each call), and
    so has the 1x1 stride-2 one, which runs the implicit-GEMM kernels (aligned channels)."""
    from vitrail.ops import conv2d
    from vitrail.ops.conv import _dgrad
    from vitrail.plan import native
    native.load(wait=True)
    N, C, K, H, W = 2, 32, 48, 15, 13
    pad = padding if isinstance(padding, tuple) else (padding, padding)
    for seed in range(3):
        x, w = _tensors(N, C, H, W, K, R, S, torch.bfloat16, seed=seed)
        w = w[:, :C // groups].contiguous(memory_format=torch.channels_last)
        b = torch.randn(K, device="cuda").to(torch.bfloat16)
        y = conv2d(x, w, b, stride, padding, groups=groups, activation="relu")
        y64 = torch.relu(torch.nn.functional.conv2d(x.double(), w.double(), b.double(), stride,
                                                    pad, 1, groups))
        _close(y, y64, torch.bfloat16, f"y, call {seed}")
        dy = torch.randn_like(y64).to(torch.bfloat16).contiguous(
            memory_format=torch.channels_last)
        geometry = ([stride] * 2, list(pad), list(pad), [1, 1], groups)
        dx = torch.ops.vitrail.conv2d_dgrad(dy, w, [H, W], *geometry)
        dw = torch.ops.vitrail.conv2d_wgrad(dy, x, [R, S], *geometry)
        _close(dx, torch.nn.grad.conv2d_input(x.shape, w.double(), dy.double(), stride, pad, 1,
                                              groups), torch.bfloat16, f"dx, call {seed}")
        _close(dw, torch.nn.grad.conv2d_weight(x.double(), w.shape, dy.double(), stride, pad, 1,
                                               groups), torch.bfloat16, f"dw, call {seed}")
        _against_fp64(lambda x, w, b: conv2d(x, w, b, stride, padding, groups=groups),
                      lambda x, w, b: torch.nn.functional.conv2d(x, w, b, stride, pad, 1,
                                                                 groups), x, w, b)
    if R == 1 or native.loaded() is None:
        return
    # (a padding pair too: the C++ keys take tuples of ints)
    assert conv2d.front.call(x, w, b, stride, padding, 1, groups, "relu") is not native.MISS
    xg, wg, bg = (t.detach().requires_grad_(True) for t in (x, w, b))
    y = conv2d.front.call(xg, wg, bg, stride, padding, 1, groups, None)  # autograd's too
    assert y is not native.MISS and y.grad_fn is not None
    planned = _dgrad.front.call(dy, w, H, W, stride, stride, *pad, *pad, 1, 1, groups)
    assert (planned is native.MISS) == (stride == 3), "dx: a plan where every pixel is written"


@pytest.mark.parametrize("R, S, stride, padding, groups", REPLAYED)
def test_a_backward_with_no_bias_makes_its_front_calls_from_cpp(R, S, stride, padding, groups):
    """With no bias and no activation, the C++ autograd node of a planned call makes the dgrad
    and wgrad front calls itself (the rule's steps): dx and dw against fp64 at three calls on
    fresh data each for x alone, w alone and both requiring a gradient (nine in all)."""
    from vitrail.ops import conv2d
    from vitrail.plan import native
    native.load(wait=True)
    N, C, K, H, W = 2, 32, 48, 15, 13
    pad = padding if isinstance(padding, tuple) else (padding, padding)
    for seed in range(9):
        needs = ((True, True), (True, False), (False, True))[seed % 3]
        x, w = _tensors(N, C, H, W, K, R, S, torch.bfloat16, seed=seed)
        w = w[:, :C // groups].contiguous(memory_format=torch.channels_last)
        x, w = (t.detach().requires_grad_(need) for t, need in zip((x, w), needs))
        x64, w64 = (t.detach().double().requires_grad_(need) for t, need in zip((x, w), needs))
        y = conv2d(x, w, None, stride, padding, groups=groups)
        if seed >= 3 and R > 1 and native.loaded() is not None:  # each key planned by now
            assert y.grad_fn.name() == "vitrail::Conv2dBackward", y.grad_fn.name()
        y64 = torch.nn.functional.conv2d(x64, w64, None, stride, pad, 1, groups)
        g = torch.randn_like(y64).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
        y.backward(g)
        y64.backward(g.double())
        for t, t64, what in ((x, x64, "dx"), (w, w64, "dw")):
            assert (t.grad is None) == (not t.requires_grad), what
            if t.requires_grad:
                _close(t.grad, t64.grad, torch.bfloat16, f"{what}, call {seed}")


def test_compiles_under_torch_compile():
    from vitrail.ops import conv2d
    x, w = _tensors(2, 16, 7, 7, 16, 3, 3, torch.bfloat16)
    f = torch.compile(lambda a, b: conv2d(a, b, padding=1, activation="relu"), fullgraph=True)
    want = torch.relu(torch.nn.functional.conv2d(x.double(), w.double(), padding=1))
    _close(f(x, w), want, torch.bfloat16, "compiled")


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("H, W", [(7, 7), (33, 33), (33, 7)])
def test_every_output_element_is_written(kind, H, W):
    """Each kind into an output filled with NaN, three times (3x3, stride 1, padding 1: some of
    these failed in a sharded H200 run and passed alone, as an output left partly unwritten
    would, since fresh memory often reads as zeros)."""
    from vitrail.gemm import ConvArguments
    from vitrail.ops.conv import operation
    N, C, K = 2, 16, 24
    x, w = _tensors(N, C, H, W, K, 3, 3, torch.bfloat16, seed=4)
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    y64 = torch.nn.functional.conv2d(x64, w64, padding=1)
    dy = torch.randn_like(y64).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    y64.backward(dy.double())
    nhwc = (lambda t: t.permute(0, 2, 3, 1))
    a, b, want = {"fprop": (nhwc(x), nhwc(w), y64.detach()),
                  "dgrad": (nhwc(dy), nhwc(w), x64.grad),
                  "wgrad": (nhwc(dy).contiguous(), nhwc(x), w64.grad)}[kind]
    op = operation(kind, torch.bfloat16)
    for _ in range(3):
        d = torch.full(nhwc(want).shape, float("nan"), device="cuda", dtype=torch.bfloat16)
        args = ConvArguments.from_tensors(op, a, b, d, padding=1)
        assert op.can_implement(args) == []
        op.run(args)
        assert not d.isnan().any(), f"{kind}: {int(d.isnan().sum())} elements not written"
        _close(d, nhwc(want), torch.bfloat16, kind)
