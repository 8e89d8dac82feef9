//! [`Defaults`]: a table's default value matrix (DeepRec's
//! `default_value_dim` rows of initial values), made once per process for
//! all of the table's shards.
//!
//! The matrix depends only on the variable, the seed and its shape, so
//! every shard of one table holds the same values. A local cluster runs
//! all the shards in one process: sharing the matrix computes it once and
//! keeps one copy in the caches the pulls that create rows read it
//! through (a megabyte per table at the issue-6 width), rather than one
//! per shard.

use std::sync::{Arc, Mutex, PoisonError, Weak};

use crate::var::{Init, VarDef};

/// The default value matrix of a table, computed whole when the table is
/// made, so creating a row on a pull is one copy with no check or
/// initialiser run.
#[derive(Debug)]
pub(super) struct Defaults {
    values: Box<[f32]>,
    rows: u64,
    dim: usize,
}

/// What a matrix is made from: two tables with the same [`Shape`] have
/// the same matrix.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Shape {
    var: u32,
    init: Init,
    seed: u64,
    rows: usize,
    dim: usize,
}

/// The matrices of the tables alive in this process.
static MADE: Mutex<Vec<(Shape, Weak<Defaults>)>> = Mutex::new(Vec::new());

impl Defaults {
    fn new(def: &VarDef, seed: u64, rows: usize, dim: usize) -> Self {
        let mut values = vec![0.0; rows * dim].into_boxed_slice();
        for (i, row) in values.chunks_exact_mut(dim.max(1)).enumerate() {
            def.init_values(seed, i as u64, row);
        }
        Self {
            values,
            rows: rows as u64,
            dim,
        }
    }

    /// The matrix of `rows` rows of `dim` floats for the variable `def`
    /// and `seed`: the one a live table of this process already holds,
    /// or a new one. `None` when `rows` is 0 (no matrix).
    pub(super) fn shared(def: &VarDef, seed: u64, rows: usize, dim: usize) -> Option<Arc<Self>> {
        if rows == 0 {
            return None;
        }
        let shape = Shape {
            var: def.id,
            init: def.init,
            seed,
            rows,
            dim,
        };
        // Tables are made at start, not per request; a panic elsewhere
        // while the lock was held left the list whole.
        let mut made = MADE.lock().unwrap_or_else(PoisonError::into_inner);
        made.retain(|(_, m)| m.strong_count() > 0);
        if let Some(m) = made
            .iter()
            .find(|(s, _)| *s == shape)
            .and_then(|(_, m)| m.upgrade())
        {
            return Some(m);
        }
        // Made under the lock: another shard of the table waits for it
        // rather than computing it a second time.
        let m = Arc::new(Self::new(def, seed, rows, dim));
        made.push((shape, Arc::downgrade(&m)));
        Some(m)
    }

    /// The initial values of a new row for `key`.
    pub(super) fn row(&self, key: u64) -> &[f32] {
        let i = (key % self.rows) as usize;
        &self.values[i * self.dim..(i + 1) * self.dim]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::var::VarKind;

    fn def(id: u32, init: Init) -> VarDef {
        VarDef {
            id,
            name: format!("emb{id}"),
            kind: VarKind::Embedding { dim: 4 },
            init,
        }
    }

    #[test]
    fn tables_of_one_shape_share_a_matrix_and_others_do_not() {
        let u = Init::Uniform { scale: 0.1 };
        // Ids no other test of this process uses.
        let a = Defaults::shared(&def(90_001, u), 5, 8, 4).expect("rows");
        let b = Defaults::shared(&def(90_001, u), 5, 8, 4).expect("rows");
        assert!(Arc::ptr_eq(&a, &b));
        let mut want = vec![0.0; 4];
        def(90_001, u).init_values(5, 3, &mut want);
        assert_eq!(a.row(8 * 7 + 3), &want[..]);
        for other in [
            Defaults::shared(&def(90_002, u), 5, 8, 4),
            Defaults::shared(&def(90_001, Init::Normal { std: 0.1 }), 5, 8, 4),
            Defaults::shared(&def(90_001, u), 6, 8, 4),
            Defaults::shared(&def(90_001, u), 5, 16, 4),
        ] {
            assert!(!Arc::ptr_eq(&a, &other.expect("rows")));
        }
        assert!(Defaults::shared(&def(90_001, u), 5, 0, 4).is_none());
    }

    #[test]
    fn a_matrix_no_table_holds_is_made_again() {
        let d = def(90_003, Init::Uniform { scale: 0.2 });
        let first = Defaults::shared(&d, 1, 4, 4).expect("rows");
        let weak = Arc::downgrade(&first);
        drop(first);
        assert!(
            weak.upgrade().is_none(),
            "the list holds no strong reference"
        );
        let again = Defaults::shared(&d, 1, 4, 4).expect("rows");
        let mut want = vec![0.0; 4];
        d.init_values(1, 2, &mut want);
        assert_eq!(again.row(2), &want[..]);
    }
}
