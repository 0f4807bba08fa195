//! Ops (contract §7): a msgpack map after the MsgHeader, answered by an
//! OpCompletion in a tick's events or in OpEvents. `op` sends any op;
//! the typed helpers below send the fields each op takes and decode what
//! it answers.
#![allow(non_upper_case_globals)] // SF_OPST_* keep the header's names
use crate::abi::*;
use crate::connection::{ns, timed_wait, Connection};
use crate::events::{Completion, Error};
use crate::grammars::Grammar;
use crate::strategies::Strategy;
use core::mem::size_of;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::time::{Duration, Instant};

#[derive(Serialize)]
struct OpMsg<'a, T: Serialize> {
    op: &'a str,
    op_id: u64,
    #[serde(flatten)]
    fields: &'a T,
}

#[derive(Deserialize)]
struct ErrorPayload {
    error: String,
}

/// What DESCRIBE says of the worker (the fields a planner needs).
#[derive(Debug, Deserialize)]
pub struct Describe {
    pub abi_version: u32,
    pub worker_epoch: u64,
    pub eos: Vec<u32>,
    pub runtime: RuntimeInfo,
    /// Absent (an older worker): one rank on one machine.
    #[serde(default)]
    pub parallel: Parallel,
}

/// DESCRIBE's `parallel`: `tp` rank processes (the tensor-parallel degree)
/// run the worker's model on `nnodes` machines. The planner sees one worker
/// at every degree; a value below 1, or more machines than ranks, is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "ParallelPayload")]
pub struct Parallel {
    pub tp: u32,
    pub nnodes: u32,
}

impl Default for Parallel {
    fn default() -> Self {
        Parallel { tp: 1, nnodes: 1 }
    }
}

#[derive(Deserialize)]
struct ParallelPayload {
    #[serde(default = "one")]
    tp: u32,
    #[serde(default = "one")]
    nnodes: u32,
}

fn one() -> u32 {
    1
}

impl TryFrom<ParallelPayload> for Parallel {
    type Error = String;
    fn try_from(p: ParallelPayload) -> Result<Self, String> {
        if p.tp < 1 || p.nnodes < 1 {
            return Err(format!("parallel.tp {} and parallel.nnodes {} must be >= 1", p.tp, p.nnodes));
        }
        if p.nnodes > p.tp {
            return Err(format!("parallel.nnodes {} exceeds tp {}", p.nnodes, p.tp));
        }
        Ok(Parallel { tp: p.tp, nnodes: p.nnodes })
    }
}

#[derive(Debug, Deserialize)]
pub struct RuntimeInfo {
    pub runtime_id: String,
    pub vocab_size: u32,
    pub max_batch: u32,
    pub max_seq_len: u64,
    pub page: u32,
    #[serde(default)]
    pub exact_only: bool,
}

/// A lane the worker holds (LIST_LANES).
#[derive(Debug, Clone, Deserialize)]
pub struct HeldLane {
    pub tag: u64,
    pub prompt: u64,
    pub generated: u64,
    pub state: String,
    pub session: u64,
}

#[derive(Deserialize)]
struct LanePage {
    lanes: Vec<HeldLane>,
    more: bool,
}

/// A seed lease (LEASE_SEED): the handle for LaneAdmit.seed_handle and the
/// prompt tokens it covers.
#[derive(Debug, Clone, Copy)]
pub struct Seed {
    pub handle: u64,
    pub value: u64,
}

#[derive(Serialize)]
struct LeaseFields<'a> {
    tokens: &'a [u32],
    ttl_ticks: u32,
    determinism_class: u32,
}

#[derive(Serialize)]
struct RetireFields<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    tags: Option<&'a [u64]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    all: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    session: Option<u64>,
    publish: bool,
}

#[derive(Serialize)]
struct GrammarFields<'a> {
    kind: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    choices: Option<&'a [String]>,
}

fn none() -> HashMap<String, u8> {
    HashMap::new()
}

impl Completion {
    pub fn status_name(&self) -> &'static str {
        crate::names::op_status(self.status)
    }

    /// The worker's `error` of a failed op.
    pub fn error(&self) -> String {
        rmp_serde::from_slice::<ErrorPayload>(&self.payload).map(|e| e.error).unwrap_or_default()
    }

    /// Ok(self) for OK; otherwise the failure as an Error naming the op.
    pub fn ok(self, op: &str) -> Result<Completion, Error> {
        if self.status == SF_OPST_OK {
            return Ok(self);
        }
        Err(Error::Op { op: op.into(), status: self.status, name: self.status_name(), message: self.error() })
    }
}

impl Connection {
    /// Run op `name` with `fields` (a struct or map that serializes to a
    /// msgpack map) and wait for its completion, whatever its status.
    pub fn op<T: Serialize>(&mut self, name: &str, fields: &T, timeout: Duration) -> Result<Completion, Error> {
        let op_id = self.next_op;
        self.next_op += 1;
        let body = rmp_serde::to_vec_named(&OpMsg { op: name, op_id, fields })
            .map_err(|e| Error::Bounds(format!("op {name}: {e}")))?;
        let total = size_of::<MsgHeader>() + body.len();
        if total > self.ops.slot_bytes as usize {
            return Err(Error::Bounds(format!("op {name}: {total} bytes do not fit an op slot")));
        }
        let h = self.header();
        let (ops, epoch) = (&mut self.ops, self.epoch);
        let i = timed_wait(&mut self.op_spin, |spin| unsafe {
            sf_queue_wait_reserve(ops, h, epoch, 0, ns(timeout), spin)
        });
        if i < 0 {
            return Err(if -i == SF_WAIT_TIMEOUT as i64 { Error::Timeout("op queue room") } else { Error::WorkerGone });
        }
        let head = MsgHeader { kind: SF_MSG_OP, record_bytes: 0, arena_bytes: body.len() as u64, session: self.session };
        unsafe {
            let slot = self.ops.slots.add(i as usize * self.ops.slot_bytes as usize);
            core::ptr::copy_nonoverlapping(crate::plan::bytes_of(&head).as_ptr(), slot, size_of::<MsgHeader>());
            core::ptr::copy_nonoverlapping(body.as_ptr(), slot.add(size_of::<MsgHeader>()), body.len());
            sf_queue_publish(&mut self.ops);
        }
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(c) = self.completions.remove(&op_id) {
                return Ok(c);
            }
            self.pump(deadline)?;
        }
    }

    fn decoded<'de, R: Deserialize<'de>>(c: &'de Completion, op: &str) -> Result<R, Error> {
        rmp_serde::from_slice(&c.payload).map_err(|e| Error::Bounds(format!("{op} payload: {e}")))
    }

    /// DESCRIBE: the runtime and its EOS ids.
    pub fn describe(&mut self, timeout: Duration) -> Result<Describe, Error> {
        let c = self.op("DESCRIBE", &none(), timeout)?.ok("DESCRIBE")?;
        Self::decoded(&c, "DESCRIBE")
    }

    /// LEASE_SEED on the longest cached prefix of `tokens`; None when
    /// nothing matches (NoMatch) or the lease table is full (Capacity).
    pub fn lease_seed(&mut self, tokens: &[u32], ttl_ticks: u32, determinism_class: u32, timeout: Duration)
                      -> Result<Option<Seed>, Error> {
        let c = self.op("LEASE_SEED", &LeaseFields { tokens, ttl_ticks, determinism_class }, timeout)?;
        match c.status {
            SF_OPST_OK => Ok(Some(Seed { handle: c.handle, value: c.value })),
            SF_OPST_NoMatch | SF_OPST_Capacity => Ok(None),
            _ => Err(c.ok("LEASE_SEED").unwrap_err()),
        }
    }

    pub fn release_seed(&mut self, handle: u64, timeout: Duration) -> Result<(), Error> {
        let mut f = HashMap::new();
        f.insert("handle", handle);
        self.op("RELEASE_SEED", &f, timeout)?.ok("RELEASE_SEED").map(|_| ())
    }

    /// REGISTER_GRAMMAR: the handle for LaneAdmit.grammar_handle. A grammar
    /// the worker refuses is `Error::Op` with its message (BadRequest: the
    /// grammar library's; Unsupported: a runtime without a tokenizer).
    pub fn register_grammar(&mut self, g: &Grammar, timeout: Duration) -> Result<u64, Error> {
        let f = match g {
            Grammar::Text { kind, text } => GrammarFields { kind, text: Some(text), choices: None },
            Grammar::Choice(choices) => GrammarFields { kind: "choice", text: None, choices: Some(choices) },
        };
        Ok(self.op("REGISTER_GRAMMAR", &f, timeout)?.ok("REGISTER_GRAMMAR")?.handle)
    }

    /// RELEASE_GRAMMAR (UnknownHandle: no such grammar).
    pub fn release_grammar(&mut self, handle: u64, timeout: Duration) -> Result<(), Error> {
        let mut f = HashMap::new();
        f.insert("handle", handle);
        self.op("RELEASE_GRAMMAR", &f, timeout)?.ok("RELEASE_GRAMMAR").map(|_| ())
    }

    /// INSTALL_STRATEGY: fill `s.slot` (replacing what it held); the new
    /// cert_id. A strategy the worker refuses is `Error::Op` with its message
    /// (BadRequest: a field out of range, named; Unsupported: a runtime that
    /// cannot verify drafts).
    pub fn install_strategy(&mut self, s: &Strategy, timeout: Duration) -> Result<u64, Error> {
        Ok(self.op("INSTALL_STRATEGY", s, timeout)?.ok("INSTALL_STRATEGY")?.value)
    }

    /// Every lane the worker holds, any session's (LIST_LANES, paged).
    pub fn list_lanes(&mut self, timeout: Duration) -> Result<Vec<HeldLane>, Error> {
        let mut out: Vec<HeldLane> = Vec::new();
        loop {
            let mut f = HashMap::new();
            f.insert("after", out.last().map_or(0, |l| l.tag));
            f.insert("limit", 1024);
            let c = self.op("LIST_LANES", &f, timeout)?.ok("LIST_LANES")?;
            let page: LanePage = Self::decoded(&c, "LIST_LANES")?;
            let empty = page.lanes.is_empty();
            out.extend(page.lanes);
            if !page.more || empty {
                return Ok(out); // an empty page with `more` would page forever
            }
        }
    }

    /// RETIRE_LANES of `tags`; the count retired.
    pub fn retire_lanes(&mut self, tags: &[u64], publish: bool, timeout: Duration) -> Result<u64, Error> {
        let f = RetireFields { tags: Some(tags), all: None, session: None, publish };
        Ok(self.op("RETIRE_LANES", &f, timeout)?.ok("RETIRE_LANES")?.value)
    }

    /// RETIRE_LANES of every lane (of `session` only, if given); the count.
    pub fn retire_all_lanes(&mut self, session: Option<u64>, timeout: Duration) -> Result<u64, Error> {
        let f = RetireFields { tags: None, all: Some(true), session, publish: false };
        Ok(self.op("RETIRE_LANES", &f, timeout)?.ok("RETIRE_LANES")?.value)
    }

    /// INJECT_FAULT (a daemon started with --fault-injection): the lane
    /// faults with `code` (SF_FAULT_*) in the next tick that runs it.
    pub fn inject_fault(&mut self, lane_tag: u64, code: u32, timeout: Duration) -> Result<(), Error> {
        let mut f = HashMap::new();
        f.insert("lane_tag", lane_tag);
        f.insert("code", code as u64);
        self.op("INJECT_FAULT", &f, timeout)?.ok("INJECT_FAULT").map(|_| ())
    }

    /// CACHE_CLEAR: drop every prefix-cache entry; the bytes freed.
    pub fn cache_clear(&mut self, timeout: Duration) -> Result<u64, Error> {
        Ok(self.op("CACHE_CLEAR", &none(), timeout)?.ok("CACHE_CLEAR")?.value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn describe_payload(parallel: Option<serde_json::Value>) -> Vec<u8> {
        let mut body = json!({
            "abi_version": SF_ABI_VERSION, "worker_epoch": 3, "fault_injection": false, "eos": [511],
            "specials": {"</s>": 511},
            "runtime": {"runtime_id": "fake", "vocab_size": 512, "max_seq_len": 256, "max_batch": 64,
                        "max_seqs": 0, "page": 16, "prefill_step_tokens": 0, "truncate_partial": true,
                        "copy_shares_cells": true, "takeover_preferred": false, "engine_sampling": false,
                        "engine_draws": false, "verify_batches": true, "exact_only": false},
        });
        if let Some(p) = parallel {
            body["parallel"] = p;
        }
        rmp_serde::to_vec_named(&body).unwrap()
    }

    fn decode(parallel: Option<serde_json::Value>) -> Result<Describe, rmp_serde::decode::Error> {
        rmp_serde::from_slice(&describe_payload(parallel))
    }

    #[test]
    fn describe_decodes_the_parallel_layout_and_defaults_it() {
        let d = decode(Some(json!({"tp": 4, "nnodes": 2}))).unwrap();
        assert_eq!((d.parallel.tp, d.parallel.nnodes), (4, 2));
        assert_eq!((d.runtime.vocab_size, d.eos.as_slice()), (512, &[511][..]));
        // An older worker sends no parallel: one rank on one machine.
        assert_eq!(decode(None).unwrap().parallel, Parallel { tp: 1, nnodes: 1 });
        assert_eq!(decode(Some(json!({"tp": 2}))).unwrap().parallel, Parallel { tp: 2, nnodes: 1 });
    }

    #[test]
    fn describe_refuses_a_layout_below_one_or_more_machines_than_ranks() {
        for (bad, says) in [(json!({"tp": 0, "nnodes": 1}), "parallel.tp 0"),
                            (json!({"tp": 2, "nnodes": 0}), "parallel.nnodes 0"),
                            (json!({"tp": 1, "nnodes": 2}), "exceeds tp"),
                            (json!({"tp": -1, "nnodes": 1}), "")] {
            let err = decode(Some(bad.clone())).expect_err(&format!("{bad} decoded"));
            assert!(err.to_string().contains(says), "{bad}: {err}");
        }
    }
}
