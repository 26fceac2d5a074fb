"""The emitted kernels do not change by accident: a dozen representative operations' C++
sources, names (with the source, the kernel cache's key) and the GEMM Ops' tuning-store key
are hashed against stored values. A refactor of the emitter must keep them; a change to a
kernel updates STORED here in the same commit, saying why."""
from __future__ import annotations

import hashlib

import pytest

from vitrail.gemm import (AccurateF32Operation, ConvOperation, GemmOperation, LinearCombination,
                          MathInstruction, TensorDescription, TileDescription)

T, M, E = TensorDescription, MathInstruction, LinearCombination


def _gemm(el="bf16", lb="row", out="bf16", tile=None, epi=None, mode="gemm", fast=False):
    return GemmOperation(A=T(el, "row"), B=T(el, lb), D=T(out, "row"), math=M(
        el, el, math_operation="multiply_add_fast_accum" if fast else "multiply_add"),
        tile=tile or TileDescription(), epilogue=epi, mode=mode)


CASES = {
    "plain": lambda: _gemm(),
    "batched_f16_col": lambda: _gemm("f16", "col", "f16", mode="batched"),
    "stream_k": lambda: _gemm(tile=TileDescription(tile_scheduler="stream_k"),
                              mode="split_k_serial"),
    "split_k_parallel": lambda: _gemm(mode="split_k_parallel", epi=E(
        "bf16", element_source="f32", bias="col", activation="gelu", clamp=True)),
    "array_source": lambda: _gemm(mode="array", epi=E("bf16", element_source="bf16")),
    "epilogue_all": lambda: _gemm(tile=TileDescription((64, 128, 64), (1, 2, 1), 4,
                                                       "pingpong"),
                                  epi=E("bf16", element_source="bf16", bias="row",
                                        activation="leaky_relu", clamp=True)),
    "tf32_bias": lambda: _gemm("tf32", "col", "f32", TileDescription((128, 128, 32)),
                               E("f32", bias="col", element_bias="f32")),
    "fp8_exact_144": lambda: _gemm("e4m3", "col", tile=TileDescription((128, 144, 128)),
                                   epi=E("bf16", scale_a="row", scale_b="col")),
    "fp8_fast": lambda: _gemm("e4m3", "col", tile=TileDescription((128, 256, 128), (2, 1, 1)),
                              epi=E("bf16", scale_a="tensor", scale_b="tensor"), fast=True),
    "accurate": lambda: AccurateF32Operation("row", "col"),
    "grouped": lambda: GemmOperation(T("bf16", "row"), T("bf16", "col"), T("bf16", "row"),
                                     M("bf16", "bf16"), TileDescription((128, 256, 64), (2, 1, 1)),
                                     mode="grouped"),
    "conv_fprop_bias": lambda: ConvOperation(
        "fprop", T("bf16"), T("bf16"), T("bf16"), M("bf16", "bf16"),
        TileDescription((128, 128, 64), kernel_schedule="warpspecialized"),
        E("bf16", bias="col", activation="relu")),
    "conv_wgrad": lambda: ConvOperation(
        "wgrad", T("f16"), T("f16"), T("f16"), M("f16", "f16"),
        TileDescription((128, 128, 64), kernel_schedule="warpspecialized")),
}

# name -> (sha256 of the source, sha256 of the kernel's name), first 16 hex digits
STORED = {
    "accurate": ("9a819a544c027414", "4ccf5f270bb2ef57"),
    "array_source": ("e0e19c8ea6045632", "6984648450cebf0a"),
    "batched_f16_col": ("03f2d7064b298f1a", "118067789a8eaed1"),
    "conv_fprop_bias": ("d84f50e5f292d214", "7e619917d896c04d"),  # + phases (ABI), max.NaN
    "conv_wgrad": ("28ea381db2a5f174", "186f51b175db783a"),  # + phases (ABI)
    "epilogue_all": ("d3420405050f3ef5", "91bd8ecf38c93f1d"),  # relu, clamp: max.NaN, min.NaN
    "fp8_exact_144": ("826d56303db1042f", "717e21415fc72caf"),
    "fp8_fast": ("2c8c15e3d8cd9699", "cc70517ff2eaca58"),
    "grouped": ("cd29e8297d8d8860", "b2d04547efc2cb21"),
    "plain": ("3ca622bfe9075cf5", "3d8b4395f5347e3a"),
    "split_k_parallel": ("fcc4ee7e740c2c93", "6f20370faf0bae92"),  # clamp: vitrail_act::clamp
    "stream_k": ("1ca92c0190370218", "8811053eeda47792"),
    "tf32_bias": ("77a869faf75670d6", "73b2a6b5da33903f"),
}


def _h(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_emitted_source_and_its_cache_key_are_unchanged(case):
    kw = CASES[case]().compile_kwargs("90a")
    assert kw["backend"] == "nvcc" and kw["arch"] == "90a"
    assert (_h(kw["source"]), _h(kw["name"])) == STORED[case], (
        f"{case}: the emitted kernel changed; if on purpose, update STORED")


def test_the_gemm_ops_tuning_key_is_unchanged():
    """An Op's tuning-store key hashes its kernel's template: timings stay valid across a
    refactor only while it is the same code (comments and spacing aside: tuner.source_hash)."""
    from vitrail.gemm.ops.configs import Kind
    from vitrail.gemm.ops.launch import op_for
    op = op_for(Kind("bf16", "bf16", "row", "row", E("bf16")))
    assert op.tunable.source_hash == STORED_TUNING_KEY


# since the hash leaves comments and spacing out; since the activations' max.NaN and min.NaN
STORED_TUNING_KEY = "dcc7ce9ed783aea3"
