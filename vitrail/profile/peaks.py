"""The measured peaks of this GPU, so results can be reported as a percentage of what it does.

Datasheet numbers are not what a GPU reaches (clocks, power limits, the PCIe or SXM variant), so
vitrail measures its own: the bandwidth of a 1 GiB device-to-device copy (bytes read + written)
and the throughput of an 8192^3 bf16 ``torch.matmul`` on random data (zeros draw less power and
run faster than real data), both timed with :func:`vitrail.profile.measure`. The result is cached in
``peaks.json`` under the vitrail cache directory, keyed by GPU name, SM count and torch version,
so it is measured once per machine; ``peaks(refresh=True)`` measures again.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from vitrail.profile.timing import cuda_device, measure

log = logging.getLogger("vitrail.profile")

CACHE_FILE = "peaks.json"
FORMAT = 1
COPY_BYTES = 1 << 30
MATMUL_N = 8192


@dataclass(frozen=True)
class Peaks:
    """Measured peaks of one GPU: copy bandwidth in GB/s (1e9 bytes/s, read + written) and dense
    bf16 matmul throughput in TFLOP/s (1e12 FLOP/s)."""
    copy_gbps: float
    bf16_tflops: float
    device: str = ""
    sms: int = 0
    torch: str = ""
    measured: str = ""  # when, ISO 8601 local time

    def __str__(self) -> str:
        return (f"{self.device or 'GPU'}: copy {self.copy_gbps:.0f} GB/s, "
                f"bf16 matmul {self.bf16_tflops:.0f} TFLOP/s")


def peaks(device: Any = None, *, refresh: bool = False) -> Peaks:
    """The peaks of ``device`` (None: the current one), from the cache or measured and cached.

    ``refresh=True`` measures again and replaces the cached entry. Raises RuntimeError where no
    GPU is visible.
    """
    name, sms, torch_version = _identity(device)
    key = cache_key(name, sms, torch_version)
    path = cache_path()
    if not refresh:
        hit = load(path).get(key)
        if hit is not None:
            return hit
    measured = _measure(device)
    result = Peaks(copy_gbps=float(measured["copy_gbps"]),
                   bf16_tflops=float(measured["bf16_tflops"]), device=name, sms=sms,
                   torch=torch_version, measured=time.strftime("%Y-%m-%dT%H:%M:%S"))
    save(path, key, result)
    return result


def cache_key(name: str, sms: int, torch_version: str) -> str:
    return f"{name} | {sms} SMs | torch {torch_version}"


def cache_path() -> Path:
    from vitrail.jit.cache import cache_dir
    return cache_dir() / CACHE_FILE


def load(path: Path) -> dict[str, Peaks]:
    """Every readable entry of a peaks file; a missing file is empty, an unreadable one is
    logged and treated as empty (it is rewritten on the next save)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("vitrail: ignoring the unreadable peaks cache %s (%s); measuring again",
                    path, e)
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return {}
    out = {}
    for key, entry in (data.get("entries") or {}).items():
        try:
            out[key] = Peaks(**entry)
        except TypeError:
            log.warning("vitrail: ignoring a malformed entry %r in %s", key, path)
    return out


def save(path: Path, key: str, value: Peaks) -> None:
    """Add or replace one entry; other entries (other GPUs of the machine) are kept. The file is
    replaced atomically, under an flock so two processes do not drop each other's entries."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with _locked(path.with_suffix(".lock")):
        entries = {k: asdict(v) for k, v in load(path).items()}
        entries[key] = asdict(value)
        blob = json.dumps({"format": FORMAT, "entries": entries}, indent=1, sort_keys=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(blob + "\n")
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _identity(device: Any) -> tuple[str, int, str]:
    """(GPU name, SM count, torch version) of device: what the cache is keyed by."""
    import torch
    dev = cuda_device(device, "peaks")
    props = torch.cuda.get_device_properties(dev)
    return props.name, int(props.multi_processor_count), str(torch.__version__)


def _measure(device: Any) -> dict[str, float]:
    """Measure copy bandwidth and bf16 matmul throughput on device (about a second)."""
    import torch
    dev = cuda_device(device, "peaks")
    with torch.cuda.device(dev):
        return {"copy_gbps": _copy_gbps(dev), "bf16_tflops": _matmul_tflops(dev)}


def _copy_gbps(dev: Any) -> float:
    import torch
    src = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), warmup=5, rep=50, flush_l2=False)  # 1 GiB: no L2 hits
    return 2 * COPY_BYTES / (t.median * 1e-3) / 1e9


def _matmul_tflops(dev: Any) -> float:
    import torch
    n = MATMUL_N
    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    c = torch.empty(n, n, dtype=torch.bfloat16, device=dev)
    t = measure(lambda: torch.matmul(a, b, out=c), warmup=10, rep=50, flush_l2=False)
    return 2 * n ** 3 / (t.median * 1e-3) / 1e12
