"""The daemon: serve, status, restarts, the crash-loop guard, shutdown, and
no worker outliving it. Workers serve the fake runtime (each start still
costs a Python + torch import, ~2 s)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from superfluid.abi import MsgKind, WorkerState, codec
from superfluid.cli import main as cli_main
from superfluid.client import PlanBuilder
from superfluid.daemon.serve import parse_crash_loop, runtime_argv
from superfluid.daemon.supervisor import Daemon, segment_config_for
from superfluid.daemon.worker import add_runtime_args
from superfluid.daemon.worker_exits import describe_exit
from superfluid.daemon.worker_life import restart_delay
from superfluid.rings.errors import SegmentError
from superfluid.rings.layout import SegmentConfig
from superfluid.rings.segment import Segment
from superfluid.testing.daemon import WAIT_S, Serve, live_workers, segment_files, state_of, wait_for


def notices(seg: Segment) -> list:
    """Drain the event queue (as the planner would) and keep the WorkerNotices."""
    out = []
    while (slot := seg.event_queue.try_peek()) is not None:
        try:
            if codec.read_header(slot)[0] == MsgKind.WORKER:
                out.append(codec.decode(slot, "WorkerNotice"))
        finally:
            seg.event_queue.release()
    return out


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Serve]]:
    started: list[Serve] = []

    def start(name: str, *args: str) -> Serve:
        s = Serve(tmp_path, name, *args)
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


# ------------------------------------------------------------ pure parts


def test_helpers() -> None:
    assert [restart_delay(n, 0.5, 3.0) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert parse_crash_loop("5/60") == (5, 60.0)
    for bad in ("5", "0/60", "5/0", "a/b"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_crash_loop(bad)
    assert describe_exit(-9) == "killed by signal 9 (SIGKILL)"
    assert describe_exit(3) == "exit 3 (the model would not load)"
    assert describe_exit(4).startswith("exit 4 (the model or its options can never be served")
    assert describe_exit(42) == "exit 42"
    # The logits ring holds two steps of max_batch rows.
    assert segment_config_for(512, 64).logits_floats == SegmentConfig().logits_floats
    assert segment_config_for(151_936, 64).logits_floats == 2 * 64 * 151_936
    p = argparse.ArgumentParser()
    add_runtime_args(p)
    assert runtime_argv(p.parse_args(["--fake", "--max-batch", "8"])) == ["--fake", "--max-batch", "8"]
    assert runtime_argv(p.parse_args(["--model", "/m", "--backend", "triton"])) == [
        "--model", "/m", "--backend", "triton"]


def test_status_without_daemon(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["status", "nosuchdaemon"]) == 1
    assert "no daemon named 'nosuchdaemon'" in capsys.readouterr().err
    assert cli_main(["status", "nosuchdaemon", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["daemon_running"] is False and out["workers"] == []


# --------------------------------------------------------- the daemon


def test_serve_status_restart_and_sigterm(serve: Callable[..., Serve], seg_name: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    d = serve(seg_name, "--fake", "--restart-backoff", "0.05", "--metrics-port", "0")
    d.wait_log("worker 0 ready (epoch 1")
    wait_for(lambda: (state_of(seg_name) or {}).get("heartbeat_age_s") is not None, "the first heartbeat")
    w = state_of(seg_name)
    assert w is not None and w["state"] == "READY" and w["epoch"] == 1 and w["restarts"] == 0
    first_pid = w["pid"]
    assert first_pid in live_workers(seg_name)

    # status, text and JSON
    assert cli_main(["status", seg_name]) == 0
    out = capsys.readouterr().out
    assert f"pid {d.proc.pid} (running)" in out and "READY" in out
    assert cli_main(["status", seg_name, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["daemon_pid"] == d.proc.pid and st["daemon_running"]
    assert st["workers"][0]["pid"] == first_pid and st["workers"][0]["heartbeat_age_s"] is not None

    # Prometheus endpoint
    port = int(d.log.split("metrics on http://127.0.0.1:")[1].split("/")[0])
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert f'superfluid_worker_ticks_total{{daemon="{seg_name}",worker="0"}} 0' in body
    assert f'superfluid_worker_up{{daemon="{seg_name}",worker="0"}} 1.0' in body

    # A second daemon of the same name must not replace a live one's segments.
    with pytest.raises(SegmentError, match="is running"):
        Daemon(seg_name, handle_signals=False).start()

    # kill -9 the worker: marked, noticed, restarted on a new epoch.
    planner = Segment.open(seg_name, 0)
    try:
        # One (empty) tick first, so the counters status reads are the worker's.
        PlanBuilder(plan_seq=1).encode_into(planner.plan_queue.reserve(WAIT_S, epoch=1))
        planner.plan_queue.publish()
        planner.event_queue.wait_readable(WAIT_S, epoch=1)
        wait_for(lambda: (state_of(seg_name) or {}).get("ticks") == 1, "status to count the tick")
        os.kill(first_pid, signal.SIGKILL)
        wait_for(lambda: planner.epoch == 2 and planner.worker_state == WorkerState.READY, "the restarted worker")
        d.wait_log("worker 0 ready (epoch 2")
        assert planner.header.restarts == 1 and planner.header.last_exit_status == -9
        assert f"worker 0 (pid {first_pid}, epoch 1) killed by signal 9 (SIGKILL)" in d.log
        assert "restarting worker 0 in 0.05 s" in d.log
        got = [(n.worker_epoch, WorkerState(n.worker_state), n.exit_status, n.restarts) for n in notices(planner)]
        assert got == [(1, WorkerState.DEAD, -9, 1), (2, WorkerState.STARTING, -9, 1)]
        w = state_of(seg_name)
        assert w is not None and w["pid"] != first_pid and w["pid"] in live_workers(seg_name)
        assert w["ticks"] == 0  # a new worker counts from zero
    finally:
        planner.close()

    # SIGTERM: drained, exit 0, no segment and no worker left.
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(WAIT_S) == 0, d.log
    assert "SIGTERM received: stopping" in d.log and "worker 0 (pid" in d.log
    assert segment_files(seg_name) == []
    assert live_workers(seg_name) == []


def test_sigkilled_daemon_takes_its_workers_along(serve: Callable[..., Serve], seg_name: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    d = serve(seg_name, "--fake", "--workers", "2")
    d.wait_log("worker 0 ready")
    d.wait_log("worker 1 ready")
    assert len(live_workers(seg_name)) == 2
    d.proc.kill()
    d.proc.wait()
    wait_for(lambda: not live_workers(seg_name), "PDEATHSIG to kill the workers", 10)
    # Its segments stay behind, and status says whose they were.
    assert len(segment_files(seg_name)) == 2
    assert cli_main(["status", seg_name]) == 1
    out = capsys.readouterr()
    assert "is not running" in out.err
    # Not a live READY worker. The workers' channel closes before PDEATHSIG lands
    # (exit closes files first), so a worker may have begun stopping by then.
    assert "NOT RUNNING" in out.out
    assert len(re.findall(r"\b(READY|STOPPING|STOPPED) \(stale\)", out.out)) == 2, out.out
    # (the fixture removes the stale segments)


def test_crash_loop_gives_up_on_one_worker_and_serves_the_other(
        tmp_path: Path, seg_name: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="superfluid.daemon")

    class OneBad(Daemon):
        def worker_command(self, index: int, segment: str, epoch: int) -> list[str]:
            # Worker 1 cannot open its segment (exit 2): a failure a restart might mend.
            return super().worker_command(index, segment + ".gone" if index == 1 else segment, epoch)

    d = OneBad(seg_name, ["--fake"], workers=2, restart_backoff=0.05, crash_loop=(3, 60.0), stop_timeout=10.0,
               handle_signals=False)
    d.start()
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(d.serve_forever()))
    t.start()
    try:
        good, bad = d.segments
        wait_for(lambda: bad.worker_state == WorkerState.GAVE_UP, "worker 1 to be given up on")
        wait_for(lambda: good.worker_state == WorkerState.READY, "worker 0 to be ready")
        assert "worker 1 failed 3 times in 60 s (last: exit 2); giving up on it" in caplog.text
        assert "exit 2 (bad arguments, or a segment it cannot open)" in caplog.text
        assert bad.header.restarts == 2 and bad.header.last_exit_status == 2 and bad.epoch == 3
        assert [(n.worker_state, n.exit_status) for n in notices(bad)][-1] == (WorkerState.GAVE_UP, 2)
        assert good.epoch == 1 and good.header.restarts == 0
        assert t.is_alive()  # still serving worker 0
        # SIGHUP (its byte on the wake-up pipe, as the signal handler writes it) retries it.
        d._loop.wake(signal.SIGHUP)
        wait_for(lambda: bad.epoch == 4, "worker 1 to be started again")
        assert "SIGHUP: retrying worker 1" in caplog.text
    finally:
        d.stop()
        t.join(WAIT_S)
    assert result == [0]
    assert segment_files(seg_name) == [] and live_workers(seg_name) == []


def test_every_worker_gave_up_exits_1(seg_name: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="superfluid.daemon")

    class AllBad(Daemon):
        def worker_command(self, index: int, segment: str, epoch: int) -> list[str]:
            return super().worker_command(index, segment + ".gone", epoch)  # exit 2, each time

    d = AllBad(seg_name, ["--fake"], workers=2, restart_backoff=0.05, crash_loop=(2, 60.0), handle_signals=False)
    d.start()
    assert d.serve_forever() == 1
    assert "worker 0 failed 2 times in 60 s (last: exit 2); giving up on it" in caplog.text
    assert "every worker gave up" in caplog.text
    assert segment_files(seg_name) == [] and live_workers(seg_name) == []


def test_a_worker_that_can_never_serve_stops_the_daemon(seg_name: str, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A load failure no restart can mend (exit 4: here a directory with no config.json, which
    `serve` refuses up front; the Daemon class starts what it is given) is not retried."""
    caplog.set_level(logging.INFO, logger="superfluid.daemon")

    class OneUnservable(Daemon):
        def worker_command(self, index: int, segment: str, epoch: int) -> list[str]:
            cmd = super().worker_command(index, segment, epoch)
            return cmd[:-1] + ["--model", str(tmp_path)] if index == 1 else cmd  # drop --fake

    d = OneUnservable(seg_name, ["--fake"], workers=2, restart_backoff=0.05, crash_loop=(5, 60.0),
                      handle_signals=False)
    d.start()
    t0 = time.monotonic()
    assert d.serve_forever() == 2
    assert time.monotonic() - t0 < WAIT_S
    assert "exit 4 (the model or its options can never be served" in caplog.text
    assert "a restart would fail the same way; the daemon stops" in caplog.text
    assert "restarting worker 1" not in caplog.text and caplog.text.count("exit 4 (") == 1
    assert segment_files(seg_name) == [] and live_workers(seg_name) == []


def test_sigterm_during_start_up_drains(serve: Callable[..., Serve], seg_name: str) -> None:
    # The signal lands while segments are being made and workers spawned (as many as the cores).
    s = serve(seg_name, "--fake", "--workers", str(len(os.sched_getaffinity(0))))
    wait_for(lambda: segment_files(seg_name) or s.proc.poll() is not None, "the first segment")
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(WAIT_S) == 0, s.log
    assert "segments removed" in s.log, s.log
    assert not segment_files(seg_name)
    wait_for(lambda: not live_workers(seg_name), "no worker left", 10)


def test_a_stop_drains_a_worker_that_always_has_a_plan_queued(seg_name: str) -> None:
    from superfluid.abi import ParamFlag
    from superfluid.abi.records import SamplingParams
    from superfluid.client import Client
    from superfluid.client.session import ClientError

    d = Daemon(seg_name, ["--fake", "--fake-step-cost", "0.02"], handle_signals=False, stop_timeout=20.0)
    d.start()
    loop = threading.Thread(target=d.serve_forever)
    loop.start()
    stop = threading.Event()
    fed: list[int] = []
    try:
        c = Client.connect(seg_name, timeout=WAIT_S)
        tag = c.new_lane_tag()
        c.tick(PlanBuilder(0, prefill_token_budget=8).admit(tag, c.write_prompt([1, 2, 3]),
                                                              params=SamplingParams(flags=int(ParamFlag.IGNORE_EOS)))
               .prefill(tag, 0, 3))

        def feed() -> None:
            try:
                for _ in range(4):
                    fed.append(c.submit(PlanBuilder(0).decode(tag, 1)))
                while not stop.is_set():
                    fed.append(c.submit(PlanBuilder(0).decode(tag, 1)))  # always one plan queued ahead
                    c.wait_events()
            except ClientError:
                pass

        feeder = threading.Thread(target=feed)
        feeder.start()
        time.sleep(0.5)
        assert feeder.is_alive() and len(fed) > 4 and len(c.seg.plan_queue) > 0  # plans queued at the stop
        t0 = time.monotonic()
        d.stop()
        loop.join(WAIT_S)
        # drained (the worker saw the stop between ticks), not killed at stop_timeout
        assert time.monotonic() - t0 < 10
        assert d.snapshot() == [] and not segment_files(seg_name)
    finally:
        stop.set()
        d.stop()
        loop.join(WAIT_S)
    feeder.join(10)
    c.close()
    wait_for(lambda: not live_workers(seg_name), "no worker left", 10)


@pytest.mark.parametrize("args", [
    ["--page", "0"], ["--max-batch", "-1"], ["--kv-cells", "x"], ["--metrics-port", "70000"],
    ["--metrics-port", "-1"], ["--stop-timeout", "inf"], ["--restart-backoff", "1e300"],
    ["--restart-backoff-max", "nan"], ["--crash-loop", "3/inf"],
])
def test_bad_serve_options_exit_2_before_anything_starts(args: list[str], seg_name: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "--name", seg_name, "--fake", *args])
    assert e.value.code == 2
    assert args[0] in capsys.readouterr().err  # the message names the option
    assert not segment_files(seg_name)


def test_a_model_dir_without_a_config_exits_2_at_once(tmp_path: Path, seg_name: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    assert cli_main(["serve", "--name", seg_name, "--model", str(tmp_path)]) == 2
    assert "config.json: file not found" in capsys.readouterr().err
    assert time.monotonic() - t0 < 10 and not segment_files(seg_name)  # no crash loop first


def test_a_worker_ignores_a_stray_sigterm(seg_name: str) -> None:
    # A group-wide SIGTERM (systemd, `timeout`) reaches the workers too: the daemon
    # alone decides, and stops them cleanly.
    d = Daemon(seg_name, ["--fake"], handle_signals=False, stop_timeout=20.0)
    d.start()
    loop = threading.Thread(target=d.serve_forever)
    loop.start()
    try:
        wait_for(lambda: (state_of(seg_name) or {}).get("state") == "READY", "the worker to be ready")
        pid = d.worker_pid(0)
        os.kill(pid, signal.SIGTERM)
        time.sleep(0.5)
        assert d.worker_pid(0) == pid and (state_of(seg_name) or {}).get("restarts", 0) == 0
        assert pid in live_workers(seg_name)  # alive, not a zombie waiting to be reaped
        assert (state_of(seg_name) or {}).get("state") == "READY"
        t0 = time.monotonic()
    finally:
        d.stop()
        loop.join(WAIT_S)
    assert time.monotonic() - t0 < 10 and not live_workers(seg_name)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_planner_sees_the_daemon_go_at_once(serve: Callable[..., Serve], seg_name: str,
                                              sig: signal.Signals) -> None:
    # Not a restart to wait out: no worker will come back.
    from superfluid.client import Client, DaemonGone
    from superfluid.client.planner import Planner

    s = serve(seg_name, "--fake", "--fake-step-cost", "0.01")
    with Client.connect(seg_name, timeout=WAIT_S) as c:
        p = Planner(c, decode_grant=1, reconnect_timeout=WAIT_S)
        p.submit([1, 2, 3], max_new_tokens=100000, stop_at_eos=False)
        p.step(WAIT_S)
        s.proc.send_signal(sig)
        t0 = time.monotonic()
        with pytest.raises(DaemonGone):
            p.run_until_done(WAIT_S)
        assert time.monotonic() - t0 < 10 and p.stats.restarts == 0
    assert s.proc.wait(WAIT_S) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
    wait_for(lambda: not live_workers(seg_name), "the workers to go with the daemon", 10)


def test_a_second_daemon_of_the_same_name_in_one_process_is_refused(seg_name: str) -> None:
    first = Daemon(seg_name, ["--fake"], handle_signals=False)
    first.start()
    try:
        path = first.segments[0].path
        inode = os.stat(path).st_ino
        with pytest.raises(SegmentError, match="running in this process"):
            Daemon(seg_name, ["--fake"], handle_signals=False).start()
        assert os.stat(path).st_ino == inode  # the first daemon's segment is untouched
    finally:
        first.stop()
        first.serve_forever()
    # once stopped, the name is free again
    again = Daemon(seg_name, ["--fake"], handle_signals=False)
    again.start()
    again.stop()
    assert again.serve_forever() == 0
    assert not segment_files(seg_name)
    wait_for(lambda: not live_workers(seg_name), "no worker left", 10)


def test_dtype_option_reaches_the_worker_runtime():
    import torch

    from superfluid.daemon.serve import runtime_argv
    from superfluid.daemon.worker import add_runtime_args, build_runtime

    p = argparse.ArgumentParser()
    add_runtime_args(p)
    args = p.parse_args(["--dtype", "bf16", "--kv-cells", "256"])
    assert runtime_argv(args) == ["--kv-cells", "256", "--dtype", "bf16"]
    rt = build_runtime(p.parse_args(runtime_argv(args)))
    assert rt.model.dtype == torch.bfloat16 and rt.pool.k.dtype == torch.bfloat16
    assert build_runtime(p.parse_args(["--kv-cells", "256"])).model.dtype == torch.float32
