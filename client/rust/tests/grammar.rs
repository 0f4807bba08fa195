// Grammar-constrained requests (contract §3 step 4, §7) through the Rust
// reference planner on a live daemon of the tiny model: the Python
// planner's tokens and finishes for the same workload, outputs that parse,
// the same tokens through a worker kill -9 (each re-admission replays what
// it generated into a fresh matcher), and a bad grammar refused at submit.
mod common;
use common::*;
use serde_json::{json, Value};
use std::time::Duration;
use superfluid::abi::*;
use superfluid::{Connection, Error, Finish, Grammar, Options, Planner, RequestSpec};

const REGEX: &str = "[a-z]{3,8}-[0-9]{2,4}";
const CHOICES: [&str; 3] = ["alpha", "beta", "gamma delta"];

fn schema() -> Value {
    json!({"type": "object", "additionalProperties": false, "required": ["ok", "n"],
           "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 999}}})
}

/// Sampled JSON-schema requests, a regex, a choice, and one unconstrained.
fn grammar_workload() -> Value {
    let mut reqs: Vec<Value> = (0..6).map(|i| json!({
        "prompt": [123, 34, 5 + i], "max_new_tokens": 48, "sampling": "sample",
        "params": {"temperature": 1.0}, "rng_base": 50 + i,
        "grammar": {"kind": "json_schema", "text": schema().to_string()}})).collect();
    reqs.push(json!({"prompt": [1, 2, 3], "max_new_tokens": 24, "sampling": "sample", "rng_base": 7,
                     "params": {"temperature": 1.0, "top_k": 50}, "grammar": {"kind": "regex", "text": REGEX}}));
    reqs.push(json!({"prompt": [7, 8, 9], "max_new_tokens": 16, "sampling": "sample", "rng_base": 3,
                     "params": {"temperature": 1.0}, "grammar": {"kind": "choice", "choices": CHOICES}}));
    reqs.push(json!({"prompt": [40, 41, 42, 43], "max_new_tokens": 12, "stop_at_eos": false}));
    json!({"options": {"decode_grant": 2}, "requests": reqs})
}

/// The tiny model's tokenizer is byte-level: ids below 256 are the bytes.
fn text(tokens: &[u64]) -> String {
    assert!(tokens.iter().all(|&t| t < 256), "not all bytes: {tokens:?}");
    String::from_utf8(tokens.iter().map(|&t| t as u8).collect()).expect("UTF-8")
}

fn matches_regex(s: &str) -> bool {
    let Some((a, b)) = s.split_once('-') else { return false };
    (3..=8).contains(&a.len()) && a.bytes().all(|c| c.is_ascii_lowercase())
        && (2..=4).contains(&b.len()) && b.bytes().all(|c| c.is_ascii_digit())
}

#[test]
fn grammar_requests_get_the_python_planners_tokens_and_survive_a_worker_kill() {
    let Some(py) = python() else { return };
    let d = serve(&py, &format!("rpg{}", std::process::id()), &[]);
    let w = grammar_workload();
    let theirs = python_plan(&py, &d.1, &w);
    let mine = rust_plan(&d.1, &w);
    let got = outcomes(&mine);
    assert_eq!(got, outcomes(&theirs));
    for (k, (tokens, finish)) in got.iter().enumerate().take(6) {
        assert_eq!(finish, "grammar", "request {k}: {tokens:?}");
        let v: Value = serde_json::from_str(&text(tokens)).unwrap_or_else(|e| panic!("request {k}: {e}"));
        let o = v.as_object().unwrap();
        assert_eq!(o.len(), 2, "{v}");
        assert!(o["ok"].is_boolean() && o["n"].as_u64().map_or(false, |n| n <= 999), "{v}");
    }
    let outputs: Vec<String> = got[..6].iter().map(|(t, _)| text(t)).collect();
    assert!(outputs.iter().any(|o| *o != outputs[0]), "sampled lanes all alike: {outputs:?}");
    assert_eq!(got[6].1, "grammar");
    assert!(matches_regex(&text(&got[6].0)), "{:?}", text(&got[6].0));
    assert_eq!(got[7].1, "grammar");
    assert!(CHOICES.contains(&text(&got[7].0).as_str()), "{:?}", text(&got[7].0));
    assert_eq!((got[8].0.len(), got[8].1.as_str()), (12, "max_tokens")); // unconstrained beside them

    // kill -9 mid-lane: re-admitted with grammar_replay = generated, the same tokens.
    let mut k = w.clone();
    k["kill_worker_after_tokens"] = json!(20);
    let killed = rust_plan(&d.1, &k);
    assert_eq!((killed["stats"]["killed"].clone(), killed["stats"]["restarts"].as_u64().unwrap() >= 1),
               (json!(true), true), "{killed}");
    assert!(killed["results"].as_array().unwrap().iter().any(|r| r["admissions"].as_u64().unwrap() > 1),
            "the kill cut no lane short: {killed}");
    assert_eq!(outcomes(&killed), got);
}

fn planner(name: &str) -> Planner {
    let conn = Connection::connect(name, 0, Duration::from_secs(120)).unwrap_or_else(|e| panic!("connect: {e}"));
    Planner::new(conn, Options::default()).unwrap()
}

fn constrained(g: Grammar) -> RequestSpec {
    let mut s = RequestSpec::new(vec![7, 8, 9], 16);
    (s.sampling, s.params, s.rng_base, s.grammar) = (SF_SAMPLING_GPU_SAMPLE, superfluid::params(1.0), 3, Some(g));
    s
}

#[test]
fn a_bad_grammar_fails_submit_with_the_workers_message() {
    let Some(py) = python() else { return };
    let d = serve(&py, &format!("rpb{}", std::process::id()), &[]);
    let mut p = planner(&d.1);
    for g in [Grammar::json_schema("{"), Grammar::regex("(ab"), Grammar::text("yaml", "a: 1")] {
        match p.submit(constrained(g.clone())) {
            Err(Error::Op { op, status, name, message }) => {
                assert_eq!((op.as_str(), status, name), ("REGISTER_GRAMMAR", SF_OPST_BadRequest, "BadRequest"));
                assert!(!message.is_empty(), "{g:?}: no message");
            }
            other => panic!("{g:?}: {other:?}"),
        }
    }
    assert!(p.requests.is_empty() && p.grammars.registered == 0);
    // Not with HOST, and a choice is a list: refused before the worker is asked.
    let mut host = constrained(Grammar::choice(&["a"]));
    host.sampling = SF_SAMPLING_HOST;
    host.host_sampler = Some(Box::new(superfluid::workload::host_argmax));
    assert!(matches!(p.submit(host), Err(Error::Bounds(_))));
    assert!(matches!(p.submit(constrained(Grammar::text("choice", "a"))), Err(Error::Bounds(_))));
    // The planner goes on: a good grammar runs to its end, and its handle is released.
    let id = p.submit(constrained(Grammar::choice(&["yes", "no"]))).unwrap();
    assert_eq!((id, p.grammars.held()), (1, 1));
    p.run_until_done(Duration::from_secs(120)).unwrap();
    let r = p.request(id);
    assert_eq!(r.finish, Some(Finish::Grammar));
    assert!(r.generated == b"yes".map(u32::from) || r.generated == b"no".map(u32::from), "{:?}", r.generated);
    assert_eq!((p.grammars.registered, p.grammars.held()), (1, 0));

    // A runtime without a tokenizer (the fake) has no grammars at all.
    let f = serve(&py, &format!("rpu{}", std::process::id()), &["--fake"]);
    let mut p = planner(&f.1);
    match p.submit(constrained(Grammar::regex("[ab]+"))) {
        Err(Error::Op { name: "Unsupported", message, .. }) => assert!(!message.is_empty()),
        other => panic!("{other:?}"),
    }
}
