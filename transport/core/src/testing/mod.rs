//! Backends for tests: an in-memory pair and a fault-injecting wrapper;
//! and the park/wake stress reactor tests share.

mod fault;
mod mem;
mod wake;

pub use fault::{FaultSpec, FaultSpecError, FaultStats, Faulty};
pub use mem::MemTransport;
pub use wake::{assert_all_in_producer_order, push_and_wake};
