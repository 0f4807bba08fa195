//! Decoding what arrives on the event queue (the header's wire rules): a
//! slot is MsgHeader, the record (exactly its struct_size), then the arena.
use crate::abi::*;
use crate::plan::align;
use core::mem::size_of;

#[derive(Debug)]
pub enum Error {
    /// No segment, or not one this build can use (the message says which).
    Segment(String),
    /// Another planner holds the worker.
    Taken,
    Timeout(&'static str),
    /// The worker's epoch changed or it is gone: reconnect and re-admit.
    WorkerGone,
    /// No worker will come back: the daemon stopped or died, or gave up on
    /// this worker (gave_up; SIGHUP to the daemon retries it).
    DaemonGone { gave_up: bool },
    /// A message that does not decode, or a reference outside a ring.
    Bounds(String),
    /// The worker refused a plan: SF_STATUS_* by name, and its message.
    Rejected { plan_seq: u64, status: u32, name: &'static str, message: String },
    /// An op failed: SF_OPST_* by name, and the worker's `error`.
    Op { op: String, status: u32, name: &'static str, message: String },
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Segment(m) => write!(f, "segment: {m}"),
            Error::Taken => write!(f, "another planner holds the worker"),
            Error::Timeout(what) => write!(f, "timed out waiting for {what}"),
            Error::WorkerGone => write!(f, "the worker restarted or died: reconnect and re-admit"),
            Error::DaemonGone { gave_up: true } => write!(f, "the daemon gave up on the worker"),
            Error::DaemonGone { gave_up: false } => write!(f, "the daemon stopped"),
            Error::Bounds(m) => write!(f, "{m}"),
            Error::Rejected { plan_seq, name, message, .. } => write!(f, "plan {plan_seq} rejected: {name}: {message}"),
            Error::Op { op, name, message, .. } => write!(f, "op {op}: {name}: {message}"),
        }
    }
}

impl std::error::Error for Error {}

/// An op's answer (contract §7): `payload` is msgpack (`{error}` on failure).
#[derive(Debug, Clone)]
pub struct Completion {
    pub op_id: u64,
    pub status: u32,
    pub op: u32,
    pub handle: u64,
    pub value: u64,
    pub payload: Vec<u8>,
}

/// What was dropped or evicted in a tick (counters and entries agree).
#[derive(Debug, Clone, Default)]
pub struct Shed {
    pub prefill_chunks_dropped: u32,
    pub evictions_performed: u32,
    pub bytes_evicted: u64,
    pub entries: Vec<ShedEntry>,
}

/// One tick's answer, every list decoded.
#[derive(Debug)]
pub struct Events {
    pub plan_seq: u64,
    pub status: u32,
    pub tick_status: u32,
    pub message: String,
    pub admit_results: Vec<AdmitResult>,
    pub emits: Vec<LaneEmit>,
    pub faults: Vec<LaneFault>,
    pub shed: Shed,
    pub completions: Vec<Completion>,
    pub logprobs: Vec<LaneLogprob>,
    pub timings: TickTimings,
    pub mem: TickMemCounters,
    pub worker_epoch: u64,
}

impl Events {
    pub fn status_name(&self) -> &'static str {
        crate::names::status(self.status)
    }

    /// Ok(self) when the plan was applied; otherwise the refusal as an Error.
    pub fn ok(self) -> Result<Events, Error> {
        if self.status == SF_STATUS_OK {
            return Ok(self);
        }
        Err(Error::Rejected { plan_seq: self.plan_seq, status: self.status, name: self.status_name(),
                              message: self.message })
    }
}

/// One event-queue message.
#[derive(Debug)]
pub enum Message {
    Events(Events),
    /// Completions of ops run between ticks (or that a tick's events could not hold).
    Ops { worker_epoch: u64, completions: Vec<Completion> },
    /// The daemon's word: a worker died, is starting, or was given up.
    Worker(WorkerNotice),
    /// The worker found a queue corrupted and reset it.
    Reset(QueueReset),
}

pub(crate) fn read<T: Copy>(buf: &[u8], at: usize) -> Result<T, Error> {
    if at.checked_add(size_of::<T>()).map_or(true, |end| end > buf.len()) {
        return Err(Error::Bounds(format!("{} bytes at {at} overrun the message", size_of::<T>())));
    }
    // Records are plain integers and floats: any bytes are a value.
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

/// The record of `R` and its arena, after checking the sizes: record_bytes
/// and the record's leading struct_size both equal this build's size.
fn record<'a, R: Copy>(slot: &'a [u8], h: &MsgHeader) -> Result<(R, &'a [u8]), Error> {
    if h.record_bytes as usize != size_of::<R>() {
        return Err(Error::Bounds(format!("a record of {} bytes, this build's is {}", h.record_bytes, size_of::<R>())));
    }
    let struct_size: u64 = read(slot, size_of::<MsgHeader>())?;
    if struct_size != size_of::<R>() as u64 {
        return Err(Error::Bounds(format!("struct_size {struct_size}, this build's is {}", size_of::<R>())));
    }
    let r: R = read(slot, size_of::<MsgHeader>())?;
    let at = size_of::<MsgHeader>() + align(size_of::<R>());
    let end = at.checked_add(h.arena_bytes as usize).filter(|&end| end <= slot.len())
        .ok_or_else(|| Error::Bounds("the arena overruns the slot".into()))?;
    Ok((r, &slot[at..end]))
}

/// The message in `slot` if it is for `session` (replies carry exactly the
/// session they answer; notices carry 0). None: another session's, or a
/// kind the event queue does not carry.
pub(crate) fn decode(slot: &[u8], session: u64) -> Result<Option<Message>, Error> {
    let h: MsgHeader = read(slot, 0)?;
    match h.kind {
        SF_MSG_WORKER if h.session == 0 => Ok(Some(Message::Worker(record::<WorkerNotice>(slot, &h)?.0))),
        SF_MSG_RESET if h.session == 0 => Ok(Some(Message::Reset(record::<QueueReset>(slot, &h)?.0))),
        _ if h.session != session => Ok(None),
        SF_MSG_OP_EVENTS => {
            let (o, arena) = record::<OpEvents>(slot, &h)?;
            Ok(Some(Message::Ops { worker_epoch: o.worker_epoch, completions: completions(arena, o.op_completions)? }))
        }
        SF_MSG_EVENTS => {
            let (e, arena) = record::<TickEvents>(slot, &h)?;
            let msg: Vec<u8> = list(arena, e.message)?;
            Ok(Some(Message::Events(Events {
                plan_seq: e.plan_seq,
                status: e.status,
                tick_status: e.tick_status,
                message: String::from_utf8_lossy(&msg).into_owned(),
                admit_results: list(arena, e.admit_results)?,
                emits: list(arena, e.emits)?,
                faults: list(arena, e.faults)?,
                shed: Shed {
                    prefill_chunks_dropped: e.shed.prefill_chunks_dropped,
                    evictions_performed: e.shed.evictions_performed,
                    bytes_evicted: e.shed.bytes_evicted,
                    entries: list(arena, e.shed.entries)?,
                },
                completions: completions(arena, e.op_completions)?,
                logprobs: list(arena, e.logprobs)?,
                timings: e.timings,
                mem: e.mem,
                worker_epoch: e.worker_epoch,
            })))
        }
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(kind: u32, record_bytes: u32, arena_bytes: u64, session: u64) -> Vec<u8> {
        crate::plan::bytes_of(&MsgHeader { kind, record_bytes, arena_bytes, session }).to_vec()
    }

    #[test]
    fn whatever_bytes_a_slot_holds_decode_gives_a_value_or_an_error() {
        // A corrupt or hostile worker's slots: never a panic, never a read past the slot.
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut rnd = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let sizes = [size_of::<TickEvents>(), size_of::<OpEvents>(), size_of::<WorkerNotice>(), size_of::<QueueReset>()];
        let (mut ok, mut refused) = (0, 0);
        for n in 0..20_000 {
            let kind = [SF_MSG_EVENTS, SF_MSG_OP_EVENTS, SF_MSG_WORKER, SF_MSG_RESET][n % 4];
            let len = (rnd() % 1024) as usize;
            let mut slot = header(kind, sizes[n % 4] as u32, rnd() % 2048, if n % 8 < 4 { 0 } else { 7 });
            slot.extend((0..len).map(|_| rnd() as u8));
            if n % 3 == 0 && slot.len() >= 32 {
                slot[24..32].copy_from_slice(&(sizes[n % 4] as u64).to_le_bytes()); // a plausible struct_size
            }
            match decode(&slot, 7) {
                Ok(_) => ok += 1,
                Err(_) => refused += 1,
            }
        }
        assert!(ok > 0 && refused > 0, "ok {ok}, refused {refused}");
    }

    #[test]
    fn a_record_of_another_size_is_refused() {
        let mut slot = header(SF_MSG_WORKER, size_of::<WorkerNotice>() as u32 + 8, 0, 0);
        slot.resize(256, 0);
        assert!(matches!(decode(&slot, 1), Err(Error::Bounds(_))));
        let mut slot = header(SF_MSG_WORKER, size_of::<WorkerNotice>() as u32, 0, 0);
        slot.extend((size_of::<WorkerNotice>() as u64 + 8).to_le_bytes()); // struct_size
        slot.resize(256, 0);
        assert!(matches!(decode(&slot, 1), Err(Error::Bounds(m)) if m.contains("struct_size")));
        slot[24..32].copy_from_slice(&(size_of::<WorkerNotice>() as u64).to_le_bytes());
        assert!(matches!(decode(&slot, 1), Ok(Some(Message::Worker(_)))));
    }
}
