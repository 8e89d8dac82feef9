//! A shard's incremental checkpoints during the run
//! (`--delta-every-steps N`): at every global step that is a multiple of
//! `N` and not a full checkpoint's, the shard writes
//! `DIR/deltas/C/shard-NNNN.delta`, the rows touched since its last full
//! checkpoint (format: docs/CHECKPOINT.md). Deltas are cumulative, so each
//! one replaces the shard's previous delta file.

use std::path::{Path, PathBuf};

use starwire_ps::delta::TouchedRows;
use starwire_ps::{write_atomic, PsShard};

/// The delta file of shard `i` at global step `c` inside `dir`.
pub fn delta_file(dir: &Path, c: u64, i: usize) -> PathBuf {
    dir.join("deltas")
        .join(c.to_string())
        .join(format!("shard-{i:04}.delta"))
}

/// What a shard keeps for its deltas.
#[derive(Debug)]
pub struct DeltaExport {
    every: u64,
    touched: TouchedRows,
    /// The global step of the shard's last full checkpoint (written or
    /// restored): the base of its deltas.
    base: u64,
    last: Option<PathBuf>,
}

impl DeltaExport {
    /// A delta every `every` global steps against the full checkpoint at
    /// global step `base`.
    pub fn new(every: u64, base: u64, shard: &PsShard) -> Self {
        Self {
            every,
            touched: TouchedRows::new(shard.config().limits),
            base,
            last: None,
        }
    }

    /// A pull `shard` was given ([`TouchedRows::record_pull`]).
    pub fn record_pull(&mut self, shard: &PsShard, body: &[u8]) {
        self.touched.record_pull(shard, body);
    }

    /// A push `shard` was given and applied or refused
    /// ([`TouchedRows::record_push`]).
    pub fn record_push(&mut self, shard: &PsShard, body: &[u8]) {
        self.touched.record_push(shard, body);
    }

    /// A full checkpoint of the shard at `step` was written: the new base.
    pub fn full_written(&mut self, step: u64) {
        self.touched.clear();
        self.base = step;
    }

    /// Whether global step `step` takes a delta.
    pub fn is_delta_step(&self, step: u64) -> bool {
        self.every > 0 && step > self.base && step % self.every == 0
    }

    /// Write shard `index`'s delta at its global step into `dir`, and
    /// remove its previous one.
    pub fn write(&mut self, shard: &PsShard, index: usize, dir: &Path) -> Result<(), String> {
        let path = delta_file(dir, shard.global_step(), index);
        if let Some(parent) = path.parent() {
            starwire_ps::create_dir_durable(parent)
                .map_err(|e| format!("{}: {e}", parent.display()))?;
        }
        write_atomic(&path, |w| shard.save_delta(self.base, &self.touched, w))
            .map_err(|e| format!("{}: {e}", path.display()))?;
        if let Some(old) = self.last.replace(path) {
            let _ = std::fs::remove_file(&old);
            // The step's directory goes once every shard's file is gone.
            if let Some(d) = old.parent() {
                let _ = std::fs::remove_dir(d);
            }
        }
        Ok(())
    }
}
