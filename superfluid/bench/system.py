"""What a reader needs to trust a benchmark: the ISA the kernels ran on, how
busy the machine was meanwhile, and what its GEMMs and memory can do at peak.

`isa()` names the CPU capability torch dispatches to, our C kernels' path
(where that extension is built), the best path and the CPU features they
see, and the /proc/cpuinfo flags that decide which GEMM paths exist.
`LoadMeter` samples the load average and /proc/stat at start and stop;
other processes' share is the machine's busy time less this process's own
(and its reaped children's), as a fraction of all cores over the wall time
— live child processes count as others. `peak_gflops` is the best of a few
square GEMMs at the current thread count, `read_bandwidth_gbs` the best of
a few read-only passes over a buffer far larger than the caches: the speed
a decode step's weights can stream at, at best.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_flags() -> dict[str, bool]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return {}
    have = set(line.split(":", 1)[-1].split())
    return {flag: flag in have for flag in CPU_FLAGS}


def isa(device: str = "cpu") -> dict[str, Any]:
    out: dict[str, Any] = {"torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                           "superfluid_cpu_kernels": None, "superfluid_best": None, "superfluid_features": None,
                           "cpu_flags": cpu_flags()}
    try:
        from superfluid.kernels import cpu as sf_cpu  # the C kernels, where built

        out["superfluid_cpu_kernels"] = sf_cpu.isa()
        out["superfluid_best"] = sf_cpu.best_isa()
        out["superfluid_features"] = sf_cpu.features()
    except (ImportError, AttributeError):
        pass
    if device == "cuda" and torch.cuda.is_available():
        out["cuda_device"] = torch.cuda.get_device_name()
        out["cuda_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return out


def _busy_jiffies() -> int | None:
    """All cores' non-idle jiffies (user nice system irq softirq steal)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return user + nice + system + irq + softirq + steal


def _own_jiffies() -> int | None:
    """This process's utime + stime + reaped children's cutime + cstime."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return sum(int(v) for v in fields[11:15])  # fields 14-17 of stat(5), counted after the name


class LoadMeter:
    """Samples at construction; `result()` samples again and reports."""

    def __init__(self) -> None:
        self.load_before = os.getloadavg()
        self.t0, self.busy0, self.own0 = time.monotonic(), _busy_jiffies(), _own_jiffies()

    def result(self) -> dict[str, Any]:
        wall = time.monotonic() - self.t0
        busy, own = _busy_jiffies(), _own_jiffies()
        share = None
        if busy is not None and own is not None and self.busy0 is not None and self.own0 is not None and wall > 0:
            ticks = os.sysconf("SC_CLK_TCK") * wall * (os.cpu_count() or 1)
            share = round(max(0.0, (busy - self.busy0) - (own - self.own0)) / ticks, 4)
        return {"loadavg_before": [round(v, 2) for v in self.load_before],
                "loadavg_after": [round(v, 2) for v in os.getloadavg()],
                "other_processes_cpu_share": share, "wall_s": round(wall, 1)}


def finish(res: dict[str, Any], meter: LoadMeter, t_start: float) -> dict[str, Any]:
    """A bench result's conditions: the load while it ran, threads, Python,
    cores and wall seconds since t_start (time.perf_counter())."""
    import platform

    res["load"] = meter.result()
    res["threads"] = torch.get_num_threads()
    res["python"], res["cpu_count"] = platform.python_version(), os.cpu_count()
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    return res


def peak_gflops(dtype: torch.dtype, device: str = "cpu", n_max: int = 2048, repeats: int = 3,
                min_s: float = 0.05) -> tuple[float, int]:
    """(GF/s, n): the best of `repeats` n x n x n torch.mm at the current
    thread count, n doubled from 256 until one GEMM takes `min_s` or n
    reaches `n_max` (so a slow path, e.g. bf16 without native support, is
    measured in seconds, not minutes)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    n = min(256, n_max)
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        torch.mm(a, b)  # warm-up: library init, packing buffers
        sync()
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        if time.perf_counter() - t0 >= min_s or n >= n_max:
            break
        n = min(2 * n, n_max)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - t0)
    return round(2 * n**3 / best / 1e9, 1), n


READ_MIB = 512  # far past any CPU's last-level cache (and an H200's 50 MB L2)


def read_bandwidth_gbs(threads: int | None = None, device: str = "cpu", mib: int = READ_MIB,
                       repeats: int = 5) -> dict[str, Any]:
    """The machine's read bandwidth over `mib` MiB of float32 at `threads`
    threads (default: torch's count now), the best of `repeats` passes after
    one untimed pass; on the CPU the faster of torch.sum and the kernels'
    own probe (sf_read_probe), the buffer in 2 MiB pages where the kernel
    gives them. The best, not the median: noise only slows a pass, and the
    floor is what the memory can do. The buffer is written first, page by
    page different (untouched pages would all read the one zero page,
    identical ones may be merged). On the CPU it is measured in a child
    process, so the buffer never counts in this process's peak RSS (which
    the benches report)."""
    threads = threads or torch.get_num_threads()
    if device == "cuda":
        return _read_passes(threads, device, mib, repeats)
    code = ("import json, sys; from superfluid.bench import system; "
            f"print(json.dumps(system._read_passes({threads}, 'cpu', {mib}, {repeats})))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # imports as ours do
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _read_passes(threads: int, device: str, mib: int, repeats: int) -> dict[str, Any]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # every page different: identical pages may be merged (a VM host's KSM), and then a pass
        # reads a few pages from cache (seen here: 55 GB/s on a 33 GB/s machine)
        buf = _huge_buffer(mib) if device == "cpu" else torch.empty((mib << 18,), device=device)
        buf.uniform_()
        buf.sum()
        sync()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            buf.sum()
            sync()
            best = min(best, time.perf_counter() - t0)
        probe = _kernel_probe(buf, threads, repeats) if device == "cpu" else None
        del buf
    finally:
        torch.set_num_threads(before)
    gbs = round((mib << 20) / best / 1e9, 2)
    out: dict[str, Any] = {"read_gbs": gbs, "statistic": "best", "repeats": repeats, "buffer_mib": mib,
                           "threads": threads, "device": device}
    if probe is not None:
        # The faster of torch.sum and our kernels' probe (four streams a thread, as the decode GEMV
        # reads): the floor is what the memory can do, not what one library's reduction gets
        kernel_gbs = round((mib << 20) / probe / 1e9, 2)
        out.update(torch_sum_gbs=gbs, kernel_probe_gbs=kernel_gbs, read_gbs=max(gbs, kernel_gbs))
    return out


def _huge_buffer(mib: int) -> torch.Tensor:
    """float32 [mib << 18] in a mapping the kernel may back with 2 MiB pages,
    as the CPU kernels' weights are (in 4 KiB pages the probe would measure
    page walks too: ~25% less here)."""
    import mmap

    m = mmap.mmap(-1, mib << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return torch.frombuffer(m, dtype=torch.float32)


def _kernel_probe(buf: torch.Tensor, threads: int, repeats: int) -> float | None:
    """The best seconds of `repeats` sf_read_probe passes over buf (None
    without the C kernels)."""
    from superfluid.kernels import cpu

    if not cpu.available():
        return None
    nbytes = buf.numel() * buf.element_size()
    cpu.lib.sf_read_probe(cpu.ffi.cast("void *", buf.data_ptr()), nbytes, threads)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        cpu.lib.sf_read_probe(cpu.ffi.cast("void *", buf.data_ptr()), nbytes, threads)
        best = min(best, time.perf_counter() - t0)
    return best
