//! Fault schedules (contract §7 INSTALL_FAULTS / LIST_FAULTS / CLEAR_FAULTS;
//! docs/faults.md), for a daemon started with --fault-injection: typed
//! rules, encoded to exactly the maps the worker reads, and its listing
//! decoded back. The worker checks every rule (a bad one is `Error::Op`,
//! BadRequest, its message naming the field: "rules[0].when.token"); these
//! types only give the maps their shape.
use crate::abi::*;
use crate::connection::Connection;
use crate::events::Error;
use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::Value;
use std::collections::HashMap;
use std::time::Duration;

/// The step an injection waits for: the next prefill or decode step, or
/// `Now`, the trigger itself (a token rule's token, an op rule's op).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Now,
    Prefill,
    Decode,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Now => "now",
            Phase::Prefill => "prefill",
            Phase::Decode => "decode",
        }
    }

    fn parse(s: &str) -> Option<Phase> {
        [Phase::Now, Phase::Prefill, Phase::Decode].into_iter().find(|p| p.as_str() == s)
    }
}

/// What a rule counts to fire.
#[derive(Debug, Clone, PartialEq)]
pub enum Trigger {
    /// The worker's N-th accepted tick, counted from its start (N >= 1).
    Tick(u64),
    /// A lane about to take its K-th token generated in this worker (K >= 1).
    Token(u64),
    /// The nth op named `op` (an SF_OP_* name, any case) since the install.
    Op { op: String, nth: u64 },
    /// Each accepted tick, with probability P in (0, 1], drawn from the seed.
    Chance(f64),
}

/// A rule's `when`: its trigger, limited to a lane (not op rules) and to a
/// worker epoch if given.
#[derive(Debug, Clone, PartialEq)]
pub struct When {
    pub trigger: Trigger,
    pub lane: Option<u64>,
    pub epoch: Option<u64>,
}

impl When {
    fn of(trigger: Trigger) -> When {
        When { trigger, lane: None, epoch: None }
    }
    pub fn tick(n: u64) -> When {
        When::of(Trigger::Tick(n))
    }
    pub fn token(k: u64) -> When {
        When::of(Trigger::Token(k))
    }
    pub fn op(name: &str, nth: u64) -> When {
        When::of(Trigger::Op { op: name.into(), nth })
    }
    pub fn chance(p: f64) -> When {
        When::of(Trigger::Chance(p))
    }
    /// The rule is this lane's only.
    pub fn lane(mut self, tag: u64) -> When {
        self.lane = Some(tag);
        self
    }
    /// The rule fires only in the worker of this epoch.
    pub fn epoch(mut self, epoch: u64) -> When {
        self.epoch = Some(epoch);
        self
    }
}

/// A rule's `what` (docs/faults.md says what each is reported as).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum What {
    /// The lane faults with this SF_FAULT_* code (tick and chance rules: the
    /// named lane, else every lane the plan decodes).
    Fault(u32),
    /// The runtime fails fatally at its next step of the phase: the worker exits 70.
    Fatal(Phase),
    /// The next step of the phase fails for lack of memory: OOM_TENTATIVE.
    Capacity(Phase),
    /// The next step of the phase first sleeps `ms` (op rules: the op; `Now`).
    Stall { ms: u32, during: Phase },
    /// Every step of the next `ticks` ticks takes `ms` longer.
    Slow { ms: u32, ticks: u32 },
    /// The lane's next logits row is NaN: it faults SF_FAULT_NUMERIC.
    Nan,
}

/// A rule of a schedule. `times`: how often it fires (None: the worker's
/// default, once; a chance rule, every draw). In a listing None is unlimited.
#[derive(Debug, Clone, PartialEq)]
pub struct FaultRule {
    pub when: When,
    pub what: What,
    pub times: Option<u32>,
}

impl FaultRule {
    pub fn new(when: When, what: What) -> FaultRule {
        FaultRule { when, what, times: None }
    }
    pub fn times(mut self, n: u32) -> FaultRule {
        self.times = Some(n);
        self
    }
}

/// LIST_FAULTS: the schedule's seed and its rules, each with how often it fired.
#[derive(Debug, Clone, PartialEq)]
pub struct FaultListing {
    pub seed: u64,
    pub rules: Vec<ListedRule>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ListedRule {
    pub rule: FaultRule,
    pub fired: u64,
}

impl LaneFault {
    /// A fault schedule or INJECT_FAULT caused it (SF_FAULT_DETAIL_INJECTED).
    pub fn injected(&self) -> bool {
        self.detail & SF_FAULT_DETAIL_INJECTED != 0
    }
    /// The code's SF_FAULT_* name ("INTERNAL", "NUMERIC", ...).
    pub fn code_name(&self) -> &'static str {
        crate::names::fault(self.code)
    }
}

impl Serialize for When {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        match &self.trigger {
            Trigger::Tick(n) => m.serialize_entry("tick", n)?,
            Trigger::Token(k) => m.serialize_entry("token", k)?,
            Trigger::Op { op, nth } => {
                m.serialize_entry("op", op)?;
                m.serialize_entry("nth", nth)?;
            }
            Trigger::Chance(p) => m.serialize_entry("chance", p)?,
        }
        if let Some(tag) = self.lane {
            m.serialize_entry("lane", &tag)?;
        }
        if let Some(e) = self.epoch {
            m.serialize_entry("epoch", &e)?;
        }
        m.end()
    }
}

impl Serialize for What {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        match *self {
            What::Fault(code) => m.serialize_entry("fault", &code)?,
            What::Fatal(p) => m.serialize_entry("fatal", p.as_str())?,
            What::Capacity(p) => m.serialize_entry("capacity", p.as_str())?,
            What::Stall { ms, during } => {
                m.serialize_entry("stall_ms", &ms)?;
                m.serialize_entry("during", during.as_str())?;
            }
            What::Slow { ms, ticks } => {
                m.serialize_entry("slow_ms", &ms)?;
                m.serialize_entry("ticks", &ticks)?;
            }
            What::Nan => m.serialize_entry("nan", &true)?,
        }
        m.end()
    }
}

impl Serialize for FaultRule {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("when", &self.when)?;
        m.serialize_entry("what", &self.what)?;
        if let Some(n) = self.times {
            m.serialize_entry("times", &n)?;
        }
        m.end()
    }
}

#[derive(serde::Serialize)]
struct InstallFields<'a> {
    rules: &'a [FaultRule],
    seed: u64,
}

// ------------------------------------------------------------- the listing
// The worker lists each rule's when and what as they were installed (by any
// client, or by `serve --fault-schedule`): codes and op kinds may be names
// or numbers.

fn field<'a>(m: &'a Value, key: &str, at: &str) -> Result<&'a Value, String> {
    m.get(key).ok_or_else(|| format!("{at}.{key} is missing"))
}

fn uint(v: &Value, at: &str) -> Result<u64, String> {
    v.as_u64().ok_or_else(|| format!("{at}: {v} is not an unsigned integer"))
}

fn u32_of(v: &Value, at: &str) -> Result<u32, String> {
    u32::try_from(uint(v, at)?).map_err(|_| format!("{at}: {v} exceeds u32"))
}

fn phase(v: Option<&Value>, at: &str) -> Result<Phase, String> {
    match v {
        None => Ok(Phase::Now), // op and token rules may leave `during` out
        Some(v) => v.as_str().and_then(Phase::parse).ok_or_else(|| format!("{at}: {v} is not a phase")),
    }
}

fn when_of(w: &Value, at: &str) -> Result<When, String> {
    let opt = |key: &str| w.get(key).map(|v| uint(v, &format!("{at}.{key}"))).transpose();
    let trigger = if let Some(n) = w.get("tick") {
        Trigger::Tick(uint(n, &format!("{at}.tick"))?)
    } else if let Some(k) = w.get("token") {
        Trigger::Token(uint(k, &format!("{at}.token"))?)
    } else if let Some(op) = w.get("op") {
        let op = match op {
            Value::String(s) => s.clone(),
            v => crate::names::op(u32_of(v, &format!("{at}.op"))?).to_string(),
        };
        Trigger::Op { op, nth: opt("nth")?.unwrap_or(1) }
    } else if let Some(p) = w.get("chance") {
        Trigger::Chance(p.as_f64().ok_or_else(|| format!("{at}.chance: {p} is not a number"))?)
    } else {
        return Err(format!("{at}: no tick, token, op or chance"));
    };
    Ok(When { trigger, lane: opt("lane")?, epoch: opt("epoch")? })
}

fn what_of(w: &Value, at: &str) -> Result<What, String> {
    let ms = |key: &str| u32_of(field(w, key, at)?, &format!("{at}.{key}"));
    if let Some(c) = w.get("fault") {
        let code = match c {
            Value::String(s) => crate::names::fault_code(s),
            v => v.as_u64().and_then(|n| u32::try_from(n).ok()),
        };
        return code.map(What::Fault).ok_or_else(|| format!("{at}.fault: {c} is not a fault code"));
    }
    if let Some(p) = w.get("fatal") {
        return Ok(What::Fatal(phase(Some(p), &format!("{at}.fatal"))?));
    }
    if let Some(p) = w.get("capacity") {
        return Ok(What::Capacity(phase(Some(p), &format!("{at}.capacity"))?));
    }
    if w.get("stall_ms").is_some() {
        return Ok(What::Stall { ms: ms("stall_ms")?, during: phase(w.get("during"), &format!("{at}.during"))? });
    }
    if w.get("slow_ms").is_some() {
        return Ok(What::Slow { ms: ms("slow_ms")?, ticks: ms("ticks")? });
    }
    if w.get("nan").is_some() {
        return Ok(What::Nan);
    }
    Err(format!("{at}: no fault, fatal, capacity, stall_ms, slow_ms or nan"))
}

/// A LIST_FAULTS payload, typed; Err names what does not decode.
fn decode_listing(payload: &[u8]) -> Result<FaultListing, Error> {
    let bad = |m: String| Error::Bounds(format!("LIST_FAULTS payload: {m}"));
    let v: Value = rmp_serde::from_slice(payload).map_err(|e| bad(e.to_string()))?;
    let seed = uint(field(&v, "seed", "").map_err(bad)?, "seed").map_err(bad)?;
    let rules = field(&v, "rules", "").map_err(bad)?.as_array().ok_or_else(|| bad("rules is not a list".into()))?;
    let rule = |i: usize, r: &Value| -> Result<ListedRule, String> {
        let at = format!("rules[{i}]");
        let when = when_of(field(r, "when", &at)?, &format!("{at}.when"))?;
        let what = what_of(field(r, "what", &at)?, &format!("{at}.what"))?;
        let times = r.get("times").map(|t| u32_of(t, &format!("{at}.times"))).transpose()?;
        Ok(ListedRule { rule: FaultRule { when, what, times }, fired: uint(field(r, "fired", &at)?, &at)? })
    };
    let rules = rules.iter().enumerate().map(|(i, r)| rule(i, r).map_err(bad)).collect::<Result<_, _>>()?;
    Ok(FaultListing { seed, rules })
}

impl Connection {
    /// INSTALL_FAULTS: `rules` replace the worker's schedule (the draws of
    /// chance rules come from `seed`); the rules installed. A rule the worker
    /// refuses is `Error::Op` (BadRequest, the message naming its field) and
    /// leaves the schedule as it was; Refused: no --fault-injection.
    pub fn install_faults(&mut self, rules: &[FaultRule], seed: u64, timeout: Duration) -> Result<u32, Error> {
        let c = self.op("INSTALL_FAULTS", &InstallFields { rules, seed }, timeout)?.ok("INSTALL_FAULTS")?;
        Ok(c.value as u32)
    }

    /// LIST_FAULTS: the installed schedule and how often each rule fired.
    pub fn list_faults(&mut self, timeout: Duration) -> Result<FaultListing, Error> {
        let c = self.op("LIST_FAULTS", &HashMap::<String, u8>::new(), timeout)?.ok("LIST_FAULTS")?;
        decode_listing(&c.payload)
    }

    /// CLEAR_FAULTS: drop every rule and whatever they armed; the rules dropped.
    pub fn clear_faults(&mut self, timeout: Duration) -> Result<u32, Error> {
        let c = self.op("CLEAR_FAULTS", &HashMap::<String, u8>::new(), timeout)?.ok("CLEAR_FAULTS")?;
        Ok(c.value as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rules() -> Vec<FaultRule> {
        vec![
            FaultRule::new(When::token(3), What::Fault(SF_FAULT_INTERNAL)),
            FaultRule::new(When::tick(2).lane(7).epoch(1), What::Stall { ms: 50, during: Phase::Decode }).times(2),
            FaultRule::new(When::op("DESCRIBE", 2), What::Fatal(Phase::Now)),
            FaultRule::new(When::chance(0.25), What::Slow { ms: 5, ticks: 3 }),
            FaultRule::new(When::token(1).lane(9), What::Nan),
            FaultRule::new(When::tick(4), What::Capacity(Phase::Prefill)),
        ]
    }

    #[test]
    fn rules_encode_to_the_maps_the_worker_reads() {
        // Encoded, then read back as any msgpack reader (Python's) would.
        let v: Value = rmp_serde::from_slice(&rmp_serde::to_vec_named(&InstallFields { rules: &rules(), seed: 9 }).unwrap())
            .unwrap();
        assert_eq!(v, json!({"seed": 9, "rules": [
            {"when": {"token": 3}, "what": {"fault": SF_FAULT_INTERNAL}},
            {"when": {"tick": 2, "lane": 7, "epoch": 1}, "what": {"stall_ms": 50, "during": "decode"}, "times": 2},
            {"when": {"op": "DESCRIBE", "nth": 2}, "what": {"fatal": "now"}},
            {"when": {"chance": 0.25}, "what": {"slow_ms": 5, "ticks": 3}},
            {"when": {"token": 1, "lane": 9}, "what": {"nan": true}},
            {"when": {"tick": 4}, "what": {"capacity": "prefill"}},
        ]}));
    }

    #[test]
    fn a_listing_decodes_names_numbers_and_defaults() {
        let mut listed: Vec<Value> = rules().iter().map(|r| serde_json::to_value(r).unwrap()).collect();
        for (r, fired) in listed.iter_mut().zip(0..) {
            r["fired"] = json!(fired);
        }
        // Another installer's spellings: a code's name, an op's number, stall_ms without during.
        listed.push(json!({"when": {"op": SF_OP_LIST_LANES}, "what": {"stall_ms": 7}, "times": 1, "fired": 0}));
        listed.push(json!({"when": {"tick": 1}, "what": {"fault": "numeric"}, "times": 1, "fired": 1}));
        let payload = rmp_serde::to_vec_named(&json!({"seed": 5, "rules": listed})).unwrap();
        let got = decode_listing(&payload).unwrap();
        assert_eq!(got.seed, 5);
        let want: Vec<FaultRule> = rules().into_iter().chain([
            FaultRule::new(When::op("LIST_LANES", 1), What::Stall { ms: 7, during: Phase::Now }).times(1),
            FaultRule::new(When::tick(1), What::Fault(SF_FAULT_NUMERIC)).times(1),
        ]).collect();
        assert_eq!(got.rules.iter().map(|r| r.rule.clone()).collect::<Vec<_>>(), want);
        assert_eq!(got.rules.iter().map(|r| r.fired).collect::<Vec<_>>(), [0, 1, 2, 3, 4, 5, 0, 1]);
        let bad = rmp_serde::to_vec_named(&json!({"seed": 5, "rules": [{"when": {"tick": 1}, "what": {}, "fired": 0}]}))
            .unwrap();
        let err = decode_listing(&bad).unwrap_err().to_string();
        assert!(err.contains("rules[0].what"), "{err}");
        let f = LaneFault { lane_tag: 1, code: SF_FAULT_NUMERIC, _pad0: 0, detail: SF_FAULT_DETAIL_INJECTED | 3 };
        assert!(f.injected() && f.code_name() == "NUMERIC");
        assert!(!LaneFault { detail: 3, ..f }.injected());
    }
}
