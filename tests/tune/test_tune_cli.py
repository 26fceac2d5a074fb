"""``vitrail tune FAMILY --shape ...`` on a machine with no GPU: every family (and every public
function) reads its shape, routes it to the variant its public function runs and builds that
variant's problem; bad shapes and dtypes are one line naming --shape or --dtype; the tune itself
stops at one line saying that timing needs a GPU."""
from __future__ import annotations

import pytest
import torch

import vitrail.ops
from vitrail.cli import _families, _load_ops, _Usage, main, resolve_tune
from vitrail.op import FAMILIES, Shaped

REGISTRY = _load_ops([])
# one shape per family (what --help documents) and the variant the public function runs
SHAPES = {
    "softmax": ("4096x4096", "bfloat16", "softmax.fwd_tile.bfloat16.v8"),
    "log_softmax": ("65536x1024", "float32", "log_softmax.fwd.float32.v4"),
    "copy": ("4096x1000x1024", "float32", "copy.rows.float32.float32.v4"),
    "gemm": ("4096x4096x4096", "bfloat16", "gemm.bf16.rrr.lincomb"),
    "mm": ("64x5120x13824", "float16", "gemm.f16.rrr.lincomb"),
    "bmm": ("512x512x512x8", "float32", "gemm.tf32.rcr.lincomb"),
    "scaled_mm": ("4096x4096x4096", "float8_e4m3fn", "gemm.e4m3.rcr.lincomb_stt"),
    "sympow": ("4096x64", "bfloat16", "sympow.elementwise.bf16.p2.t8"),
    "sympow_mma": ("4096x4096x64", "bfloat16", "sympow.mma90.bf16.p2.t8"),
    "mma_sympow_bwd": ("4096x4096x64x2x1", "float32", "sympow.mma.f32.p2.t1"),
}


def test_every_family_and_public_function_is_tunable_from_a_shape():
    """A family registered later (a new op folder, a --module) fails here until it says how a
    shape becomes its problem."""
    assert set(_families(REGISTRY)) - {"tests"} <= set(FAMILIES)
    assert set(vitrail.ops.__all__) <= set(FAMILIES)
    for name, op in REGISTRY.items():
        assert op.make_problem is not None and op.shape, name
    tunable = {n for n, f in FAMILIES.items() if f.resolve is not None}
    assert tunable == set(SHAPES)
    assert FAMILIES["grouped_mm"].why_not


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_a_family_routes_its_shape_to_the_public_functions_variant(family):
    shape, dtype, variant = SHAPES[family]
    shaped, label = resolve_tune(family, shape, dtype, False, REGISTRY)
    assert isinstance(shaped, Shaped) and shaped.op.name == variant
    assert shaped.key and label.startswith(family) and callable(shaped.args)
    # registered (precompile's, tune's) where it exists at import; sympow makes its other
    # (dtype, power, d_tile) variants on first use
    assert REGISTRY.get(variant, shaped.op) is shaped.op
    # the variant named itself makes the same problem from the shape
    dims = tuple(int(d) for d in shape.split("x"))
    if family.endswith("sympow_bwd") or family == "sympow_mma" or family == "sympow":
        dims = dims[:2 if family == "sympow" else 3]  # the variant fixes power and d_tile
    again = shaped.op.make_problem(dims, dtype)
    assert (again.op, again.key, again.problem) == (shaped.op, shaped.key, shaped.problem)


@pytest.mark.parametrize("shape, variant", [
    ("4096x4097", "softmax.fwd_tile.bfloat16.v8w"),   # rows off 16-byte boundaries: windows
    ("1048576x7", "softmax.fwd_packed.bfloat16.v8"),  # short rows end to end
    ("8x1048576", "softmax.fwd_split.bfloat16.v8"),   # few long rows
    ("65536x1024", "softmax.fwd.bfloat16.v8"),        # registers
])
def test_softmax_shapes_take_the_public_functions_paths(shape, variant):
    from vitrail.ops.softmax import route_contiguous
    shaped, _ = resolve_tune("softmax", shape, "bfloat16", False, REGISTRY)
    rows, n = map(int, shape.split("x"))
    assert shaped.op is route_contiguous("fwd", rows, n, torch.bfloat16, False, None)[0]
    assert shaped.op.name == variant
    back, _ = resolve_tune("softmax", shape, "bfloat16", True, REGISTRY)
    assert back.op.name == variant.replace("fwd", "bwd")


def test_copy_shapes_and_conversions():
    for shape, dtype, variant in (("1048576", "bfloat16:float32", "copy.flat.bfloat16.float32.v4"),
                                  ("4096x4096", "float16", "copy.transpose.float16.float16"),
                                  ("4095x4097", "float32", "copy.tiled.float32.float32"),
                                  ("4096x1000x1001", "float32", "copy.rows.float32.float32.v1")):
        assert resolve_tune("copy", shape, dtype, False, REGISTRY)[0].op.name == variant
    with pytest.raises(_Usage, match="runs copy.transpose.float32.float32, not copy.rows"):
        resolve_tune("copy.rows.float32.float32.v4", "4096x4096", None, False, REGISTRY)


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_the_tune_without_a_gpu_is_one_line_after_the_resolution(capsys, monkeypatch, family):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    shape, dtype, variant = SHAPES[family]
    assert main(["tune", family, "--shape", shape, "--dtype", dtype]) == 1
    out, err = capsys.readouterr()
    assert variant in out and err.count("\n") == 1 and "no GPU is visible" in err


@pytest.mark.parametrize("family", sorted(SHAPES))
@pytest.mark.parametrize("bad", ["abc", "0x4", "4", "1x2x3x4x5x6", "-3x4"])
def test_a_bad_shape_is_one_line_naming_the_expected_form(capsys, family, bad):
    if bad == "4" and family == "copy":  # one dim is copy's flat form: no usage error
        pytest.skip("a flat copy")
    assert main(["tune", family, f"--shape={bad}"]) == 2
    out, err = capsys.readouterr()
    spec = FAMILIES[family].shape
    assert err.count("\n") == 1 and "--shape" in err and spec in err, err


def test_usage_errors_are_one_line(capsys):
    cases = {("softmax",): "give --shape ROWSxCOLS",
             ("softmax", "--shape", "4x4", "--dtype", "int8"): "--dtype 'int8': softmax takes",
             ("gemm", "--shape", "4x4x4", "--backward"): "no backward",
             ("grouped_mm", "--shape", "4x4x4"): "nothing to tune",
             ("sofmax", "--shape", "4x4"): "did you mean softmax",
             ("softmax.fwd.float32.v4", "--shape", "4x6"): "COLS must be a multiple of 4",
             ("sympow", "--shape", "4096x63"): "d_tile=8 must divide",
             ("copy", "--shape", "4x8x4"): "LD must exceed COLS"}
    for argv, message in cases.items():
        assert main(["tune", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)


def test_help_documents_every_familys_shape(capsys):
    with pytest.raises(SystemExit) as done:
        main(["tune", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for name, fam in FAMILIES.items():
        assert name in text and fam.shape in text


def test_sympow_problems_capture_through_the_package_module():
    """On a GPU, sympow's problems record the implementation's launch through the package's
    CAPTURE; vitrail.ops's attribute of that name is the public function, not the package."""
    from vitrail.ops.sympow import problems
    assert hasattr(problems._pkg, "CAPTURE") and hasattr(problems._pkg, "mma_bwd_impl")
