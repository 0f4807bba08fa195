"""Starting a tensor-parallel group: the leader in this process, the
followers as processes of their own (spawned here, or by the daemon).

Every rank gets a RankSpec: the checkpoint, its rank, how to meet the others
(torch.distributed's init method; within a machine also a shared-memory
segment the leader creates) and the pool's shape. Each rank reads only its
shard of the weights (load_weights with a Shard).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import select
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from superfluid.engine.config import ModelConfig, load_config
from superfluid.engine.parallel.group import GlooGroup, GlooLink, Group, GroupFault, NcclGroup, ShmGroup
from superfluid.engine.parallel.sharding import Shard
from superfluid.engine.parallel.tp_model import TpModel
from superfluid.engine.parallel.tp_torch import TpTorchModel
from superfluid.engine.weights import load_weights

if TYPE_CHECKING:
    from superfluid.engine.transformer import TransformerRuntime

__all__ = ["TRANSPORTS", "RankSpec", "build_model", "digest", "join_group", "load_tp", "read_shard", "spawn_followers"]

TRANSPORTS = ("shm", "gloo", "nccl")
OPS = ("c", "torch", "triton")  # the C kernels, the torch reference ops, the Triton kernels
DEFAULT_TIMEOUT_S = 10.0  # a collective that waits longer: a rank died or stopped
LOAD_TIMEOUT_S = 600.0  # every rank joined and loaded its shard
SLOT_BYTES = 4 << 20


@dataclasses.dataclass
class RankSpec:
    path: str
    world: int
    rank: int
    init_method: str  # torch.distributed's: file://... or tcp://host:port
    transport: str = "shm"
    shm_path: str = ""
    slot_bytes: int = SLOT_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    dtype: str = "float32"
    max_seq_len: int | None = None
    n_blocks: int = 0
    page: int = 16
    threads: int = 1
    leader_pid: int = 0
    plain_reduce: bool = False
    ops: str = "c"  # OPS: which kernels compute (every rank the same)
    device: str = "cpu"  # "cpu" or "cuda" (a rank takes the GPU of its index on its machine)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def join_group(spec: RankSpec) -> Group:
    """The rank's gloo process groups (every transport: they carry the plain
    all-reduce and the barriers, and are the whole path across machines),
    and the transport over them."""
    if spec.transport not in TRANSPORTS:
        raise ValueError(f"--tp-transport {spec.transport!r}: expected one of {', '.join(TRANSPORTS)}")
    if spec.device == "cuda":
        torch.cuda.set_device(rank_device(spec))
    link = GlooLink(spec.init_method, spec.world, spec.rank, spec.timeout_s, LOAD_TIMEOUT_S)
    if spec.transport == "gloo":
        return GlooGroup(link)
    if spec.transport == "nccl":
        try:
            return NcclGroup(link, rank_device(spec), spec.timeout_s)
        except BaseException:
            link.close()
            raise
    from superfluid.kernels.comm import ShmComm

    comm = None
    try:
        if spec.rank == 0:
            comm = ShmComm.create(spec.shm_path, spec.world, spec.slot_bytes)
            link.all_reduce(torch.zeros(1))  # the segment exists before anyone attaches
        else:
            link.all_reduce(torch.zeros(1))
            comm = ShmComm.attach(spec.shm_path, spec.world, spec.rank, spec.slot_bytes, spec.timeout_s)
        link.all_reduce(torch.zeros(1))  # every rank has it mapped: its name can go
        if spec.rank == 0:
            os.unlink(spec.shm_path)
    except BaseException:
        if comm is not None:
            comm.close()
        link.close()
        raise
    return ShmGroup(comm, link, spec.timeout_s)


def digest(spec: RankSpec) -> bytes:
    """What every rank must agree on: the options that shape the shard and the
    pool, and the checkpoint's config (GlooLink.barrier compares them)."""
    from superfluid.engine.checkpoint import read_text

    # Not the path (another machine may keep the checkpoint elsewhere): the config's text instead.
    mine = ("path", "rank", "leader_pid", "shm_path", "threads")  # ops, device: every rank the same
    same = {k: v for k, v in dataclasses.asdict(spec).items() if k not in mine}
    text = json.dumps(same, sort_keys=True) + read_text(os.path.join(spec.path, "config.json"))
    if spec.ops == "c":
        # The numeric class too: ranks on machines of other classes would add pieces that differ.
        from superfluid.kernels import cpu

        text += cpu.numeric_class(getattr(torch, spec.dtype))
    return hashlib.sha256(text.encode()).digest()


@dataclasses.dataclass
class ShardWeights:
    """A rank's weights, read before it joins its group (a slow or failing load
    is seen by the leader before anyone waits in a collective)."""

    cfg: ModelConfig
    shard: Shard
    dtype: torch.dtype
    weights: dict[str, torch.Tensor]


def rank_device(spec: RankSpec) -> torch.device:
    """This rank's device: the CPU, or the GPU of its index among this
    machine's (ranks share GPUs round-robin when there are fewer)."""
    if spec.device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", spec.rank % torch.cuda.device_count())


def read_shard(spec: RankSpec) -> ShardWeights:
    if spec.ops == "c":
        from superfluid.kernels import cpu

        cpu.own_threads(spec.threads)
    else:
        torch.set_num_threads(spec.threads)
    cfg = load_config(spec.path)
    shard = Shard.plan(cfg, spec.world, spec.rank)
    dtype = getattr(torch, spec.dtype)
    return ShardWeights(cfg, shard, dtype, load_weights(spec.path, cfg, dtype=dtype, shard=shard))


def build_model(spec: RankSpec, read: ShardWeights, group: Group) -> TpModel | TpTorchModel:
    if spec.ops == "c":
        return TpModel(read.cfg, read.weights, read.shard, group, dtype=read.dtype, max_seq_len=spec.max_seq_len,
                       plain_reduce=spec.plain_reduce)
    from superfluid.kernels.backend import Backend, TritonBackend

    backend = TritonBackend() if spec.ops == "triton" else Backend()
    return TpTorchModel(read.cfg, read.weights, read.shard, group, backend, rank_device(spec), dtype=read.dtype,
                        max_seq_len=spec.max_seq_len, plain_reduce=spec.plain_reduce)


def spawn_followers(base: RankSpec) -> list[subprocess.Popen[bytes]]:
    """Ranks 1..world-1 as processes of this one. They end within a second of
    their leader's end (follow() checks that it lives; no PR_SET_PDEATHSIG:
    that fires when the spawning *thread* ends)."""
    procs = []
    for r in range(1, base.world):
        spec = dataclasses.replace(base, rank=r, leader_pid=os.getpid())
        procs.append(subprocess.Popen([sys.executable, "-P", "-m", "superfluid.engine.parallel.rank", spec.to_json()],
                                      stdout=subprocess.PIPE))
    return procs


def wait_ready(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """Every follower said "ready" (GroupFault naming the one that exited or
    stayed silent instead)."""
    deadline = time.monotonic() + timeout_s
    waiting = {p.stdout.fileno(): (r + 1, p) for r, p in enumerate(procs) if p.stdout is not None}
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            raise GroupFault(f"tp rank(s) {sorted(r for r, _ in waiting.values())} not ready in {timeout_s:.0f} s")
        ready, _, _ = select.select(list(waiting), [], [], min(left, 1.0))
        for fd in ready:
            r, p = waiting.pop(fd)
            line = p.stdout.readline() if p.stdout else b""
            if p.stdout is not None:
                p.stdout.close()
            if line.strip() != b"ready":
                p.wait(5)
                raise GroupFault(f"tp rank {r} exited with status {p.returncode} while loading")


def rank_spec(path: str, tp: int, rank: int, init_method: str, shm_path: str, *, backend: str = "torch",
              device: str | None = None, dtype: torch.dtype | None = None, max_seq_len: int | None = None,
              transport: str = "auto", threads: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S,
              plain_reduce: bool = False, leader_pid: int = 0, slot_bytes: int = SLOT_BYTES,
              **pool_options: Any) -> RankSpec:
    """Rank `rank`'s spec from load()'s options: every rank of a group
    computes the same kernels, device kind, pool shape and sequence limit
    from the same options."""
    from superfluid.engine.transformer import DEFAULT_KV_CELLS, DEFAULT_PAGE
    from superfluid.kernels.backend import cpu_kernels_in_use

    cfg = load_config(path)
    Shard.plan(cfg, tp, rank)  # a degree the model does not split into is refused before anything starts
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if backend == "torch":
        ops = "c" if cpu_kernels_in_use(backend, True, dev) else "torch"
    elif backend == "triton":
        ops = "triton"
    else:
        raise ValueError(f"--backend {backend!r}: expected torch or triton")
    transport = resolve_transport(transport, dev, tp)
    if not timeout_s > 0:
        raise ValueError(f"--tp-timeout {timeout_s}: must be > 0 seconds")
    limit = min(cfg.max_position_embeddings, cfg.sliding_window or cfg.max_position_embeddings)
    page = pool_options.get("page", DEFAULT_PAGE)
    if dtype is None:  # as load() chooses: float32 on a CPU, the checkpoint's on a GPU
        dtype = torch.float32 if dev.type == "cpu" else cfg.dtype
    return RankSpec(path=os.fspath(path), world=tp, rank=rank, init_method=init_method, transport=transport,
                    shm_path=shm_path, timeout_s=timeout_s, ops=ops, device=dev.type,
                    dtype=str(dtype).removeprefix("torch."),
                    max_seq_len=min(max_seq_len or limit, limit),
                    n_blocks=-(-pool_options.get("kv_cells", DEFAULT_KV_CELLS) // page) + 1, page=page,
                    threads=threads, leader_pid=leader_pid, plain_reduce=plain_reduce, slot_bytes=slot_bytes)


def resolve_transport(transport: str, dev: torch.device, tp: int) -> str:
    """--tp-transport's choice: `auto` is NCCL where each rank has a GPU of
    its own, else this machine's shared memory (tensors on a GPU go through
    host copies: two ranks may share one GPU)."""
    if transport not in (*TRANSPORTS, "auto"):
        raise ValueError(f"--tp-transport {transport!r}: expected auto or one of {', '.join(TRANSPORTS)}")
    if transport == "auto":
        own_gpus = dev.type == "cuda" and torch.cuda.device_count() >= tp and dist.is_nccl_available()
        return "nccl" if own_gpus else "shm"
    if transport == "nccl" and (dev.type != "cuda" or not dist.is_nccl_available()):
        raise ValueError(f"--tp-transport nccl: needs CUDA GPUs and a torch built with NCCL (the device here is "
                         f"{dev.type})")
    return transport


def load_tp(path: str, tp: int, *, backend: str = "torch", device: str | None = None,
            dtype: torch.dtype | None = None, max_seq_len: int | None = None,
            transport: str = "auto", threads: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S,
            plain_reduce: bool = False, join: tuple[str, str] | None = None, nnodes: int = 1,
            slot_bytes: int = SLOT_BYTES, **pool_options: Any) -> TransformerRuntime:
    """A TransformerRuntime whose model runs on `tp` ranks, this process the
    leader. `join` (init method, shared-memory path): the followers are
    started by someone else (the daemons of `nnodes` machines) and meet
    here; without it they are spawned here and stopped with the runtime."""
    from superfluid.engine.parallel.ranks import LeaderModel
    from superfluid.engine.transformer import TransformerRuntime

    spawn = join is None
    if join is None:  # a TCP store on a free port of this machine: no file to leave behind
        join = (f"tcp://127.0.0.1:{_free_port()}", f"/dev/shm/sf-tp-{os.getpid()}-{secrets.token_hex(4)}")
    spec = rank_spec(path, tp, 0, *join, backend=backend, device=device, dtype=dtype, max_seq_len=max_seq_len,
                     transport=transport, threads=threads, timeout_s=timeout_s, plain_reduce=plain_reduce,
                     slot_bytes=slot_bytes, **pool_options)
    procs = spawn_followers(spec) if spawn else []
    group: Group | None = None
    try:
        read = read_shard(spec)
        wait_ready(procs, LOAD_TIMEOUT_S)  # each loaded its shard (or exited: named), then joins
        group = join_group(spec)
        model = build_model(spec, read, group)
        group.link.barrier(digest(spec))  # every rank joined, with the same checkpoint and options
    except BaseException:
        for p in procs:
            p.kill()
            p.wait()
        if group is not None:
            group.close()
        raise

    def close_group() -> None:
        assert group is not None
        group.close()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    from superfluid.engine.loader import _tokenizer

    tokenizer_json, specials = _tokenizer(os.fspath(path))
    cfg = model.cfg
    leader = LeaderModel(model, close_group)
    rt = TransformerRuntime(leader, specials=specials, tokenizer_json=tokenizer_json,
                            runtime_id=f"{cfg.arch}-{backend}", **pool_options)
    rt.desc = dataclasses.replace(rt.desc, tp=tp, nnodes=nnodes)
    rt.followers = procs
    return rt


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
