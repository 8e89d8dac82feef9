//! The hashing of the keys peers send.
//!
//! A key is whatever id a worker puts in a pull or push, so an unkeyed
//! hash lets a peer choose keys that all land in one probe sequence: with
//! FxHash (one multiply and a rotation), keys of the form
//! `(i << 12) * K^-1` share their home slot in every table up to 2^38
//! entries, and a pull of 64K of them held a reactor for seconds, for
//! every connection on it, and left the cluster in the table for every
//! later probe. So every map keyed by peer keys takes a hasher with a
//! random seed of its own: foldhash's `RandomState`, the default of
//! `hashbrown`, about as cheap as FxHash for one `u64` (a folded 64x64
//! multiply). Nothing the PS writes depends on the maps' order
//! (checkpoints sort their keys), so the seeds change no output.

use std::collections::{HashMap, HashSet};

/// A hasher builder with a seed of its own, drawn when it is made.
pub(crate) type KeyState = foldhash::fast::RandomState;

/// A map keyed by peer keys.
pub(crate) type KeyMapOf<V> = HashMap<u64, V, KeyState>;

/// A set of peer keys.
pub(crate) type KeySet = HashSet<u64, KeyState>;
