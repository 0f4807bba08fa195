// Against a live `superfluid serve --fake`: connect through the session
// protocol, run a lane, and get the tokens a Python Client gets for the
// same plan on the same worker (a second session). SUPERFLUID_PYTHON names
// the interpreter (the pytest wrapper sets it); without it the test says so
// and passes nothing off as checked.
mod common;
use common::*;
use std::process::Command;
use std::time::Duration;
use superfluid::abi::*;
use superfluid::{Connection, Error, Plan};

#[test]
fn a_rust_planner_gets_the_python_clients_tokens() {
    let Some(py) = python() else { return };
    let d = serve(&py, &format!("rs{}", std::process::id()), &["--fake"]);
    let prompt = [5u32, 6, 7, 8, 9];
    let mine = {
        let mut c = connect(&d.1);
        assert!(c.session() != 0);
        let desc = c.describe(Duration::from_secs(30)).unwrap();
        assert_eq!((desc.abi_version, desc.runtime.runtime_id.as_str()), (SF_ABI_VERSION, "fake"));
        assert!(desc.runtime.vocab_size > 0 && desc.worker_epoch == c.epoch());
        assert_eq!((desc.parallel.tp, desc.parallel.nnodes), (1, 1)); // the fake: one process
        let bad = c.op("NO_SUCH_OP", &std::collections::HashMap::<String, u8>::new(), Duration::from_secs(30)).unwrap();
        assert_eq!(bad.status, SF_OPST_UnknownOp);
        assert_eq!(superfluid::names::op_status(bad.status), "UnknownOp");
        assert_eq!(superfluid::names::status(SF_STATUS_StaleSession), "StaleSession");
        let r = c.write_prompt(&prompt).unwrap();
        let mut p = Plan::new(64);
        p.admit(7, r).prefill(7, 0, prompt.len() as u32).decode(7, 12);
        let ev = c.tick(&p, Duration::from_secs(30)).unwrap();
        assert_eq!(ev.status, SF_STATUS_OK, "{}", ev.message);
        assert_eq!(ev.admit_results.len(), 1);
        let toks = c.read_tokens(&ev.emits[0].token_ref).unwrap();
        let mut p = Plan::new(0);
        p.retire(7, false);
        assert_eq!(c.tick(&p, Duration::from_secs(30)).unwrap().status, SF_STATUS_OK);
        // A second planner is refused while this one holds the worker.
        assert!(matches!(Connection::connect(&d.1, 0, Duration::from_secs(1)), Err(Error::Taken)));
        toks
    };
    assert_eq!(mine.len(), 12);
    let script = format!(
        "from superfluid.client import Client, PlanBuilder\n\
         with Client.connect({name:?}, 0, timeout=60) as c:\n\
         \x20   r = c.write_prompt({prompt:?})\n\
         \x20   ev = c.tick(PlanBuilder(0, prefill_token_budget=64).admit(7, r).prefill(7, 0, 5).decode(7, 12))\n\
         \x20   print(' '.join(map(str, c.tokens(ev.emits[0]))))\n",
        name = d.1,
        prompt = prompt
    );
    let out = Command::new(&py).args(["-P", "-c", &script]).output().expect("python");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let theirs: Vec<u32> = String::from_utf8_lossy(&out.stdout).split_whitespace().map(|t| t.parse().unwrap()).collect();
    assert_eq!(mine, theirs);
}

#[test]
fn a_header_of_another_abi_version_is_refused_at_connect() {
    let Some(py) = python() else { return };
    let d = serve(&py, &format!("rv{}", std::process::id()), &["--fake"]);
    let worker = connect(&d.1).worker_pid() as i32;
    // abi_version 1 in place: what a planner of this build sees on another ABI's
    // segment. The worker restores its header within a second: hold it still.
    unsafe { kill(worker, 19) }; // SIGSTOP
    let path = format!("{}/superfluid.{}.0", std::env::var("SUPERFLUID_SHM_DIR").unwrap_or("/dev/shm".into()), d.1);
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.seek(SeekFrom::Start(8)).unwrap();
        f.write_all(&1u32.to_le_bytes()).unwrap();
    }
    let got = Connection::connect(&d.1, 0, Duration::from_secs(1));
    unsafe { kill(worker, 18) }; // SIGCONT
    match got {
        Err(Error::Segment(m)) => assert!(m.contains(&format!("says {SF_CONNECT_ABI}")), "{m}"),
        other => panic!("expected a refusal, got {:?}", other.map(|c| c.session())),
    }
}

/// One lane, `grant` tokens a tick, until `n` tokens; kills the worker once
/// after `kill_after` tokens and recovers as contract §9 says.
fn run_lane(c: &mut Connection, prompt: &[u32], n: usize, kill_after: Option<usize>) -> (Vec<u32>, usize) {
    let t = Duration::from_secs(60);
    let mut got: Vec<u32> = Vec::new();
    let mut admitted = false;
    let mut restarts = 0;
    let mut kill_after = kill_after;
    while got.len() < n {
        let mut p = Plan::new(256);
        if !admitted {
            let full: Vec<u32> = prompt.iter().chain(got.iter()).copied().collect();
            let r = c.write_prompt(&full).unwrap();
            p.admit_replay(7, r, got.len() as u32).prefill(7, 0, prompt.len() as u32);
            p.admits[0].params.flags = SF_PARAM_IGNORE_EOS; // n tokens, whatever they are
        }
        let replay = if admitted { 0 } else { got.len() };
        p.decode(7, (replay + 1) as u16);
        match c.tick(&p, t) {
            Ok(ev) => {
                assert_eq!(ev.status, SF_STATUS_OK, "{}", ev.message);
                admitted = true;
                got.extend(c.read_tokens(&ev.emits[0].token_ref).unwrap());
            }
            Err(Error::WorkerGone) => {
                if let Err(e) = c.reconnect(t) {
                    panic!("reconnect: {e:?} (epoch {}, worker pid {})", c.epoch(), c.worker_pid());
                }
                admitted = false; // its lanes died with it
                restarts += 1;
                continue;
            }
            Err(e) => panic!("tick: {e:?}"),
        }
        if kill_after.map_or(false, |k| got.len() >= k) {
            unsafe { kill(c.worker_pid() as i32, 9) };
            kill_after = None;
        }
    }
    (got, restarts)
}

#[test]
fn a_rust_planner_recovers_a_lane_bitwise_after_a_worker_kill() {
    let Some(py) = python() else { return };
    let d = serve(&py, &format!("rk{}", std::process::id()), &["--fake"]);
    let prompt = [11u32, 12, 13, 14, 15, 16];
    let mut c = connect(&d.1);
    let (plain, r0) = run_lane(&mut c, &prompt, 16, None);
    let mut p = Plan::new(0);
    p.retire(7, false);
    assert_eq!(c.tick(&p, Duration::from_secs(30)).unwrap().status, SF_STATUS_OK);
    let (recovered, r1) = run_lane(&mut c, &prompt, 16, Some(6));
    assert_eq!((r0, r1), (0, 1)); // negative control: the kill did restart the worker
    assert_eq!(recovered, plain);
}
