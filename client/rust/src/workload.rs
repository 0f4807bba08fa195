//! The workload format of `superfluid plan` (client/workload.py's
//! docstring is the definition): requests in, results out, both JSON, so
//! the Rust, Go and Python planners can be compared token for token.
use crate::abi::*;
use crate::connection::Connection;
use crate::events::Error;
use crate::grammars::Grammar;
use crate::planner::{HostSampler, Options, Planner, RequestSpec};
use crate::strategies::Strategy;
use serde::Deserialize;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Host samplers' perturbation scale (client/workload.py's PERTURB_SCALE).
pub const PERTURB_SCALE: f32 = 2.0;

// As Python's reader: unknown keys are refused in options and params, ignored elsewhere.
#[derive(Deserialize)]
pub struct Workload {
    #[serde(default)]
    pub options: Option<WorkloadOptions>,
    pub requests: Vec<WorkloadRequest>,
    #[serde(default)]
    pub kill_worker_after_tokens: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct WorkloadOptions {
    pub prefill_token_budget: Option<u32>,
    pub prefill_chunk: Option<u32>,
    pub decode_grant: Option<u64>,
    pub max_lanes: Option<usize>,
    pub use_leases: Option<bool>,
    /// null or {max_draft, ngram_min, ngram_max} (each optional); read by `strategy`.
    #[serde(default)]
    pub strategy: Option<Value>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Params {
    pub temperature: Option<f32>,
    pub top_k: Option<u32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub freq_penalty: Option<f32>,
}

#[derive(Deserialize)]
pub struct WorkloadRequest {
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: Option<String>,
    pub host_sampler: Option<String>,
    pub params: Option<Params>,
    /// Masked to 64 bits, as Python's `& (2**64 - 1)`: -1 is 2^64 - 1.
    pub rng_base: Option<serde_json::Number>,
    pub stop_at_eos: Option<bool>,
    pub publish: Option<bool>,
    /// {"kind": json_schema | regex | lark | gbnf, "text": ...} or
    /// {"kind": "choice", "choices": [...]}; read by `specs` (not with host).
    #[serde(default)]
    pub grammar: Option<Value>,
    /// With the options' strategy (default true).
    pub speculate: Option<bool>,
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The first index of the largest value (of the first NaN, as numpy's argmax).
pub fn host_argmax(row: &[f32], _position: u64) -> u32 {
    first_max(row.iter().copied())
}

fn first_max(values: impl Iterator<Item = f32>) -> u32 {
    let (mut best, mut top) = (0usize, f32::NEG_INFINITY);
    for (i, v) in values.enumerate() {
        if v.is_nan() {
            return i as u32;
        }
        if v > top || i == 0 {
            best = i;
            top = v;
        }
    }
    best as u32
}

/// argmax of row[i] + PERTURB_SCALE * u(position, i), float32 throughout.
pub fn host_perturb(row: &[f32], position: u64) -> u32 {
    first_max(row.iter().enumerate().map(|(i, &v)| {
        let bits = splitmix64((position << 32).wrapping_add(i as u64)) >> 40;
        v + PERTURB_SCALE * (bits as f32 / (1u32 << 24) as f32)
    }))
}

/// A request's "grammar", as client/workload.py reads it (and
/// client/grammars.py checks it), a bad one naming its field.
fn grammar(g: &Value, where_: &str) -> Result<Grammar, Error> {
    let bad = |m: &str| Error::Bounds(format!("{where_}.grammar{m}"));
    let Some(kind) = g.as_object().and_then(|o| o.get("kind")) else {
        return Err(bad(": an object with kind and text (or choices)"));
    };
    let kind = kind.as_str().ok_or_else(|| bad(".kind: a string"))?;
    let field = if kind == "choice" { "choices" } else { "text" };
    let v = g.get(field).ok_or_else(|| bad(&format!(".{field} is missing")))?;
    if kind == "choice" {
        let list = v.as_array().filter(|l| l.iter().all(Value::is_string));
        let list = list.ok_or_else(|| bad(".choices: a choice grammar is a list of strings"))?;
        Ok(Grammar::Choice(list.iter().map(|c| c.as_str().unwrap().to_string()).collect()))
    } else {
        let text = v.as_str().ok_or_else(|| bad(&format!(".text: a {kind} grammar is a string")))?;
        Ok(Grammar::text(kind, text))
    }
}

const STRATEGY_FIELDS: [&str; 3] = ["max_draft", "ngram_min", "ngram_max"];

/// options.strategy as client/workload.py reads it: an object of some of
/// max_draft, ngram_min, ngram_max (the rest Strategy's defaults), integers
/// (Python's int(): a float is truncated, a bool is 0 or 1, "8" is 8).
fn strategy(v: &Value) -> Result<Strategy, Error> {
    let bad = || Error::Bounds(format!("options.strategy: an object of {}", STRATEGY_FIELDS.join(", ")));
    let o = v.as_object().ok_or_else(bad)?;
    if o.keys().any(|k| !STRATEGY_FIELDS.contains(&k.as_str())) {
        return Err(bad());
    }
    let mut s = Strategy::default();
    for (k, v) in o {
        let n = match v {
            Value::Bool(b) => Some(*b as i64),
            Value::Number(n) => n.as_i64().or_else(|| n.as_f64().filter(|f| f.is_finite()).map(|f| f.trunc() as i64)),
            Value::String(t) => t.trim().parse().ok(),
            _ => None,
        };
        let n = n.and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| Error::Bounds(format!("options.strategy.{k}: an integer >= 0")))?;
        match k.as_str() {
            "max_draft" => s.max_draft = n,
            "ngram_min" => s.ngram_min = n,
            _ => s.ngram_max = n,
        }
    }
    Ok(s)
}

fn sampler(name: &str, at: usize) -> Result<HostSampler, Error> {
    match name {
        "argmax" => Ok(Box::new(host_argmax)),
        "perturb" => Ok(Box::new(host_perturb)),
        other => Err(Error::Bounds(format!("requests[{at}].host_sampler = {other:?}: one of argmax, perturb"))),
    }
}

impl Workload {
    pub fn parse(text: &str) -> Result<Workload, Error> {
        let w: Workload = serde_json::from_str(text).map_err(|e| Error::Bounds(format!("workload: {e}")))?;
        w.strategy()?;
        Ok(w)
    }

    /// options.strategy (None: null or left out); a bad one names its field.
    pub fn strategy(&self) -> Result<Option<Strategy>, Error> {
        match self.options.as_ref().and_then(|o| o.strategy.as_ref()).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => strategy(v).map(Some),
        }
    }

    pub fn options(&self) -> Options {
        let o = self.options.as_ref();
        let d = Options::default();
        Options {
            prefill_token_budget: o.and_then(|o| o.prefill_token_budget).unwrap_or(d.prefill_token_budget),
            prefill_chunk: o.and_then(|o| o.prefill_chunk),
            decode_grant: o.and_then(|o| o.decode_grant).map_or(d.decode_grant, |g| g.min(u16::MAX as u64) as u16),
            max_lanes: o.and_then(|o| o.max_lanes),
            use_leases: o.and_then(|o| o.use_leases).unwrap_or(d.use_leases),
            strategy: self.strategy().unwrap_or(None), // checked by parse
            ..d
        }
    }

    /// The requests as the planner takes them; a bad one names its field.
    pub fn specs(&self) -> Result<Vec<RequestSpec>, Error> {
        self.requests.iter().enumerate().map(|(n, r)| {
            let mut s = RequestSpec::new(r.prompt.clone(), r.max_new_tokens);
            s.sampling = match r.sampling.as_deref().unwrap_or("greedy") {
                "greedy" => SF_SAMPLING_GPU_GREEDY,
                "sample" => SF_SAMPLING_GPU_SAMPLE,
                "host" => SF_SAMPLING_HOST,
                other => return Err(Error::Bounds(format!("requests[{n}].sampling = {other:?}: one of greedy, \
                                                           sample, host"))),
            };
            if s.sampling == SF_SAMPLING_HOST {
                s.host_sampler = Some(sampler(r.host_sampler.as_deref().unwrap_or("argmax"), n)?);
            }
            let p = r.params.as_ref();
            let f = |g: fn(&Params) -> Option<f32>| p.and_then(g).unwrap_or(0.0);
            s.params.temperature = f(|p| p.temperature);
            s.params.top_k = p.and_then(|p| p.top_k).unwrap_or(0);
            s.params.top_p = f(|p| p.top_p);
            s.params.min_p = f(|p| p.min_p);
            s.params.repeat_penalty = f(|p| p.repeat_penalty);
            s.params.presence_penalty = f(|p| p.presence_penalty);
            s.params.freq_penalty = f(|p| p.freq_penalty);
            s.rng_base = match &r.rng_base {
                None => 0,
                Some(v) => v.as_u64().or_else(|| v.as_i64().map(|v| v as u64))
                    .ok_or_else(|| Error::Bounds(format!("requests[{n}].rng_base: an integer")))?,
            };
            s.stop_at_eos = r.stop_at_eos.unwrap_or(true);
            s.publish = r.publish.unwrap_or(true);
            s.speculate = r.speculate.unwrap_or(true);
            if let Some(g) = r.grammar.as_ref().filter(|g| !g.is_null()) {
                s.grammar = Some(grammar(g, &format!("requests[{n}]"))?);
                if s.sampling == SF_SAMPLING_HOST {
                    return Err(Error::Bounds(format!("requests[{n}].grammar: not with host sampling")));
                }
            }
            Ok(s)
        }).collect()
    }
}

extern "C" {
    fn kill(pid: i32, sig: i32) -> i32;
}

/// Run `w` on a connection through the reference planner; the results
/// JSON `superfluid plan` prints.
pub fn run(conn: Connection, w: &Workload, timeout: Duration) -> Result<Value, Error> {
    let mut opts = w.options();
    opts.reconnect_timeout = timeout;
    let mut p = Planner::new(conn, opts)?;
    let mut ids = Vec::new();
    for s in w.specs()? {
        ids.push(p.submit(s)?);
    }
    let deadline = Instant::now() + timeout;
    let mut killed = false;
    while p.busy() {
        if Instant::now() > deadline {
            return Err(Error::Timeout("the workload"));
        }
        p.step()?;
        let made: u64 = p.requests.iter().map(|r| r.generated.len() as u64).sum();
        if let (Some(n), false) = (w.kill_worker_after_tokens, killed) {
            let pid = p.conn.worker_pid() as i32;
            if made >= n && pid > 0 {
                // (pid 0 while the daemon starts a worker: kill(0) would hit our own group)
                unsafe { kill(pid, 9) };
                killed = true;
            }
        }
    }
    let results: Vec<Value> = ids.iter().map(|&i| {
        let r = p.request(i);
        json!({"id": i, "tokens": r.generated, "finish": r.finish.map(|f| f.as_str()),
               "admissions": r.admissions})
    }).collect();
    let s = &p.stats;
    let tokens: usize = p.requests.iter().map(|r| r.generated.len()).sum();
    Ok(json!({"results": results, "stats": {"ticks": s.ticks, "restarts": s.restarts,
              "seeded_tokens": s.seeded_tokens, "leases": s.leases, "tokens": tokens, "killed": killed,
              "draft_proposed": s.draft_proposed, "draft_accepted": s.draft_accepted}}))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(grammar: &str, sampling: &str) -> Result<Vec<RequestSpec>, Error> {
        let w = format!(r#"{{"requests": [{{"prompt": [1], "max_new_tokens": 3, "sampling": "{sampling}",
                            "grammar": {grammar}}}]}}"#);
        Workload::parse(&w)?.specs()
    }

    #[test]
    fn options_strategy_and_speculate_are_read_and_a_bad_strategy_names_its_field() {
        let w = Workload::parse(r#"{"options": {"strategy": {"max_draft": 6, "ngram_max": 3.7}},
                                    "requests": [{"prompt": [1], "max_new_tokens": 3},
                                                 {"prompt": [1], "max_new_tokens": 3, "speculate": false}]}"#)
            .unwrap();
        assert_eq!(w.options().strategy, Some(Strategy::prompt_lookup(6, 1, 3)));
        let specs = w.specs().unwrap();
        assert_eq!((specs[0].speculate, specs[1].speculate), (true, false));
        for opts in [r#"{}"#, r#"{"strategy": null}"#] {
            let w = Workload::parse(&format!(r#"{{"options": {opts}, "requests": []}}"#)).unwrap();
            assert_eq!(w.options().strategy, None);
        }
        let w = Workload::parse(r#"{"options": {"strategy": {}}, "requests": []}"#).unwrap();
        assert_eq!(w.options().strategy, Some(Strategy::default()));
        for bad in [r#"{"depth": 3}"#, r#"3"#, r#"{"max_draft": "eight"}"#, r#"{"max_draft": -1}"#] {
            match Workload::parse(&format!(r#"{{"options": {{"strategy": {bad}}}, "requests": []}}"#)) {
                Err(Error::Bounds(m)) => assert!(m.starts_with("options.strategy"), "{bad}: {m}"),
                other => panic!("{bad}: {:?}", other.map(|w| w.options().strategy)),
            }
        }
    }

    #[test]
    fn a_requests_grammar_is_read_and_a_bad_one_names_its_field() {
        let s = one(r#"{"kind": "json_schema", "text": "{\"type\": \"object\"}"}"#, "sample").unwrap();
        assert_eq!(s[0].grammar, Some(Grammar::json_schema(r#"{"type": "object"}"#)));
        let s = one(r#"{"kind": "choice", "choices": ["a", "b"]}"#, "greedy").unwrap();
        assert_eq!(s[0].grammar, Some(Grammar::choice(&["a", "b"])));
        assert_eq!(one("null", "greedy").unwrap()[0].grammar, None);
        for (g, sampling, field) in [
            (r#"{"text": "a"}"#, "greedy", "requests[0].grammar: an object with kind"),
            (r#""a""#, "greedy", "requests[0].grammar: an object with kind"),
            (r#"{"kind": "choice"}"#, "greedy", "requests[0].grammar.choices is missing"),
            (r#"{"kind": "choice", "choices": "ab"}"#, "greedy", "requests[0].grammar.choices: a choice grammar"),
            (r#"{"kind": "regex"}"#, "greedy", "requests[0].grammar.text is missing"),
            (r#"{"kind": "regex", "text": ["a"]}"#, "greedy", "requests[0].grammar.text: a regex grammar is a string"),
            (r#"{"kind": "regex", "text": "a"}"#, "host", "requests[0].grammar: not with host sampling"),
        ] {
            match one(g, sampling) {
                Err(Error::Bounds(m)) => assert!(m.starts_with(field), "{g}: {m}"),
                other => panic!("{g}: {:?}", other.map(|s| s[0].grammar.clone())),
            }
        }
    }
}
