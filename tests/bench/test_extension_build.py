"""vitrail.bench.extension_build's cases, without building them (the builds are the benchmark)."""
from __future__ import annotations

import json

import pytest
import torch

from vitrail.bench import extension_build as E


def test_each_case_gives_a_source_no_cache_has_seen(tmp_path):
    small = E._source("small_cuda", tmp_path)
    decl, cuda = json.loads(small)
    assert "at::Tensor scale_add(" in decl and "__global__ void scale_add_kernel" in cuda
    assert json.loads(E._source("small_cuda", tmp_path))[1] != cuda  # a fresh salt each time
    files = json.loads(E._source("large_cuda", tmp_path))
    assert [f.rsplit("/", 1)[1] for f in files] == ["kernels.cu", "more_kernels.cu"]
    texts = [open(f).read() for f in files]
    assert sum(t.count("__global__") for t in texts) == 5
    assert "PYBIND11_MODULE" in texts[1] and "PYBIND11_MODULE" not in texts[0]
    files = json.loads(E._source("large", tmp_path))
    assert [f.rsplit("/", 1)[1] for f in files] == ["ops.cpp", "bind.cpp"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines with no GPU")
def test_the_cuda_cases_are_refused_where_torch_sees_no_gpu():
    with pytest.raises(RuntimeError, match="small_cuda call a kernel: they need a GPU"):
        E.measure(cases=["small", "small_cuda"])


def test_an_unknown_case_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        E.main(["--cases", "small,medium"])
    assert "expected some of small, large, small_cuda, large_cuda" in capsys.readouterr().err


def test_each_row_is_reported_and_written_as_it_is_measured(monkeypatch, tmp_path, capsys):
    """--impls picks the builders; every row is printed and the JSON written when it is measured
    (a run cut short keeps them), the rows still to come under "pending"."""
    runs = []

    def run(impl, case, name, source, env, timeout=None):
        runs.append((impl, case))
        return {"call_s": 2.0 if impl == "torch" else 1.0, "import_s": 0.001}
    monkeypatch.setattr(E, "_run", run)
    seen = []
    E.measure(warm=2, killed=False, cases=("small", "large"), impls=("vitrail", "torch"),
              on_row=lambda case, impl, row, report: seen.append(
                  (case, impl, row["cold_s"], len(report["pending"]))))
    assert seen == [("small", "torch", 2.0, 3), ("large", "torch", 2.0, 2),
                    ("small", "vitrail", 1.0, 1), ("large", "vitrail", 1.0, 0)]
    assert len(runs) == 4 * 3  # a cold build and two warm processes a row
    out = tmp_path / "report.json"
    assert E.main(["--cases", "small", "--impls", "torch,vitrail", "--warm", "1", "--no-killed",
                   "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "small torch: cold_s 2.0, warm_ms 2000.0" in printed
    report = json.loads(out.read_text())
    assert report["pending"] == [] and set(report["results"]["small"]) == {"torch", "vitrail"}
    assert report["results"]["small"]["vitrail"]["warm_ms"] == 1000.0
    with pytest.raises(SystemExit):
        E.main(["--impls", "torch,ninja"])
    assert "expected some of torch, vitrail, vitrail+pch" in capsys.readouterr().err
