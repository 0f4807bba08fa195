//! `superfluid-bench --name NAME [--worker I] [--n N] [--warmup N] [--timeout S]`:
//! N empty ticks (a TickPlan with no lists) through a live worker, timed
//! around `Connection::tick`, printed as one JSON line:
//! {"p50_ns", "p99_ns", "mean_ns", "worker_wall_p50_ns", "n"}; worker_wall
//! is TickTimings.wall_ns of each tick's events (the worker's own tick).
use std::time::{Duration, Instant};
use superfluid::abi::SF_STATUS_OK;
use superfluid::{Connection, Plan};

fn usage(msg: &str) -> ! {
    eprintln!("superfluid-bench: {msg}\nusage: superfluid-bench --name NAME [--worker I] [--n N] [--warmup N] [--timeout S]");
    std::process::exit(2)
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
            wall.push(ev.timings.wall_ns);
        }
    }
    let mean = lat.iter().sum::<u64>() / lat.len() as u64;
    lat.sort_unstable();
    wall.sort_unstable();
    println!(
        "{{\"p50_ns\": {}, \"p99_ns\": {}, \"mean_ns\": {}, \"worker_wall_p50_ns\": {}, \"n\": {}}}",
        pct(&lat, 50.0), pct(&lat, 99.0), mean, pct(&wall, 50.0), lat.len()
    );
}
