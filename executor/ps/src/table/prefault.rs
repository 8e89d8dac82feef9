//! Reserved rows' blocks made and faulted in ahead, on a thread of their
//! own.
//!
//! A table told how many rows it will reach ([`super::EmbeddingTable::reserve`])
//! used to fault their pages in with one `MADV_POPULATE_WRITE` when its
//! first row came: inside the first pull, so the run's first steps paid
//! for clearing every reserved page (on the train config of issue 28,
//! two shards of 190 MB each, about a third of a one-epoch run's timed
//! steps; while one worker's pull faulted a shard in, the other waited
//! for the shard). Now a thread (one per process) maps the blocks and
//! faults them in, block 0 of every table ordered, then block 1 of each,
//! and so on (a step touches every table), and passes each to its arena
//! through a channel. A table starts its order when its first row comes;
//! the local cluster's PS starts every table's as the shard is made
//! ([`crate::PsShard::reserve_rows`]), so the faulting overlaps the rest
//! of the cluster's start. An arena that needs a block the thread has not
//! passed yet waits for it: the thread makes blocks in turns over every
//! open order, so the wait can include other tables' blocks of the same
//! turn (in the first steps; after them the thread runs ahead of the
//! rows made).
//!
//! Nothing here is unsafe: a block is an owned mapping, made by the
//! thread and moved to its arena whole; the thread never holds a block
//! an arena uses.

use std::sync::{mpsc, Mutex, PoisonError};

use super::rows::{Block, POPULATE_BYTES, SMALL_PAGE_BLOCKS};

/// Bytes faulted in by one `MADV_POPULATE_WRITE` (see [`make`]).
const ADVISE_BYTES: usize = 256 << 10;

/// Blocks an arena receives from the thread of [`spawn`], in order: its
/// blocks from `first` on.
#[derive(Debug)]
pub(crate) struct Supply {
    rx: mpsc::Receiver<Block>,
    /// Blocks still to come.
    pub(crate) left: usize,
    /// Rows from the arena's first whose pages the blocks come with
    /// faulted in.
    pub(crate) rows: usize,
}

impl Supply {
    /// The next block; `None` once the thread has stopped making this
    /// arena's (it could not map one, or it could not start), when the
    /// arena makes its own.
    pub(crate) fn next(&mut self) -> Option<Block> {
        if self.left == 0 {
            return None;
        }
        match self.rx.recv() {
            Ok(b) => {
                self.left -= 1;
                Some(b)
            }
            Err(_) => {
                self.left = 0;
                None
            }
        }
    }
}

/// What the thread makes for one arena.
#[derive(Debug)]
pub(crate) struct Order {
    tx: mpsc::Sender<Block>,
    /// Floats per block.
    floats: usize,
    /// Arena index of the first block.
    first: usize,
    /// Blocks to make.
    count: usize,
    /// Bytes of the last block to fault in (the others: all).
    last_bytes: usize,
}

/// An order for blocks `first..first + count` of `floats` floats each,
/// the last faulted in to `last_bytes` (rounded up to a
/// [`POPULATE_BYTES`] chunk, as [`super::rows::Arena::ensure`] would
/// leave it), and the supply that receives them, holding `rows` rows.
pub(crate) fn order(
    floats: usize,
    first: usize,
    count: usize,
    last_bytes: usize,
    rows: usize,
) -> (Order, Supply) {
    let (tx, rx) = mpsc::channel();
    let block_bytes = floats * std::mem::size_of::<f32>();
    let last_bytes = last_bytes.next_multiple_of(POPULATE_BYTES).min(block_bytes);
    (
        Order {
            tx,
            floats,
            first,
            count,
            last_bytes,
        },
        Supply {
            rx,
            left: count,
            rows,
        },
    )
}

/// Orders waiting for the thread, and whether it runs.
#[derive(Debug, Default)]
struct Queue {
    orders: Vec<Order>,
    running: bool,
}

/// One thread per process: each shard's PS starts its orders as it is
/// made, and two threads faulting in at once took both cores of a
/// two-core host from the rest of the cluster's start.
static QUEUE: Mutex<Queue> = Mutex::new(Queue {
    orders: Vec::new(),
    running: false,
});

fn queue() -> std::sync::MutexGuard<'static, Queue> {
    // The queue is whole after any panic: a poisoned lock is taken as it is.
    QUEUE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Have the process's prefault thread make the `orders`' blocks, with
/// those of orders given before, round-robin over all of them; the thread
/// starts when none runs and ends when no order has blocks left. When it
/// cannot start, the orders are dropped and each arena makes its own
/// blocks.
pub(crate) fn spawn(orders: Vec<Order>) {
    let mut q = queue();
    q.orders.extend(orders.into_iter().filter(|o| o.count > 0));
    if q.running || q.orders.is_empty() {
        return;
    }
    q.running = true;
    drop(q);
    let started = std::thread::Builder::new()
        .name("starwire-prefault".into())
        .spawn(run);
    if started.is_err() {
        let mut q = queue();
        q.running = false;
        q.orders.clear();
    }
}

/// The thread's loop: one block of every open order per turn, the
/// queue's new orders joining at the next turn.
fn run() {
    // Should the loop ever unwind, the next `spawn` starts a thread again,
    // and the orders queued meanwhile are dropped, so their arenas map
    // their own blocks rather than wait for a thread that is gone.
    struct Stopped;
    impl Drop for Stopped {
        fn drop(&mut self) {
            if std::thread::panicking() {
                let mut q = queue();
                q.running = false;
                q.orders.clear();
            }
        }
    }
    let _stopped = Stopped;
    // Each open order with the index of its next block.
    let mut open: Vec<(Order, usize)> = Vec::new();
    loop {
        {
            let mut q = queue();
            open.extend(q.orders.drain(..).map(|o| (o, 0)));
            if open.is_empty() {
                q.running = false;
                return;
            }
        }
        open.retain_mut(|(o, r)| {
            let more = make(o, *r);
            *r += 1;
            more && *r < o.count
        });
    }
}

/// Make block `r` of order `o` and send it; false when the order stops
/// (no memory, or its arena is gone).
fn make(o: &Order, r: usize) -> bool {
    let index = o.first + r;
    let Ok(b) = Block::new(o.floats, index >= SMALL_PAGE_BLOCKS) else {
        // Out of memory: the arena maps its own from here, and reports
        // the failure to the pull that needs the row.
        return false;
    };
    let bytes = if r + 1 == o.count {
        o.last_bytes
    } else {
        b.map.len()
    };
    // A chunk per call: the advice holds the process's mmap lock (read)
    // for its whole range, and a thread that maps or unmaps memory (an
    // allocation's `brk`) waits for it; over a 2 MiB block at a time the
    // cluster's start spent most of its time waiting so. A kernel without
    // MADV_POPULATE_WRITE (before 5.14) refuses it: the pages then fault
    // in on first touch.
    let mut at = 0;
    while at < bytes {
        let len = ADVISE_BYTES.min(bytes - at);
        if b.map
            .advise_range(memmap2::Advice::PopulateWrite, at, len)
            .is_err()
        {
            break;
        }
        at += len;
    }
    // A table dropped before its blocks came: stop making them.
    o.tx.send(b).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_come_in_order_and_the_last_is_faulted_to_its_chunk() {
        let floats = 2 * POPULATE_BYTES / 4;
        // Blocks 7 and 8 of one arena: the first on small pages, the
        // second past SMALL_PAGE_BLOCKS, so the order shows.
        let (a, mut sa) = order(floats, SMALL_PAGE_BLOCKS - 1, 2, 10, 40);
        let (b, mut sb) = order(floats, 0, 1, POPULATE_BYTES + 1, 9);
        assert_eq!(a.last_bytes, POPULATE_BYTES);
        assert_eq!(b.last_bytes, 2 * POPULATE_BYTES);
        spawn(vec![a, b]);
        for huge in [false, true] {
            let blk = sa.next().expect("a block");
            assert_eq!(blk.huge, huge);
            assert_eq!(blk.floats().len(), floats);
            assert!(blk.floats().iter().all(|&x| x == 0.0));
        }
        assert!(sa.next().is_none(), "two ordered");
        assert_eq!(sa.left, 0);
        assert!(!sb.next().expect("b's block").huge);
        assert!(sb.next().is_none());
    }

    #[test]
    fn a_dropped_supply_stops_its_blocks_and_a_dropped_order_ends_the_supply() {
        // Blocks of 4 MiB: a thread that made all 1000 would fault in 4 GB.
        let (a, sa) = order(1 << 20, 0, 1000, 4096, 1);
        let (b, mut sb) = order(1024, 0, 2, 4096, 1);
        drop(sa);
        spawn(vec![a, b]);
        assert!(sb.next().is_some());
        assert!(sb.next().is_some());
        // The thread ends soon: the dropped supply's order stopped at its
        // first refused block (other tests' orders may keep it a moment).
        let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while queue().running {
            assert!(std::time::Instant::now() < until, "the thread still runs");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let (c, mut sc) = order(1024, 0, 5, 4096, 1);
        drop(c);
        assert!(sc.next().is_none(), "no thread will send");
        assert_eq!(sc.left, 0);
    }
}
