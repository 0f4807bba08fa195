//! `superfluid-bench --name NAME [--worker I] [--n N] [--warmup N] [--timeout S]`:
//! N empty ticks (a TickPlan with no lists) through a live worker, timed
//! around `Connection::tick`, printed as one JSON line:
//! {"p50_ns", "p99_ns", "mean_ns", "worker_wall_p50_ns", "n", "wall_samples"}.
//! worker_wall is TickTimings.wall_ns of each tick's events: `Events` does
//! not carry it in every version of the crate, so it is read from the event
//! slot the connection just released (read only; the worker rewrites that
//! slot only n_slots messages later).
use std::fs::OpenOptions;
use std::os::unix::io::AsRawFd;
use std::time::{Duration, Instant};
use superfluid::abi::*;
use superfluid::{Connection, Plan};

extern "C" {
    fn mmap(addr: *mut u8, len: usize, prot: i32, flags: i32, fd: i32, off: i64) -> *mut u8;
}
const PROT_READ: i32 = 0x1;
const MAP_SHARED: i32 = 0x01;

fn usage(msg: &str) -> ! {
    eprintln!("superfluid-bench: {msg}\nusage: superfluid-bench --name NAME [--worker I] [--n N] [--warmup N] [--timeout S]");
    std::process::exit(2)
}

/// The event queue of the segment, mapped read-only a second time.
struct EventSlots {
    q: *const Queue,
    slots: *const u8,
    n_slots: u64,
    slot_bytes: usize,
}

impl EventSlots {
    fn open(name: &str, worker: u32) -> Result<EventSlots, String> {
        let dir = std::env::var("SUPERFLUID_SHM_DIR").unwrap_or_else(|_| "/dev/shm".into());
        let path = format!("{dir}/superfluid.{name}.{worker}");
        let f = OpenOptions::new().read(true).open(&path).map_err(|e| format!("{path}: {e}"))?;
        let len = f.metadata().map_err(|e| format!("{path}: {e}"))?.len() as usize;
        let base = unsafe { mmap(core::ptr::null_mut(), len, PROT_READ, MAP_SHARED, f.as_raw_fd(), 0) };
        if base as isize == -1 || len < core::mem::size_of::<SegmentHeader>() {
            return Err(format!("{path}: cannot map it"));
        }
        let h = base as *const SegmentHeader;
        let at = unsafe { (*h).layout.event_queue } as usize;
        if at + core::mem::size_of::<Queue>() > len {
            return Err(format!("{path}: the event queue is outside the segment"));
        }
        let q = unsafe { base.add(at) } as *const Queue;
        let (n_slots, slot_bytes) = unsafe { ((*q).n_slots as u64, (*q).slot_bytes as usize) };
        let slots_at = at + core::mem::size_of::<Queue>();
        if n_slots == 0 || !n_slots.is_power_of_two() || slots_at + n_slots as usize * slot_bytes > len {
            return Err(format!("{path}: event queue geometry {n_slots} x {slot_bytes} does not fit"));
        }
        Ok(EventSlots { q, slots: unsafe { base.add(slots_at) }, n_slots, slot_bytes })
    }

    /// wall_ns of the last message read off the queue, if it is the events of `seq`.
    fn last_wall_ns(&self, seq: u64) -> Option<u64> {
        let tail = unsafe { core::ptr::read_volatile(&(*self.q).tail) };
        let i = (tail.wrapping_sub(1) & (self.n_slots - 1)) as usize;
        let slot = unsafe { self.slots.add(i * self.slot_bytes) };
        let h: MsgHeader = unsafe { core::ptr::read_unaligned(slot as *const MsgHeader) };
        if h.kind != SF_MSG_EVENTS || h.record_bytes as usize != core::mem::size_of::<TickEvents>() {
            return None;
        }
        let e: TickEvents = unsafe { core::ptr::read_unaligned(slot.add(core::mem::size_of::<MsgHeader>()) as *const TickEvents) };
        (e.plan_seq == seq).then_some(e.timings.wall_ns)
    }
}

fn pct(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((q / 100.0 * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut name, mut worker, mut n, mut warmup, mut timeout) = (None, 0u32, 20_000usize, 2_000usize, 30.0f64);
    while let Some(a) = args.next() {
        let mut val = |what: &str| args.next().unwrap_or_else(|| usage(&format!("{what} needs a value")));
        match a.as_str() {
            "--name" => name = Some(val("--name")),
            "--worker" => worker = val("--worker").parse().unwrap_or_else(|_| usage("--worker: an index")),
            "--n" => n = val("--n").parse().unwrap_or_else(|_| usage("--n: a count")),
            "--warmup" => warmup = val("--warmup").parse().unwrap_or_else(|_| usage("--warmup: a count")),
            "--timeout" => timeout = val("--timeout").parse().unwrap_or_else(|_| usage("--timeout: seconds")),
            "-h" | "--help" => usage("empty ticks through a live worker"),
            _ => usage(&format!("unexpected argument {a:?}")),
        }
    }
    let name = name.unwrap_or_else(|| usage("--name is needed"));
    if n == 0 {
        usage("--n: at least 1");
    }
    let t = Duration::from_secs_f64(timeout);
    let mut conn = Connection::connect(&name, worker, t).unwrap_or_else(|e| {
        eprintln!("superfluid-bench: connect {name}/{worker}: {e:?}");
        std::process::exit(1)
    });
    let slots = EventSlots::open(&name, worker).unwrap_or_else(|e| {
        eprintln!("superfluid-bench: {e}");
        std::process::exit(1)
    });
    let plan = Plan::new(0);
    let mut lat = Vec::with_capacity(n);
    let mut wall = Vec::with_capacity(n);
    for k in 0..warmup + n {
        let t0 = Instant::now();
        let ev = conn.tick(&plan, t).unwrap_or_else(|e| {
            eprintln!("superfluid-bench: tick: {e:?}");
            std::process::exit(1)
        });
        let dt = t0.elapsed().as_nanos() as u64;
        if ev.status != SF_STATUS_OK {
            eprintln!("superfluid-bench: plan {} answered status {}", ev.plan_seq, ev.status);
            std::process::exit(1);
        }
        if k >= warmup {
            lat.push(dt);
            if let Some(w) = slots.last_wall_ns(ev.plan_seq) {
                wall.push(w);
            }
        }
    }
    let mean = lat.iter().sum::<u64>() / lat.len() as u64;
    lat.sort_unstable();
    wall.sort_unstable();
    println!(
        "{{\"p50_ns\": {}, \"p99_ns\": {}, \"mean_ns\": {}, \"worker_wall_p50_ns\": {}, \"n\": {}, \"wall_samples\": {}}}",
        pct(&lat, 50.0), pct(&lat, 99.0), mean, pct(&wall, 50.0), lat.len(), wall.len()
    );
}
