//! Connecting to a worker the way abi/superfluid.h's "sessions" comment
//! says, with the same sf_ring.c calls every language makes: find, check,
//! lock, wait for READY, begin a session; then plans out, events in.
use crate::abi::*;
use crate::events::{self, Completion, Error, Events, Message};
use crate::plan::{LogitsRow, Plan};
use core::ffi::c_void;
use std::collections::{HashMap, HashSet, VecDeque};
use std::ffi::CString;
use std::time::{Duration, Instant};

/// The header's wait advice: spin about a peer's turnaround, then sleep.
pub const SPIN_NS: i64 = 200_000;
/// A wait counts at most this many budgets towards the typical one, so an
/// idle spell is forgotten within a few quick answers.
const LONG_WAIT_BUDGETS: i64 = 4;

/// How long a queue's waits spin before they sleep, from how long its
/// recent waits took (the header's wait advice; the Python client's
/// SpinBudget): the whole budget while they typically end within about
/// twice it, none once they typically do not. A wait spun through a long
/// tick (milliseconds) is a core taken from the worker's threads on a small
/// machine; a short one (an empty tick) is answered while spinning.
#[derive(Clone, Copy, Debug)]
pub struct SpinBudget {
    pub budget_ns: i64,
    typical_ns: i64, // a running mean (1/8 per wait) of recent waits, each capped
}

impl SpinBudget {
    pub const fn new(budget_ns: i64) -> SpinBudget {
        SpinBudget { budget_ns, typical_ns: 0 }
    }

    /// The spin_ns for the next wait.
    pub fn spin_ns(&self) -> i64 {
        if self.typical_ns <= 2 * self.budget_ns { self.budget_ns } else { 0 }
    }

    /// A wait took `ns`.
    pub fn waited(&mut self, ns: i64) {
        let ns = ns.clamp(0, LONG_WAIT_BUDGETS * self.budget_ns);
        self.typical_ns += (ns - self.typical_ns) >> 3;
    }
}

/// One sf_queue_wait_* call, spinning as `spin` says and telling it how long it took.
pub(crate) fn timed_wait(spin: &mut SpinBudget, wait: impl FnOnce(i64) -> i64) -> i64 {
    let start = unsafe { sf_monotonic_ns() };
    let i = wait(spin.spin_ns());
    spin.waited(unsafe { sf_monotonic_ns() }.wrapping_sub(start) as i64);
    i
}

pub struct Connection {
    map: SegmentMap, // sf_segment_open's: the mapping and the locked fd
    base: *mut u8,
    pub(crate) epoch: u64,
    pub(crate) session: u64,
    next_seq: u64,
    pub(crate) next_op: u64,
    lanes_made: u64,
    plans: QueueView,
    events: QueueView,
    pub(crate) ops: QueueView,
    // Each queue's waits spin as its own recent waits say.
    plan_spin: SpinBudget,
    event_spin: SpinBudget,
    pub(crate) op_spin: SpinBudget,
    ready: VecDeque<Events>,
    pub(crate) completions: HashMap<u64, Completion>,
    inflight: HashSet<u64>, // plan_seqs sent to this epoch, not answered yet
    stale: HashSet<u64>,    // sent to an earlier epoch: a new worker may still run them
    orphans: HashSet<u64>,  // lanes a stale plan admitted on the new worker
    early: Vec<Message>,    // a newer epoch's messages, read before the reconnect
    gone: bool,
    /// Event messages that did not decode (dropped), and why the last one.
    pub dropped: u64,
    pub last_dropped: Option<String>,
    /// Queue resets the worker reported (it found counters impossible).
    pub queue_resets: Vec<QueueReset>,
    prompt: RingView,
    tokens: RingView,
    logits: RingView,
}

fn shm_dir() -> String {
    std::env::var("SUPERFLUID_SHM_DIR").ok().filter(|d| !d.is_empty()).unwrap_or_else(|| "/dev/shm".into())
}

fn wait_error(r: i64, what: &'static str) -> Error {
    if r == SF_WAIT_TIMEOUT as i64 { Error::Timeout(what) } else { Error::WorkerGone }
}

/// Nanoseconds for the C waits (< 0 would mean "no timeout": saturate instead).
pub(crate) fn ns(d: Duration) -> i64 {
    d.as_nanos().min(i64::MAX as u128) as i64
}

/// `now + d`, saturating (Duration::MAX means "as long as it takes").
pub(crate) fn deadline(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d).unwrap_or(now + Duration::from_secs(100 * 365 * 86_400))
}

impl Connection {
    /// Worker `index` of daemon `name`: checked, taken, READY, in a new
    /// session. Waits up to `timeout` for a segment the daemon is still
    /// making (absent, or its magic not written yet); refuses at once one
    /// that is wrong (another ABI, owner, mode or size).
    pub fn connect(name: &str, index: u32, timeout: Duration) -> Result<Connection, Error> {
        let until = deadline(timeout);
        let path = format!("{}/superfluid.{}.{}", shm_dir(), name, index);
        let seg = |e: String| Error::Segment(format!("{path}: {e}"));
        let cname = CString::new(name).map_err(|_| seg("a name with a NUL byte".into()))?;
        let mut map = SegmentMap { seg: core::ptr::null_mut(), bytes: 0, fd: -1, _pad0: 0 };
        // Steps 1-2: sf_segment_open waits while the daemon is still making it.
        let r = unsafe { sf_segment_open(cname.as_ptr() as *mut u8, index, ns(timeout), &mut map) };
        if r < 0 {
            return Err(seg(std::io::Error::from_raw_os_error(-r).to_string()));
        }
        if r != SF_CONNECT_OK as i32 {
            return Err(seg(format!("sf_segment_open says {r} (SF_CONNECT_*)")));
        }
        let (base, len) = (map.seg as *mut u8, map.bytes as usize);
        // All-zero views until attached below; Drop only unlocks and unmaps.
        let mut c = Connection {
            map, base, epoch: 0, session: 0, next_seq: 1, next_op: 1, lanes_made: 0,
            plans: unsafe { core::mem::zeroed() }, events: unsafe { core::mem::zeroed() },
            ops: unsafe { core::mem::zeroed() }, plan_spin: SpinBudget::new(SPIN_NS),
            event_spin: SpinBudget::new(SPIN_NS), op_spin: SpinBudget::new(SPIN_NS),
            ready: VecDeque::new(), completions: HashMap::new(),
            inflight: HashSet::new(), stale: HashSet::new(), orphans: HashSet::new(), early: Vec::new(),
            gone: false, dropped: 0, last_dropped: None, queue_resets: Vec::new(),
            prompt: unsafe { core::mem::zeroed() }, tokens: unsafe { core::mem::zeroed() },
            logits: unsafe { core::mem::zeroed() },
        };
        let h = c.header();
        match unsafe { sf_session_lock(c.map.fd) } {
            0 => {}
            r if r == -(SF_EWOULDBLOCK as i32) => return Err(Error::Taken),
            r => return Err(seg(format!("lock failed ({r})"))),
        }
        let layout = unsafe { (*h).layout };
        let offs = [layout.plan_queue, layout.event_queue, layout.op_queue, layout.prompt_ring, layout.token_ring,
                    layout.logits_ring];
        if offs.iter().any(|&o| o >= len as u64 || o % SF_CACHE_LINE as u64 != 0) {
            return Err(seg("a queue or ring offset outside the segment or off a cache line".into()));
        }
        unsafe {
            let at = |off: u64| (c.base.add(off as usize) as *mut c_void, len as u64 - off);
            let (q, n) = at(layout.plan_queue);
            let (e, m) = at(layout.event_queue);
            let (o, on) = at(layout.op_queue);
            let (p, pn) = at(layout.prompt_ring);
            let (t, tn) = at(layout.token_ring);
            let (l, ln) = at(layout.logits_ring);
            if sf_queue_attach(&mut c.plans, q, n) != 0 || sf_queue_attach(&mut c.events, e, m) != 0
                || sf_queue_attach(&mut c.ops, o, on) != 0 || sf_ring_attach(&mut c.prompt, p, pn) != 0
                || sf_ring_attach(&mut c.tokens, t, tn) != 0 || sf_ring_attach(&mut c.logits, l, ln) != 0
            {
                return Err(seg("a queue or ring does not fit the segment".into()));
            }
        }
        let mut epoch = 0u64;
        let left = ns(until.saturating_duration_since(Instant::now()));
        let r = unsafe { sf_wait_ready(h, 0, left, &mut epoch) };
        if r != SF_WAIT_READY as i32 {
            return Err(c.not_ready(r));
        }
        c.epoch = epoch;
        c.session = unsafe { sf_session_begin(h) };
        Ok(c)
    }

    /// The worker epoch this connection talks to.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// This connection's session (MsgHeader.session of its messages).
    pub fn session(&self) -> u64 {
        self.session
    }

    pub(crate) fn header(&self) -> *mut SegmentHeader {
        self.base as *mut SegmentHeader
    }

    /// The worker process serving now (the header's report; 0 while none runs).
    pub fn worker_pid(&self) -> u32 {
        // Raw pointers, never references: other processes write these words.
        unsafe { sf_load_acquire_u32(core::ptr::addr_of_mut!((*self.header()).worker_pid)) }
    }

    fn worker_state(&self) -> u32 {
        unsafe { sf_load_acquire_u32(core::ptr::addr_of_mut!((*self.header()).worker_state)) }
    }

    /// What the runtime can do (the header's copy of the worker's RuntimeDesc).
    pub fn runtime(&self) -> RuntimeDesc {
        unsafe { core::ptr::read_volatile(core::ptr::addr_of!((*self.header()).runtime)) }
    }

    /// Why a wait for READY ended without one: the daemon stopped, the
    /// worker was given up, or a timeout.
    fn not_ready(&self, r: i32) -> Error {
        let h = self.header();
        let stop = unsafe { sf_load_acquire_u32(core::ptr::addr_of_mut!((*h).stop_requested)) };
        match self.worker_state() {
            SF_WORKER_GAVE_UP => Error::DaemonGone { gave_up: true },
            _ if stop != 0 || r == SF_WAIT_STOP as i32 => Error::DaemonGone { gave_up: false },
            _ if r == SF_WAIT_TIMEOUT as i32 => Error::Timeout("READY"),
            _ => Error::DaemonGone { gave_up: false },
        }
    }

    /// After WorkerGone: wait for the next READY worker and talk to it in
    /// the same session (contract §9: its lanes are gone; re-admit them with
    /// their replay). plan_seq keeps counting; plans still queued may run on
    /// the new worker: their replies are dropped and the lanes they admitted
    /// come back from take_orphans().
    pub fn reconnect(&mut self, timeout: Duration) -> Result<u64, Error> {
        let mut epoch = 0u64;
        let r = unsafe { sf_wait_ready(self.header(), self.epoch, ns(timeout), &mut epoch) };
        if r != SF_WAIT_READY as i32 {
            return Err(self.not_ready(r));
        }
        self.epoch = epoch;
        self.gone = false;
        self.stale.extend(self.inflight.drain());
        self.ready.clear();
        self.completions.clear();
        self.orphans.clear();
        for m in std::mem::take(&mut self.early) {
            self.file_message(m)?;
        }
        Ok(epoch)
    }

    /// A lane tag this connection never handed out, apart from every other
    /// session's (tags are never reused: a stale plan's lane can't pass for
    /// a new one).
    pub fn new_lane_tag(&mut self) -> u64 {
        self.lanes_made += 1;
        ((self.session & 0xFFFF_FFFF) << 32) + self.lanes_made
    }

    /// Lanes that plans sent before a restart admitted on the new worker
    /// (the planner did not mean them there): retire them.
    pub fn take_orphans(&mut self) -> HashSet<u64> {
        std::mem::take(&mut self.orphans)
    }

    pub fn write_prompt(&mut self, tokens: &[u32]) -> Result<RingRef, Error> {
        let mut r: RingRef = unsafe { core::mem::zeroed() };
        let st = unsafe { sf_ring_write(&mut self.prompt, tokens.as_ptr() as *mut c_void, tokens.len() as u64, &mut r) };
        if st != SF_STATUS_OK {
            return Err(Error::Bounds(format!("{} tokens do not fit the prompt ring", tokens.len())));
        }
        Ok(r)
    }

    fn read_ring<T: Copy + Default>(view: &RingView, r: &RingRef) -> Result<Vec<T>, Error> {
        // The worker wrote r: check it before allocating for it.
        if r.len > view.capacity {
            return Err(Error::Bounds(format!("ring {} reference of {} elements, the ring holds {}", r.ring_id, r.len,
                                             view.capacity)));
        }
        let mut out = vec![T::default(); r.len as usize];
        let st = unsafe { sf_ring_read(view as *const RingView as *mut RingView, r as *const RingRef as *mut RingRef, out.as_mut_ptr() as *mut c_void, out.len() as u64) };
        if st != SF_STATUS_OK {
            return Err(Error::Bounds(format!("ring {} reference: {}", r.ring_id, crate::names::status(st))));
        }
        Ok(out)
    }

    /// Tokens a reference points at (read them before the ring wraps).
    pub fn read_tokens(&self, r: &RingRef) -> Result<Vec<u32>, Error> {
        Self::read_ring(&self.tokens, r)
    }

    /// The tokens an emit carries (none for HOST lanes and replays).
    pub fn emit_tokens(&self, emit: &LaneEmit) -> Result<Vec<u32>, Error> {
        if emit.n_tokens == 0 {
            return Ok(Vec::new());
        }
        if emit.n_tokens as u64 != emit.token_ref.len {
            return Err(Error::Bounds(format!("lane {}: n_tokens {} but a reference of {}", emit.lane_tag,
                                             emit.n_tokens, emit.token_ref.len)));
        }
        self.read_tokens(&emit.token_ref)
    }

    /// A HOST lane's logits row (vocab_size f32) and what commits a token for it.
    pub fn logits_row(&self, emit: &LaneEmit) -> Result<LogitsRow, Error> {
        if emit.logits_nonce == 0 {
            return Err(Error::Bounds(format!("lane {}: this emit carries no logits row", emit.lane_tag)));
        }
        let vocab = self.runtime().vocab_size as u64;
        if emit.logits_row.len != vocab {
            return Err(Error::Bounds(format!("lane {}: a logits row of {} values, vocab_size is {vocab}",
                                             emit.lane_tag, emit.logits_row.len)));
        }
        Ok(LogitsRow { lane_tag: emit.lane_tag, nonce: emit.logits_nonce, row: Self::read_ring(&self.logits, &emit.logits_row)? })
    }

    /// Queue a plan (numbered here when its plan_seq is 0); its plan_seq.
    pub fn submit(&mut self, plan: &Plan, timeout: Duration) -> Result<u64, Error> {
        self.check()?;
        let seq = if plan.plan_seq == 0 { self.next_seq } else { plan.plan_seq };
        if seq < self.next_seq {
            return Err(Error::Bounds(format!("plan_seq {seq}: this session has sent up to {}", self.next_seq - 1)));
        }
        if seq > SF_PLAN_SEQ_MAX {
            return Err(Error::Bounds(format!("plan_seq {seq} is past SF_PLAN_SEQ_MAX")));
        }
        let msg = plan.encode(seq, self.session);
        if msg.len() > self.plans.slot_bytes as usize {
            return Err(Error::Bounds(format!("a plan of {} bytes does not fit a plan slot", msg.len())));
        }
        let h = self.header();
        let (plans, epoch) = (&mut self.plans, self.epoch);
        let i = timed_wait(&mut self.plan_spin,
                           |spin| unsafe { sf_queue_wait_reserve(plans, h, epoch, 0, ns(timeout), spin) });
        if i < 0 {
            return Err(wait_error(-i, "plan queue room"));
        }
        unsafe {
            let slot = self.plans.slots.add(i as usize * self.plans.slot_bytes as usize);
            core::ptr::copy_nonoverlapping(msg.as_ptr(), slot, msg.len());
            sf_queue_publish(&mut self.plans);
        }
        self.next_seq = seq + 1;
        self.inflight.insert(seq);
        Ok(seq)
    }

    /// The next TickEvents of this session (a rejected plan is events too:
    /// look at `status`, or call `.ok()`).
    pub fn wait_events(&mut self, timeout: Duration) -> Result<Events, Error> {
        let until = deadline(timeout);
        loop {
            if let Some(ev) = self.ready.pop_front() {
                return Ok(ev);
            }
            self.pump(until)?;
        }
    }

    /// Submit and wait, `timeout` in all, for that plan's events; events of
    /// other plans stay for wait_events.
    pub fn tick(&mut self, plan: &Plan, timeout: Duration) -> Result<Events, Error> {
        let until = deadline(timeout);
        let seq = self.submit(plan, timeout)?;
        loop {
            if let Some(k) = self.ready.iter().position(|e| e.plan_seq == seq) {
                return Ok(self.ready.remove(k).unwrap());
            }
            self.pump(until)?;
        }
    }

    fn check(&self) -> Result<(), Error> {
        let epoch = unsafe { sf_load_acquire_u64(core::ptr::addr_of_mut!((*self.header()).worker_epoch)) };
        if self.gone || epoch != self.epoch { Err(Error::WorkerGone) } else { Ok(()) }
    }

    /// Read one event-queue message and file it.
    pub(crate) fn pump(&mut self, deadline: Instant) -> Result<(), Error> {
        self.check()?;
        let h = self.header();
        let left = ns(deadline.saturating_duration_since(Instant::now()));
        let (events, epoch) = (&mut self.events, self.epoch);
        let i = timed_wait(&mut self.event_spin, |spin| unsafe { sf_queue_wait_peek(events, h, epoch, 0, left, spin) });
        if i < 0 {
            return Err(wait_error(-i, "events"));
        }
        let slot = unsafe {
            core::slice::from_raw_parts(self.events.slots.add(i as usize * self.events.slot_bytes as usize),
                                        self.events.slot_bytes as usize)
        };
        let got = events::decode(slot, self.session);
        unsafe { sf_queue_release(&mut self.events) };
        match got {
            Ok(Some(m)) => self.file_message(m),
            Ok(None) => Ok(()),
            Err(e) => {
                // Nothing the worker writes may stop the planner: drop it, count it.
                self.dropped += 1;
                self.last_dropped = Some(e.to_string());
                Ok(())
            }
        }
    }

    fn file_message(&mut self, m: Message) -> Result<(), Error> {
        match m {
            Message::Worker(n) => {
                let gone = matches!(n.worker_state, SF_WORKER_STOPPED | SF_WORKER_DEAD | SF_WORKER_GAVE_UP);
                if n.worker_epoch > self.epoch || (n.worker_epoch == self.epoch && gone) {
                    self.gone = true;
                    return Err(Error::WorkerGone);
                }
            }
            Message::Reset(r) => self.queue_resets.push(r),
            Message::Ops { worker_epoch, completions } => {
                if worker_epoch > self.epoch {
                    self.early.push(Message::Ops { worker_epoch, completions });
                    self.gone = true;
                    return Err(Error::WorkerGone);
                }
                if worker_epoch == self.epoch {
                    self.completions.extend(completions.into_iter().map(|c| (c.op_id, c)));
                }
            }
            Message::Events(ev) => {
                if ev.worker_epoch > self.epoch {
                    self.early.push(Message::Events(ev));
                    self.gone = true;
                    return Err(Error::WorkerGone);
                }
                if ev.worker_epoch < self.epoch {
                    return Ok(()); // a dead worker's answer: its plan is void
                }
                self.completions.extend(ev.completions.iter().map(|c| (c.op_id, c.clone())));
                if self.stale.remove(&ev.plan_seq) {
                    // Sent to the old worker, run by this one: not an answer
                    // to anything now, but the lanes it admitted exist.
                    self.orphans.extend(ev.admit_results.iter().map(|r| r.lane_tag));
                    return Ok(());
                }
                self.inflight.remove(&ev.plan_seq);
                self.ready.push_back(ev);
            }
        }
        Ok(())
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        unsafe {
            sf_session_unlock(self.map.fd);
            sf_segment_close(&mut self.map);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // As tests/rings/test_spin_budget.py: the whole budget while answers come
    // quickly, none once they typically take far longer, and quick answers
    // bring the spin back within a few waits.
    #[test]
    fn quick_answers_spin_long_ones_do_not_and_it_comes_back() {
        let mut s = SpinBudget::new(SPIN_NS);
        assert_eq!(s.spin_ns(), SPIN_NS); // nothing known yet: spin
        for _ in 0..20 {
            s.waited(30_000); // an empty tick's round trip
        }
        assert_eq!(s.spin_ns(), SPIN_NS);
        for _ in 0..20 {
            s.waited(20_000_000); // ticks of 20 ms
        }
        assert_eq!(s.spin_ns(), 0);
        for _ in 0..8 {
            s.waited(30_000); // an idle spell counts as long, not as forever
        }
        assert_eq!(s.spin_ns(), SPIN_NS);
        let mut t = SpinBudget::new(SPIN_NS);
        let i = timed_wait(&mut t, |spin| {
            assert_eq!(spin, SPIN_NS);
            std::thread::sleep(std::time::Duration::from_millis(5));
            7
        });
        assert_eq!((i, t.spin_ns()), (7, SPIN_NS)); // one long wait: the mean moved, not past the cap
        assert!(t.typical_ns > 0 && t.typical_ns <= LONG_WAIT_BUDGETS * SPIN_NS / 8 + 1, "{t:?}");
    }
}
