//! M:N lock-free queue between application threads and reactor (network)
//! threads, used in both directions (requests out, completions back).
//!
//! # Design
//!
//! **Grid of SPSC rings.** Following PS-Plus, an M x N queue is not one shared
//! MPMC structure but a grid of M x N single-producer/single-consumer rings,
//! one per (producer thread, consumer reactor) pair ([`grid`]). A
//! [`Producer`] owns the producing end of its N rings and picks the target
//! consumer per item ([`Producer::push_to`]); a [`Consumer`] owns the consuming
//! end of the M rings destined to it and drains them round-robin
//! ([`Consumer::pop`], [`Consumer::drain`]). No ring ever has two writers of
//! the same index, so there are no CAS loops and no contention between
//! producers; handles are `Send` but neither `Clone` nor `Sync`.
//!
//! **SPSC ring** ([`spsc`]). Bounded, power-of-two capacity, free-running
//! `usize` indices masked into the buffer (no modulo). `head` (written by the
//! consumer) and `tail` (written by the producer) each sit in their own
//! [`CachePadded`](crossbeam_utils::CachePadded) line. Each handle keeps a
//! private copy of its own index plus a *cached copy of the peer's index*:
//! the producer only reloads `head` when its cached value says the ring is
//! full, the consumer only reloads `tail` when its cached value says it is
//! empty (or holds less than the batch wants). In steady state each side thus
//! touches the peer's cache line once per lap or per batch rather than once
//! per item. Publication is a Release store of the own index, matched by an
//! Acquire load on the other side. Batch operations
//! ([`SpscProducer::push_batch`], [`SpscConsumer::drain`]) write/read many
//! slots and publish them with a single store. A full ring hands the item
//! back (`Err(item)`); batch pushes never pull an item they cannot store.
//! Dropping the last handle drops the undelivered items.
//!
//! **Eventcount parking.** Reactors poll, then park when idle
//! ([`Consumer::park`], [`Consumer::park_timeout`]). Each consumer has a
//! `sleeping` flag plus a mutex-protected `notified` flag and a condvar.
//!
//! * consumer: `sleeping = true; fence(SeqCst);` re-check all its rings; if
//!   still empty, lock, wait until `notified`, clear it, `sleeping = false`.
//! * producer, after publishing the tail: `fence(SeqCst);` load `sleeping`;
//!   only if set: lock, `notified = true`, notify the condvar.
//!
//! *Why no wakeup is lost:* SeqCst fences are totally ordered. If the
//! producer's fence comes first, the consumer's re-check (after its own fence)
//! must see the published tail and it does not sleep. If the consumer's fence
//! comes first, the producer's load after its fence must see
//! `sleeping == true`, so it sets `notified` under the mutex; the consumer
//! checks `notified` under that same mutex before every wait, so it either
//! sees it or is already waiting and gets the condvar notification. When
//! nobody sleeps the producer's cost is one fence and one load of a
//! read-mostly line (per item for [`Producer::push_to`], per batch for
//! [`Producer::push_batch_to`]). Wakeups may be spurious; callers re-poll.
//!
//! **Verification.** All atomics, `UnsafeCell`s, mutexes and condvars come
//! from a private `sync` module that switches to `loom` under `--cfg loom`;
//! `tests/loom.rs` model-checks ordering, wrap-around, full-ring hand-back,
//! batches and the park/wake path.

#![deny(unsafe_code)]
#![warn(unsafe_op_in_unsafe_fn)]

mod grid;
// The ring's slots are `UnsafeCell<MaybeUninit<T>>`: its `unsafe` stays here.
#[allow(unsafe_code)]
mod spsc;
mod sync;

pub use grid::{grid, grid_polling, Consumer, Producer};
pub use spsc::{spsc, SpscConsumer, SpscProducer};
