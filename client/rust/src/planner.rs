//! The reference planner in Rust: continuous batching over one worker, as
//! client/planner.py does it (read its docstring for the why). A tick:
//! plan (retires, host commits, prefill chunks under the budget, admits,
//! decode grants), send, shrink on NeedsReplan, absorb the events. When the
//! worker dies, reconnect and re-admit every unfinished request with its
//! prompt plus what it generated, replayed by decode, draws resuming at
//! rng_base + tokens sampled: the request goes on exactly where it was. A
//! constrained request's grammar is registered when it is submitted and
//! released when it is done (GrammarBook); a re-admission replays what it
//! generated into a fresh matcher too. With a speculation strategy
//! (Options::strategy, client/strategies.py) the planner installs it when
//! it is made (a strategy the worker refuses fails `new`), and again at the
//! first admission after a restart; requests that speculate (the default)
//! are admitted with its slot and granted overshoot: drafted tokens the
//! worker verified past the tick's grant, never past max_new_tokens.
use crate::abi::*;
use crate::connection::Connection;
use crate::events::{Error, Events};
use crate::grammars::{Grammar, GrammarBook};
use crate::ops::Seed;
use crate::plan::{Admit, LogitsRow, Plan};
use crate::seeds::SeedBook;
use crate::strategies::{Strategy, StrategyBook};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Picks a token from a HOST lane's logits row; `position` is the draw's
/// rng position (rng_base + tokens sampled so far), the engine's key too.
pub type HostSampler = Box<dyn FnMut(&[f32], u64) -> u32>;

const EVICT_ALL: u64 = 1 << 62; // max_evict_bytes when the planner lets the cache go

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Eos,
    /// The grammar is complete.
    Grammar,
    Length,
    MaxTokens,
    /// The worker's memory cannot hold it even alone.
    Unservable,
    /// Its lane faulted NUMERIC (the same row would come back), or faulted
    /// more than Options::max_fault_readmits times in a row.
    Fault,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Eos => "eos",
            Finish::Grammar => "grammar",
            Finish::Length => "length",
            Finish::MaxTokens => "max_tokens",
            Finish::Unservable => "unservable",
            Finish::Fault => "fault",
        }
    }
}

/// What the user asked for, before submit.
pub struct RequestSpec {
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: u32,
    pub params: SamplingParams,
    pub rng_base: u64,
    pub publish: bool,
    pub stop_at_eos: bool,
    pub host_sampler: Option<HostSampler>,
    /// The output follows it (not with HOST sampling).
    pub grammar: Option<Grammar>,
    /// Admitted with the planner's strategy, if it has one (drafting never
    /// changes its tokens).
    pub speculate: bool,
}

impl std::fmt::Debug for RequestSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestSpec").field("prompt", &self.prompt).field("max_new_tokens", &self.max_new_tokens)
            .field("sampling", &self.sampling).field("params", &self.params).field("rng_base", &self.rng_base)
            .field("publish", &self.publish).field("stop_at_eos", &self.stop_at_eos)
            .field("host_sampler", &self.host_sampler.as_ref().map(|_| "callback"))
            .field("grammar", &self.grammar).field("speculate", &self.speculate).finish()
    }
}

impl RequestSpec {
    /// Greedy, published to the cache, stopping at EOS.
    pub fn new(prompt: Vec<u32>, max_new_tokens: usize) -> Self {
        RequestSpec { prompt, max_new_tokens, sampling: SF_SAMPLING_GPU_GREEDY, params: crate::plan::params(0.0),
                      rng_base: 0, publish: true, stop_at_eos: true, host_sampler: None, grammar: None,
                      speculate: true }
    }
}

#[derive(Debug)]
pub struct Request {
    pub id: usize,
    pub spec: RequestSpec,
    pub generated: Vec<u32>,
    pub finish: Option<Finish>,
    pub admissions: u32, // > 1: re-admitted after a restart, a fault or a preemption
    pub faults: u32,     // its lanes' faults in a row (no token between), not injected or OOM ones
    /// Admitted with the planner's strategy: spec.speculate and the planner has one.
    pub speculate: bool,
    pub(crate) seed: Option<Seed>,
    pub(crate) no_seed: bool, // its lease went stale: admit it without one this time
}

pub(crate) struct Lane {
    pub tag: u64,
    pub req: usize,
    pub prefill_end: usize, // prompt tokens prefill feeds; the generated tail is replayed by decode
    pub replay_left: usize,
    pub prefilled: usize,
    pub commit: Option<(LogitsRow, u32)>, // HOST: the token the next plan commits
    pub retiring: bool,
}

#[derive(Debug, Clone, Default)]
pub struct Stats {
    pub ticks: u64,
    pub replans: u64,
    pub prefill_chunks_shed: u64,
    pub prefill_tokens_shed: u64,
    pub evictions: u64,
    pub bytes_evicted: u64,
    pub faults: u64,
    pub preemptions: u64,
    pub restarts: u64,
    pub seeded_tokens: u64,
    pub leases: u64,
    /// Draft tokens the worker verified (LaneEmit.spec.proposed, summed).
    pub draft_proposed: u64,
    /// Of them, the tokens taken (LaneEmit.spec.accepted).
    pub draft_accepted: u64,
}

/// How the planner batches (client/planner.py's arguments).
#[derive(Debug, Clone)]
pub struct Options {
    pub prefill_token_budget: u32,
    /// Tokens offered to one lane a tick; None: what the budget has left.
    pub prefill_chunk: Option<u32>,
    pub decode_grant: u16,
    pub max_lanes: Option<usize>,
    pub max_admits_per_tick: Option<usize>,
    pub tick_timeout: Duration,
    pub reconnect_timeout: Duration,
    pub use_leases: bool,
    /// How many times in a row (no token between) a faulted request is
    /// re-admitted; its next fault ends it Finish::Fault. A NUMERIC fault
    /// ends it at once; injected and OOM_TENTATIVE faults never count.
    pub max_fault_readmits: u32,
    /// A speculation strategy installed on the worker and named by every
    /// request's admission unless it opts out (RequestSpec::speculate).
    pub strategy: Option<Strategy>,
}

impl Default for Options {
    fn default() -> Self {
        Options { prefill_token_budget: 512, prefill_chunk: None, decode_grant: 4, max_lanes: None,
                  max_admits_per_tick: None, tick_timeout: Duration::from_secs(30),
                  reconnect_timeout: Duration::from_secs(60), use_leases: true, max_fault_readmits: 8,
                  strategy: None }
    }
}

/// A plan and what it means to the planner; applied only once accepted.
#[derive(Default)]
pub(crate) struct Draft {
    pub plan: Plan,
    pub admits: Vec<Lane>,
    pub prefills: Vec<(u64, usize)>,     // tag, tokens offered
    pub reached: HashMap<u64, usize>,    // tag -> prefilled after, by the budget
    pub decodes: Vec<(u64, usize)>,      // tag, tokens granted
    pub commits: Vec<u64>,
    pub retires: Vec<u64>,
    pub published: Vec<Vec<u32>>,        // tokens of publishing retires
    pub seeded: HashMap<u64, usize>,     // tag -> tokens its lease covers
}

pub struct Planner {
    pub conn: Connection,
    pub opts: Options,
    pub eos: Vec<u32>,
    pub requests: Vec<Request>,
    pub stats: Stats,
    pub(crate) waiting: VecDeque<usize>,
    pub(crate) lanes: Vec<Lane>, // in admission order (prefill runs in this order)
    pub(crate) retire_next: BTreeSet<u64>, // faulted, preempted or orphaned tags
    pub(crate) seeds: SeedBook,
    pub grammars: GrammarBook,
    pub strategies: StrategyBook,
    max_lanes: usize,
    evict: bool,
    pub(crate) admit_cap: Option<usize>,
}

impl Planner {
    pub fn new(mut conn: Connection, opts: Options) -> Result<Planner, Error> {
        if opts.prefill_token_budget < 1 || opts.decode_grant < 1 || opts.prefill_chunk == Some(0) {
            return Err(Error::Bounds("prefill_token_budget, prefill_chunk and decode_grant are at least 1".into()));
        }
        let desc = conn.describe(opts.tick_timeout)?;
        let max_batch = desc.runtime.max_batch as usize;
        // 0 lanes would never admit: as Python's, 0 means "as many as the runtime batches".
        let max_lanes = opts.max_lanes.filter(|&n| n > 0).unwrap_or(max_batch).min(max_batch);
        let seeds = SeedBook::new(desc.runtime.page, desc.runtime.exact_only);
        let mut strategies = StrategyBook::new(opts.strategy.clone());
        strategies.slot(&mut conn, opts.tick_timeout)?; // a strategy the worker refuses fails here, not mid-run
        Ok(Planner { conn, opts, eos: desc.eos, requests: Vec::new(), stats: Stats::default(),
                     waiting: VecDeque::new(), lanes: Vec::new(), retire_next: BTreeSet::new(), seeds,
                     grammars: GrammarBook::default(), strategies, max_lanes,
                     evict: false, admit_cap: None })
    }

    /// A request by the id submit gave it.
    pub fn request(&self, id: usize) -> &Request {
        &self.requests[id - 1]
    }

    /// Queue a request; its id (1, 2, ...: `request(id)`). A grammar is
    /// compiled by the worker now: one it refuses is `Error::Op` with the
    /// worker's message (REGISTER_GRAMMAR: BadRequest), and nothing is queued.
    pub fn submit(&mut self, mut spec: RequestSpec) -> Result<usize, Error> {
        if spec.prompt.is_empty() || spec.max_new_tokens < 1 {
            return Err(Error::Bounds("a request needs a prompt and max_new_tokens >= 1".into()));
        }
        if spec.sampling == SF_SAMPLING_HOST && spec.host_sampler.is_none() {
            return Err(Error::Bounds("a HOST request needs a host_sampler(row, position) -> token".into()));
        }
        if let Some(g) = &spec.grammar {
            g.check()?;
            if spec.sampling == SF_SAMPLING_HOST {
                return Err(Error::Bounds("a grammar constrains the engine's sampling: not with HOST".into()));
            }
        }
        if !spec.stop_at_eos {
            spec.params.flags |= SF_PARAM_IGNORE_EOS;
        }
        let id = self.requests.len() + 1;
        if let Some(g) = &spec.grammar {
            self.grammars.handle(&mut self.conn, id - 1, g, self.opts.tick_timeout)?;
        }
        let speculate = spec.speculate && self.strategies.strategy.is_some();
        self.requests.push(Request { id, spec, generated: Vec::new(), finish: None, admissions: 0, faults: 0, speculate,
                                     seed: None, no_seed: false });
        self.waiting.push_back(id - 1);
        Ok(id)
    }

    /// Work left: waiting requests, lanes, or tags to retire.
    pub fn busy(&mut self) -> bool {
        self.retire_next.extend(self.conn.take_orphans());
        !(self.waiting.is_empty() && self.lanes.is_empty() && self.retire_next.is_empty())
    }

    pub fn run_until_done(&mut self, timeout: Duration) -> Result<(), Error> {
        let deadline = Instant::now() + timeout;
        while self.busy() {
            if Instant::now() > deadline {
                return Err(Error::Timeout("requests still running"));
            }
            self.step()?;
        }
        Ok(())
    }

    /// One tick, or, when the worker is gone, one recovery.
    pub fn step(&mut self) -> Result<(), Error> {
        self.retire_next.extend(self.conn.take_orphans());
        match self.send() {
            Ok((d, ev)) => {
                self.absorb(d, &ev)
            }
            Err(Error::WorkerGone) => self.recover(),
            Err(e) => Err(e),
        }
    }

    /// Plan, send, and shrink the plan while the worker answers NeedsReplan.
    fn send(&mut self) -> Result<(Draft, Events), Error> {
        let mut max_admits = [self.opts.max_admits_per_tick, self.admit_cap].into_iter().flatten().min();
        let mut publish = true;
        loop {
            let d = self.plan(max_admits, publish)?;
            let ev = self.conn.tick(&d.plan, self.opts.tick_timeout)?;
            if ev.status == SF_STATUS_OK {
                return Ok((d, ev));
            }
            if ev.status == SF_STATUS_RejectStaleSeed && !d.seeded.is_empty() {
                // A lease ran out (or the worker let it go): admit those afresh.
                for lane in &d.admits {
                    let r = &mut self.requests[lane.req];
                    r.seed = None;
                    r.no_seed = true;
                }
                continue;
            }
            if ev.status != SF_STATUS_NeedsReplan {
                return Err(ev.ok().err().unwrap());
            }
            self.stats.replans += 1;
            // Nothing happened. Let the cache go first, then admit fewer, then
            // keep nothing a retiring lane would publish, then preempt.
            if !self.evict {
                self.evict = true;
            } else if d.admits.len() == 1 && self.lanes.is_empty() {
                let id = self.waiting.pop_front().unwrap();
                self.refuse(id)?; // alone on an idle worker, it still does not fit
            } else if !d.admits.is_empty() {
                max_admits = Some(d.admits.len() / 2);
                self.admit_cap = max_admits;
            } else if publish && self.lanes.iter().any(|l| l.retiring && self.requests[l.req].spec.publish) {
                publish = false;
            } else if self.preempt_newest()? {
                max_admits = Some(0);
            } else {
                return Err(ev.ok().err().unwrap());
            }
        }
    }

    fn plan(&mut self, max_admits: Option<usize>, publish: bool) -> Result<Draft, Error> {
        let mut d = Draft { plan: Plan::new(self.opts.prefill_token_budget), ..Default::default() };
        if self.evict {
            d.plan.evictable_cache_classes = SF_CACHE_RESIDENT_PREFIX_CLASS;
            d.plan.max_evict_bytes = EVICT_ALL;
        }
        for lane in &self.lanes {
            if lane.retiring {
                let req = &self.requests[lane.req];
                let keep = publish && req.spec.publish;
                d.plan.retire(lane.tag, keep);
                d.retires.push(lane.tag);
                if keep {
                    d.published.push([req.spec.prompt.as_slice(), req.generated.as_slice()].concat());
                }
            }
        }
        for &tag in &self.retire_next {
            d.plan.retire(tag, false);
            d.retires.push(tag);
        }
        for lane in &self.lanes {
            if let (Some((row, tok)), false) = (&lane.commit, lane.retiring) {
                d.plan.commit(row, *tok);
                d.commits.push(lane.tag);
            }
        }
        // Lanes already in flight prefill first: they hold memory already.
        let mut budget = self.opts.prefill_token_budget as usize;
        for k in 0..self.lanes.len() {
            budget = self.plan_prefill(&mut d, Which::Live(k), budget);
        }
        for &id in self.waiting.clone().iter() {
            if self.lanes.len() + d.admits.len() >= self.max_lanes || budget == 0 {
                break;
            }
            if max_admits.map_or(false, |m| d.admits.len() >= m) {
                break;
            }
            self.admit(&mut d, id)?;
            let k = d.admits.len() - 1;
            budget = self.plan_prefill(&mut d, Which::New(k), budget);
        }
        self.plan_decodes(&mut d);
        Ok(d)
    }

    fn plan_prefill(&self, d: &mut Draft, which: Which, budget: usize) -> usize {
        let lane = match which {
            Which::Live(k) => &self.lanes[k],
            Which::New(k) => &d.admits[k],
        };
        let left = lane.prefill_end - lane.prefilled;
        if left == 0 || lane.retiring {
            return budget;
        }
        let offer = left.min(self.opts.prefill_chunk.map_or(budget, |c| c as usize));
        if offer == 0 {
            return budget;
        }
        let (tag, from) = (lane.tag, lane.prefilled);
        d.plan.prefill(tag, from as u32, offer as u32);
        d.prefills.push((tag, offer));
        let take = offer.min(budget); // the executor takes tokens in plan order up to the budget
        d.reached.insert(tag, from + take);
        budget - take
    }

    /// Admit request `id` from where it is (contract §9).
    fn admit(&mut self, d: &mut Draft, id: usize) -> Result<(), Error> {
        let tag = self.conn.new_lane_tag();
        let req = &self.requests[id];
        let sampled = req.generated.len(); // every generated token was drawn at base + index
        let tokens = [req.spec.prompt.as_slice(), req.generated.as_slice()].concat();
        if self.opts.use_leases && req.seed.is_none() && !req.no_seed {
            let seed = self.seeds.lease(&mut self.conn, &tokens, sampled, self.opts.tick_timeout)?;
            self.requests[id].seed = seed;
        }
        // The grammar's fresh matcher replays what was generated (contract §9, as the draws resume).
        let grammar = match &self.requests[id].spec.grammar {
            Some(g) => self.grammars.handle(&mut self.conn, id, g, self.opts.tick_timeout)?,
            None => 0,
        };
        let speculate = self.requests[id].speculate;
        let slot = if speculate { self.strategies.slot(&mut self.conn, self.opts.tick_timeout)? } else { 0 };
        let req = &self.requests[id];
        let value = req.seed.map_or(0, |s| s.value as usize);
        let r = self.conn.write_prompt(&tokens)?;
        let a = Admit::new(tag, r)
            .sampling(req.spec.sampling, req.spec.params)
            .rng_base(req.spec.rng_base.wrapping_add(sampled as u64))
            .replay(sampled as u32)
            .seed(req.seed.map_or(0, |s| s.handle))
            .determinism(SF_CLASS_SEED_PATH_INVARIANT)
            .grammar(grammar, if grammar != 0 { sampled as u32 } else { 0 })
            .strategy(slot);
        d.plan.admit_with(&a);
        // A seed covers `value` tokens: prefill starts there, and so does decode's replay.
        let end = req.spec.prompt.len().max(value);
        if req.seed.is_some() {
            d.seeded.insert(tag, value);
        }
        d.admits.push(Lane { tag, req: id, prefill_end: end, replay_left: tokens.len() - end, prefilled: value,
                             commit: None, retiring: false });
        Ok(())
    }

    /// Lanes whose prefill completes this tick decode: GPU lanes their
    /// replay plus up to decode_grant new tokens, HOST lanes one. A lane
    /// with the strategy may run past the grant on verified drafts
    /// (overshoot) up to what its request has left.
    fn plan_decodes(&self, d: &mut Draft) {
        let mut grants = Vec::new();
        let max_draft = self.strategies.strategy.as_ref().map_or(0, |s| s.max_draft as usize);
        for lane in self.lanes.iter().chain(d.admits.iter()) {
            if lane.retiring || *d.reached.get(&lane.tag).unwrap_or(&lane.prefilled) != lane.prefill_end {
                continue;
            }
            let req = &self.requests[lane.req];
            let mut over = 0;
            let grant = if req.spec.sampling == SF_SAMPLING_HOST {
                1 // the executor's rule: the planner picks each token
            } else {
                // A re-admitted lane catches up in one tick: its replay, then the usual grant.
                let left = req.spec.max_new_tokens - req.generated.len();
                let new = (self.opts.decode_grant as usize).min(left);
                if req.speculate {
                    // Room for every round's draft to be taken whole.
                    over = (left - new).min(self.opts.decode_grant as usize * max_draft).min(u16::MAX as usize);
                }
                (lane.replay_left + new).min(u16::MAX as usize)
            };
            grants.push((lane.tag, grant, over));
        }
        for (tag, g, over) in grants {
            d.plan.decode_overshoot(tag, g as u16, over as u16);
            d.decodes.push((tag, g));
        }
    }

    /// A request the worker's memory cannot hold even alone: it ends with
    /// what it has.
    fn refuse(&mut self, id: usize) -> Result<(), Error> {
        self.requests[id].finish = Some(Finish::Unservable);
        self.grammars.release(&mut self.conn, id, self.opts.tick_timeout)
    }

    /// Give up the newest running lane's memory; false: none to give up.
    fn preempt_newest(&mut self) -> Result<bool, Error> {
        let Some(k) = self.lanes.iter().rposition(|l| !l.retiring) else { return Ok(false) };
        let alone = self.lanes.iter().filter(|l| !l.retiring).count() == 1;
        let lane = self.lanes.remove(k);
        self.retire_next.insert(lane.tag);
        if alone {
            self.refuse(lane.req)?;
        } else {
            self.waiting.push_back(lane.req);
            self.stats.preemptions += 1;
        }
        Ok(true)
    }

    /// The worker is gone with every lane: wait for its replacement and
    /// queue each unfinished request to be re-admitted from where it is.
    fn recover(&mut self) -> Result<(), Error> {
        self.conn.reconnect(self.opts.reconnect_timeout)?;
        self.stats.restarts += 1;
        let again: Vec<usize> =
            self.lanes.iter().map(|l| l.req).filter(|&r| self.requests[r].finish.is_none()).collect();
        self.lanes.clear();
        self.retire_next.clear();
        self.evict = false;
        self.admit_cap = None;
        self.seeds.forget();
        self.grammars.forget(); // nor grammars: each is registered again at its next admission
        self.strategies.forget(); // nor the strategy: installed again at the next admission
        for r in &mut self.requests {
            r.seed = None;
            r.no_seed = false;
        }
        for &r in again.iter().rev() {
            self.waiting.push_front(r);
        }
        Ok(())
    }
}

pub(crate) enum Which {
    Live(usize),
    New(usize),
}
