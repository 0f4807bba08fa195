// A live `superfluid serve` for the tests, and the Python reference
// planner on the same daemon. SUPERFLUID_PYTHON names the interpreter (the
// pytest wrapper sets it); without it a test says so and checks nothing.
#![allow(dead_code)]
use serde_json::Value;
use std::process::{Child, Command};
use std::time::Duration;
use superfluid::Connection;

pub struct Daemon(pub Child, pub String);

extern "C" {
    pub fn kill(pid: i32, sig: i32) -> i32;
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SIGTERM: the daemon drains and removes its segments.
        unsafe { kill(self.0.id() as i32, 15) };
        let _ = self.0.wait();
    }
}

pub fn python() -> Option<String> {
    let py = std::env::var("SUPERFLUID_PYTHON").ok();
    if py.is_none() {
        eprintln!("SUPERFLUID_PYTHON is not set: no daemon to test against (run through pytest)");
    }
    py
}

/// `superfluid serve --name NAME ARGS...` (the tiny model unless --fake).
pub fn serve(py: &str, name: &str, args: &[&str]) -> Daemon {
    let child = Command::new(py)
        .args(["-P", "-m", "superfluid", "serve", "--name", name, "--log-level", "WARNING", "--restart-backoff", "0.05"])
        .args(args)
        .spawn()
        .expect("superfluid serve");
    Daemon(child, name.into())
}

/// Connect waits for the segment the daemon is still making.
pub fn connect(name: &str) -> Connection {
    Connection::connect(name, 0, Duration::from_secs(120)).unwrap_or_else(|e| panic!("connect: {e}"))
}

/// The Python reference planner's results for `workload` on daemon `name`.
pub fn python_plan(py: &str, name: &str, workload: &Value) -> Value {
    let path = std::env::temp_dir().join(format!("sf-workload-{name}-{}.json", std::process::id()));
    std::fs::write(&path, workload.to_string()).unwrap();
    let out = Command::new(py)
        .args(["-P", "-m", "superfluid", "plan", "--name", name, "--timeout", "300"])
        .arg(&path)
        .output()
        .expect("superfluid plan");
    let _ = std::fs::remove_file(&path);
    assert!(out.status.success(), "superfluid plan: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("superfluid plan prints JSON")
}

/// The Rust reference planner's results for `workload` on daemon `name`.
pub fn rust_plan(name: &str, workload: &Value) -> Value {
    let w = superfluid::workload::Workload::parse(&workload.to_string()).unwrap();
    superfluid::workload::run(connect(name), &w, Duration::from_secs(300)).unwrap()
}

/// Each request's tokens and finish, in request order.
pub fn outcomes(results: &Value) -> Vec<(Vec<u64>, String)> {
    results["results"].as_array().unwrap().iter().map(|r| {
        let toks = r["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
        (toks, r["finish"].as_str().unwrap_or("").to_string())
    }).collect()
}
