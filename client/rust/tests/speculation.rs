// Speculative decoding by prompt lookup (contract §7 INSTALL_STRATEGY, §4
// overshoot) through the Rust reference planner on a live daemon of the tiny
// model: the Python planner's tokens for the same workload with the
// strategy, which are the tokens without one; drafts really taken (the
// negative control: none without the strategy); the same tokens through a
// worker kill -9 (the strategy is installed again on the new worker); and a
// bad strategy refused when the planner is made, with the worker's message.
mod common;
use common::*;
use serde_json::{json, Value};
use std::time::Duration;
use superfluid::abi::*;
use superfluid::{Connection, Error, Options, Planner, RequestSpec, Strategy};

/// tests/client/test_workload.py's SPEC_WORKLOAD: greedy lanes whose
/// prompts repeat, a sampled one, and one that does not speculate; lengths
/// fixed (stop_at_eos false) but the last's.
fn spec_workload(strategy: Option<Value>) -> Value {
    let mut reqs: Vec<Value> = (0..3).map(|i| json!({
        "prompt": [40 + i, 41 + i, 42 + i, 40 + i, 41 + i], "max_new_tokens": 40, "stop_at_eos": false})).collect();
    reqs.push(json!({"prompt": [9, 8, 7, 9, 8], "max_new_tokens": 30, "sampling": "sample", "rng_base": 5,
                     "params": {"temperature": 0.7, "top_k": 8}, "stop_at_eos": false}));
    reqs.push(json!({"prompt": [3, 4, 5], "max_new_tokens": 12, "speculate": false, "stop_at_eos": false}));
    let mut options = json!({"decode_grant": 3});
    if let Some(s) = strategy {
        options["strategy"] = s;
    }
    json!({"options": options, "requests": reqs})
}

fn stat(v: &Value, k: &str) -> u64 {
    v["stats"][k].as_u64().unwrap_or_else(|| panic!("stats.{k}: {v}"))
}

#[test]
fn speculation_gets_the_python_planners_tokens_which_are_the_plain_ones_through_a_worker_kill() {
    let Some(py) = python() else { return };
    let d = serve(&py, &format!("rps{}", std::process::id()), &[]);
    let st = json!({"max_draft": 6, "ngram_min": 1, "ngram_max": 3});
    let plain = rust_plan(&d.1, &spec_workload(None));
    let w = spec_workload(Some(st));
    let theirs = python_plan(&py, &d.1, &w);
    let mine = rust_plan(&d.1, &w);
    let got = outcomes(&mine);
    assert_eq!(got, outcomes(&theirs), "rust {mine}\npython {theirs}");
    assert_eq!(got, outcomes(&plain), "with {mine}\nwithout {plain}");
    let lens: Vec<usize> = got.iter().map(|(t, _)| t.len()).collect();
    assert_eq!(lens, [40, 40, 40, 30, 12]); // overshoot never past max_new_tokens
    assert_eq!(stat(&plain, "draft_proposed"), 0);
    assert!(stat(&mine, "draft_accepted") > 0 && stat(&mine, "draft_proposed") >= stat(&mine, "draft_accepted"),
            "no drafts taken: {mine}");
    assert!(stat(&theirs, "draft_accepted") > 0, "python took no drafts: {theirs}");

    // kill -9 mid-lane: a fresh worker, the strategy installed again, the same tokens.
    let mut k = w.clone();
    k["kill_worker_after_tokens"] = json!(50);
    let killed = rust_plan(&d.1, &k);
    assert_eq!((killed["stats"]["killed"].clone(), stat(&killed, "restarts") >= 1), (json!(true), true), "{killed}");
    assert!(killed["results"].as_array().unwrap().iter().any(|r| r["admissions"].as_u64().unwrap() > 1),
            "the kill cut no lane short: {killed}");
    assert_eq!(outcomes(&killed), got);
}

fn planner(name: &str, strategy: Option<Strategy>) -> Result<Planner, Error> {
    let conn = Connection::connect(name, 0, Duration::from_secs(120)).unwrap_or_else(|e| panic!("connect: {e}"));
    Planner::new(conn, Options { strategy, decode_grant: 2, ..Options::default() })
}

#[test]
fn a_bad_strategy_fails_the_planner_with_the_workers_message() {
    let Some(py) = python() else { return };
    let d = serve(&py, &format!("rpz{}", std::process::id()), &["--fake"]);
    let medusa = Strategy { kind: "medusa".into(), ..Strategy::default() };
    for (bad, field) in [(Strategy::prompt_lookup(0, 1, 4), "max_draft"),
                         (Strategy::prompt_lookup(4, 3, 2), "ngram_max"), (medusa, "kind")] {
        match planner(&d.1, Some(bad.clone())) {
            Err(Error::Op { op, status, name, message }) => {
                assert_eq!((op.as_str(), status, name), ("INSTALL_STRATEGY", SF_OPST_BadRequest, "BadRequest"));
                assert!(message.contains(field), "{bad:?}: {message}");
            }
            Err(e) => panic!("{bad:?}: {e}"),
            Ok(_) => panic!("{bad:?}: installed"),
        }
    }
    // A good one installs when the planner is made; a request may opt out.
    let mut p = planner(&d.1, Some(Strategy::default())).unwrap();
    assert_eq!((p.strategies.installs, p.strategies.cert_id.is_some()), (1, true));
    let a = p.submit(RequestSpec { stop_at_eos: false, ..RequestSpec::new(vec![5, 6, 7, 5, 6], 9) }).unwrap();
    let b = p.submit(RequestSpec { speculate: false, ..RequestSpec::new(vec![5, 6, 7], 5) }).unwrap();
    assert_eq!((p.request(a).speculate, p.request(b).speculate), (true, false));
    p.run_until_done(Duration::from_secs(60)).unwrap();
    assert_eq!((p.request(a).generated.len(), p.strategies.installs), (9, 1));
    drop(p); // its session: one planner per worker
    // Without a strategy nothing speculates, whatever the request says.
    let mut q = planner(&d.1, None).unwrap();
    let c = q.submit(RequestSpec::new(vec![5, 6, 7], 4)).unwrap();
    assert!(!q.request(c).speculate && q.strategies.cert_id.is_none());
}
