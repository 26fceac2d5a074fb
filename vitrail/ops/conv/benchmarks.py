"""`vitrail bench conv`: every convolution of ResNet-50 (batch 128, 224x224), of an SD-1.x
U-Net (batch 8, 64x64 latent) and of ConvNeXt-T (batch 64, 224x224; its depthwise 7x7s), and
the depthwise convolutions of MobileNetV2 (batch 128, 224x224), fprop, dgrad and wgrad in bf16,
and fprop with its bias and activation fused (ResNet-50 and the U-Net), in TFLOP/s beside torch
(cuDNN, channels_last, ``cudnn.benchmark`` on) timed in the same run.

The baselines: ``F.conv2d`` (fprop), ``torch.ops.aten.convolution_backward`` asked for dx only
(dgrad) or dw only (wgrad), and ``F.conv2d`` with its bias (torch adds it after cuDNN's
convolution) then the activation (the fused rows: ReLU for ResNet-50, where most convs are
followed by a batch norm, a bias once folded for inference, and a ReLU; SiLU, the U-Net's
activation, for the U-Net). vitrail's rows call what conv2d and its autograd call:
``vitrail.ops.conv2d`` and the ``vitrail::conv2d_dgrad`` and ``vitrail::conv2d_wgrad`` custom
ops; each result is compared with cuDNN's before it is timed (a mismatch is printed). FLOPs
are the convolution's own, 2 N P Q K (C / groups) R S, for every kind (a strided dgrad of a
filter larger than 1x1 runs stride_h * stride_w unit-stride dgrads, one a stride phase, which
together do that work).

A layer the op refuses is a row of value 0 whose ``extra["refused"]`` says why, decided by
vitrail.ops.conv.reasons on meta tensors, beside cuDNN's row; it enters no speedup (none is: the
3-channel stems of ResNet-50 and ConvNeXt-T and the U-Net's 4-channel conv_in run fprop and
wgrad as GEMMs over x's patches and dgrad, like the 4-channel conv_out, on channels
zero-padded to 8, as TMA reads 16-byte channel vectors). The run ends with a table
per network and kind: the geometric mean of vitrail's speedups over cuDNN, the worst and best
layer, and the speedup of the network's convolutions taken together (each layer's time times its
count).

``build()`` compiles the conv kernels the rows run (``operations()``: fprop, dgrad, wgrad, wgrad
in batch chunks, fprop+bias+relu, fprop+bias+silu, in bf16, at the tiles the layers' channels
take) and the GEMM kernels of the 1x1 unpadded layers (which the op runs as GEMMs over pixels)
and of the 3-channel stems' fprop and wgrad (GEMMs over x's patches), in parallel: what
``vitrail bench conv`` builds on a machine with no GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

from vitrail.bench import Row, register
from vitrail.bench.rows import ratios
from vitrail.profile.timing import geomean


@dataclass(frozen=True)
class Layer:
    """A convolution's geometry (x: N x C x H x W, weight: K x C / groups x R x S, square
    stride and padding, no dilation) and how many convolutions of its network have it."""
    name: str
    C: int
    H: int
    W: int
    K: int
    R: int
    S: int
    stride: int
    padding: int
    count: int = 1
    groups: int = 1

    def out_hw(self) -> tuple[int, int]:
        return ((self.H + 2 * self.padding - self.R) // self.stride + 1,
                (self.W + 2 * self.padding - self.S) // self.stride + 1)

    @property
    def label(self) -> str:
        return (f"{self.name} C{self.C} {self.H}x{self.W} K{self.K} {self.R}x{self.S}"
                + (f"/{self.stride}" if self.stride > 1 else "")
                + (" dw" if self.groups == self.C > 1 else
                   f" g{self.groups}" if self.groups > 1 else ""))


L = Layer
# torchvision's ResNet-50 (v1.5: a bottleneck's stride on its 3x3 conv) at 224x224: its 53
# convolutions, 23 geometries; the name is the first convolution of each geometry (a stage's
# first conv3 has the geometry of its downsample in layer1, of its blocks' conv3 after that).
RESNET50 = [
    L("conv1", 3, 224, 224, 64, 7, 7, 2, 3),  # C=3: patches (dgrad zero-padded)
    L("layer1.0.conv1", 64, 56, 56, 64, 1, 1, 1, 0),
    L("layer1.0.conv2", 64, 56, 56, 64, 3, 3, 1, 1, count=3),
    L("layer1.0.conv3", 64, 56, 56, 256, 1, 1, 1, 0, count=4),  # and layer1.0.downsample
    L("layer1.1.conv1", 256, 56, 56, 64, 1, 1, 1, 0, count=2),
    L("layer2.0.conv1", 256, 56, 56, 128, 1, 1, 1, 0),
    L("layer2.0.conv2", 128, 56, 56, 128, 3, 3, 2, 1),
    L("layer2.0.conv3", 128, 28, 28, 512, 1, 1, 1, 0, count=4),
    L("layer2.0.downsample", 256, 56, 56, 512, 1, 1, 2, 0),
    L("layer2.1.conv1", 512, 28, 28, 128, 1, 1, 1, 0, count=3),
    L("layer2.1.conv2", 128, 28, 28, 128, 3, 3, 1, 1, count=3),
    L("layer3.0.conv1", 512, 28, 28, 256, 1, 1, 1, 0),
    L("layer3.0.conv2", 256, 28, 28, 256, 3, 3, 2, 1),
    L("layer3.0.conv3", 256, 14, 14, 1024, 1, 1, 1, 0, count=6),
    L("layer3.0.downsample", 512, 28, 28, 1024, 1, 1, 2, 0),
    L("layer3.1.conv1", 1024, 14, 14, 256, 1, 1, 1, 0, count=5),
    L("layer3.1.conv2", 256, 14, 14, 256, 3, 3, 1, 1, count=5),
    L("layer4.0.conv1", 1024, 14, 14, 512, 1, 1, 1, 0),
    L("layer4.0.conv2", 512, 14, 14, 512, 3, 3, 2, 1),
    L("layer4.0.conv3", 512, 7, 7, 2048, 1, 1, 1, 0, count=3),
    L("layer4.0.downsample", 1024, 14, 14, 2048, 1, 1, 2, 0),
    L("layer4.1.conv1", 2048, 7, 7, 512, 1, 1, 1, 0, count=2),
    L("layer4.1.conv2", 512, 7, 7, 512, 3, 3, 1, 1, count=2),
]

# An SD-1.x U-Net (diffusers' UNet2DConditionModel of SD 1.5: widths 320/640/1280/1280, two
# ResNet blocks per down block, three per up block fed the skip connections, two in the middle)
# at a 64x64 latent: its 66 convolutions, 31 geometries. Included: conv_in (4 channels in),
# each ResNet block's two 3x3 convs and its 1x1 shortcut where its channels change, the three
# stride-2 downsamplers, the three upsamplers' 3x3 convs (after the nearest 2x upsampling),
# conv_out (4 channels out). conv_in (C=4) runs fprop and wgrad as GEMMs over its patches,
# conv_out (K=4) on channels zero-padded to 8 (TMA's 16-byte vectors). Not included: the
# transformer blocks' proj_in / proj_out (1x1 convs in SD 1.x, linear layers in SD 2.x: GEMMs,
# `vitrail bench gemm`'s subject).
UNET = [
    L("conv_in", 4, 64, 64, 320, 3, 3, 1, 1),  # C=4: patches (dgrad zero-padded)
    L("down0.res0.conv1", 320, 64, 64, 320, 3, 3, 1, 1, count=7),  # and up3's conv2s
    L("down0.downsample", 320, 64, 64, 320, 3, 3, 2, 1),
    L("down1.res0.conv1", 320, 32, 32, 640, 3, 3, 1, 1),
    L("down1.res0.conv2", 640, 32, 32, 640, 3, 3, 1, 1, count=6),  # and up2's conv2s
    L("down1.res0.shortcut", 320, 32, 32, 640, 1, 1, 1, 0),
    L("down1.downsample", 640, 32, 32, 640, 3, 3, 2, 1),
    L("down2.res0.conv1", 640, 16, 16, 1280, 3, 3, 1, 1),
    L("down2.res0.conv2", 1280, 16, 16, 1280, 3, 3, 1, 1, count=7),  # up1's, up0.upsample
    L("down2.res0.shortcut", 640, 16, 16, 1280, 1, 1, 1, 0),
    L("down2.downsample", 1280, 16, 16, 1280, 3, 3, 2, 1),
    L("down3.res0.conv1", 1280, 8, 8, 1280, 3, 3, 1, 1, count=11),  # down3, mid, up0's conv2s
    L("up0.res0.conv1", 2560, 8, 8, 1280, 3, 3, 1, 1, count=3),
    L("up0.res0.shortcut", 2560, 8, 8, 1280, 1, 1, 1, 0, count=3),
    L("up1.res0.conv1", 2560, 16, 16, 1280, 3, 3, 1, 1, count=2),
    L("up1.res2.conv1", 1920, 16, 16, 1280, 3, 3, 1, 1),
    L("up1.res0.shortcut", 2560, 16, 16, 1280, 1, 1, 1, 0, count=2),
    L("up1.res2.shortcut", 1920, 16, 16, 1280, 1, 1, 1, 0),
    L("up1.upsample", 1280, 32, 32, 1280, 3, 3, 1, 1),
    L("up2.res0.conv1", 1920, 32, 32, 640, 3, 3, 1, 1),
    L("up2.res1.conv1", 1280, 32, 32, 640, 3, 3, 1, 1),
    L("up2.res2.conv1", 960, 32, 32, 640, 3, 3, 1, 1),
    L("up2.res0.shortcut", 1920, 32, 32, 640, 1, 1, 1, 0),
    L("up2.res1.shortcut", 1280, 32, 32, 640, 1, 1, 1, 0),
    L("up2.res2.shortcut", 960, 32, 32, 640, 1, 1, 1, 0),
    L("up2.upsample", 640, 64, 64, 640, 3, 3, 1, 1),
    L("up3.res0.conv1", 960, 64, 64, 320, 3, 3, 1, 1),
    L("up3.res1.conv1", 640, 64, 64, 320, 3, 3, 1, 1, count=2),
    L("up3.res0.shortcut", 960, 64, 64, 320, 1, 1, 1, 0),
    L("up3.res1.shortcut", 640, 64, 64, 320, 1, 1, 1, 0, count=2),
    L("conv_out", 320, 64, 64, 4, 3, 3, 1, 1),  # K=4: zero-padded to 8
]

# torchvision's ConvNeXt-T at 224x224: its 22 convolutions, 8 geometries: the 4x4/4 stem (3
# channels in: GEMMs over its patches), each stage's depthwise 7x7s (3, 3, 9, 3 blocks) and the
# 2x2/2 downsamplers between stages. (Each block's two pointwise layers are linear layers: GEMMs.)
CONVNEXT_T = [
    L("stem", 3, 224, 224, 96, 4, 4, 4, 0),  # C=3: patches (dgrad zero-padded)
    L("stage0.dwconv", 96, 56, 56, 96, 7, 7, 1, 3, count=3, groups=96),
    L("down1", 96, 56, 56, 192, 2, 2, 2, 0),
    L("stage1.dwconv", 192, 28, 28, 192, 7, 7, 1, 3, count=3, groups=192),
    L("down2", 192, 28, 28, 384, 2, 2, 2, 0),
    L("stage2.dwconv", 384, 14, 14, 384, 7, 7, 1, 3, count=9, groups=384),
    L("down3", 384, 14, 14, 768, 2, 2, 2, 0),
    L("stage3.dwconv", 768, 7, 7, 768, 7, 7, 1, 3, count=3, groups=768),
]

# torchvision's MobileNetV2 (width 1.0) at 224x224: its 17 depthwise 3x3 convolutions, 10
# geometries, named by the first inverted-residual block of each (features.N). Its 1x1 expand
# and project convolutions are GEMMs over pixels (vitrail's GEMM runs them: `vitrail bench
# gemm`'s subject) and its stem takes 3 channels; neither is listed.
MOBILENET_V2 = [
    L("features.1", 32, 112, 112, 32, 3, 3, 1, 1, groups=32),
    L("features.2", 96, 112, 112, 96, 3, 3, 2, 1, groups=96),
    L("features.3", 144, 56, 56, 144, 3, 3, 1, 1, groups=144),
    L("features.4", 144, 56, 56, 144, 3, 3, 2, 1, groups=144),
    L("features.5", 192, 28, 28, 192, 3, 3, 1, 1, count=2, groups=192),
    L("features.7", 192, 28, 28, 192, 3, 3, 2, 1, groups=192),
    L("features.8", 384, 14, 14, 384, 3, 3, 1, 1, count=4, groups=384),
    L("features.12", 576, 14, 14, 576, 3, 3, 1, 1, count=2, groups=576),
    L("features.14", 576, 14, 14, 576, 3, 3, 2, 1, groups=576),
    L("features.15", 960, 7, 7, 960, 3, 3, 1, 1, count=3, groups=960),
]
del L

# network: (batch, layers, the activation of its fused rows: None for none)
NETWORKS = {"resnet50": (128, RESNET50, "relu"), "unet": (8, UNET, "silu"),
            "convnext_t": (64, CONVNEXT_T, None), "mobilenet_v2": (128, MOBILENET_V2, None)}
KINDS = ("fprop", "dgrad", "wgrad")
OURS, THEIRS = "vitrail", "cuDNN"  # implementations' first words: "vitrail fprop", "cuDNN fprop"
TOLERANCE = 0.03  # vitrail's result against cuDNN's, max error / max |cuDNN|: a mismatch above


@dataclass(frozen=True)
class Case:
    """One layer of one network, one kind: fprop, dgrad, wgrad or fprop+bias+ACTIVATION."""
    network: str
    layer: Layer
    batch: int
    kind: str

    @property
    def name(self) -> str:
        return f"{self.network} {self.layer.label} {self.kind}"

    @property
    def kernel(self) -> str:
        """The kernel's kind (fprop, dgrad or wgrad)."""
        return self.kind.split("+")[0]

    @property
    def activation(self) -> str | None:
        return self.kind.split("+")[2] if "+" in self.kind else None

    def chunks(self, sms: int) -> int:
        """The batch chunks the implicit-GEMM wgrad runs the case in on a GPU of ``sms`` SMs
        (vitrail.ops.conv.wgrad_chunks, on the channels the kernel gets; 1 for the other
        kinds)."""
        from vitrail.ops.conv import kernel_channels, wgrad_chunks
        if self.kernel != "wgrad":
            return 1
        lay, (p, q) = self.layer, self.layer.out_hw()
        c, k = kernel_channels(lay.C, lay.K, lay.groups)
        return wgrad_chunks(k, lay.R * lay.S * c // lay.groups, self.batch, p * q, sms)

    @property
    def flops(self) -> float:
        p, q = self.layer.out_hw()
        lay = self.layer
        return 2.0 * self.batch * p * q * lay.K * (lay.C // lay.groups) * lay.R * lay.S


def cases() -> list[Case]:
    """Every case the benchmark times, network by network, layer by layer."""
    out = []
    for network, (batch, layers, act) in NETWORKS.items():
        for layer in layers:
            for kind in KINDS + ((f"fprop+bias+{act}",) if act else ()):
                out.append(Case(network, layer, batch, kind))
    return out


def refusal(case: Case) -> str:
    """Why vitrail.ops.conv2d's kernel refuses the case ('' when it runs it): the op's own
    checks (vitrail.ops.conv.reasons) on meta tensors, nothing compiled."""
    import torch

    from vitrail.ops.conv import reasons
    lay, bf = case.layer, torch.bfloat16
    x = torch.empty(case.batch, lay.C, lay.H, lay.W, dtype=bf, device="meta")
    w = torch.empty(lay.K, lay.C // lay.groups, lay.R, lay.S, dtype=bf, device="meta")
    bias = torch.empty(lay.K, dtype=bf, device="meta") if case.activation else None
    return "; ".join(reasons(x, w, bias, lay.stride, lay.padding, groups=lay.groups,
                             activation=case.activation, kind=case.kernel))


def row(case: Case, impl: str, ms: float | None, **extra) -> Row:
    """A row of ``case``: TFLOP/s of ``ms`` (value 0 and no ms where vitrail did not run it:
    ``extra`` says why, ``refused`` or ``error``)."""
    lay = case.layer
    info = {"network": case.network, "layer": lay.name, "kind": case.kind, "batch": case.batch,
            "count": lay.count, "geometry": {k: getattr(lay, k) for k in (
                "C", "H", "W", "K", "R", "S", "stride", "padding", "groups")}, **extra}
    if case.kernel == "dgrad" and lay.stride > 1 and lay.groups == 1 and impl.startswith(OURS):
        info["note"] = f"{lay.stride ** 2} unit-stride dgrads, one a stride phase"
    return Row(case=case.name, impl=f"{impl} {case.kind}",
               value=0.0 if ms is None else case.flops / ms / 1e9, unit="TFLOP/s",
               lower_is_better=False, baseline=impl == THEIRS, extra=info,
               ms=ms, flops=case.flops if ms is not None else 0.0, math="bf16",
               group=f"{case.network} {case.kind}")


# ---------------------------------------------------------------------------------- summary
def summarize(rows: list[Row]) -> list[dict]:
    """Per (network, kind), in the rows' order: the layers vitrail ran beside cuDNN, the
    geometric mean, worst and best of its speedups (with their layers), how many at or above
    1.0x, the speedup of those layers taken together as in the network (``weighted``: the sum
    over layers of count x time, cuDNN's over vitrail's), and the layers refused or failed
    (value 0: in no speedup)."""
    out: dict[tuple[str, str], dict] = {}
    bases = {r.case: r for r in rows if r.baseline}
    for r, vs in ratios(rows):
        if r.baseline:
            continue
        e = out.setdefault((r.extra["network"], r.extra["kind"]), {
            "network": r.extra["network"], "kind": r.extra["kind"], "got": [], "refused": [],
            "failed": [], "ours_ms": 0.0, "theirs_ms": 0.0})
        x = next((v for v in vs.values() if v), None)
        if r.extra.get("refused"):
            e["refused"].append(r.extra["layer"])
            continue
        if x is None:  # an error, or no cuDNN time to compare with
            e["failed"].append(r.extra["layer"])
            continue
        e["got"].append((r.extra["layer"], x))
        e["ours_ms"] += r.extra["count"] * r.ms
        e["theirs_ms"] += r.extra["count"] * bases[r.case].ms
    summary = []
    for e in out.values():
        got = e.pop("got")
        ours, theirs = e.pop("ours_ms"), e.pop("theirs_ms")
        if got:
            worst = min(got, key=lambda lx: lx[1])
            best = max(got, key=lambda lx: lx[1])
            e.update(layers=len(got), geomean=geomean([x for _, x in got]), worst=worst[1],
                     worst_layer=worst[0], best=best[1], best_layer=best[0],
                     at_or_above_1x=sum(x >= 1.0 for _, x in got), weighted=theirs / ours)
        else:
            e.update(layers=0)
        summary.append(e)
    return summary


def summary_lines(summary: list[dict]) -> list[str]:
    """The summary as ``vitrail bench conv`` prints it after its table."""
    wide = max(map(len, NETWORKS)) + 2  # the network's column
    lines = [f"  {'network':<{wide}}{'kind':<17}{'layers':>6}{'geomean':>9}{'worst':>8}"
             f"{'best':>8}{'>=1.0x':>8}{'network':>9}  worst layer; refused"]
    for e in summary:
        refused = "".join(f"; {what}: {', '.join(e[what])}" for what in ("refused", "failed")
                          if e[what])
        if not e["layers"]:
            lines.append(f"  {e['network']:<{wide}}{e['kind']:<17}{0:>6}  none ran{refused}")
            continue
        lines.append(f"  {e['network']:<{wide}}{e['kind']:<17}{e['layers']:>6}"
                     f"{e['geomean']:>8.2f}x{e['worst']:>7.2f}x{e['best']:>7.2f}x"
                     f"{str(e['at_or_above_1x']) + '/' + str(e['layers']):>8}"
                     f"{e['weighted']:>8.2f}x  {e['worst_layer']}{refused}")
    lines.append("  speedups over cuDNN (> 1x: vitrail faster); network: the layers taken "
                 "together, each layer's time times its count in the network")
    return lines


# ------------------------------------------------------------------------------------ build
def operations(sms: int = 132) -> list:
    """The ConvOperations the rows run (bf16; in the cases' order, each once): the kernel
    vitrail.ops.conv.kernel gives each layer's kind, wgrad's chunked one where wgrad_chunks
    splits its batch on a GPU of ``sms`` SMs, dgrad's phased one where a stride leaves several
    phases with taps (a strided 1x1's one phase runs the plain dgrad); none for the layers the
    GEMM runs (1x1 unpadded at unit stride), the depthwise ones (NVRTC kernels of their own,
    built at the first call in seconds) or refused ones."""
    import torch

    from vitrail.ops.conv import kernel, kernel_problem
    ops = []
    for case in cases():
        lay = case.layer
        if runs_gemm(lay) or runs_patches(case) or lay.groups > 1 or refusal(case):
            continue
        chunks = case.chunks(sms)
        two, pad = (lay.stride,) * 2, (lay.padding,) * 2
        problem, phased = kernel_problem(case.kernel, case.batch, lay.C, (lay.H, lay.W), lay.K,
                                         (lay.R, lay.S), pad, pad, two, (1, 1))
        op = kernel(case.kernel, torch.bfloat16, problem, bias=case.activation is not None,
                    activation=case.activation, chunks=chunks, phased=phased)
        if op not in ops:
            ops.append(op)
    return ops


def runs_gemm(lay: Layer) -> bool:
    """Whether vitrail.ops.conv runs the layer as a GEMM over pixels."""
    from vitrail.ops.conv import is_gemm
    pad = (lay.padding,) * 2
    return is_gemm((lay.R, lay.S), pad, pad, lay.groups, (lay.stride,) * 2, (lay.C, lay.K))


def runs_patches(case: Case) -> bool:
    """Whether vitrail.ops.conv runs the case's kind as a GEMM over x's patches (a stem's)."""
    from vitrail.ops import conv
    lay, pad = case.layer, (case.layer.padding,) * 2
    return conv.runs_patches(case.kernel, lay.C, (lay.R, lay.S), pad, pad, lay.groups,
                             (lay.stride,) * 2)


def gemm_kernels(lim) -> list:
    """(Op, config) of each GEMM kernel the layers run as GEMMs over pixels (1x1 unpadded at
    unit stride: vitrail.ops.conv's GEMM route, fprop x W^T, dgrad dy W, wgrad dy^T x) or over
    x's patches (the stems' fprop X W^T and wgrad dy^T X: runs_patches), as the GEMM's selection
    chooses them for their shapes (torch's matmul, where chosen, compiles nothing and is left
    out)."""
    from vitrail.gemm import LinearCombination
    from vitrail.gemm.ops.configs import Kind, Problem
    from vitrail.gemm.ops.launch import op_for
    from vitrail.gemm.ops.model import TORCH
    found = []
    for case in cases():
        lay = case.layer
        if not runs_gemm(lay) and not runs_patches(case):
            continue
        p, q = lay.out_hw()
        pixels = case.batch * p * q
        epilogue = LinearCombination("bf16", bias="col" if case.activation else None,
                                     activation=case.activation)
        c = lay.C * lay.R * lay.S  # the patches' columns (a 1x1's: its channels)
        layout_a, layout_b, problem = {
            "fprop": ("row", "col", Problem(pixels, lay.K, c)),
            "dgrad": ("row", "row", Problem(pixels, c, lay.K)),
            "wgrad": ("col", "row", Problem(lay.K, c, pixels))}[case.kernel]
        op = op_for(Kind("bf16", "bf16", layout_a, layout_b, epilogue))
        config = op.space.default(problem, lim)
        if config["backend"] != TORCH and (op, config) not in found:
            found.append((op, config))
    return found


def build() -> None:
    """Compile the conv kernels the rows run and the GEMM kernels (gemm_kernels) in parallel for
    the build target (the kernels are sm_90a: for another target, say so and build nothing)."""
    from vitrail.tune import compile_all, limits
    lim = limits()
    arch = lim.arch.name
    if arch != "90a":
        print(f"  conv bench: the convolution kernels are sm_90a (Hopper); the target is "
              f"sm_{arch}: nothing to build")
        return
    jobs = [(op.name, op.compile_kwargs(arch)) for op in operations(lim.sm_count)]
    jobs += [(f"{op.name} {i}", dict(op.render(config), arch=arch))
             for i, (op, config) in enumerate(gemm_kernels(lim))]
    for name, error in compile_all(jobs, verbose=True, label="conv bench").items():
        print(f"  build failed: {name}: {error[:2000]}")


# -------------------------------------------------------------------------------------- run
def case_tensors(case: Case):
    """x, w, dy (channels_last bf16) and the fused rows' bias, on the GPU."""
    import torch
    lay, bf = case.layer, torch.bfloat16
    cl = torch.channels_last
    p, q = case.layer.out_hw()
    x = torch.randn(case.batch, lay.C, lay.H, lay.W, device="cuda", dtype=bf).to(memory_format=cl)
    w = (torch.randn(lay.K, lay.C // lay.groups, lay.R, lay.S, device="cuda", dtype=bf)
         / (lay.C // lay.groups * lay.R * lay.S) ** 0.5).to(memory_format=cl)
    dy = torch.randn(case.batch, lay.K, p, q, device="cuda", dtype=bf).to(memory_format=cl)
    bias = torch.randn(lay.K, device="cuda", dtype=bf) if case.activation else None
    return x, w, dy, bias


def _calls(case: Case):
    """(vitrail's call, cuDNN's call) of the case."""
    import torch
    import torch.nn.functional as F

    from vitrail.ops.conv import conv2d
    x, w, dy, bias = case_tensors(case)
    lay = case.layer
    s, pad, one, g = [lay.stride] * 2, [lay.padding] * 2, [1, 1], lay.groups
    back = torch.ops.aten.convolution_backward
    if case.kind == "fprop":
        return (lambda: conv2d(x, w, None, s, pad, 1, g),
                lambda: F.conv2d(x, w, None, s, pad, 1, g))
    if case.kind == "dgrad":
        return (lambda: torch.ops.vitrail.conv2d_dgrad(dy, w, [lay.H, lay.W], s, pad, pad, one,
                                                       g),
                lambda: back(dy, x, w, None, s, pad, one, False, [0, 0], g,
                             [True, False, False])[0])
    if case.kind == "wgrad":
        return (lambda: torch.ops.vitrail.conv2d_wgrad(dy, x, [lay.R, lay.S], s, pad, pad, one,
                                                       g),
                lambda: back(dy, x, w, None, s, pad, one, False, [0, 0], g,
                             [False, True, False])[1])
    act = {"relu": torch.relu, "silu": F.silu}[case.activation]
    return (lambda: conv2d(x, w, bias, s, pad, 1, g, activation=case.activation),
            lambda: act(F.conv2d(x, w, bias, s, pad, 1, g)))


def time_case(case: Case) -> list[Row]:
    """vitrail's row and cuDNN's of one case, timed together (vitrail.profile.compare); a
    case vitrail refuses (by the op's checks, or NotImplementedError at its call) gets a
    refused row beside cuDNN's timed one."""
    from vitrail.profile import compare
    why = refusal(case)
    ours, theirs = _calls(case)
    err, failed = None, ""
    if not why:
        try:
            got = ours()
        except NotImplementedError as e:
            why = str(e)
        except Exception as e:  # reported as a row of its own, the run goes on
            failed = f"{type(e).__name__}: {str(e)[:500]}"
        else:
            ref = theirs().float()
            err = ((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            got = ref = None
    if why or failed:
        t = compare({THEIRS: theirs})[THEIRS]
        print(f"    {case.name:<62} {'refused' if why else 'FAILED'}: {(why or failed)[:140]}")
        extra = {"refused": why} if why else {"error": failed}
        return [row(case, OURS, None, **extra), row(case, THEIRS, t.median)]
    times = compare({OURS: ours, THEIRS: theirs})
    rows = [row(case, OURS, times[OURS].median, max_rel_err=err),
            row(case, THEIRS, times[THEIRS].median)]
    flag = f"  MISMATCH (max error / max |cuDNN| > {TOLERANCE})" if err > TOLERANCE else ""
    print(f"    {case.name:<62} vitrail {rows[0].value:6.1f}  cuDNN {rows[1].value:6.1f} "
          f"TFLOP/s  {rows[1].ms / rows[0].ms:5.2f}x{flag}")
    return rows


@register("conv", "vitrail.ops.conv2d fprop/dgrad/wgrad and fused bias+act vs cuDNN: every "
          "conv of ResNet-50 (batch 128), an SD U-Net (batch 8) and ConvNeXt-T (batch 64), "
          "MobileNetV2's depthwise convs (batch 128), bf16", build,
          by_name=True)  # (not in a bare `vitrail bench` until the op's GPU tests all pass)
def run() -> list[Row]:
    import torch
    rows: list[Row] = []
    bench_was = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True  # cuDNN picks its fastest algorithm per shape
    try:
        for case in cases():
            rows += time_case(case)
            torch.cuda.empty_cache()
    finally:
        torch.backends.cudnn.benchmark = bench_was
    print("\n  conv: vitrail over cuDNN per network and kind")
    print("\n".join(summary_lines(summarize(rows))))
    return rows
