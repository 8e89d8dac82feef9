//! Row storage of an [`EmbeddingTable`](super::EmbeddingTable): the key
//! map and the arena of rows (weights and optimizer slots side by side),
//! in blocks that grow without moving rows.

use super::keymap::{Found, KeyMap};
use super::prefault::{self, Order, Supply};
use super::*;

/// A row's place and bookkeeping, for eviction, Adam's per-row bias
/// correction and checkpoints: what [`Rows::get`] returns, gathered from
/// the key map's [`Held`] and the row's [`Meta`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slot {
    /// The row's index in the arena.
    pub(crate) index: u32,
    /// Global step of the last pull or update.
    pub(crate) last_access: u64,
    /// Number of optimizer updates applied to this row.
    pub(crate) updates: u64,
}

impl Slot {
    /// A row's bookkeeping from its key map entry and its [`Meta`].
    fn of(h: Held, m: Meta) -> Self {
        Self {
            index: h.index,
            last_access: m.last_access,
            updates: m.updates,
        }
    }
}

/// The key map's value: the key's row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Held {
    /// The row's index in the arena.
    pub(crate) index: u32,
}

/// A row's bookkeeping, by row index beside the arena rather than in the
/// key map: an update that knows its row (a worker's push of the keys its
/// pull found) changes it without reading the key map's entry, a cache
/// miss of its own in a map of megabytes, and a pull refreshes it while
/// it copies the row, prefetched with the row. 16 bytes, four rows to a
/// cache line, and rows are made in index order, so the rows made early
/// (the frequent keys') share few lines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Meta {
    /// Number of optimizer updates applied to the row.
    pub(crate) updates: u64,
    /// Global step of the last pull or update.
    pub(crate) last_access: u64,
}

/// A fresh [`Rows::epoch`]: unique in the process.
fn next_epoch() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// The rows of a table: a key -> [`Held`] map, an [`Arena`] of rows of
/// `stride` floats each (`dim` weights, then each optimizer slot) and the
/// rows' [`Meta`]. Rows are not allocated one by one: a new row takes a
/// freed index or the next one, so creating a row costs no `malloc` and
/// removing one no `free`.
#[derive(Debug)]
pub(crate) struct Rows {
    pub(crate) map: KeyMap,
    pub(crate) arena: Arena,
    /// By row index: updates and last update step.
    pub(crate) meta: Vec<Meta>,
    /// Indices below this have been handed out.
    pub(crate) next: u32,
    /// Indices of evicted rows, reused first.
    pub(crate) free: Vec<u32>,
    /// Rows the key map and the bookkeeping are to be sized for when the
    /// first row comes ([`Rows::reserve`]); zero when none.
    deferred: usize,
    /// The reserved rows' blocks for a thread of [`prefault`], given to it
    /// when the first row comes unless taken before ([`Rows::take_order`]).
    pub(crate) order: Option<Order>,
    /// Which key -> row assignment this is: a value no other `Rows` of
    /// the process has had, changed whenever a key loses its row. While
    /// it stays the same, a key that had row `i` still has row `i` (new
    /// keys only add rows), so a row index found earlier can be used
    /// without looking the key up again.
    pub(crate) epoch: u64,
}

impl Clone for Rows {
    /// A copy with an epoch of its own: row indices found in the original
    /// are not taken for the copy's.
    fn clone(&self) -> Self {
        Self {
            map: self.map.clone(),
            arena: self.arena.clone(),
            meta: self.meta.clone(),
            next: self.next,
            free: self.free.clone(),
            deferred: self.deferred,
            // Blocks still to come go to the original's arena.
            order: None,
            epoch: next_epoch(),
        }
    }
}

/// Rows of a table in blocks of about [`BLOCK_BYTES`]. Growing adds a block
/// and never moves a row: one growable `Vec` of all rows copied the whole
/// table (and faulted its new pages in) at every doubling, which showed as
/// the PS's largest `memmove` while a table filled.
///
/// Blocks are anonymous mappings, so pages no row has touched cost no
/// memory. Those past the first [`SMALL_PAGE_BLOCKS`] are advised
/// `MADV_HUGEPAGE`: a large table's rows are read and updated in random
/// order, and with 4 KiB pages nearly every row touched cost a TLB miss
/// (`ps_table_1m`, 512 MiB of rows: pull and push 13-14% faster with huge
/// pages). A small table stays on 4 KiB pages: its TLB footprint is small,
/// many small tables cost no 2 MiB page each, and on this VM a fresh 2 MiB
/// page cost more to clear on first touch than the TLB saved (the
/// comm-bound train, whose table shards are 14 MiB each, was 10-20% slower
/// with huge pages from the first block).
#[derive(Debug)]
pub(crate) struct Arena {
    pub(crate) stride: usize,
    /// log2 of the rows per block.
    pub(crate) shift: u32,
    pub(crate) blocks: Vec<Block>,
    /// Rows below this have their block and pages already (a
    /// [`Supply`]'s).
    pub(crate) populated: usize,
    /// The blocks of reserved rows a thread of [`prefault`] makes
    /// ([`Self::order`]), while some are still to come.
    pub(crate) supply: Option<Supply>,
}

/// Target size of an arena block: one transparent huge page.
pub(crate) const BLOCK_BYTES: usize = 2 << 20;
/// Blocks of a table shard (16 MiB) kept on small pages; see [`Arena`].
pub(crate) const SMALL_PAGE_BLOCKS: usize = 8;
/// Pages of a small-page block are faulted in this many bytes at a time
/// (see [`Arena::ensure`]).
pub(crate) const POPULATE_BYTES: usize = 64 << 10;
/// Fewest rows per block (for rows wider than `BLOCK_BYTES / 1024`).
pub(crate) const MIN_BLOCK_SHIFT: u32 = 10;

/// One block of an [`Arena`]: an anonymous mapping of `rows << shift`
/// floats, zeroed by the kernel.
#[derive(Debug)]
pub(crate) struct Block {
    pub(crate) map: memmap2::MmapMut,
    /// Advised `MADV_HUGEPAGE`.
    pub(crate) huge: bool,
}

impl Block {
    /// A zeroed block; [`NoRoom::Memory`] when the mapping fails.
    pub(crate) fn new(floats: usize, huge: bool) -> Result<Self, NoRoom> {
        let map = memmap2::MmapOptions::new()
            .len(floats * std::mem::size_of::<f32>())
            .map_anon()
            .map_err(|_| NoRoom::Memory)?;
        if huge {
            // Refused advice (THP disabled) leaves small pages: harmless.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        Ok(Self { map, huge })
    }

    // A mapping is page-aligned and its length a multiple of 4: the casts
    // cannot fail.
    pub(crate) fn floats(&self) -> &[f32] {
        bytemuck::cast_slice(&self.map)
    }

    pub(crate) fn floats_mut(&mut self) -> &mut [f32] {
        bytemuck::cast_slice_mut(&mut self.map)
    }
}

impl Clone for Arena {
    fn clone(&self) -> Self {
        let mut out = Arena::with_shift(self.stride, self.shift, self.blocks.len());
        for b in &self.blocks {
            // Cloning a table is for tests and tools, which treat running
            // out of memory as `vec!` does.
            let Ok(mut copy) = Block::new(b.floats().len(), b.huge) else {
                std::alloc::handle_alloc_error(std::alloc::Layout::new::<Block>());
            };
            copy.floats_mut().copy_from_slice(b.floats());
            out.blocks.push(copy);
        }
        // Blocks still to come stay with the original: the copy maps
        // its own.
        out.populated = self.populated;
        out
    }
}

impl Arena {
    pub(crate) fn new(stride: usize, rows: usize) -> Self {
        let per_block = BLOCK_BYTES / (stride.max(1) * std::mem::size_of::<f32>());
        let shift = per_block.max(1).ilog2().max(MIN_BLOCK_SHIFT);
        Self::with_shift(stride, shift, rows.div_ceil(1 << shift))
    }

    pub(crate) fn with_shift(stride: usize, shift: u32, blocks: usize) -> Self {
        Self {
            stride,
            shift,
            blocks: Vec::with_capacity(blocks),
            populated: 0,
            supply: None,
        }
    }

    /// Rows per block.
    pub(crate) fn block_rows(&self) -> usize {
        1 << self.shift
    }

    /// Add the next block: the [`Supply`]'s while it has blocks to come
    /// (waiting for the thread to make it), else a fresh mapping.
    #[cold]
    #[inline(never)]
    pub(crate) fn push_block(&mut self) -> Result<(), NoRoom> {
        self.blocks.try_reserve(1).map_err(|_| NoRoom::Memory)?;
        if let Some(s) = &mut self.supply {
            if let Some(b) = s.next() {
                self.blocks.push(b);
                let held = self.blocks.len() << self.shift;
                self.populated = self.populated.max(held.min(s.rows));
                if s.left == 0 {
                    self.supply = None;
                }
                return Ok(());
            }
            self.supply = None;
        }
        let floats = self.block_rows() * self.stride;
        let huge = self.blocks.len() >= SMALL_PAGE_BLOCKS;
        self.blocks.push(Block::new(floats, huge)?);
        Ok(())
    }

    /// Make row `index` addressable (its floats are zero or stale).
    ///
    /// Rows are handed out in index order, so a small-page block's pages
    /// are first touched in order too: when row `index` is the first to
    /// reach into a [`POPULATE_BYTES`] chunk of its block, the chunk's
    /// pages are faulted in by one `MADV_POPULATE_WRITE` rather than by one
    /// page fault each as its rows are written. A kernel without it (before
    /// 5.14) refuses the advice, and the pages fault in one by one as before.
    pub(crate) fn ensure(&mut self, index: u32) -> Result<(), NoRoom> {
        if (index as usize) < self.populated {
            return Ok(());
        }
        let block = (index >> self.shift) as usize;
        while self.blocks.len() <= block {
            self.push_block()?;
        }
        if (index as usize) < self.populated {
            // The supply's block came faulted in.
            return Ok(());
        }
        let b = &self.blocks[block];
        if !b.huge {
            let row_bytes = self.stride * std::mem::size_of::<f32>();
            let at = (index as usize & (self.block_rows() - 1)) * row_bytes;
            let end = at + row_bytes;
            // The chunks this row reaches that the row before it did not.
            let from = if at == 0 {
                0
            } else {
                (at - 1) / POPULATE_BYTES + 1
            };
            let to = end.div_ceil(POPULATE_BYTES);
            if from < to {
                let lo = from * POPULATE_BYTES;
                let hi = (to * POPULATE_BYTES).min(b.map.len());
                let _ = b
                    .map
                    .advise_range(memmap2::Advice::PopulateWrite, lo, hi - lo);
            }
        }
        Ok(())
    }

    /// Order the blocks that make the first `rows` rows addressable from
    /// a thread of [`prefault`], their pages faulted in (to the end of
    /// the [`POPULATE_BYTES`] chunk the last row reaches, as
    /// [`Self::ensure`] would have left it): the pulls that create those
    /// rows then map no block and pay no page fault. `None` when the
    /// blocks held already reach that far, or while an earlier order still
    /// has blocks to come (its supply is the arena's only one). Rows of
    /// the last block held before the order still fault in as
    /// [`Self::ensure`] makes them.
    pub(crate) fn order(&mut self, rows: usize) -> Option<Order> {
        let rows = rows.min(NO_ROW as usize);
        let first = self.blocks.len();
        let count = rows.div_ceil(self.block_rows()).saturating_sub(first);
        if count == 0 || self.supply.is_some() {
            return None;
        }
        let row_bytes = self.stride * std::mem::size_of::<f32>();
        let last_rows = rows - ((first + count - 1) << self.shift);
        let (order, supply) = prefault::order(
            self.block_rows() * self.stride,
            first,
            count,
            last_rows * row_bytes,
            rows,
        );
        self.supply = Some(supply);
        Some(order)
    }

    #[inline(always)]
    pub(crate) fn row(&self, index: u32) -> &[f32] {
        let at = (index as usize & (self.block_rows() - 1)) * self.stride;
        &self.blocks[(index >> self.shift) as usize].floats()[at..at + self.stride]
    }

    /// Prefetch the first `floats` floats of row `index`, unless it is
    /// `None` or [`NO_ROW`] (see [`prefetch`]).
    #[inline(always)]
    pub(crate) fn prefetch(&self, index: Option<u32>, floats: usize) {
        if let Some(i) = index.filter(|&i| i != NO_ROW) {
            prefetch::row(&self.row(i)[..floats]);
        }
    }

    #[inline(always)]
    pub(crate) fn row_mut(&mut self, index: u32) -> &mut [f32] {
        let at = (index as usize & (self.block_rows() - 1)) * self.stride;
        &mut self.blocks[(index >> self.shift) as usize].floats_mut()[at..at + self.stride]
    }
}

impl Rows {
    /// An empty store of rows of `stride` floats, with room for `n` rows.
    pub(crate) fn with_capacity(stride: usize, n: usize) -> Self {
        let mut map = KeyMap::default();
        map.reserve(n);
        Self {
            map,
            arena: Arena::new(stride, n),
            meta: Vec::with_capacity(n),
            next: 0,
            free: Vec::new(),
            deferred: 0,
            order: None,
            epoch: next_epoch(),
        }
    }

    /// Room for `rows` more rows, made when the first row comes (at once
    /// when the table holds rows), so a table nothing ever pulls (a
    /// model's unused feature, a PS no worker trains on) holds no memory
    /// for rows it never makes: the key map and the bookkeeping sized for
    /// them and, with `ahead`, their arena blocks ordered from a thread of
    /// [`prefault`] ([`Arena::order`]). [`Self::take_order`] can start the
    /// blocks sooner, which gives that up: they are faulted in whether or
    /// not a row comes.
    pub(crate) fn reserve(&mut self, rows: usize, ahead: bool) {
        self.deferred = rows;
        if ahead {
            // An order not started yet stays if this one has nothing to add.
            if let Some(o) = self.arena.order((self.next as usize).saturating_add(rows)) {
                self.order = Some(o);
            }
        }
        if self.next != 0 {
            self.take_reserve();
        }
    }

    /// The reserved rows' order of blocks, to start before the first row
    /// comes.
    pub(crate) fn take_order(&mut self) -> Option<Order> {
        self.order.take()
    }

    /// Make the deferred reservation, if one waits. Called before a key
    /// is looked up for a new row: growing the map moves its positions.
    #[inline]
    pub(crate) fn reserve_before_insert(&mut self) {
        if self.deferred != 0 || self.order.is_some() {
            self.take_reserve();
        }
    }

    #[cold]
    fn take_reserve(&mut self) {
        let rows = std::mem::take(&mut self.deferred);
        self.map.reserve(rows);
        self.meta.reserve(rows);
        prefault::spawn(self.order.take().into_iter().collect());
    }

    /// Number of rows.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// True when there is no row.
    pub(crate) fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The keys, in no particular order.
    pub(crate) fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.map.keys()
    }

    /// The bookkeeping and the `stride` floats of `key`'s row.
    pub(crate) fn get(&self, key: u64) -> Option<(Slot, &[f32])> {
        let h = *self.map.get(key)?;
        Some((self.slot(h), self.arena.row(h.index)))
    }

    /// The bookkeeping of the row the key map holds as `h`.
    fn slot(&self, h: Held) -> Slot {
        Slot::of(h, self.meta[h.index as usize])
    }

    /// Refresh row `index`'s access time to `step` (a pull of it);
    /// [`NO_ROW`] does nothing.
    #[inline]
    pub(crate) fn touch(&mut self, index: u32, step: u64) {
        if let Some(m) = self.meta.get_mut(index as usize) {
            m.last_access = m.last_access.max(step);
        }
    }

    /// Prefetch the first `floats` floats of row `index` and its
    /// bookkeeping, unless it is `None` or [`NO_ROW`].
    #[inline]
    pub(crate) fn prefetch(&self, index: Option<u32>, floats: usize) {
        if let Some(i) = index.filter(|&i| i != NO_ROW) {
            self.arena.prefetch(Some(i), floats);
            if let Some(m) = self.meta.get(i as usize) {
                prefetch::entry(m);
            }
        }
    }

    /// Start the bookkeeping of the new row `index` ([`alloc`] gave it).
    #[inline]
    pub(crate) fn start_meta(&mut self, index: u32, updates: u64, last_access: u64) {
        let m = Meta {
            updates,
            last_access,
        };
        match self.meta.get_mut(index as usize) {
            Some(old) => *old = m,
            // Indices are handed out in order: a new one is the next.
            None => self.meta.push(m),
        }
    }

    /// Add a row for `key` (which must not have one) holding `data`
    /// (`stride` floats); false if the key already has a row.
    pub(crate) fn insert(
        &mut self,
        key: u64,
        last_access: u64,
        updates: u64,
        data: &[f32],
    ) -> Result<bool, NoRoom> {
        self.reserve_before_insert();
        let found = self.map.find(key);
        if let Some(Found::At(_)) = found {
            return Ok(false);
        }
        let index = alloc(&mut self.arena, &mut self.next, &mut self.free)?;
        self.arena.row_mut(index).copy_from_slice(data);
        self.start_meta(index, updates, last_access);
        self.map.insert_at(found, key, Held { index });
        Ok(true)
    }

    /// Keep the rows for which `keep` is true; returns how many were removed.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&Slot) -> bool) -> usize {
        let before = self.map.len();
        let free = &mut self.free;
        let meta = &self.meta;
        self.map.retain(|h| {
            let k = keep(&Slot::of(*h, meta[h.index as usize]));
            if !k {
                free.push(h.index);
            }
            k
        });
        let removed = before - self.map.len();
        if removed > 0 {
            self.epoch = next_epoch();
        }
        removed
    }
}

/// Why a table could not make a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum NoRoom {
    /// The table holds [`TablePolicy::max_rows`] rows.
    MaxRows,
    /// The arena's memory could not be mapped.
    Memory,
    /// Every row index of the shard is taken.
    Indices,
}

/// A pull needed a new row and the table had no room for it. Rows the
/// request created before it stay (each is a row a later pull would have
/// made).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("table {var} cannot take a new row: {} ({rows} rows held)", match why {
    NoRoom::MaxRows => "it holds --max-rows rows",
    NoRoom::Memory => "out of memory",
    NoRoom::Indices => "every row index is taken",
})]
pub struct TableFull {
    /// The table's variable id.
    pub var: u32,
    /// Rows it holds.
    pub rows: usize,
    /// Which bound it hit.
    pub why: NoRoom,
}

/// A new row index: a freed one, or the next one (the arena grows to hold
/// it). The row's floats are stale or zero; the caller writes all of them.
pub(crate) fn alloc(arena: &mut Arena, next: &mut u32, free: &mut Vec<u32>) -> Result<u32, NoRoom> {
    if let Some(i) = free.pop() {
        return Ok(i);
    }
    let i = *next;
    // `NO_ROW` marks a missing row, so it is never an index.
    if i == NO_ROW {
        return Err(NoRoom::Indices);
    }
    arena.ensure(i)?;
    *next = i + 1;
    Ok(i)
}
