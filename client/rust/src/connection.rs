//! Connecting to a worker the way abi/superfluid.h's "sessions" comment
//! says, with the same sf_ring.c calls every language makes: find, check,
//! lock, wait for READY, begin a session; then plans out, events in.
use crate::abi::*;
use crate::plan::{align, Plan};
use core::ffi::c_void;
use core::mem::size_of;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::time::{Duration, Instant};

extern "C" {
    fn mmap(addr: *mut u8, len: usize, prot: i32, flags: i32, fd: i32, off: i64) -> *mut u8;
    fn munmap(addr: *mut u8, len: usize) -> i32;
    fn geteuid() -> u32;
}
const PROT_RW: i32 = 0x1 | 0x2;
const MAP_SHARED: i32 = 0x01;
const O_NOFOLLOW: i32 = 0o400000;
const EWOULDBLOCK: i32 = 11;

#[derive(Debug)]
pub enum Error {
    /// No segment, or not one this build can use (the message says which).
    Segment(String),
    /// Another planner holds the worker.
    Taken,
    Timeout(&'static str),
    /// The worker's epoch changed or it is gone: reconnect and re-admit.
    WorkerGone,
    /// A message that does not decode, or a reference outside a ring.
    Bounds(String),
}

/// An op's answer (SPEC §7): `payload` is msgpack (`{error}` on failure).
#[derive(Debug, Clone)]
pub struct Completion {
    pub op_id: u64,
    pub status: u32,
    pub op: u32,
    pub handle: u64,
    pub value: u64,
    pub payload: Vec<u8>,
}

/// What DESCRIBE says of the worker (the fields a planner needs).
#[derive(Debug, Deserialize)]
pub struct Describe {
    pub abi_version: u32,
    pub worker_epoch: u64,
    pub eos: Vec<u32>,
    pub runtime: RuntimeInfo,
}

#[derive(Debug, Deserialize)]
pub struct RuntimeInfo {
    pub runtime_id: String,
    pub vocab_size: u32,
    pub max_batch: u32,
    pub max_seq_len: u64,
    pub page: u32,
}

#[derive(Serialize)]
struct OpMsg<'a, T: Serialize> {
    op: &'a str,
    op_id: u64,
    #[serde(flatten)]
    fields: &'a T,
}

/// What a tick answered (the parts a planner reads first).
pub struct Events {
    pub plan_seq: u64,
    pub status: u32,
    pub message: String,
    pub emits: Vec<LaneEmit>,
    pub faults: Vec<LaneFault>,
    pub admit_results: Vec<AdmitResult>,
}

pub struct Connection {
    _file: File,
    base: *mut u8,
    len: usize,
    pub epoch: u64,
    pub session: u64,
    next_seq: u64,
    next_op: u64,
    plans: QueueView,
    events: QueueView,
    ops: QueueView,
    ready: VecDeque<Events>,
    completions: HashMap<u64, Completion>,
    prompt: RingView,
    tokens: RingView,
}

fn shm_dir() -> String {
    std::env::var("SUPERFLUID_SHM_DIR").unwrap_or_else(|_| "/dev/shm".into())
}

impl Connection {
    /// Worker `index` of daemon `name`: checked, taken, READY, in a new session.
    pub fn connect(name: &str, index: u32, timeout: Duration) -> Result<Connection, Error> {
        let path = format!("{}/superfluid.{}.{}", shm_dir(), name, index);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(O_NOFOLLOW)
            .open(&path)
            .map_err(|e| Error::Segment(format!("{path}: {e}")))?;
        let meta = file.metadata().map_err(|e| Error::Segment(format!("{path}: {e}")))?;
        if meta.uid() != unsafe { geteuid() } || meta.mode() & 0o077 != 0 {
            return Err(Error::Segment(format!("{path}: not a mode-0600 file of this user")));
        }
        let len = meta.len() as usize;
        let base = unsafe { mmap(core::ptr::null_mut(), len, PROT_RW, MAP_SHARED, file.as_raw_fd(), 0) };
        if base as isize == -1 {
            return Err(Error::Segment(format!("{path}: mmap failed")));
        }
        let mut c = Connection {
            _file: file,
            base,
            len,
            epoch: 0,
            session: 0,
            next_seq: 1,
            next_op: 1,
            plans: unsafe { core::mem::zeroed() },
            events: unsafe { core::mem::zeroed() },
            ops: unsafe { core::mem::zeroed() },
            ready: VecDeque::new(),
            completions: HashMap::new(),
            prompt: unsafe { core::mem::zeroed() },
            tokens: unsafe { core::mem::zeroed() },
        };
        let h = c.header();
        let check = unsafe { sf_segment_check(h, len as u64) };
        if check != SF_CONNECT_OK as i32 {
            return Err(Error::Segment(format!("{path}: sf_segment_check says {check} (SF_CONNECT_*)")));
        }
        match unsafe { sf_session_lock(c._file.as_raw_fd()) } {
            0 => {}
            r if r == -EWOULDBLOCK => return Err(Error::Taken),
            r => return Err(Error::Segment(format!("{path}: lock failed ({r})"))),
        }
        let layout = unsafe { (*h).layout };
        unsafe {
            let at = |off: u64| (c.base.add(off as usize) as *mut c_void, (len as u64).saturating_sub(off));
            let (q, n) = at(layout.plan_queue);
            let (e, m) = at(layout.event_queue);
            let (o, on) = at(layout.op_queue);
            let (p, pn) = at(layout.prompt_ring);
            let (t, tn) = at(layout.token_ring);
            if sf_queue_attach(&mut c.plans, q, n) != 0 || sf_queue_attach(&mut c.events, e, m) != 0
                || sf_queue_attach(&mut c.ops, o, on) != 0
                || sf_ring_attach(&mut c.prompt, p, pn) != 0 || sf_ring_attach(&mut c.tokens, t, tn) != 0
            {
                return Err(Error::Segment(format!("{path}: a queue or ring does not fit the segment")));
            }
        }
        let mut epoch = 0u64;
        let r = unsafe { sf_wait_ready(h, 0, timeout.as_nanos() as i64, &mut epoch) };
        if r != SF_WAIT_READY as i32 {
            return Err(if r == SF_WAIT_TIMEOUT as i32 { Error::Timeout("READY") } else { Error::WorkerGone });
        }
        c.epoch = epoch;
        c.session = unsafe { sf_session_begin(h) };
        Ok(c)
    }

    fn header(&self) -> *mut SegmentHeader {
        self.base as *mut SegmentHeader
    }

    /// The worker process serving now (the header's report).
    pub fn worker_pid(&self) -> u32 {
        unsafe { sf_load_acquire_u32(&mut (*self.header()).worker_pid) }
    }

    /// After WorkerGone: wait for the next READY worker and talk to it in
    /// the same session (SPEC §9: its lanes are gone; re-admit them with
    /// their replay). plan_seq keeps counting.
    pub fn reconnect(&mut self, timeout: Duration) -> Result<u64, Error> {
        let mut epoch = 0u64;
        let r = unsafe { sf_wait_ready(self.header(), self.epoch, timeout.as_nanos() as i64, &mut epoch) };
        if r != SF_WAIT_READY as i32 {
            return Err(if r == SF_WAIT_TIMEOUT as i32 { Error::Timeout("READY") } else { Error::WorkerGone });
        }
        self.epoch = epoch;
        self.ready.clear();
        self.completions.clear();
        Ok(epoch)
    }

    pub fn write_prompt(&mut self, tokens: &[u32]) -> Result<RingRef, Error> {
        let mut r: RingRef = unsafe { core::mem::zeroed() };
        let st = unsafe { sf_ring_write(&mut self.prompt, tokens.as_ptr() as *mut c_void, tokens.len() as u64, &mut r) };
        if st != SF_STATUS_OK {
            return Err(Error::Bounds(format!("{} tokens do not fit the prompt ring", tokens.len())));
        }
        Ok(r)
    }

    pub fn read_tokens(&self, r: &RingRef) -> Result<Vec<u32>, Error> {
        let mut out = vec![0u32; r.len as usize];
        let mut r2 = *r;
        let st = unsafe { sf_ring_read(&self.tokens as *const RingView as *mut RingView, &mut r2, out.as_mut_ptr() as *mut c_void, out.len() as u64) };
        if st != SF_STATUS_OK {
            return Err(Error::Bounds(format!("token reference: status {st}")));
        }
        Ok(out)
    }

    /// Queue a plan (numbered here when its plan_seq is 0); its plan_seq.
    pub fn submit(&mut self, plan: &Plan, timeout: Duration) -> Result<u64, Error> {
        let seq = if plan.plan_seq == 0 { self.next_seq } else { plan.plan_seq };
        let msg = plan.encode(seq, self.session);
        if msg.len() > self.plans.slot_bytes as usize {
            return Err(Error::Bounds(format!("a plan of {} bytes does not fit a plan slot", msg.len())));
        }
        let h = self.header();
        let i = unsafe { sf_queue_wait_reserve(&mut self.plans, h, self.epoch, 0, timeout.as_nanos() as i64, 200_000) };
        if i < 0 {
            return Err(if -i == SF_WAIT_TIMEOUT as i64 { Error::Timeout("plan queue room") } else { Error::WorkerGone });
        }
        unsafe {
            let slot = self.plans.slots.add(i as usize * self.plans.slot_bytes as usize);
            core::ptr::copy_nonoverlapping(msg.as_ptr(), slot, msg.len());
            sf_queue_publish(&mut self.plans);
        }
        self.next_seq = seq + 1;
        Ok(seq)
    }

    /// The next TickEvents of this session (other sessions' replies and
    /// notices are skipped; a dead worker is WorkerGone).
    pub fn wait_events(&mut self, timeout: Duration) -> Result<Events, Error> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(ev) = self.ready.pop_front() {
                return Ok(ev);
            }
            self.pump(deadline)?;
        }
    }

    /// Read one event-queue message and file it: events to `ready`, op
    /// completions (in events or OpEvents) to `completions`.
    fn pump(&mut self, deadline: Instant) -> Result<(), Error> {
        let h = self.header();
        let left = deadline.saturating_duration_since(Instant::now()).as_nanos() as i64;
        let i = unsafe { sf_queue_wait_peek(&mut self.events, h, self.epoch, 0, left, 200_000) };
        if i < 0 {
            return Err(if -i == SF_WAIT_TIMEOUT as i64 { Error::Timeout("events") } else { Error::WorkerGone });
        }
        let slot = unsafe {
            core::slice::from_raw_parts(self.events.slots.add(i as usize * self.events.slot_bytes as usize),
                                        self.events.slot_bytes as usize)
        };
        let got = decode_message(slot, self.session, self.epoch);
        unsafe { sf_queue_release(&mut self.events) };
        if let Some((ev, comps)) = got? {
            for c in comps {
                self.completions.insert(c.op_id, c);
            }
            if let Some(ev) = ev {
                self.ready.push_back(ev);
            }
        }
        Ok(())
    }

    /// Run op `name` with `fields` (a struct or map that serializes to a
    /// msgpack map) and wait for its completion.
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
        let i = unsafe { sf_queue_wait_reserve(&mut self.ops, h, self.epoch, 0, timeout.as_nanos() as i64, 200_000) };
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

    /// Op DESCRIBE: the runtime, the EOS ids.
    pub fn describe(&mut self, timeout: Duration) -> Result<Describe, Error> {
        let c = self.op("DESCRIBE", &HashMap::<String, u8>::new(), timeout)?;
        if c.status != SF_OPST_OK {
            return Err(Error::Bounds(format!("DESCRIBE: status {}", c.status)));
        }
        rmp_serde::from_slice(&c.payload).map_err(|e| Error::Bounds(format!("DESCRIBE payload: {e}")))
    }

    pub fn tick(&mut self, plan: &Plan, timeout: Duration) -> Result<Events, Error> {
        let seq = self.submit(plan, timeout)?;
        loop {
            let ev = self.wait_events(timeout)?;
            if ev.plan_seq == seq {
                return Ok(ev);
            }
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        unsafe {
            sf_session_unlock(self._file.as_raw_fd());
            munmap(self.base, self.len);
        }
    }
}

fn read<T: Copy>(buf: &[u8], at: usize) -> Result<T, Error> {
    if at.checked_add(size_of::<T>()).map_or(true, |end| end > buf.len()) {
        return Err(Error::Bounds(format!("{} bytes at {at} overrun the message", size_of::<T>())));
    }
    Ok(unsafe { core::ptr::read_unaligned(buf.as_ptr().add(at) as *const T) })
}

fn list<T: Copy>(arena: &[u8], span: Span) -> Result<Vec<T>, Error> {
    (0..span.count as usize).map(|k| read::<T>(arena, span.offset as usize + k * size_of::<T>())).collect()
}

fn completions(arena: &[u8], span: Span) -> Result<Vec<Completion>, Error> {
    let raw: Vec<OpCompletion> = list(arena, span)?;
    raw.iter()
        .map(|c| {
            Ok(Completion { op_id: c.op_id, status: c.status, op: c.op, handle: c.handle, value: c.value,
                            payload: list(arena, c.payload)? })
        })
        .collect()
}

/// The record of `R` and its arena, after checking the sizes.
fn record<'a, R: Copy>(slot: &'a [u8], h: &MsgHeader) -> Result<(R, &'a [u8]), Error> {
    if h.record_bytes as usize != size_of::<R>() {
        return Err(Error::Bounds(format!("a record of {} bytes, this build's is {}", h.record_bytes, size_of::<R>())));
    }
    let r: R = read(slot, size_of::<MsgHeader>())?;
    let at = size_of::<MsgHeader>() + align(size_of::<R>());
    let end = at.checked_add(h.arena_bytes as usize).filter(|&end| end <= slot.len())
        .ok_or_else(|| Error::Bounds("the arena overruns the slot".into()))?;
    Ok((r, &slot[at..end]))
}

/// This session's events and completions of a message; None for what is
/// not this session's (an earlier planner's replies) or not a reply.
fn decode_message(slot: &[u8], session: u64, epoch: u64) -> Result<Option<(Option<Events>, Vec<Completion>)>, Error> {
    let h: MsgHeader = read(slot, 0)?;
    if h.kind == SF_MSG_WORKER && h.session == 0 {
        // The daemon's word: a worker died, starts, or was given up.
        let (n, _) = record::<WorkerNotice>(slot, &h)?;
        let gone = matches!(n.worker_state, SF_WORKER_STOPPED | SF_WORKER_DEAD | SF_WORKER_GAVE_UP);
        if n.worker_epoch > epoch || (n.worker_epoch == epoch && gone) {
            return Err(Error::WorkerGone);
        }
        return Ok(None); // old news (an earlier epoch's), or our worker starting
    }
    if h.session != session {
        return Ok(None);
    }
    if h.kind == SF_MSG_OP_EVENTS {
        let (o, arena) = record::<OpEvents>(slot, &h)?;
        return Ok(Some((None, completions(arena, o.op_completions)?)));
    }
    if h.kind != SF_MSG_EVENTS {
        return Ok(None);
    }
    let (e, arena) = record::<TickEvents>(slot, &h)?;
    if e.worker_epoch != epoch {
        return Ok(None); // a dead worker's answer: its plan is void
    }
    let msg: Vec<u8> = list(arena, e.message)?;
    let comps = completions(arena, e.op_completions)?;
    Ok(Some((Some(Events {
        plan_seq: e.plan_seq,
        status: e.status,
        message: String::from_utf8_lossy(&msg).into_owned(),
        emits: list(arena, e.emits)?,
        faults: list(arena, e.faults)?,
        admit_results: list(arena, e.admit_results)?,
    }), comps)))
}
