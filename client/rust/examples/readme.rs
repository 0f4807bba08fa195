// Two requests through the Rust reference planner: connect, describe, run, print.
use std::time::Duration;
use superfluid::{abi, params, Connection, Options, Planner, RequestSpec};

fn main() -> Result<(), superfluid::Error> {
    let name = std::env::args().nth(1).unwrap_or_else(|| "superfluid".into());
    let conn = Connection::connect(&name, 0, Duration::from_secs(30))?;
    let mut planner = Planner::new(conn, Options::default())?;
    let d = planner.conn.describe(Duration::from_secs(10))?;
    println!("{} (vocab {}), eos {:?}", d.runtime.runtime_id, d.runtime.vocab_size, d.eos);
    let greedy = planner.submit(RequestSpec::new(vec![5, 6, 7, 8, 9], 12))?;
    let mut spec = RequestSpec::new(vec![1, 2, 3], 8);
    (spec.sampling, spec.params, spec.rng_base) = (abi::SF_SAMPLING_GPU_SAMPLE, params(0.8), 42);
    let sampled = planner.submit(spec)?;
    planner.run_until_done(Duration::from_secs(60))?;
    for id in [greedy, sampled] {
        let r = planner.request(id);
        println!("request {id}: {:?} ({})", r.generated, r.finish.map_or("running", |f| f.as_str()));
    }
    Ok(())
}
