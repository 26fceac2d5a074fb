"""The torch-extension examples: built for sm_90a on a machine with no GPU (CI), and on the GPU
equal to torch's own results, eagerly and under torch.compile (the TORCH_LIBRARY op)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import requires_gpu, requires_nvcc


@pytest.mark.slow
@requires_nvcc
def test_both_build_for_sm90a(monkeypatch):
    torch_cuda_headers = Path(torch.__file__).parent / "include/c10/cuda/impl"
    if not (torch_cuda_headers / "cuda_cmake_macros.h").is_file():
        pytest.skip("this torch has no CUDA headers (c10/cuda: a CPU build); the GPU tests "
                    "build them")
    monkeypatch.setenv("VITRAIL_ARCH", "90a")
    from examples.torch_extension import softmax, square
    for example in (square, softmax):
        assert example.module(build_only=True).is_file()


@requires_gpu
def test_square_matches_torch():
    from examples.torch_extension.square import square
    for n in (1, 1000, 1 << 20):
        x = torch.randn(n, device="cuda")
        torch.testing.assert_close(square(x), x * x)
    x = torch.randn(64, 64, device="cuda").t()  # not contiguous
    torch.testing.assert_close(square(x), x * x)


@requires_gpu
def test_softmax_matches_torch_eagerly_and_compiled():
    from examples.torch_extension.softmax import softmax
    for shape in ((1, 1), (7, 1000), (333, 4097)):
        x = torch.randn(shape, device="cuda") * 4
        torch.testing.assert_close(softmax(x), torch.softmax(x, -1))
    # the op, registered by the load above, in a graph (its Meta kernel gives the shapes)
    compiled = torch.compile(lambda t: torch.ops.vitrail_example.softmax(t * 2) + 1,
                             fullgraph=True)
    x = torch.randn(100, 300, device="cuda")
    torch.testing.assert_close(compiled(x), torch.softmax(x * 2, -1) + 1)
