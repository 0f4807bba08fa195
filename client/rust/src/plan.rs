//! A TickPlan and its lists, encoded into a plan-queue slot: MsgHeader,
//! the record, then the arena at the next 8-byte boundary, every list a
//! Span {offset from the arena start, count}; an empty list is {0, 0}.
use crate::abi::*;
use core::mem::size_of;

/// One tick's plan. `plan_seq` 0 lets the connection number it.
#[derive(Clone, Default)]
pub struct Plan {
    pub plan_seq: u64,
    pub flags: u32,
    pub max_decode_lanes: Option<u32>,
    pub prefill_token_budget: u32,
    /// SF_CACHE_* classes the memory check may evict, and how much.
    pub evictable_cache_classes: u32,
    pub max_evict_bytes: u64,
    pub protected_quota_bytes: u64,
    pub admits: Vec<LaneAdmit>,
    pub prefills: Vec<LanePrefill>,
    pub decodes: Vec<LaneDecode>,
    pub commits: Vec<LaneCommit>,
    pub retires: Vec<LaneRetire>,
}

/// A HOST lane's logits row (vocab_size values) and what commits its token.
#[derive(Debug, Clone)]
pub struct LogitsRow {
    pub lane_tag: u64,
    pub nonce: u64,
    pub row: Vec<f32>,
}

/// A LaneAdmit under construction: greedy, default parameters, until set.
#[derive(Clone, Copy)]
pub struct Admit(pub LaneAdmit);

impl Admit {
    pub fn new(lane_tag: u64, prompt: RingRef) -> Self {
        let mut a: LaneAdmit = zeroed();
        a.lane_tag = lane_tag;
        a.prompt = prompt;
        a.sampling = SF_SAMPLING_GPU_GREEDY;
        Admit(a)
    }
    /// SF_SAMPLING_* and its parameters.
    pub fn sampling(mut self, sampling: u32, params: SamplingParams) -> Self {
        self.0.sampling = sampling;
        self.0.params = params;
        self
    }
    /// Draw position of the lane's first sampled token.
    pub fn rng_base(mut self, base: u64) -> Self {
        self.0.rng_counter_base = base;
        self
    }
    /// The prompt's last `n` tokens are fed as decode rounds (contract §9).
    pub fn replay(mut self, n: u32) -> Self {
        self.0.decode_replay = n;
        self
    }
    pub fn seed(mut self, handle: u64) -> Self {
        self.0.seed_handle = handle;
        self
    }
    /// SF_CLASS_* asked for.
    pub fn determinism(mut self, class: u32) -> Self {
        self.0.determinism_class = class;
        self
    }
    /// A registered grammar's handle; its fresh matcher first consumes the
    /// prompt's last `replay` tokens (what a re-admitted lane generated).
    pub fn grammar(mut self, handle: u64, replay: u32) -> Self {
        self.0.grammar_handle = handle;
        self.0.grammar_replay = replay;
        self
    }
    /// An INSTALL_STRATEGY slot (0: none): the lane may draft with it.
    pub fn strategy(mut self, slot: u32) -> Self {
        self.0.strategy_slot = slot;
        self
    }
    pub fn logprobs(mut self, n: u32) -> Self {
        self.0.want_logprobs = n;
        self
    }
}

/// SamplingParams with everything off (0 = off) but what is set after.
pub fn params(temperature: f32) -> SamplingParams {
    let mut p: SamplingParams = zeroed();
    p.temperature = temperature;
    p
}

fn zeroed<T: Copy>() -> T {
    // Every record is plain integers and floats: all-zero is a valid value.
    unsafe { core::mem::zeroed() }
}

impl Plan {
    pub fn new(prefill_token_budget: u32) -> Self {
        Plan { prefill_token_budget, ..Default::default() }
    }

    /// A greedy lane with default parameters.
    pub fn admit(&mut self, lane_tag: u64, prompt: RingRef) -> &mut Self {
        self.admit_with(&Admit::new(lane_tag, prompt))
    }

    /// A lane as `a` describes it.
    pub fn admit_with(&mut self, a: &Admit) -> &mut Self {
        self.admits.push(a.0);
        self
    }

    /// Re-admission after a restart (contract §9): `prompt` is the original
    /// prompt and the tokens generated so far, the last `replay` of which are
    /// fed as decode rounds (not emitted again).
    pub fn admit_replay(&mut self, lane_tag: u64, prompt: RingRef, replay: u32) -> &mut Self {
        self.admit_with(&Admit::new(lane_tag, prompt).replay(replay))
    }

    pub fn prefill(&mut self, lane_tag: u64, token_offset: u32, token_count: u32) -> &mut Self {
        self.prefills.push(LanePrefill { lane_tag, token_offset, token_count });
        self
    }

    pub fn decode(&mut self, lane_tag: u64, max_new_tokens: u16) -> &mut Self {
        self.decode_overshoot(lane_tag, max_new_tokens, 0)
    }

    /// A grant of `max_new_tokens` plus what a verified draft may run past
    /// it (`overshoot`; a drafting lane's).
    pub fn decode_overshoot(&mut self, lane_tag: u64, max_new_tokens: u16, overshoot: u16) -> &mut Self {
        self.decodes.push(LaneDecode { lane_tag, max_new_tokens, overshoot, _pad0: 0 });
        self
    }

    /// A HOST lane's token for the row it was sent.
    pub fn commit(&mut self, row: &LogitsRow, token_id: u32) -> &mut Self {
        self.commits.push(LaneCommit { lane_tag: row.lane_tag, token_id, _pad0: 0, logits_nonce: row.nonce });
        self
    }

    pub fn retire(&mut self, lane_tag: u64, publish: bool) -> &mut Self {
        self.retires.push(LaneRetire { lane_tag, publish_to_cache: publish as u8, _pad0: [0; 7] });
        self
    }

    /// The message's bytes (what goes into a slot).
    pub fn encode(&self, plan_seq: u64, session: u64) -> Vec<u8> {
        let arena_at = size_of::<MsgHeader>() + align(size_of::<TickPlan>());
        let mut arena: Vec<u8> = Vec::new();
        let admits = put(&mut arena, &self.admits);
        let prefills = put(&mut arena, &self.prefills);
        let decodes = put(&mut arena, &self.decodes);
        let commits = put(&mut arena, &self.commits);
        let retires = put(&mut arena, &self.retires);
        let mut p: TickPlan = zeroed();
        p.struct_size = size_of::<TickPlan>() as u64;
        p.plan_seq = plan_seq;
        p.flags = self.flags;
        p.max_decode_lanes = self.max_decode_lanes.unwrap_or(self.decodes.len() as u32);
        p.prefill_token_budget = self.prefill_token_budget;
        p.evictable_cache_classes = self.evictable_cache_classes;
        p.max_evict_bytes = self.max_evict_bytes;
        p.protected_quota_bytes = self.protected_quota_bytes;
        p.admits = admits;
        p.prefills = prefills;
        p.decodes = decodes;
        p.commits = commits;
        p.retires = retires;
        let h = MsgHeader {
            kind: SF_MSG_PLAN,
            record_bytes: size_of::<TickPlan>() as u32,
            arena_bytes: arena.len() as u64,
            session,
        };
        let mut out = vec![0u8; arena_at + arena.len()];
        out[..size_of::<MsgHeader>()].copy_from_slice(bytes_of(&h));
        out[size_of::<MsgHeader>()..size_of::<MsgHeader>() + size_of::<TickPlan>()].copy_from_slice(bytes_of(&p));
        out[arena_at..].copy_from_slice(&arena);
        out
    }
}

pub(crate) fn align(n: usize) -> usize {
    (n + SF_ARENA_ALIGN as usize - 1) / SF_ARENA_ALIGN as usize * SF_ARENA_ALIGN as usize
}

pub(crate) fn bytes_of<T: Copy>(v: &T) -> &[u8] {
    // Records have explicit padding (the header's rule): no uninitialised bytes.
    unsafe { core::slice::from_raw_parts(v as *const T as *const u8, size_of::<T>()) }
}

fn put<T: Copy>(arena: &mut Vec<u8>, items: &[T]) -> Span {
    if items.is_empty() {
        return Span { offset: 0, count: 0 };
    }
    let offset = arena.len() as u32;
    for it in items {
        arena.extend_from_slice(bytes_of(it));
    }
    arena.resize(align(arena.len()), 0);
    Span { offset, count: items.len() as u32 }
}
