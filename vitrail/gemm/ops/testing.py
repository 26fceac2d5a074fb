"""Test hooks of the GEMM launch path, as context managers (the state they set is the launch
module's private state, so outside them every call runs as a user's does).

    with poisoned():              outputs start as NaN, so an element the kernel leaves fails
    with kernels_only():          every GEMM runs a vitrail kernel, never torch's matmul
    with recording() as found:    launch.run prepares operands and launches nothing; found gets
                                  (kind, problem, (a, b, c, d, bias, scale_a, scale_b)) per call

The state is process-wide, not per thread: autograd's device threads run the backward's GEMMs.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from vitrail.gemm.ops import launch, model


@contextlib.contextmanager
def poisoned() -> Iterator[None]:
    """Every GEMM output is filled with NaN before its kernel runs (plans keyed apart)."""
    before = launch.poisoned
    launch.poisoned = True
    try:
        yield
    finally:
        launch.poisoned = before


@contextlib.contextmanager
def kernels_only(on: bool = True) -> Iterator[None]:
    """on: every GEMM runs a vitrail kernel, never torch's matmul (the selection's torch route
    off); False: the selection's routes, inside an outer kernels_only. The configs and plans
    chosen before are forgotten on entry and on exit."""
    before = model.torch_allowed
    model.torch_allowed = not on
    launch.forget_choices()
    try:
        yield
    finally:
        model.torch_allowed = before
        launch.forget_choices()


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """launch.run records (kind, problem, prepared operands) into the list it yields and zeroes
    the output instead of launching: the host-side preparation runs without a GPU."""
    before = launch.recording
    found: list = []
    launch.recording = found
    try:
        yield found
    finally:
        launch.recording = before
