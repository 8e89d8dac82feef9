//! Backends for tests: an in-memory pair and a fault-injecting wrapper.

mod fault;
mod mem;

pub use fault::{FaultSpec, FaultSpecError, FaultStats, Faulty};
pub use mem::MemTransport;
