"""sympow problems from a shape (``vitrail tune``): the Op (kernel source, dtype, power, d_tile)
the public function runs, its problem (the vector width), and its launch arguments, which the
implementation itself makes on the GPU: it is called with ``CAPTURE`` set (in this context), so
that its launch is recorded instead of made (the kernels take tables, grids and shared memory
sizes that only it computes). Without a GPU the variant is predicted from the dtype, power and
the build target."""
from __future__ import annotations

import importlib

import torch

from vitrail.jit.errors import ArgumentError
from vitrail.op import Shaped, family
from vitrail.ops.sympow import FAMILY, variant_op, configs

# the package module itself: vitrail.ops's attribute "sympow" is the public function
_pkg = importlib.import_module("vitrail.ops.sympow")

DTYPES = ("bfloat16", "float16", "float32")
SHAPES = {"sympow": "ROWSxD[xPOWER[xD_TILE]]", "sympow_mma": "MxNxD[xPOWER[xD_TILE]]",
          "mma_sympow_bwd": "MxNxD[xPOWER[xD_TILE]]"}
DOCS = {"sympow": "x (ROWS x D) expanded along D (POWER default 2, D_TILE default 8)",
        "sympow_mma": "sympow(a (M x D) along D) @ b (x N), expand_dim -1 (POWER default 2, "
                      "D_TILE default 8)",
        "mma_sympow_bwd": "the gradient wrt c (M x D) of <sympow(c), a (M x N) @ b>, expand_dim "
                          "-1 (POWER default 2, D_TILE default 8)"}


def _dims(name: str, shape: tuple[int, ...]) -> tuple[int, int, int, int, int]:
    """(rows or M, N (1 for sympow), d, power, d_tile), the expansion checked."""
    lead = 2 if name == "sympow" else 3
    power, d_tile = (*shape[lead:], 2, 8)[:2]
    rows, n, d = (shape[0], 1, shape[1]) if name == "sympow" else shape[:3]
    try:
        configs.check_support(name, d, power, d_tile)
    except ArgumentError as e:
        raise ValueError(f"--shape {'x'.join(map(str, shape))}: {e}") from None
    return rows, n, d, power, d_tile


def _call(name: str, dims: tuple, dtype: torch.dtype, wgmma: bool | None = None) -> list:
    """The implementation's launch of the problem on random inputs on the GPU, recorded
    (wgmma: the fused kernels' variant, None: the implementation's own choice)."""
    rows, n, d, power, d_tile = dims
    D = configs.check_support(name, d, power, d_tile)
    dev = "cuda"
    found: list = []
    token = _pkg.CAPTURE.set(found)
    try:
        if name == "sympow":
            x = torch.randn(rows, d, device=dev, dtype=dtype)
            _pkg.sympow_into(x, x.new_empty(rows, D), power, d_tile, True, D)
        elif name == "sympow_mma":
            a = torch.randn(1, rows, d, device=dev, dtype=dtype)
            b = torch.randn(1, D, n, device=dev, dtype=dtype)
            _pkg.mma_impl(a, b, -1, power, d_tile, 1.0, True, wgmma=wgmma)
        else:
            c = torch.randn(1, rows, d, device=dev, dtype=dtype)
            a = torch.randn(1, rows, n, device=dev, dtype=dtype)
            b = torch.randn(1, n, D, device=dev, dtype=dtype)
            _pkg.mma_bwd_impl(a, b, c, -1, power, d_tile, 1.0, True)
    finally:
        _pkg.CAPTURE.reset(token)
    return found


def _predict(name: str, dims: tuple, dtype: torch.dtype) -> tuple:
    """(op, key, problem) without a GPU: for the build target (vitrail.tune.limits())."""
    _, n, d, power, d_tile = dims
    if name == "sympow":
        vec = configs.vector_width(dtype, d_tile ** power)  # fresh allocations are aligned
        return variant_op("elementwise", dtype, power, d_tile), f"vec={vec}", {"vec": vec}
    from vitrail.tune import limits
    arch = limits().arch
    wgmma = configs.wgmma_supports(dtype, power, d_tile) and (arch.major, arch.suffix) == (9, "a")
    if name == "mma_sympow_bwd":
        wgmma = wgmma and configs.wgmma_bwd_fits(d, -(-n // 8) * 8)
    return variant_op("mma90" if wgmma else "mma", dtype, power, d_tile), "vec=0", {"vec": 0}


def _shaped(name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> Shaped:
    dims = _dims(name, shape)
    if device is not None:  # the GPU's own route, from the implementation
        op, key, problem, args = _call(name, dims, dtype)[0]
        return Shaped(op, key, problem, lambda: args)
    op, key, problem = _predict(name, dims, dtype)
    return Shaped(op, key, problem, lambda: _call(name, dims, dtype)[0][3])


def _family(name: str):
    def resolve(shape: tuple[int, ...], dtype: str, *, backward: bool = False,
                device: torch.device | None = None) -> Shaped:
        return _shaped(name, shape, getattr(torch, dtype), device)
    return resolve


def variant_problem(key: tuple, shape: tuple[int, ...], dtype: str | None = None) -> Shaped:
    """The problem of the shape on the variant FAMILY[key]: (kind, dtype, power, d_tile); the
    shape is ROWSxD for the elementwise kernels, MxNxD for the fused ones (sympow_mma's)."""
    kind, dt, power, d_tile = key
    name = "sympow" if kind == "elementwise" else "sympow_mma"
    if len(shape) != (2 if name == "sympow" else 3):
        raise ValueError(f"--shape {'x'.join(map(str, shape))}: {FAMILY[key].name} takes "
                         f"{SHAPES[name].split('[')[0]} (power and d_tile are the variant's)")
    dims = _dims(name, (*shape, power, d_tile))
    op = FAMILY[key]
    _, problem_key, problem = _predict(name, dims, dt)
    wgmma = None if kind == "elementwise" else kind == "mma90"

    def args() -> tuple:  # the variant's own launch, not the route's on this GPU
        captured_op, _, _, launch_args = _call(name, dims, dt, wgmma)[0]
        if captured_op is not op:
            raise ValueError(f"{op.name} cannot run --shape {'x'.join(map(str, shape))} "
                             f"on this GPU (the implementation runs {captured_op.name})")
        return launch_args
    return Shaped(op, problem_key, problem, args)


for _name in SHAPES:
    family(_name, SHAPES[_name], DOCS[_name], DTYPES, _family(_name),
           variants=("sympow.elementwise",) if _name == "sympow" else ("sympow.mma",))
FAMILY.set_problems(variant_problem)
