//! How an epoch of the generator's examples is dealt to workers: in blocks
//! of `block` consecutive indices, block `j` to worker `j % workers`, like
//! `tf.data`'s `batch().shard()`.
//!
//! Asynchronous training deals a batch at a time (when every worker's
//! even share holds a batch): every worker's share is then whole batches
//! but for the one block that ends the epoch, so `W` workers take
//! `ceil(n / batch)` steps an epoch together, as one worker does. Dealt
//! one example at a time, each of the `W` shares would end on a partial
//! batch: with 64 workers and 400 000 examples in batches of 512, 832
//! steps instead of 782, the extra 50 carrying a fifth of a batch each.

use crate::criteo::DataError;

/// Worker `worker`'s share of `workers`, dealt `block` indices at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deal {
    worker: u64,
    workers: u64,
    block: u64,
}

impl Default for Deal {
    /// Everything, to one worker.
    fn default() -> Self {
        Self {
            worker: 0,
            workers: 1,
            block: 1,
        }
    }
}

impl Deal {
    /// Worker `worker` of `workers`, dealt `block` indices at a time.
    pub fn new(worker: usize, workers: usize, block: usize) -> Result<Self, DataError> {
        if workers == 0 {
            return Err(DataError::Options("workers must be at least 1"));
        }
        if worker >= workers {
            return Err(DataError::Options("worker must be below workers"));
        }
        if block == 0 {
            return Err(DataError::Options("the dealing block must be at least 1"));
        }
        Ok(Self {
            worker: worker as u64,
            workers: workers as u64,
            block: block as u64,
        })
    }

    /// This worker.
    pub fn worker(&self) -> usize {
        self.worker as usize
    }

    /// Workers sharing the data.
    pub fn workers(&self) -> usize {
        self.workers as usize
    }

    /// Indices dealt at a time.
    pub fn block(&self) -> usize {
        self.block as usize
    }

    /// True when index `i` is this worker's.
    pub fn owns(&self, i: u64) -> bool {
        (i / self.block) % self.workers == self.worker
    }

    /// This worker's first index.
    pub fn first(&self) -> u64 {
        self.worker.saturating_mul(self.block)
    }

    /// This worker's next index after its index `i`.
    pub fn next(&self, i: u64) -> u64 {
        let j = i.saturating_add(1);
        if j % self.block == 0 {
            j.saturating_add((self.workers - 1).saturating_mul(self.block))
        } else {
            j
        }
    }

    /// Indices of this worker's share of `0..n`.
    pub fn share(&self, n: u64) -> u64 {
        let (blocks, rest) = (n / self.block, n % self.block);
        let whole = blocks
            .checked_sub(self.worker)
            .map_or(0, |b| b.div_ceil(self.workers));
        let last = if rest > 0 && blocks % self.workers == self.worker {
            rest
        } else {
            0
        };
        whole * self.block + last
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The share by brute force: the indices `owns` accepts, and the
    /// walk from `first` by `next`.
    fn brute(d: &Deal, n: u64) -> (Vec<u64>, Vec<u64>) {
        let owned = (0..n).filter(|&i| d.owns(i)).collect();
        let mut walk = Vec::new();
        let mut i = d.first();
        while i < n {
            walk.push(i);
            i = d.next(i);
        }
        (owned, walk)
    }

    #[test]
    fn shares_partition_the_indices_and_agree_with_the_walk() {
        for workers in 1..6 {
            for block in 1..7 {
                for n in 0..80u64 {
                    let mut seen = vec![0u32; n as usize];
                    for w in 0..workers {
                        let d = Deal::new(w, workers, block).unwrap();
                        let (owned, walk) = brute(&d, n);
                        assert_eq!(owned, walk, "w {w} of {workers}, block {block}, n {n}");
                        assert_eq!(d.share(n), owned.len() as u64);
                        for i in owned {
                            seen[i as usize] += 1;
                        }
                    }
                    assert!(seen.iter().all(|&c| c == 1));
                }
            }
        }
    }

    #[test]
    fn dealt_a_batch_at_a_time_only_the_last_block_is_partial() {
        // The figure in the module docs: 64 workers, 400 000 examples,
        // batches of 512.
        let steps: u64 = (0..64)
            .map(|w| Deal::new(w, 64, 512).unwrap().share(400_000).div_ceil(512))
            .sum();
        assert_eq!(steps, 782);
        let one_at_a_time: u64 = (0..64)
            .map(|w| Deal::new(w, 64, 1).unwrap().share(400_000).div_ceil(512))
            .sum();
        assert_eq!(one_at_a_time, 832);
    }

    #[test]
    fn bad_options_are_errors_and_large_indices_do_not_overflow() {
        assert!(Deal::new(0, 0, 1).is_err());
        assert!(Deal::new(2, 2, 1).is_err());
        assert!(Deal::new(0, 2, 0).is_err());
        let d = Deal::new(3, 4, usize::MAX).unwrap();
        assert_eq!(d.first(), u64::MAX);
        assert_eq!(d.next(u64::MAX), u64::MAX);
        assert_eq!(d.share(u64::MAX), 0);
        assert_eq!(Deal::default().share(12_345), 12_345);
    }
}
