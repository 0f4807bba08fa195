//! The planner's side of a superfluid worker, from Rust: the records and
//! functions of `abi/superfluid.h` (`abi`, generated), a connection that
//! follows the header's session protocol (`Connection`), typed ops (fault
//! schedules among them: `FaultRule`), and the reference planner (`Planner`,
//! as client/planner.py; its grammars as client/grammars.py, its speculation
//! strategy as client/strategies.py).
pub mod abi;
mod absorb;
mod connection;
mod events;
mod faults;
mod grammars;
mod ops;
mod plan;
mod planner;
mod seeds;
mod strategies;
pub mod workload;

pub use connection::{Connection, SpinBudget, SPIN_NS};

/// The SF_ABI_VERSION this crate was written for. sf_segment_check compares a
/// segment with the header it was compiled with, not with this code: a build
/// against a header of another version fails here instead of at a plan.
pub const ABI_VERSION: u32 = 2;
const _: () = assert!(abi::SF_ABI_VERSION == ABI_VERSION, "written for another SF_ABI_VERSION: port it to abi/superfluid.h");
pub use events::{Completion, Error, Events, Message, Shed};
pub use faults::{FaultListing, FaultRule, ListedRule, Phase, Trigger, What, When};
pub use grammars::{Grammar, GrammarBook};
pub use ops::{Describe, HeldLane, Parallel, RuntimeInfo, Seed};
pub use plan::{params, Admit, LogitsRow, Plan};
pub use planner::{Finish, HostSampler, Options, Planner, Request, RequestSpec, Stats};
pub use seeds::SeedBook;
pub use strategies::{Strategy, StrategyBook};

/// The header's names of its constants (from sf_ring.c, as in every language).
pub mod names {
    use crate::abi;

    fn s(p: *mut u8) -> &'static str {
        // sf_ring.c returns static NUL-terminated ASCII.
        unsafe { core::ffi::CStr::from_ptr(p as *const core::ffi::c_char) }.to_str().unwrap_or("unknown")
    }
    pub fn status(v: u32) -> &'static str {
        s(unsafe { abi::sf_status_name(v) })
    }
    pub fn op_status(v: u32) -> &'static str {
        s(unsafe { abi::sf_opst_name(v) })
    }
    pub fn worker_state(v: u32) -> &'static str {
        s(unsafe { abi::sf_worker_state_name(v) })
    }
    pub fn op(v: u32) -> &'static str {
        s(unsafe { abi::sf_op_name(v) })
    }

    /// SF_FAULT_* codes and their names (sf_ring.c has no function for them).
    const FAULTS: [(u32, &str); 6] = [
        (abi::SF_FAULT_OOM_TENTATIVE, "OOM_TENTATIVE"),
        (abi::SF_FAULT_INTERNAL, "INTERNAL"),
        (abi::SF_FAULT_GRAMMAR_OVERFLOW, "GRAMMAR_OVERFLOW"),
        (abi::SF_FAULT_REF_SPAN_OOB, "REF_SPAN_OOB"),
        (abi::SF_FAULT_INJECTED, "INJECTED"),
        (abi::SF_FAULT_NUMERIC, "NUMERIC"),
    ];
    pub fn fault(v: u32) -> &'static str {
        FAULTS.iter().find(|f| f.0 == v).map_or("unknown", |f| f.1)
    }
    /// The code of a fault's name, any case ("numeric": SF_FAULT_NUMERIC).
    pub fn fault_code(name: &str) -> Option<u32> {
        FAULTS.iter().find(|f| f.1.eq_ignore_ascii_case(name)).map(|f| f.0)
    }
}
