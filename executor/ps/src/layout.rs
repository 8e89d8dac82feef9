//! A shard file read without the model that wrote it, for `starwire
//! checkpoint`: its [`ShardLayout`] (header, each variable's kind, width
//! and row count, each worker's applied steps), and an empty shard of that
//! layout, which [`PsShard::restore`] fills and
//! [`PsShard::apply_delta`] brings to a delta's step.

use crate::applied::Position;
use crate::checkpoint::{checked_body, read_applied, Cursor, VAR_DENSE, VAR_TABLE};
use crate::error::CheckpointError;
use crate::optim::{OptimizerConfig, OptimizerKind};
use crate::shard::{PsShard, ShardConfig};
use crate::var::{Init, VarDef, VarKind};

/// One variable of a shard file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VarLayout {
    /// Its id.
    pub id: u32,
    /// An embedding table (else a dense variable).
    pub embedding: bool,
    /// Element count (dense) or row width (embedding).
    pub width: usize,
    /// Rows this shard holds (0 for a dense variable).
    pub rows: u64,
    /// Pending frequency-filter counters (0 for a dense variable).
    pub pending: u64,
}

/// What a shard file holds, read from its bytes alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardLayout {
    /// Its format version.
    pub version: u32,
    /// The shard.
    pub shard_index: u64,
    /// Its global step.
    pub global_step: u64,
    /// The job's seed.
    pub seed: u64,
    /// The optimizer whose slots it holds.
    pub optimizer: OptimizerKind,
    /// Its variables, by increasing id.
    pub vars: Vec<VarLayout>,
    /// Each worker's pushes applied, by task index (none in version 1).
    pub workers: Vec<(u32, Position)>,
}

fn optimizer_of(code: u8) -> Option<OptimizerKind> {
    OptimizerKind::ALL
        .iter()
        .map(|&(_, k)| k)
        .find(|&k| crate::checkpoint::opt_code(k) == code)
}

impl ShardLayout {
    /// Check a whole shard file (magic, version, CRC) and read its layout.
    pub fn parse(data: &[u8]) -> Result<Self, CheckpointError> {
        let (version, body) = checked_body(data)?;
        let mut c = Cursor::new(body, 12);
        c.zeros(4, "header")?;
        let shard_index = c.u64("shard index")?;
        let global_step = c.u64("global step")?;
        let seed = c.u64("seed")?;
        let code = c.u8("optimizer")?;
        let optimizer = optimizer_of(code)
            .ok_or_else(|| CheckpointError::Corrupt(format!("optimizer code {code}")))?;
        c.zeros(3, "header")?;
        let n_vars = c.u32("variable count")?;
        let mut vars = Vec::new();
        for _ in 0..n_vars {
            let id = c.u32("variable id")?;
            let kind = c.u8("variable kind")?;
            c.zeros(3, "variable header")?;
            let width = c.u32("variable width")? as usize;
            let slots = c.u32("slot count")? as usize;
            if slots != optimizer.slots() {
                return Err(CheckpointError::Corrupt(format!(
                    "variable {id}: {slots} slots for {} optimizer slots",
                    optimizer.slots()
                )));
            }
            let floats = width.saturating_mul(1 + slots);
            let mut v = VarLayout {
                id,
                embedding: kind == VAR_TABLE,
                width,
                rows: 0,
                pending: 0,
            };
            match kind {
                VAR_DENSE => {
                    c.u64("dense updates")?;
                    let n = c.fits(floats as u64, 4, "dense values")?;
                    c.bytes(4 * n, "dense values")?;
                }
                VAR_TABLE => {
                    c.bytes(40, "table counters")?;
                    v.rows = c.u64("row count")?;
                    v.pending = c.u64("pending count")?;
                    let row = 24usize.saturating_add(floats.saturating_mul(4));
                    let n = c.fits(v.rows, row, "rows")?;
                    c.bytes(n * row, "rows")?;
                    let n = c.fits(v.pending, 24, "pending counters")?;
                    c.bytes(n * 24, "pending counters")?;
                }
                k => return Err(CheckpointError::Corrupt(format!("variable {id}: kind {k}"))),
            }
            if vars.last().is_some_and(|p: &VarLayout| p.id >= id) {
                return Err(CheckpointError::Corrupt(
                    "variable ids not strictly increasing".into(),
                ));
            }
            vars.push(v);
        }
        let workers = match version {
            crate::checkpoint::FORMAT_VERSION_1 => Vec::new(),
            _ => read_applied(&mut c)?.applied().collect(),
        };
        if c.left() != 0 {
            return Err(CheckpointError::Corrupt(format!(
                "{} bytes after the last record",
                c.left()
            )));
        }
        Ok(Self {
            version,
            shard_index,
            global_step,
            seed,
            optimizer,
            vars,
            workers,
        })
    }

    /// An empty shard of this layout: restoring the file it was read
    /// from fills it (its variables' initial values are not the model's;
    /// the file's replace them all).
    pub fn shard(&self) -> Result<PsShard, CheckpointError> {
        let index = usize::try_from(self.shard_index)
            .map_err(|_| CheckpointError::Corrupt("shard index".into()))?;
        let defs: Vec<VarDef> = self
            .vars
            .iter()
            .map(|v| VarDef {
                id: v.id,
                name: format!("var{}", v.id),
                kind: if v.embedding {
                    VarKind::Embedding { dim: v.width }
                } else {
                    VarKind::Dense {
                        shape: vec![v.width],
                    }
                },
                init: Init::Zeros,
            })
            .collect();
        let cfg = ShardConfig {
            seed: self.seed,
            optimizer: OptimizerConfig::with_kind(self.optimizer, 0.0),
            // No default value matrix: no row is ever created from it.
            default_value_dim: 0,
            ..ShardConfig::default()
        };
        Ok(PsShard::new(index, &defs, cfg))
    }
}
