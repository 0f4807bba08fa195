"""A worker process: open its segment, load the runtime, serve plans.

    python -m superfluid.daemon.worker --segment PATH --epoch N [--model DIR | --fake]
        [--backend torch|triton] [--fault-injection] [--kv-cells N] [--page N] [--state-bytes N]
        [--max-batch N] ... [--control-fd FD --segment-config JSON --metrics-fd FD]   (given by the daemon)

A Llama-family checkpoint is served by the paged-KV transformer runtime
(--kv-cells, --page, --dtype size it), a Mamba2 one (config.json model_type
"mamba2") by the exact_only Mamba2 runtime (--state-bytes sizes its state
pool; it computes in float32 only).

The daemon starts one per segment and restarts it when it dies. It talks to
the worker over --control-fd (stop), tells it the segment's geometry
(--segment-config: the header's copy may have been scribbled on) and shares
a metrics block (--metrics-fd). Without a control fd, SIGTERM stops it.
Exit codes: 0 stopped, 70 the runtime failed fatally (state unknown), 2 bad
arguments or a segment it cannot open, 3 the model would not load this time
(a restart may mend it), 4 the model or the options can never be served here
(a config or weights error, sizes beyond the machine: the daemon stops).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable

from superfluid.engine.checkpoint import model_type, raw_config

EXIT_BAD_ARGS = 2
EXIT_LOAD = 3  # the model would not load this time (a restart may)
EXIT_UNSERVABLE = 4  # the model or the options can never be served here: a restart would fail the same way


def build_runtime(args: argparse.Namespace):
    """The runtime a worker serves: a checkpoint, the embedded tiny model, or the fake."""
    if args.fake:
        if args.tp > 1:
            raise ValueError(f"--tp {args.tp}: the fake runtime runs on one process")
        from superfluid.engine.fake import FakeRuntime

        return FakeRuntime(vocab_size=args.fake_vocab, max_seq_len=args.max_seq_len or 4096,
                           max_batch=args.max_batch, max_seqs=args.max_seqs, page=args.page,
                           cells_total=args.kv_cells, engine_sampling=True, engine_draws=True,
                           prefill_step_tokens=args.prefill_step_tokens, step_cost=args.fake_step_cost)
    from superfluid.engine import load
    from superfluid.engine.tiny import default_model_dir

    model = args.model or str(default_model_dir())
    return load(model, args.backend, **runtime_options(args, model))


MAMBA2 = "mamba2"


def model_vocab(model: str) -> int:
    """The checkpoint's vocabulary (it sizes the logits ring). ValueError when
    the config cannot be read or is not one we load."""
    if model_type(model) == MAMBA2:
        from superfluid.engine.mamba2 import Mamba2Config

        return Mamba2Config.from_dict(raw_config(model)).vocab_size
    from superfluid.engine.config import load_config

    return load_config(model).vocab_size


def runtime_options(args: argparse.Namespace, model: str) -> dict:
    """load()'s options for this checkpoint, from the runtime options.
    ValueError, naming the option, for one its runtime cannot honour: the
    daemon checks them before starting a worker that would crash-loop."""
    common = dict(max_batch=args.max_batch, max_seqs=args.max_seqs, prefill_step_tokens=args.prefill_step_tokens,
                  max_seq_len=args.max_seq_len or None)
    dtype = getattr(args, "dtype", None) or "auto"
    state_bytes = getattr(args, "state_bytes", 0)
    tp = getattr(args, "tp", 1)
    if model_type(model) != MAMBA2:
        if state_bytes:
            raise ValueError("--state-bytes sizes a Mamba2 state pool; this model's KV pool is sized by --kv-cells")
        out = dict(common, kv_cells=args.kv_cells or 16384, page=args.page, dtype=_DTYPES[dtype])
        if getattr(args, "nnodes", 1) > 1 and tp == 1:
            raise ValueError(f"--nnodes {args.nnodes}: spans machines with the ranks of --tp, which is 1")
        if tp > 1:
            out.update(tp=tp, tp_options=tp_options(args))
        return out
    if tp > 1:
        raise ValueError(f"--tp {tp}: the Mamba2 runtime runs on one process (tensor parallelism is for "
                         f"Llama-family models)")
    if dtype not in ("auto", "fp32"):
        raise ValueError(f"--dtype {dtype}: the Mamba2 runtime computes in float32 only "
                         "(use --dtype fp32, or auto, which is fp32 for it)")
    if args.kv_cells or args.page != _PAGE_DEFAULT:
        raise ValueError("--kv-cells and --page size a paged KV pool; a Mamba2 model's state pool is sized "
                         "by --state-bytes")
    if state_bytes:
        from superfluid.engine.mamba2 import Mamba2Config
        from superfluid.engine.mamba2_state import StatePool

        slot = StatePool.slot_bytes(Mamba2Config.from_dict(raw_config(model)))
        if state_bytes < slot:
            raise ValueError(f"--state-bytes {state_bytes}: less than one sequence's state ({slot} bytes)")
    # None: the runtime's default, one slot per --max-seqs sequence (64 when that is 0).
    return dict(common, state_bytes=state_bytes or None)


def tp_options(args: argparse.Namespace) -> dict:
    """load()'s tp_options: the transport, the collective timeout, each rank's
    threads (--threads, default this machine's cores shared out), and where
    the ranks meet: across machines at --master-addr:--master-port through
    gloo, else where the daemon says (--tp-init, --tp-shm)."""
    check_nodes(args)
    local = args.tp // args.nnodes
    across = "nccl" if args.tp_transport == "nccl" else "gloo"
    out: dict = dict(transport=args.tp_transport if args.nnodes == 1 else across, timeout_s=args.tp_timeout,
                     threads=args.threads or max(1, len(os.sched_getaffinity(0)) // local), nnodes=args.nnodes)
    if args.nnodes > 1:
        out["join"] = (f"tcp://{args.master_addr}:{args.master_port}", "")
    elif getattr(args, "tp_init", None):
        out["join"] = (args.tp_init, getattr(args, "tp_shm", "") or "")
    return out


def check_nodes(args: argparse.Namespace) -> None:
    """ValueError naming the option when --nnodes, --node-rank and --tp do not fit together."""
    if args.node_rank >= args.nnodes:
        raise ValueError(f"--node-rank {args.node_rank}: the nodes of --nnodes {args.nnodes} are 0..{args.nnodes - 1}")
    if args.nnodes > 1:
        if args.tp % args.nnodes:
            raise ValueError(f"--nnodes {args.nnodes}: does not divide --tp {args.tp} (each node runs as many ranks)")
        if not args.master_addr:
            raise ValueError(f"--nnodes {args.nnodes}: --master-addr is needed (node 0's address)")



_PAGE_DEFAULT = 16
# auto: float32 on a CPU, the checkpoint's dtype on a GPU (a Mamba2 model: float32).
_DTYPES = {"auto": None, "fp32": "float32", "bf16": "bfloat16"}


U32_MAX = (1 << 32) - 1  # the runtime description's fields (abi/superfluid.h RuntimeDesc)
DEFAULT_RECORD_BYTES = 256 << 20  # --record-bytes
MIN_RECORD_BYTES = 32 << 10


def _at_least(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r}: expected an integer") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{s}: must be >= {lo}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"{s}: must be <= {hi}")
        return v
    return parse


def _positive_seconds(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected seconds") from None
    if not 0 < v <= 86400:
        raise argparse.ArgumentTypeError(f"{s}: must be in (0, 86400] seconds")
    return v


def _bytes_or_auto(s: str) -> int | str:
    if s == "auto":
        return s
    return _at_least(0)(s)


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    """Options that size the runtime (shared with `superfluid serve`)."""
    p.add_argument("--model", help="checkpoint directory (config.json + safetensors); default: the embedded tiny model")
    p.add_argument("--backend", choices=("torch", "triton"), default="torch")
    p.add_argument("--fake", action="store_true", help="serve the deterministic fake runtime (tests, benchmarks)")
    p.add_argument("--fake-vocab", type=_at_least(2), default=512, help=argparse.SUPPRESS)
    p.add_argument("--fake-step-cost", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--kv-cells", type=_at_least(0), default=0,
                   help="KV cells in the pool (default 16384; fake: unlimited; not for a Mamba2 model)")
    p.add_argument("--page", type=_at_least(1, U32_MAX), default=_PAGE_DEFAULT, help="cells per KV block (default 16)")
    p.add_argument("--state-bytes", type=_at_least(0), default=0,
                   help="Mamba2 models: bytes of recurrent state in the pool, one fixed-size slot per sequence "
                        "(default: --max-seqs slots, 64 when that is 0; a sequence of the embedded tiny Mamba2 "
                        "holds 40448 bytes)")
    p.add_argument("--max-batch", type=_at_least(1, U32_MAX), default=64, help="lanes per step (default 64)")
    p.add_argument("--max-seqs", type=_at_least(0, U32_MAX), default=0,
                   help="sequences at once, 0 = unbounded (a Mamba2 model: as many as --state-bytes holds)")
    p.add_argument("--max-seq-len", type=_at_least(0, U32_MAX), default=0,
                   help="cap on cells per sequence (default: the model's)")
    p.add_argument("--prefill-step-tokens", type=_at_least(0, U32_MAX), default=512,
                   help="tokens per prefill step (default 512)")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default="auto",
                   help="weights and KV: fp32, or bf16 (half the bytes; activations stay float32 on a CPU); "
                        "default auto: fp32 on a CPU, the checkpoint's on a GPU; a Mamba2 model: fp32 only")
    p.add_argument("--fault-schedule", metavar="FILE",
                   help="a fault schedule (JSON: {seed, rules}; docs/faults.md) installed at every start of a "
                        "worker; needs --fault-injection")
    p.add_argument("--cache-bytes", type=_bytes_or_auto, default="auto",
                   help="bytes of the KV pool that published prefixes may keep (default auto: half the pool)")
    p.add_argument("--host-cache-bytes", type=_at_least(0), default=1 << 30,
                   help="host memory for prefixes evicted from the pool, 0 = none (default 1 GiB)")
    p.add_argument("--max-leases", type=_at_least(1), default=1024, help="seed leases at once (default 1024)")
    p.add_argument("--state-dir", help="the folder op paths (EXPORT_ENTRY, IMPORT_STATE) may name; serve: "
                   "default $SUPERFLUID_SHM_DIR (or /dev/shm)/superfluid.NAME.state, made mode 0700; a worker "
                   "without one takes no paths")
    p.add_argument("--state-dir-bytes", type=_at_least(0), default=0,
                   help="what exports may keep in the state directory (default: half of what it holds and its "
                        "file system has free when a worker starts)")
    p.add_argument("--tp", type=_at_least(1, 64), default=1,
                   help="tensor-parallel degree: the model runs on this many rank processes, with the same bits "
                        "as on one (a Llama-family model; the degree must divide its pieces)")
    p.add_argument("--tp-transport", choices=("auto", "shm", "gloo", "nccl"), default="auto",
                   help="how a machine's ranks exchange a step's tensors: shared memory, torch.distributed's "
                        "gloo (the reference; always across machines unless nccl) or NCCL between GPUs; auto "
                        "(default): nccl where each rank has a GPU of its own, else shm")
    p.add_argument("--tp-timeout", type=_positive_seconds, default=10.0,
                   help="seconds a rank waits for the others in a collective before the group is restarted "
                        "(a rank died or stopped; default 10)")
    p.add_argument("--nnodes", type=_at_least(1, 64), default=1,
                   help="machines the --tp ranks span (each runs `serve` with the same options and its "
                        "--node-rank; node 0 hosts the worker and its segment; default 1)")
    p.add_argument("--node-rank", type=_at_least(0, 63), default=0, help="this machine's place among --nnodes")
    p.add_argument("--master-addr", default="",
                   help="with --nnodes > 1: the address where node 0's leader rank listens for the others")
    p.add_argument("--master-port", type=_at_least(1, 65535), default=29517,
                   help="with --nnodes > 1: its port (default 29517)")
    # Not the runtime's, but passed on to every worker like its options (serve's runtime_argv).
    p.add_argument("--record", metavar="DIR",
                   help="flight recorder: keep what each worker consumes (plans, ops, prompts, sessions, the "
                        "outcomes) in DIR/worker-<i>/, for `superfluid replay` (docs/recorder.md)")
    p.add_argument("--record-bytes", type=_at_least(MIN_RECORD_BYTES), default=DEFAULT_RECORD_BYTES, metavar="N",
                   help=f"the most a worker's record keeps (default {DEFAULT_RECORD_BYTES >> 20} MiB; the oldest "
                        "segment file goes first)")
    p.add_argument("--threads", type=_at_least(0), default=0,
                   help="threads per worker (default: torch's choice): a transformer on the CPU runs our "
                        "kernels on them and torch's own ops on one; else torch's. Keep workers x threads at or "
                        "under the free cores")


def state_dir_limit(args: argparse.Namespace) -> int | None:
    """The bytes the state directory may hold (--state-dir-bytes; 0: half of
    what it holds and its file system has free now), making it if missing."""
    if args.state_dir is None:
        return None
    os.makedirs(args.state_dir, mode=0o700, exist_ok=True)
    if args.state_dir_bytes:
        return args.state_dir_bytes
    from superfluid.executor import StateDir

    st = os.statvfs(args.state_dir)
    return (StateDir(args.state_dir).held_bytes() + st.f_bavail * st.f_frsize) // 2


def check_servable(args: argparse.Namespace) -> None:
    """ValueError naming the option or field when the checkpoint could never
    load or its sizes are more than this machine has (whoever started us;
    `serve` checked the same before it did)."""
    if args.fake:
        return
    from superfluid.daemon.preflight import Machine, Refused, check_memory
    from superfluid.engine.sizing import plan_load
    from superfluid.engine.tiny import default_model_dir

    model = args.model or str(default_model_dir())
    needs = plan_load(model, args.backend, **runtime_options(args, model))
    try:
        check_memory(needs, Machine.here(gpu=any(n.on_device for n in needs)))
    except Refused as e:
        raise ValueError(str(e)) from None


def thread_layout(args: argparse.Namespace) -> None:
    """A transformer on our CPU kernels runs them on --threads (default:
    torch's count) and torch's own ops on one (kernels/cpu.own_threads says
    why); the fake, a Mamba2 model, a GPU and the pure-torch path
    (SUPERFLUID_CPU_KERNELS=0) keep torch's count, --threads when given."""
    if args.fake and not args.threads:
        return
    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from superfluid.kernels.backend import cpu_kernels_in_use

    if args.fake or not cpu_kernels_in_use(args.backend, device="cuda" if torch.cuda.is_available() else "cpu"):
        return
    from superfluid.engine.tiny import default_model_dir
    from superfluid.kernels import cpu

    if model_type(args.model or str(default_model_dir())) != MAMBA2:
        cpu.own_threads()


def make_executor(args: argparse.Namespace, runtime, rings, *, epoch: int, fatal_exit: bool,  # type: ignore[no-untyped-def]
                  state_bytes: int | None = None):
    """The worker's executor over `runtime` as its options say (whatever
    re-runs a worker's input builds it here too, so it is the same one)."""
    from superfluid.executor import Executor

    ex = Executor(runtime, rings, epoch=epoch, fatal_exit=fatal_exit, fault_injection=args.fault_injection,
                  cache_max_bytes=args.cache_bytes, host_cache_bytes=args.host_cache_bytes,
                  max_leases=args.max_leases, state_dir=args.state_dir, state_dir_bytes=state_bytes)
    if args.fault_schedule:
        if not args.fault_injection:
            raise ValueError(f"--fault-schedule {args.fault_schedule}: needs --fault-injection")
        ex.install_faults(read_fault_schedule(args.fault_schedule))
    return ex


def read_fault_schedule(path: str):  # type: ignore[no-untyped-def]
    """--fault-schedule FILE's schedule; ValueError naming the file and the field."""
    import json

    from superfluid.executor import OpError, parse_schedule

    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"--fault-schedule {path}: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"--fault-schedule {path}: expected a JSON object {{\"seed\": ..., \"rules\": [...]}}")
    try:
        return parse_schedule(doc.get("rules"), doc.get("seed", 0))
    except OpError as e:
        raise ValueError(f"--fault-schedule {path}: {e}") from None


def worker_parser() -> argparse.ArgumentParser:
    """The worker's command line (a replay parses a recorded one with it)."""
    p = argparse.ArgumentParser(prog="superfluid-worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--segment", required=True, help="path of this worker's segment")
    p.add_argument("--epoch", type=int, required=True, help="the epoch the daemon gave this worker")
    p.add_argument("--fault-injection", action="store_true", help="allow op INJECT_FAULT")
    p.add_argument("--control-fd", type=int, help=argparse.SUPPRESS)
    p.add_argument("--metrics-fd", type=int, help=argparse.SUPPRESS)
    p.add_argument("--segment-config", help=argparse.SUPPRESS)
    p.add_argument("--tp-init", help=argparse.SUPPRESS)  # where the daemon's TP ranks meet
    p.add_argument("--tp-shm", help=argparse.SUPPRESS)
    add_runtime_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = worker_parser().parse_args(argv)

    from superfluid.daemon.control import Control
    from superfluid.daemon.segment_rings import SegmentRings
    from superfluid.daemon.worker_loop import Worker
    from superfluid.rings.errors import SegmentError
    from superfluid.rings.layout import SegmentConfig
    from superfluid.rings.segment import Segment

    control = Control(args.control_fd)
    # The daemon handles signals for the pool (a group-wide SIGTERM, e.g.
    # systemd's, must not kill a worker mid-tick); alone, SIGTERM stops it cleanly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if args.control_fd is None:
        control.stop_on_sigterm()
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        config = SegmentConfig.from_json(args.segment_config) if args.segment_config else None
        seg = Segment.open_path(args.segment, config=config)
    except SegmentError as e:
        print(f"superfluid worker: {e}", file=sys.stderr)
        return EXIT_BAD_ARGS
    # The daemon's --epoch is this worker's; the header's copy is a report (rewritten when READY).
    seg.set_epoch(args.epoch)
    seg.header.worker_pid = os.getpid()
    metrics = None
    if args.metrics_fd is not None:
        from superfluid.daemon.metrics import WorkerMetrics

        metrics = WorkerMetrics.from_fd(args.metrics_fd)
    thread_layout(args)
    try:
        check_servable(args)
        runtime = build_runtime(args)
    except ValueError as e:  # ConfigError, WeightError, an option or size the model or machine cannot take
        print(f"superfluid worker: cannot serve this model: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_UNSERVABLE
    except Exception as e:  # a file gone, memory others hold: the daemon counts it as a crash and restarts
        print(f"superfluid worker: cannot load the runtime: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_LOAD
    try:
        state_bytes = state_dir_limit(args)
    except OSError as e:  # made again if someone removed it; a restart may mend what stops that
        print(f"superfluid worker: --state-dir {args.state_dir}: {e.strerror}", file=sys.stderr)
        return EXIT_LOAD
    try:
        ex = make_executor(args, runtime, SegmentRings(seg), epoch=args.epoch, fatal_exit=True,
                           state_bytes=state_bytes)
    except ValueError as e:  # the fault schedule (the daemon checked it: the file changed since)
        print(f"superfluid worker: {e}", file=sys.stderr)
        return EXIT_UNSERVABLE
    if metrics is not None:
        ex.fault_sink = metrics.fault_injected
    recorder = None
    if args.record:
        from superfluid.daemon.recorder import Recorder
        from superfluid.engine.tiny import default_model_dir

        try:
            recorder = Recorder(args.record, seg.index, max_bytes=args.record_bytes, epoch=args.epoch, argv=argv,
                                model=None if args.fake else (args.model or str(default_model_dir())),
                                state_bytes=state_bytes)
        except OSError as e:  # the folder or a file an option names: a restart may mend it
            print(f"superfluid worker: --record {args.record}: {e}", file=sys.stderr)
            return EXIT_LOAD
    try:
        worker = Worker(seg, ex, epoch=args.epoch, control=control, metrics=metrics, recorder=recorder)
    except OSError as e:  # the recorder's first file (made when the worker attaches it)
        print(f"superfluid worker: --record {args.record}: {e}", file=sys.stderr)
        return EXIT_LOAD
    status = worker.run()
    if recorder is not None:
        recorder.close()
    runtime.close()  # a tensor-parallel leader tells its followers to stop (they exit 0)
    return status


if __name__ == "__main__":
    sys.exit(main())
