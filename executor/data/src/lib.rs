//! Training data for starwire: the Criteo click-log format, a synthetic
//! generator of Criteo-like data with known true weights, evaluation metrics
//! and a single-process reference logistic regression.
//!
//! * [`Batch`]: examples as flat row-major vectors (labels, 13 transformed
//!   numeric features, 26 categorical keys), reused across calls.
//! * [`feature_hash`]: categorical value -> 64-bit key, `xxh3_64` seeded per
//!   field (`(field + 1) * 0x9E3779B97F4A7C15`); never 0, which means
//!   missing. See [`hash`].
//! * [`CriteoReader`]: the Criteo TSV format, `label \t I1..I13 \t C1..C26`,
//!   empty columns missing, integer counts `x` transformed to `ln(1 + x)`
//!   (`-ln(1 - x)` when negative, [`transform_count`]), categorical strings
//!   hashed by [`feature_hash`] with their field index (`C1` = 0). Bad lines
//!   are typed errors or skipped and counted; `W` workers split a file by
//!   line index modulo `W`. See [`criteo`].
//! * [`Synthetic`]: the default training data set: Zipf-distributed ids
//!   (exponent 1.1 over 10^5 ids per field) rendered as 8-hex-digit strings,
//!   log-normal counts, labels from a logistic model whose weights are known
//!   ([`TrueModel`]), bias calibrated to a 25% click rate. Deterministic per
//!   seed and per example index, dealt to workers a block of indices at a
//!   time ([`Deal`]), writable as a
//!   Criteo file that reads back to the same batches. See [`synthetic`].
//! * [`auc`], [`logloss`]: exact, tie-aware AUC and clipped log loss.
//! * [`BatchSource`]: the reader and the generator behind one trait.
//! * [`ConvergedLr`]: L2 logistic regression fitted to convergence with
//!   L-BFGS, its strength chosen on a validation split. See [`converged`].
//! * [`reference::ReferenceLr`]: the single-process logistic regression
//!   (SGD or Adagrad) the distributed trainer is compared with.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod batch;
pub mod converged;
pub mod criteo;
pub mod deal;
pub mod files;
pub mod hash;
pub mod metrics;
pub mod reference;
pub mod source;
pub mod synthetic;

pub use batch::{transform_count, Batch, NUM_CATEGORICAL, NUM_NUMERIC};
pub use converged::{ConvergedError, ConvergedLr, ConvergedOptions, ConvergedReport, FitStatus};
pub use criteo::{
    BadLineReason, CriteoReader, DataError, ReaderCounters, ReaderOptions, CRITEO_COLUMNS,
};
pub use deal::Deal;
pub use files::CriteoFiles;
pub use hash::{feature_hash, MISSING_KEY};
pub use metrics::{auc, logloss};
pub use reference::{Optimizer, ReferenceLr};
pub use source::BatchSource;
pub use synthetic::{write_criteo, RawExample, Stream, Synthetic, SyntheticSpec, TrueModel};
