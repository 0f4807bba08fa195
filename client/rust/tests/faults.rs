// Fault schedules against a live `superfluid serve --fake --fault-injection`:
// typed rules installed and listed back with their fired counts, injected
// lane faults seen in raw plans (code and the injected bit), the reference
// planner finishing a request through one with the tokens of a clean run,
// a bad rule refused naming its field, and clear_faults' count.
mod common;
use common::*;
use std::time::Duration;
use superfluid::abi::*;
use superfluid::{Error, FaultRule, Options, Phase, Plan, Planner, RequestSpec, What, When};

const T: Duration = Duration::from_secs(60);

#[test]
fn fault_schedules_fire_list_and_clear_and_the_planner_finishes_through_them() {
    let Some(py) = python() else { return };
    let d = serve(&py, &format!("rf{}", std::process::id()), &["--fake", "--fault-injection"]);
    let mut c = connect(&d.1);
    let rules = [
        FaultRule::new(When::token(3).lane(7), What::Fault(SF_FAULT_INTERNAL)),
        FaultRule::new(When::token(2).lane(8), What::Nan),
        FaultRule::new(When::tick(1), What::Slow { ms: 1, ticks: 1 }),
        FaultRule::new(When::chance(0.5).epoch(99), What::Stall { ms: 1, during: Phase::Decode }), // never: epoch 99
    ];
    assert_eq!(c.install_faults(&rules, 7, T).unwrap(), 4);
    let listed = c.list_faults(T).unwrap();
    assert_eq!(listed.seed, 7);
    let mut want: Vec<FaultRule> = rules[..3].iter().map(|r| r.clone().times(1)).collect(); // the default, listed
    want.push(rules[3].clone()); // a chance rule without times: unlimited
    assert_eq!(listed.rules.iter().map(|r| r.rule.clone()).collect::<Vec<_>>(), want);
    assert!(listed.rules.iter().all(|r| r.fired == 0));

    // Two lanes in one plan (the worker's first tick): 7 faults INTERNAL at
    // its 3rd token, 8 NUMERIC at its 2nd (a NaN row); both marked injected.
    let mut p = Plan::new(64);
    for (tag, prompt) in [(7u64, [5u32, 6, 7, 8, 9]), (8, [9, 8, 7, 6, 5])] {
        let r = c.write_prompt(&prompt).unwrap();
        p.admit(tag, r).prefill(tag, 0, prompt.len() as u32).decode(tag, 8);
    }
    for a in p.admits.iter_mut() {
        a.params.flags = SF_PARAM_IGNORE_EOS;
    }
    let ev = c.tick(&p, T).unwrap().ok().unwrap();
    let mut faults: Vec<_> = ev.faults.iter().map(|f| (f.lane_tag, f.code_name(), f.injected())).collect();
    faults.sort();
    assert_eq!(faults, [(7, "INTERNAL", true), (8, "NUMERIC", true)]);
    let mut p = Plan::new(0);
    p.retire(7, false).retire(8, false);
    c.tick(&p, T).unwrap().ok().unwrap();
    let fired: Vec<u64> = c.list_faults(T).unwrap().rules.iter().map(|r| r.fired).collect();
    assert_eq!(fired, [1, 1, 1, 0]);

    // A bad rule: BadRequest naming its field; the schedule stays.
    match c.install_faults(&[FaultRule::new(When::token(0), What::Nan)], 0, T) {
        Err(Error::Op { status, message, .. }) => {
            assert_eq!(status, SF_OPST_BadRequest);
            assert!(message.contains("rules[0].when.token"), "{message}");
        }
        other => panic!("a token 0 rule: {other:?}"),
    }
    assert_eq!(c.list_faults(T).unwrap().rules.len(), 4);
    assert_eq!(c.clear_faults(T).unwrap(), 4);
    assert!(c.list_faults(T).unwrap().rules.is_empty());

    // The planner through an injected fault: the lane is re-admitted and the
    // request ends with the tokens of a run without it.
    let mut planner = Planner::new(c, Options { decode_grant: 2, ..Options::default() }).unwrap();
    let run = |planner: &mut Planner| {
        let mut spec = RequestSpec::new(vec![11, 12, 13, 14], 12);
        spec.stop_at_eos = false;
        let id = planner.submit(spec).unwrap();
        planner.run_until_done(T).unwrap();
        let r = planner.request(id);
        (r.generated.clone(), r.finish.map(|f| f.as_str()), r.admissions)
    };
    let clean = run(&mut planner);
    assert_eq!((clean.0.len(), clean.1, clean.2, planner.stats.faults), (12, Some("max_tokens"), 1, 0));
    let rule = FaultRule::new(When::token(5), What::Fault(SF_FAULT_INJECTED));
    assert_eq!(planner.conn.install_faults(&[rule], 0, T).unwrap(), 1);
    let faulted = run(&mut planner);
    assert_eq!(planner.stats.faults, 1); // negative control: the rule did fire
    assert_eq!((faulted.2, &faulted.0, faulted.1), (2, &clean.0, clean.1));
    assert_eq!(planner.conn.list_faults(T).unwrap().rules[0].fired, 1);
    assert_eq!(planner.conn.clear_faults(T).unwrap(), 1);
}

/// A row the model itself makes non-finite (a checkpoint whose embedding row
/// 7 is +inf; nothing injected) faults NUMERIC, and the same row would come
/// back on every re-admission: the Rust planner ends that request "fault"
/// after one fault, as the Python planner does, and the other requests get
/// the Python planner's tokens.
#[test]
fn a_fault_the_model_causes_ends_its_request_as_in_python() {
    let Some(py) = python() else { return };
    let dir = std::env::temp_dir().join(format!("sf-poisoned-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(dir.with_file_name(format!("sf-poisoned-{}.clean", std::process::id())));
    let made = std::process::Command::new(&py)
        .args(["-P", "-m", "superfluid.testing.checkpoints", "poisoned"])
        .arg(&dir)
        .arg("7")
        .output()
        .expect("python");
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let d = serve(&py, &format!("rfp{}", std::process::id()), &["--model", dir.to_str().unwrap()]);
    let w = serde_json::json!({"requests": [
        {"prompt": [3, 4, 5], "max_new_tokens": 6, "stop_at_eos": false},
        {"prompt": [9, 7, 2], "max_new_tokens": 6, "stop_at_eos": false},
        {"prompt": [11, 12], "max_new_tokens": 6, "stop_at_eos": false}]});
    let mine = rust_plan(&d.1, &w);
    let theirs = python_plan(&py, &d.1, &w);
    assert_eq!(outcomes(&mine), outcomes(&theirs));
    let got = outcomes(&mine);
    assert_eq!(got[1], (vec![], "fault".to_string()));
    assert!(got[0].0.len() == 6 && got[2].0.len() == 6); // the negative control: the others ran
    assert_eq!(mine["results"][1]["admissions"], 1);
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(dir.with_file_name(format!("sf-poisoned-{}.clean", std::process::id())));
}
