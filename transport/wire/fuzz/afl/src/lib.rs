//! The AFL++ drivers' one loop: a target's one-input body
//! ([`Target::check`], the same one the stable-toolchain mutation drivers'
//! corpus replay runs) under `afl::fuzz!`. A failed oracle panics, which
//! AFL++ records as a crash.
#![deny(unsafe_code)]

use std::panic::AssertUnwindSafe;

use starwire_wire_fuzz::driver::Target;

/// Fuzz `target` with the inputs AFL++ gives this process.
pub fn run<T: Target>(target: T) {
    // A panic aborts the process (AFL++'s crash); the target is never seen
    // again after one, so its state cannot be half-updated.
    let mut t = AssertUnwindSafe(target);
    afl::fuzz!(|data: &[u8]| {
        if let Err(e) = t.check(data) {
            panic!("{}: {e}", T::SPEC.name);
        }
    });
}
