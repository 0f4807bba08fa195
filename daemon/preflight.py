"""What `superfluid serve` checks before it makes a segment or starts a
worker: everything a restart could not change. The checkpoint (config,
every safetensors header, every tensor's name, shape and dtype), the
options against the model, and the memory they imply against the machine
(RAM, device memory, /dev/shm, cores). A failure is one line naming the
option, field, file or tensor, and `serve` exits 2 with it at once rather
than crash-looping workers that would each fail the same way.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING

from superfluid.rings.errors import SegmentError
from superfluid.rings.layout import segment_bytes
from superfluid.rings.naming import shm_dir

if TYPE_CHECKING:
    from superfluid.engine.sizing import Need


log = logging.getLogger("superfluid.daemon")
# Workers per core past which --workers is refused: they would mostly wait for a core.
OVERSUBSCRIBED = 8


class Refused(Exception):
    """An option, a checkpoint or the machine refuses the daemon's start (one line)."""


@dataclass(frozen=True)
class Machine:
    """What this process may use: cores, memory, /dev/shm, device memory."""

    cores: int
    ram_bytes: int  # total, or the cgroup's limit when lower
    shm_free_bytes: int  # free space where segments are made
    device_bytes: int | None  # the GPU's total memory; None without one

    @classmethod
    def here(cls, *, gpu: bool = False) -> Machine:
        return cls(cores=len(os.sched_getaffinity(0)), ram_bytes=_ram_bytes(),
                   shm_free_bytes=_free_bytes(shm_dir()), device_bytes=_device_bytes() if gpu else None)


def _ram_bytes() -> int:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit_file) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _device_bytes() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def size(n: int) -> str:
    """Bytes for a person: 8.0 GiB, 512 B, 7.1 PiB."""
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if v < 1024:
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{v:.1f} PiB"


def flag(option: str) -> str:
    """load()'s option as serve names it: kv_cells -> --kv-cells."""
    return "--" + option.replace("_", "-")


@dataclass(frozen=True)
class Checked:
    vocab: int  # the model's vocabulary: it sizes the segments' logits rings
    made_state_dir: bool  # the state directory was made now (the daemon removes it if left empty)


def check(args: argparse.Namespace, machine: Machine | None = None) -> Checked:
    """Refused (one line) unless the daemon `args` describe could start and
    serve on this machine. Resolves args.state_dir (made if missing)."""
    from superfluid.daemon.supervisor import segment_config_for

    machine = machine or Machine.here(gpu=_wants_gpu(args))
    if args.workers > OVERSUBSCRIBED * machine.cores:
        raise Refused(f"--workers {args.workers}: more than {OVERSUBSCRIBED} per core of the "
                      f"{machine.cores} this machine gives the daemon")
    if args.workers > machine.cores:
        log.warning("--workers %d on %d core(s): the workers' ticks will share cores", args.workers,
                    machine.cores)
    if args.threads > machine.cores:
        raise Refused(f"--threads {args.threads}: more than the {machine.cores} core(s) this machine gives "
                      f"the daemon")
    if args.host_cache_bytes > machine.ram_bytes:
        raise Refused(f"--host-cache-bytes {args.host_cache_bytes}: more than this machine's memory "
                      f"({size(machine.ram_bytes)})")
    if args.fake and args.tp > 1:
        raise Refused(f"--tp {args.tp}: the fake runtime runs on one process")
    if args.nnodes > 1 and args.workers > 1:
        raise Refused(f"--workers {args.workers}: a group across machines (--nnodes {args.nnodes}) is one worker "
                      f"(its ranks meet at the one --master-port)")
    here = args.tp // max(1, args.nnodes)  # rank processes a worker runs on this machine
    if args.workers * here > OVERSUBSCRIBED * machine.cores:
        raise Refused(f"--tp {args.tp}: {args.workers} worker(s) of {here} rank processes each here, more than "
                      f"{OVERSUBSCRIBED} per core of the {machine.cores} this machine gives the daemon")
    from superfluid.kernels import isa

    if isa.ENV_ERROR:
        raise Refused(isa.ENV_ERROR)
    if 0 < getattr(args, "tick_timeout", 0) < 1:
        raise Refused(f"--tick-timeout {args.tick_timeout}: at least 1 s (a loop may pause that long without "
                      f"hanging), or 0 for no watchdog")
    if getattr(args, "fault_schedule", None):
        if not args.fault_injection:
            raise Refused(f"--fault-schedule {args.fault_schedule}: needs --fault-injection")
        from superfluid.daemon.worker import read_fault_schedule

        args.fault_schedule = os.path.abspath(args.fault_schedule)  # the workers read the very same file
        try:
            read_fault_schedule(args.fault_schedule)
        except ValueError as e:
            raise Refused(str(e)) from None
    vocab = args.fake_vocab
    if not args.fake:
        vocab = _check_model(args, machine)
    try:
        seg = segment_bytes(segment_config_for(vocab, args.max_batch))
    except SegmentError as e:
        raise Refused(f"--max-batch {args.max_batch}: the segment's logits ring would be too large ({e})") \
            from None
    if args.workers * seg > machine.shm_free_bytes:
        one_fits = seg <= machine.shm_free_bytes
        who = f"--workers {args.workers}" if one_fits else f"--max-batch {args.max_batch}"
        raise Refused(f"{who}: {args.workers} segment(s) of {size(seg)} (the logits ring holds two steps of "
                      f"--max-batch rows) need more than the {size(machine.shm_free_bytes)} free in "
                      f"{shm_dir()}")
    if args.metrics_port:
        _check_port(args.metrics_port)
    args.state_dir, made = prepare_state_dir(args.state_dir or default_state_dir(args.name))
    return Checked(vocab, made)


def _wants_gpu(args: argparse.Namespace) -> bool:
    if args.fake:
        return False
    import torch

    return torch.cuda.is_available()


def _check_model(args: argparse.Namespace, machine: Machine) -> int:
    """The checkpoint and the memory it implies; its vocabulary (it sizes the logits ring)."""
    from superfluid.daemon.worker import model_vocab, runtime_options
    from superfluid.engine.sizing import plan_load  # imports torch: only for a model

    model = args.model
    try:
        vocab = model_vocab(model)
        options = runtime_options(args, model)
        needs = plan_load(model, args.backend, **options)
    except (OSError, ValueError) as e:  # ConfigError and WeightError are ValueErrors
        raise Refused(f"--model {model}: {e}") from None
    except Exception as e:  # a config no check foresaw: still one line, not a traceback
        raise Refused(f"--model {model}: {type(e).__name__}: {e}") from None
    check_memory(needs, machine, args.workers)
    cache = args.cache_bytes
    if isinstance(cache, int):
        pool = next((n for n in needs if n.what in ("the KV pool", "the state pool")), None)
        if pool is not None and cache > pool.nbytes:
            raise Refused(f"--cache-bytes {cache}: more than {pool.what} ({size(pool.nbytes)}, "
                          f"{pool.describe(flag)}) it is a share of")
    return vocab


def check_memory(needs: list[Need], machine: Machine, workers: int = 1) -> None:
    """Refused when `workers` workers, each allocating `needs`, would take more
    memory (or GPU memory) than the machine has: naming the largest need's
    option, or --workers when one worker would fit."""
    for on_device, have, where in ((False, machine.ram_bytes, "memory"),
                                   (True, machine.device_bytes, "GPU memory")):
        mine = [n for n in needs if n.on_device == on_device]
        if not mine or have is None:
            continue
        each = sum(n.nbytes for n in mine)
        if workers * each <= have:
            continue
        big = max(mine, key=lambda n: n.nbytes)
        if each > have:
            raise Refused(f"{big.describe(flag)}: {big.what}: {size(big.nbytes)} (a worker: {size(each)} "
                          f"in all), more than this machine's {size(have)} of {where}")
        raise Refused(f"--workers {workers}: each worker needs {size(each)} of {where} ({big.what}: "
                      f"{size(big.nbytes)}), {size(workers * each)} in all: more than this machine's "
                      f"{size(have)}")


def _check_port(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise Refused(f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}: {e.strerror}") from None


def default_state_dir(name: str) -> str:
    """Beside the daemon's segments: $SUPERFLUID_SHM_DIR (or /dev/shm)/superfluid.NAME.state."""
    return os.path.join(shm_dir(), f"superfluid.{name}.state")


def prepare_state_dir(path: str) -> tuple[str, bool]:
    """The state directory's absolute path, and whether it was made now (mode
    0700); an existing one must be a real directory of this user that others
    cannot write."""
    path = os.path.abspath(path)
    made = True
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        made = False
    except OSError as e:
        raise Refused(f"--state-dir {path}: cannot make it: {e.strerror}") from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise Refused(f"--state-dir {path}: not a directory (a symlink is not taken either)")
    if st.st_uid != os.geteuid():
        raise Refused(f"--state-dir {path}: owned by uid {st.st_uid}, not by this user ({os.geteuid()})")
    if st.st_mode & 0o022:
        raise Refused(f"--state-dir {path}: others can write to it (mode {stat.S_IMODE(st.st_mode):o})")
    return path, made
