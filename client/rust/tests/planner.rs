// The Rust reference planner against the Python one, on one live daemon:
// the same workload (client/workload.py's format) gives every request the
// same tokens and finish — greedy, sampled, host-sampled, seeded, and
// through a worker kill -9 — on the fake runtime and the tiny model.
mod common;
use common::*;
use serde_json::{json, Value};

/// Deterministic prompt tokens below 256 (inside every runtime's vocab).
fn prompt(seed: u64, n: usize) -> Vec<u64> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n).map(|_| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % 250
    }).collect()
}

fn mixed() -> Value {
    let sampled = json!({"temperature": 0.9, "top_k": 50, "top_p": 0.9});
    json!({
        "options": {"prefill_token_budget": 48, "decode_grant": 3},
        "requests": [
            {"prompt": prompt(1, 5), "max_new_tokens": 20},
            {"prompt": prompt(2, 70), "max_new_tokens": 12, "stop_at_eos": false, "publish": false},
            {"prompt": prompt(3, 12), "max_new_tokens": 16, "sampling": "sample", "params": sampled, "rng_base": 1000},
            {"prompt": prompt(4, 3), "max_new_tokens": 14, "sampling": "sample",
             "params": {"temperature": 1.2, "min_p": 0.05}, "rng_base": 77, "stop_at_eos": false},
            {"prompt": prompt(5, 20), "max_new_tokens": 10, "sampling": "host", "host_sampler": "perturb", "rng_base": 5},
            {"prompt": prompt(6, 9), "max_new_tokens": 8, "sampling": "host", "host_sampler": "argmax",
             "stop_at_eos": false},
            {"prompt": prompt(7, 33), "max_new_tokens": 9, "sampling": "sample", "params": {"temperature": 0.8},
             "rng_base": 1u64 << 40}
        ]
    })
}

fn same_as_python(args: &[&str], tag: &str) {
    let Some(py) = python() else { return };
    let d = serve(&py, &format!("{tag}{}", std::process::id()), args);
    let w = mixed();
    let theirs = python_plan(&py, &d.1, &w);
    let mine = rust_plan(&d.1, &w);
    assert_eq!(outcomes(&mine), outcomes(&theirs));
    assert!(outcomes(&mine).iter().all(|(t, _)| !t.is_empty()));
    // Negative control: the draws are keyed by rng_base, so other bases give
    // other sampled tokens (the equality above could not pass by accident).
    let mut other = w.clone();
    for r in other["requests"].as_array_mut().unwrap() {
        if r["sampling"] == "sample" || r["host_sampler"] == "perturb" {
            r["rng_base"] = json!(r["rng_base"].as_u64().unwrap_or(0) + 12345);
        }
    }
    let moved = outcomes(&rust_plan(&d.1, &other));
    let base = outcomes(&mine);
    for k in [2, 3, 4, 6] {
        assert_ne!(moved[k].0, base[k].0, "request {k}: rng_base changed nothing");
    }
    for k in [0, 1, 5] {
        assert_eq!(moved[k], base[k], "request {k}: greedy and argmax do not draw");
    }
}

#[test]
fn the_fake_runtime_gives_the_rust_planner_the_python_planners_tokens() {
    same_as_python(&["--fake"], "rpf");
}

#[test]
fn the_tiny_model_gives_the_rust_planner_the_python_planners_tokens() {
    same_as_python(&[], "rpt");
}

/// The tensor-parallel degree changes no bit: the mixed workload gets the
/// same tokens from a `--tp 2` worker (two rank processes) as from a `--tp 1`
/// one. same_as_python shows that rng_base moves the sampled tokens, so
/// equal non-empty tokens here are not an accident of the draws.
#[test]
fn a_tp2_worker_gives_the_rust_planner_the_tokens_of_a_tp1_worker() {
    let Some(py) = python() else { return };
    let pid = std::process::id();
    // One thread a rank: two ranks on a two-core box, not four spinning threads.
    let two = serve(&py, &format!("rptp2{pid}"), &["--tp", "2", "--threads", "1", "--tp-timeout", "60"]);
    let one = serve(&py, &format!("rptp1{pid}"), &["--threads", "1"]);
    let w = mixed();
    let run = |d: &Daemon| {
        let tp = connect(&d.1).describe(std::time::Duration::from_secs(120)).unwrap().parallel;
        ((tp.tp, tp.nnodes), outcomes(&rust_plan(&d.1, &w)))
    };
    let (p2, got) = run(&two);
    drop(two); // stopped: its ranks leave the cores to the second run
    let (p1, want) = run(&one);
    assert_eq!((p2, p1), ((2, 1), (1, 1)));
    assert!(want.iter().all(|(t, _)| !t.is_empty()), "{want:?}");
    assert_eq!(got, want);
}

/// Requests sharing a long prefix, one lane at a time: each after the first
/// leases what the one before published.
fn shared_prefix(use_leases: bool) -> Value {
    let head = prompt(9, 40);
    let reqs: Vec<Value> = (0..4).map(|i| {
        let mut p = head.clone();
        p.extend(prompt(20 + i, 3 + i as usize));
        json!({"prompt": p, "max_new_tokens": 6, "stop_at_eos": false,
               "sampling": if i % 2 == 0 { "greedy" } else { "sample" },
               "params": {"temperature": 0.7}, "rng_base": 500 + i})
    }).collect();
    json!({"options": {"max_lanes": 1, "use_leases": use_leases}, "requests": reqs})
}

#[test]
fn seeded_admissions_give_the_tokens_of_unseeded_ones() {
    let Some(py) = python() else { return };
    let d = serve(&py, &format!("rps{}", std::process::id()), &[]);
    let theirs = python_plan(&py, &d.1, &shared_prefix(true));
    let mine = rust_plan(&d.1, &shared_prefix(true));
    let plain = rust_plan(&d.1, &shared_prefix(false));
    assert_eq!(outcomes(&mine), outcomes(&theirs));
    assert_eq!(outcomes(&mine), outcomes(&plain));
    // The leases were used (and not in the control run).
    assert!(mine["stats"]["leases"].as_u64().unwrap() >= 3, "{mine}");
    assert!(mine["stats"]["seeded_tokens"].as_u64().unwrap() >= 3 * 32, "{mine}");
    assert_eq!(plain["stats"]["seeded_tokens"], json!(0));
}

#[test]
fn a_worker_killed_mid_run_changes_no_token() {
    let Some(py) = python() else { return };
    let d = serve(&py, &format!("rpk{}", std::process::id()), &[]);
    let w = mixed();
    let theirs = python_plan(&py, &d.1, &w);
    let mut k = w.clone();
    k["kill_worker_after_tokens"] = json!(25);
    let mine = rust_plan(&d.1, &k);
    // The kill happened and the planner recovered from it (negative control).
    assert_eq!((mine["stats"]["killed"].clone(), mine["stats"]["restarts"].as_u64().unwrap() >= 1),
               (json!(true), true), "{mine}");
    assert!(mine["results"].as_array().unwrap().iter().any(|r| r["admissions"].as_u64().unwrap() > 1));
    assert_eq!(outcomes(&mine), outcomes(&theirs));
}
