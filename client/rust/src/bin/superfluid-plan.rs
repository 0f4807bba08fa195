//! `superfluid-plan WORKLOAD [--name NAME] [--worker I] [--timeout S]`: the
//! Rust reference planner on a workload (client/workload.py's format),
//! printing the results JSON `superfluid plan` prints.
use std::time::Duration;
use superfluid::workload::{run, Workload};
use superfluid::Connection;

fn usage(msg: &str) -> ! {
    eprintln!("superfluid-plan: {msg}\nusage: superfluid-plan WORKLOAD [--name NAME] [--worker I] [--timeout S]");
    std::process::exit(2)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut path, mut name, mut worker, mut timeout) = (None, "superfluid".to_string(), 0u32, 300.0f64);
    while let Some(a) = args.next() {
        let mut val = |what: &str| args.next().unwrap_or_else(|| usage(&format!("{what} needs a value")));
        match a.as_str() {
            "--name" => name = val("--name"),
            "--worker" => worker = val("--worker").parse().unwrap_or_else(|_| usage("--worker: an index")),
            "--timeout" => timeout = val("--timeout").parse().unwrap_or_else(|_| usage("--timeout: seconds")),
            "-h" | "--help" => usage("run a workload through the reference planner"),
            _ if path.is_none() => path = Some(a),
            _ => usage(&format!("unexpected argument {a:?}")),
        }
    }
    let path = path.unwrap_or_else(|| usage("a WORKLOAD file is needed ('-': stdin)"));
    let text = if path == "-" {
        std::io::read_to_string(std::io::stdin()).unwrap_or_else(|e| usage(&format!("stdin: {e}")))
    } else {
        std::fs::read_to_string(&path).unwrap_or_else(|e| usage(&format!("{path}: {e}")))
    };
    let w = Workload::parse(&text).unwrap_or_else(|e| usage(&format!("{path}: {e}")));
    if let Err(e) = w.specs() {
        usage(&format!("{path}: {e}"));
    }
    let t = Duration::from_secs_f64(timeout);
    let conn = Connection::connect(&name, worker, t).unwrap_or_else(|e| {
        eprintln!("superfluid-plan: connect to {name}/{worker}: {e}");
        std::process::exit(1)
    });
    match run(conn, &w, t) {
        Ok(v) => println!("{v}"),
        Err(e) => {
            eprintln!("superfluid-plan: {e}");
            std::process::exit(1)
        }
    }
}
