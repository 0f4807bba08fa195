"""Bad input at the daemon's edges, against live daemons: a checkpoint that
cannot load and a size the machine cannot hold are refused once, up front
(exit 2 within seconds, one line naming the file, tensor, field or option,
nothing made); an op's path cannot leave the state directory, block the
worker or overwrite a file. A healthy daemon beside them serves throughout."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest
import torch

from superfluid.abi import OpStatus, Status
from superfluid.client import Client, PlanBuilder
from superfluid.engine.tiny import write_tiny
from superfluid.testing.checkpoints import rewrite_checkpoint
from superfluid.testing.daemon import FAKE, WAIT_S, Serve, live_workers, segment_files, start_fake
from superfluid.testing.launch import python

# Start-up before the refusal is Python's and torch's imports (~2 s here); a
# crash loop took ~29 s. A loaded CI machine gets room, not minutes.
REFUSAL_S = 20.0


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> Serve:
    s = start_fake(tmp_path_factory, "ok")
    yield s
    s.close()


def still_serves(d: Serve) -> None:
    with Client.connect(d.name, 0, timeout=WAIT_S) as c:
        assert c.tick(PlanBuilder(0)).status == Status.OK
    assert d.proc.poll() is None


def serve_refused(name: str, *args: str) -> str:
    """`superfluid serve` that must exit 2 within REFUSAL_S, having made nothing: its one line."""
    t0 = time.monotonic()
    r = subprocess.run([*python("-m", "superfluid", "serve", "--name", name), *args], capture_output=True,
                       text=True, timeout=60, env=dict(os.environ))
    took = time.monotonic() - t0
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert took < REFUSAL_S, took
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert not segment_files(name) and not live_workers(name)
    return lines[0]


# ------------------------------------------------------------------ checkpoints


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return write_tiny(tmp_path / "ok", seed=3)


def _weights(d: Path) -> Path:
    (f,) = d.glob("*.safetensors")
    return f


def _truncated(d: Path) -> str:
    f = _weights(d)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return f.name


def _not_json(d: Path) -> str:
    f = _weights(d)
    junk = b"{this is not json" + b" " * 30
    f.write_bytes(struct.pack("<Q", len(junk)) + junk + f.read_bytes()[8:])
    return f.name


def _int8(d: Path) -> str:
    rewrite_checkpoint(d, d.with_name("i8"), lambda t: t.__setitem__("model.norm.weight",
                                                                      torch.ones(t["model.norm.weight"].shape,
                                                                                 dtype=torch.int8)))
    return "model.norm.weight"


def _wrong_shape(d: Path) -> str:
    name = "model.layers.0.mlp.down_proj.weight"
    rewrite_checkpoint(d, d.with_name("ws"), lambda t: t.__setitem__(name, t[name][:, :-1].contiguous()))
    return name


def _heads(d: Path) -> str:
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_attention_heads"] = cfg["hidden_size"] - 1  # divides neither hidden nor the kv heads
    (d / "config.json").write_text(json.dumps(cfg))
    return "num_attention_heads"


def _symlink_loop(d: Path) -> str:
    f = _weights(d)
    f.unlink()
    f.symlink_to(f.name)  # itself
    return f.name


def _positions(d: Path) -> str:
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 10**12
    (d / "config.json").write_text(json.dumps(cfg))
    return "max_position_embeddings"


def _no_weights(d: Path) -> str:
    _weights(d).unlink()
    return "no *.safetensors"


def _fifo_weights(d: Path) -> str:
    f = _weights(d)
    f.unlink()
    os.mkfifo(f)  # a reader would wait for a writer for ever
    return "FIFO"


def _fifo_config(d: Path) -> str:
    (d / "config.json").unlink()
    os.mkfifo(d / "config.json")
    return "config.json"


def _layers(d: Path) -> str:
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 10**9  # a per-layer list of this would take minutes and gigabytes
    (d / "config.json").write_text(json.dumps(cfg))
    return "num_"


CORRUPTIONS = {"truncated": _truncated, "header-not-json": _not_json, "int8-tensor": _int8,
               "wrong-shape": _wrong_shape, "heads-do-not-divide": _heads, "symlink-loop": _symlink_loop,
               "max-position-embeddings-1e12": _positions, "no-weights": _no_weights,
               "fifo-weights": _fifo_weights, "fifo-config": _fifo_config, "layers-1e9": _layers}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_a_checkpoint_that_cannot_load_is_refused_up_front(kind, ckpt, healthy, seg_name):
    named = CORRUPTIONS[kind](ckpt)
    model = ckpt.with_name({"int8-tensor": "i8", "wrong-shape": "ws"}.get(kind, ckpt.name))
    line = serve_refused(seg_name, "--model", str(model), "--restart-backoff", "0.05")
    assert named in line and str(model) in line, line
    still_serves(healthy)


@pytest.mark.parametrize("edit,named", [
    ({"n_groups": 0}, "n_groups"), ({"time_step_limit": 5}, "time_step_limit"),
    ({"hidden_size": "x"}, "hidden_size"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"), ({"num_heads": 7}, "num_heads"),
])
def test_a_mamba2_config_that_cannot_load_is_refused_in_one_line(edit, named, tmp_path, seg_name):
    m2 = write_tiny(tmp_path / "m2", arch="mamba2", seed=1)
    cfg = json.loads((m2 / "config.json").read_text())
    (m2 / "config.json").write_text(json.dumps({**cfg, **edit}))
    line = serve_refused(seg_name, "--model", str(m2))
    assert named in line and str(m2) in line, line


def test_a_good_checkpoint_passes_the_same_checks(ckpt, seg_name, tmp_path):
    """The negative control: the checks above refuse what is wrong, not everything."""
    s = Serve(tmp_path, seg_name, "--model", str(ckpt))
    try:
        s.wait_log("worker 0 ready")
    finally:
        s.close()


# ------------------------------------------------------------------ sizes and options


@pytest.mark.parametrize("args,named", [
    (["--kv-cells", str(10**15)], "--kv-cells 1000000000000000"),
    (["--max-batch", str(10**8)], "--max-batch 100000000"),
    (["--workers", "1000"], "--workers 1000"),
    (["--host-cache-bytes", str(10**18)], "--host-cache-bytes 1000000000000000000"),
    (["--cache-bytes", str(10**14)], "--cache-bytes 100000000000000"),
    (["--fake", "--workers", "1000"], "--workers 1000"),
    (["--fake", "--max-batch", str(10**9)], "--max-batch 1000000000"),
    (["--threads", "100000"], "--threads 100000"),
    (["--max-seqs", str(10**12)], "--max-seqs"),
    (["--prefill-step-tokens", str(10**12)], "--prefill-step-tokens"),
    (["--name", "bad/name"], "--name"),
    (["--name", "x" * 40], "--name"),
    (["--tp", "3"], "--tp 3"),  # the tiny model's 4 heads do not split into 3
    (["--fake", "--tp", "2"], "--tp 2"),
    (["--tp", "2", "--nnodes", "3", "--master-addr", "127.0.0.1"], "--nnodes 3"),
    (["--tp", "2", "--nnodes", "2"], "--master-addr"),
    (["--tp", "2", "--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1"], "--node-rank 2"),
    (["--tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--workers", "2"], "--workers 2"),
])
def test_a_size_the_machine_cannot_hold_is_refused_naming_its_option(args, named, healthy, seg_name):
    by_argparse = {"--name", "--max-seqs", "--prefill-step-tokens"} & set(args)
    line = _argparse_refusal(args) if by_argparse else serve_refused(seg_name, *args)
    assert named in line, line
    still_serves(healthy)


@pytest.mark.parametrize("var,value", [("SUPERFLUID_ISA", "avx9"), ("SUPERFLUID_BF16_CLASS", "bf17")])
def test_an_unknown_isa_or_numeric_class_is_refused_naming_the_variable(var, value, ckpt, seg_name, monkeypatch):
    monkeypatch.setenv(var, value)
    line = serve_refused(seg_name, "--model", str(ckpt))
    assert f"{var}={value}" in line, line


def _argparse_refusal(args: list[str]) -> str:
    r = subprocess.run(python("-m", "superfluid", "serve", *args), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    return r.stderr.strip().splitlines()[-1]


def test_a_state_pool_larger_than_the_machine_is_refused(tmp_path, seg_name):
    m2 = write_tiny(tmp_path / "m2", arch="mamba2", seed=1)
    line = serve_refused(seg_name, "--model", str(m2), "--state-bytes", str(10**15))
    assert "--state-bytes 1000000000000000" in line and "state pool" in line, line
    line = serve_refused(seg_name, "--model", str(m2), "--tp", "2")
    assert "--tp 2" in line and "Mamba2" in line, line


def test_a_fault_schedule_is_checked_up_front(tmp_path, seg_name):
    f = tmp_path / "faults.json"
    f.write_text('{"rules": [{"when": {"tick": 1}, "what": {"stall_ms": 5}}]}')
    line = serve_refused(seg_name, "--fake", "--fault-schedule", str(f))
    assert "--fault-schedule" in line and "--fault-injection" in line, line
    line = serve_refused(seg_name, "--fake", "--fault-injection", "--fault-schedule", str(f))
    assert str(f) in line and "rules[0].what.during" in line, line
    f.write_text("{not json")
    line = serve_refused(seg_name, "--fake", "--fault-injection", "--fault-schedule", str(f))
    assert str(f) in line, line
    line = serve_refused(seg_name, "--fake", "--fault-injection", "--fault-schedule", str(tmp_path / "none"))
    assert "none" in line, line


def test_a_metrics_port_that_cannot_be_had_is_refused(seg_name):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = serve_refused(seg_name, "--fake", "--metrics-port", str(port))
    assert f"--metrics-port {port}" in line and f"127.0.0.1:{port}" in line, line


def test_a_state_dir_that_is_a_symlink_is_refused(tmp_path, seg_name):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    line = serve_refused(seg_name, "--fake", "--state-dir", str(tmp_path / "link"))
    assert "--state-dir" in line and "symlink" in line, line


# ------------------------------------------------------------------ op paths


@pytest.fixture(scope="module")
def state_daemon(tmp_path_factory):
    """A fake daemon with its state directory, and a lease on a published prompt."""
    base = tmp_path_factory.mktemp("state-daemon")
    state = base / "state"
    s = Serve(base, f"sd{os.getpid()}", *FAKE, "--state-dir", str(state))
    try:
        s.wait_log("worker 0 ready (epoch 1")
        yield s, state
    finally:
        s.close()


def _leased(c: Client) -> int:
    prompt = list(range(1, 13))
    tag = c.new_lane_tag()
    ev = c.tick(PlanBuilder(0, prefill_token_budget=64).admit(tag, c.write_prompt(prompt)).prefill(tag, 0, 12)
                .decode(tag, 1))
    assert ev.status == Status.OK, ev
    assert c.tick(PlanBuilder(0).retire(tag, publish_to_cache=True)).status == Status.OK
    done = c.op("LEASE_SEED", tokens=prompt, ttl_ticks=1000)
    assert done.status == OpStatus.OK, done
    return done.handle


def _refused(done, *words: str) -> None:
    assert done.status == OpStatus.BadRequest, done
    msg = done.payload.decode(errors="replace")
    assert "field 'path'" in msg and all(w in msg for w in words), msg


def test_an_export_and_an_import_through_the_state_dir(state_daemon):
    d, state = state_daemon
    with Client.connect(d.name, 0, timeout=WAIT_S) as c:
        h = _leased(c)
        done = c.op("EXPORT_ENTRY", handle=h, path="sub-ok.bin")
        assert done.status == OpStatus.OK and (state / "sub-ok.bin").stat().st_size == done.value
        assert (state / "sub-ok.bin").stat().st_mode & 0o777 == 0o600
        (state / "nested").mkdir(exist_ok=True)
        assert c.op("EXPORT_ENTRY", handle=h, path=str(state / "nested" / "e.bin")).status == OpStatus.OK
        imp = c.op("IMPORT_STATE", tokens=list(range(1, 9)), ttl_ticks=5, path="nested/e.bin")
        assert imp.status == OpStatus.OK and imp.value == 8, imp


def test_an_op_path_cannot_block_read_or_write_outside_or_overwrite(state_daemon, healthy, tmp_path):
    d, state = state_daemon
    fifo = state / "fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    (state / "dir").mkdir(exist_ok=True)
    outside = tmp_path / "victim"
    outside.write_bytes(b"precious")
    link = state / "link"
    if not link.exists():
        link.symlink_to(outside)
    (state / "loop").unlink(missing_ok=True)
    (state / "loop").symlink_to("loop")
    kept = state / "kept.bin"
    kept.write_bytes(b"kept")
    with Client.connect(d.name, 0, timeout=WAIT_S) as c:
        h = _leased(c)
        t0 = time.monotonic()
        imports = {"fifo": ("FIFO",), "/dev/zero": ("outside the state directory",),
                   str(outside): ("outside",), "../state/kept.bin": ("'..'",), "link": ("symlink",),
                   "loop": ("symlink",), "dir": ("directory",), "nothing-here": ("cannot be read",),
                   "dir/../kept.bin": ("'..'",)}
        for path, words in imports.items():
            _refused(c.op("IMPORT_STATE", tokens=list(range(1, 9)), ttl_ticks=5, path=path, timeout=WAIT_S),
                     *words)
        assert time.monotonic() - t0 < WAIT_S  # the FIFO did not block the worker
        exports = {"kept.bin": ("exists",), "link": ("symlink",), str(outside): ("outside",),
                   "/etc/passwd": ("outside",), "fifo": ("FIFO",), "no-such-dir/x.bin": ("cannot be reached",),
                   "dir/": ("folder",), str(state): ("state directory itself",),
                   ".sf-write.1.0": ("in progress",)}
        for path, words in exports.items():
            _refused(c.op("EXPORT_ENTRY", handle=h, path=path, timeout=WAIT_S), *words)
        for path, words in {"fifo": ("FIFO",), "link": ("symlink",), "dir": ("directory",)}.items():
            _refused(c.op("EXPORT_ENTRY", handle=h, path=path, overwrite=True, timeout=WAIT_S), *words)
        bad = c.op("EXPORT_ENTRY", handle=h, path="x.bin", overwrite="yes")
        assert bad.status == OpStatus.BadRequest and b"overwrite" in bad.payload
        assert outside.read_bytes() == b"precious" and kept.read_bytes() == b"kept"
        assert fifo.is_fifo() and link.is_symlink()
        # With overwrite, an existing regular file is replaced whole.
        done = c.op("EXPORT_ENTRY", handle=h, path="kept.bin", overwrite=True)
        assert done.status == OpStatus.OK and kept.stat().st_size == done.value
        assert not [p for p in state.iterdir() if p.name.startswith(".sf-write.")]
        assert c.tick(PlanBuilder(0)).status == Status.OK  # the worker ticks on
    still_serves(healthy)


def test_an_import_reads_no_more_than_the_cap_whatever_the_file_size(state_daemon):
    d, state = state_daemon
    big = state / "big.bin"
    with open(big, "wb") as f:
        f.truncate(64 << 20)  # sparse: 64 MiB of zeros, far more than the fake's largest export
    with Client.connect(d.name, 0, timeout=WAIT_S) as c:
        _refused(c.op("IMPORT_STATE", tokens=list(range(1, 9)), ttl_ticks=5, path="big.bin"), "more than")
        assert c.tick(PlanBuilder(0)).status == Status.OK


def test_the_state_dir_holds_no_more_than_its_limit(tmp_path):
    state = tmp_path / "state"
    s = Serve(tmp_path, f"lim{os.getpid()}", *FAKE, "--state-dir", str(state), "--state-dir-bytes", "400")
    try:
        s.wait_log("worker 0 ready (epoch 1")
        with Client.connect(s.name, 0, timeout=WAIT_S) as c:
            h = _leased(c)
            done = [c.op("EXPORT_ENTRY", handle=h, path=f"e{i}.bin") for i in range(20)]
            ok = [d for d in done if d.status == OpStatus.OK]
            assert ok and len(ok) < 20, [d.status for d in done]
            _refused(done[len(ok)], "400")
            held = sum(p.stat().st_size for p in state.iterdir())
            assert held <= 400 and held == sum(d.value for d in ok)
            # Replacing a file with one of its own size fits where a new one does not.
            assert c.op("EXPORT_ENTRY", handle=h, path="e0.bin", overwrite=True).status == OpStatus.OK
            assert c.tick(PlanBuilder(0)).status == Status.OK
    finally:
        s.close()


def test_a_state_dir_removed_under_a_worker_is_a_bad_request_and_made_again(tmp_path):
    state = tmp_path / "state"
    s = Serve(tmp_path, f"rm{os.getpid()}", *FAKE, "--state-dir", str(state))
    try:
        s.wait_log("worker 0 ready (epoch 1")
        with Client.connect(s.name, 0, timeout=WAIT_S) as c:
            state.rmdir()
            _refused(c.op("IMPORT_STATE", tokens=list(range(1, 9)), ttl_ticks=5, path="x.bin"),
                     "state directory", "cannot be opened")
            assert c.tick(PlanBuilder(0)).status == Status.OK  # the worker ticks on
        # The next worker makes it again; the one after sweeps what a writer that died left.
        (pid,) = live_workers(s.name)
        os.kill(pid, 9)
        s.wait_log("worker 0 ready (epoch 2")
        assert state.is_dir()
        gone = subprocess.Popen(["true"])
        gone.wait()
        leftover = state / f".sf-write.{gone.pid}.0"
        leftover.write_bytes(b"half an export")
        live = state / f".sf-write.{os.getpid()}.0"  # a live writer's (this process): kept
        live.write_bytes(b"in progress")
        (pid,) = live_workers(s.name)
        os.kill(pid, 9)
        s.wait_log("worker 0 ready (epoch 3")
        assert not leftover.exists() and live.exists()
    finally:
        s.close()


def test_a_fifo_op_leaves_no_writer_waiting(state_daemon):
    """The worker opened the FIFO without blocking and closed it: a writer opening it now would
    block (no reader), proven by a non-blocking open failing with ENXIO."""
    d, state = state_daemon
    fifo = state / "fifo2"
    os.mkfifo(fifo)
    with Client.connect(d.name, 0, timeout=WAIT_S) as c:
        _refused(c.op("IMPORT_STATE", tokens=list(range(1, 9)), ttl_ticks=5, path="fifo2"), "FIFO")
    with pytest.raises(OSError) as e:
        os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    assert e.value.errno == 6  # ENXIO: nobody holds it open for reading


def test_no_state_dir_no_paths(tmp_path):
    """An executor without a state directory (in process, by default) takes no path at all."""
    from superfluid.testing.executor import make_executor

    ex = make_executor()
    done = ex.op({"op": "IMPORT_STATE", "op_id": 1, "tokens": [1, 2, 3, 4], "ttl_ticks": 1,
                  "path": str(tmp_path / "x")})
    assert done.status == int(OpStatus.BadRequest) and b"no state directory" in done.payload


def test_a_device_in_the_state_dir_is_refused(tmp_path):
    """A character device inside the directory (root can make one) is not read."""
    from superfluid.testing.executor import make_executor

    dev = tmp_path / "zero"
    try:
        os.mknod(dev, 0o600 | 0o020000, os.makedev(1, 5))  # S_IFCHR: /dev/zero's numbers
    except PermissionError:
        pytest.skip("no permission to make a device node here")
    ex = make_executor(state_dir=tmp_path)
    done = ex.op({"op": "IMPORT_STATE", "op_id": 1, "tokens": [1, 2, 3, 4], "ttl_ticks": 1, "path": "zero"})
    assert done.status == int(OpStatus.BadRequest) and b"character device" in done.payload, done


def test_a_sigterm_at_any_moment_of_start_up_is_answered(tmp_path, seg_name):
    """SIGTERM at a spread of moments from the launch: the daemon always ends within seconds and
    leaves no segment or worker."""
    for delay in (0.0, 0.3, 1.0, 2.0, 3.5):
        s = Serve(tmp_path, seg_name, "--fake", "--workers", str(len(os.sched_getaffinity(0))))
        try:
            time.sleep(delay)
            s.proc.terminate()
            t0 = time.monotonic()
            rc = s.proc.wait(30)
            assert time.monotonic() - t0 < 15
            assert rc in (0, -15), (delay, rc, s.log)  # -15: before its handlers, when nothing was made
            assert not segment_files(seg_name) and not live_workers(seg_name), s.log
        finally:
            s.close()


def test_the_name_of_a_running_daemon_is_refused_and_it_serves_on(healthy):
    line = serve_refused_running(healthy.name)
    assert "--name" in line and "is running" in line, line
    still_serves(healthy)


def serve_refused_running(name: str) -> str:
    """serve_refused for a name whose segments a live daemon holds (they must stay)."""
    r = subprocess.run(python("-m", "superfluid", "serve", "--fake", "--name", name), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and segment_files(name), r.stderr
    return lines[0]
