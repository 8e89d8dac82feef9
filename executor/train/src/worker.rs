//! The worker: reads its share of the data, pulls what a step needs from
//! every PS shard (fused: one request per shard; unfused: one per tensor),
//! runs the partitioned graph, and pushes the gradients back.
//!
//! Ordered writes: a step's push and the next step's pull leave together;
//! since one connection delivers in order, each shard applies the push
//! before it answers the pull, and no round trip is spent waiting for the
//! push acknowledgement (PS-Plus's ordered writes).

use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use starwire_data::Batch;
use starwire_graph::{
    Combiner, Dedup, Executor, LookupFeed, LookupGrad, Partitioned, PullForm, RunBuffers,
    StepFeeds, StepOutput, Tensor, VarId, WireRows,
};
use starwire_ps::shard_of;
use starwire_transport::wire::{Opcode, Status};
use starwire_transport::Payload;
use starwire_wire::ps::{
    parse_push_response, pull_dense_len, pull_pooled_len, pull_request_header_len, pull_rows_len,
    push_dense_len, push_pooled_len, push_request_header_len, push_rows_len, Control, Limits,
    PullReply, PullRequestWriter, PullResponse, PushRequestWriter,
};

use crate::net::{Exchange, Reply, Request};
use crate::staleness::{StalenessHistogram, StalenessTracker};
use crate::TrainError;

/// Where the model's variables live, as the worker needs it.
#[derive(Debug, Clone)]
pub struct Layout {
    /// Number of shards (PS tasks × reactors per PS).
    pub shards: usize,
    /// The one shard holding each variable assigned whole (every dense
    /// variable, and tables too small to shard), by variable id; `None`
    /// for tables sharded by key over every shard.
    pub home_shard: Vec<Option<usize>>,
    /// Numeric fields per example.
    pub num_dense: usize,
    /// Categorical fields per example.
    pub num_fields: usize,
}

/// What to pull for one item of a message, to route its reply.
#[derive(Debug, Clone, Copy)]
enum Item {
    /// Dense variable, by position in `Pulls::dense`.
    Dense(usize),
    /// Lookup `l` on shard `s`.
    Lookup(usize, usize),
}

/// One lookup of one step: its keys and how they are split over shards.
#[derive(Debug, Default)]
struct LookupStep {
    /// Ragged per-example offsets into `keys` (`B+1`).
    offsets: Vec<u32>,
    /// Keys of every example, in order.
    keys: Vec<u64>,
    /// Robust: the unique keys in first-seen order, and the hash map that
    /// finds them.
    unique: Vec<u64>,
    dedup: Dedup,
    /// Robust: per occurrence, its row of the rows feed.
    index: Vec<u32>,
    /// Robust: the rows feed holds the unique keys shard by shard; shard
    /// `s`'s rows are `shard_start[s]..shard_start[s + 1]`. Lite: unused.
    shard_start: Vec<usize>,
    /// Robust: per unique key (first-seen order), its shard, then its row.
    row_of: Vec<u32>,
    /// Robust: per shard, the next row to hand out while `row_of` is filled.
    next_row: Vec<usize>,
    /// Per shard, the keys sent (robust: unique keys of the shard, in
    /// first-seen order; lite: every occurrence of the shard's keys, per
    /// example).
    shard_keys: Vec<Vec<u64>>,
    /// Lite: per shard, ragged offsets (`B+1`).
    shard_offsets: Vec<Vec<u32>>,
}

/// Buffers shared by the workers of one process.
///
/// Graph run buffers ([`RunBuffers`]): a worker takes a set for its step's
/// forward and backward pass and puts it back when the step's pushes are
/// built. Request bodies: a push or pull request is written into a body
/// from the pool, which returns to it when the transport lets go of the
/// request. So the workers that compute at once (as many as there are
/// CPUs, whatever the worker count) reuse a few sets and bodies, already
/// faulted in and warm in the caches, rather than each worker faulting in
/// its own for the few steps it runs. Contents are stale; only the
/// allocations are reused (a buffer of another size is resized).
#[derive(Debug, Clone, Default)]
pub struct WorkerBuffers(Arc<SharedBuffers>);

#[derive(Debug, Default)]
struct SharedBuffers {
    runs: Mutex<Vec<RunBuffers>>,
    bodies: Mutex<Vec<Vec<u8>>>,
}

/// Bodies kept for reuse at most: bounds what a burst of requests leaves
/// behind.
const MAX_IDLE_BODIES: usize = 256;

/// A request body from [`WorkerBuffers`]: back to the pool when dropped.
struct PooledBody {
    buf: Vec<u8>,
    pool: WorkerBuffers,
}

impl AsRef<[u8]> for PooledBody {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for PooledBody {
    fn drop(&mut self) {
        self.pool.put_body(std::mem::take(&mut self.buf));
    }
}

impl WorkerBuffers {
    // A worker that panicked while holding a lock left whole buffers in
    // the list: still usable, so a poisoned lock is taken as it is.
    fn take_run(&self) -> RunBuffers {
        let mut runs = self.0.runs.lock().unwrap_or_else(PoisonError::into_inner);
        runs.pop().unwrap_or_default()
    }

    fn put_run(&self, set: RunBuffers) {
        let mut runs = self.0.runs.lock().unwrap_or_else(PoisonError::into_inner);
        runs.push(set);
    }

    /// An empty body with room for `len` bytes.
    fn take_body(&self, len: usize) -> Vec<u8> {
        let mut bodies = self.0.bodies.lock().unwrap_or_else(PoisonError::into_inner);
        let mut buf = bodies.pop().unwrap_or_default();
        drop(bodies);
        buf.clear();
        buf.reserve(len);
        buf
    }

    fn put_body(&self, buf: Vec<u8>) {
        let mut bodies = self.0.bodies.lock().unwrap_or_else(PoisonError::into_inner);
        if bodies.len() < MAX_IDLE_BODIES && buf.capacity() > 0 {
            bodies.push(buf);
        }
    }

    /// Graph run buffer sets and request bodies waiting to be taken.
    pub fn idle(&self) -> (usize, usize) {
        let runs = self.0.runs.lock().unwrap_or_else(PoisonError::into_inner);
        let bodies = self.0.bodies.lock().unwrap_or_else(PoisonError::into_inner);
        (runs.len(), bodies.len())
    }
}

/// Step statistics.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepInfo {
    /// Loss of the batch.
    pub loss: f32,
    /// Examples.
    pub examples: usize,
    /// Highest global step any shard reported.
    pub global_step: u64,
}

/// The per-worker state that turns batches into requests and replies into
/// feeds.
#[derive(Debug)]
pub struct WorkerCore {
    part: Partitioned,
    layout: Layout,
    fuse: bool,
    exec: Executor,
    limits: Limits,
    lookups: Vec<LookupStep>,
    /// Pushes of the last step, not sent yet.
    pending_push: Vec<Request>,
    replies: Vec<Reply>,
    /// The graph's output buffers, kept from step to step, or taken from
    /// and given back to `pool` around each step's run.
    bufs: RunBuffers,
    /// The process's shared buffers, if the worker uses them.
    pool: Option<WorkerBuffers>,
    global_step: u64,
    staleness: StalenessTracker,
    /// Per-step scratch: the shard of each request of an exchange.
    shards: Vec<usize>,
    /// The pull reply bodies the step's rows feeds read in place, with
    /// their positions in `replies`.
    shared: Vec<(usize, Arc<Vec<u8>>)>,
}

fn bytes_body(v: Vec<u8>) -> Payload {
    Payload::from_bytes(Bytes::from(v))
}

fn check(r: &Reply, what: &str) -> Result<(), TrainError> {
    match r.status {
        Some(Status::Ok) => Ok(()),
        Some(s) => Err(TrainError::Remote(format!(
            "{what} failed with {s:?} ({}): {}",
            s.describe(),
            String::from_utf8_lossy(&r.body)
        ))),
        None => Err(TrainError::Remote(format!("{what}: no reply"))),
    }
}

impl WorkerCore {
    /// A worker for the partitioned graph `part` over `layout`.
    pub fn new(part: Partitioned, layout: Layout, fuse: bool, exec: Executor) -> Self {
        let n = part.pulls().lookups.len();
        Self {
            part,
            layout,
            fuse,
            exec,
            limits: Limits::default(),
            lookups: (0..n).map(|_| LookupStep::default()).collect(),
            pending_push: Vec::new(),
            replies: Vec::new(),
            bufs: RunBuffers::default(),
            pool: None,
            global_step: 0,
            staleness: StalenessTracker::default(),
            shards: Vec::new(),
            shared: Vec::new(),
        }
    }

    /// Run the graph in buffers, and write push and pull requests in
    /// bodies, taken from `pool` (shared with the process's other workers)
    /// rather than in buffers of its own.
    pub fn share_buffers(&mut self, pool: WorkerBuffers) {
        self.pool = Some(pool);
    }

    /// A body for a request of `len` bytes.
    fn body(&self, len: usize) -> Vec<u8> {
        match &self.pool {
            Some(p) => p.take_body(len),
            None => Vec::with_capacity(len),
        }
    }

    /// The payload of a request body from [`Self::body`].
    fn payload(&self, buf: Vec<u8>) -> Payload {
        match &self.pool {
            Some(p) => Payload::from_bytes(Bytes::from_owner(PooledBody {
                buf,
                pool: p.clone(),
            })),
            None => bytes_body(buf),
        }
    }

    /// The protocol's pull form.
    fn form(&self) -> PullForm {
        self.part
            .pulls()
            .lookups
            .first()
            .map_or(PullForm::Rows, |l| l.form)
    }

    /// Split the batch's keys for every lookup.
    fn plan_lookups(&mut self, batch: &Batch) {
        let s_count = self.layout.shards;
        let nf = self.layout.num_fields;
        let form = self.form();
        for (l, lp) in self.part.pulls().lookups.iter().enumerate() {
            // A table assigned whole takes every key; a sharded one splits
            // them by key hash.
            let home = self
                .layout
                .home_shard
                .get(lp.spec.var.0 as usize)
                .copied()
                .flatten();
            let route = |k: u64| home.unwrap_or_else(|| shard_of(k, s_count));
            let st = &mut self.lookups[l];
            st.offsets.clear();
            st.keys.clear();
            // Sized once for a whole batch: a worker's first step does not
            // grow its plan by doublings (with many workers, each taking
            // few steps, those copies showed in the profile).
            st.offsets.reserve(batch.len + 1);
            st.keys.reserve(batch.len * lp.spec.fields.len());
            st.offsets.push(0);
            for b in 0..batch.len {
                let row = &batch.keys[b * nf..(b + 1) * nf];
                for &f in &lp.spec.fields {
                    let k = row[f];
                    if k != starwire_data::MISSING_KEY {
                        st.keys.push(k);
                    }
                }
                st.offsets.push(st.keys.len() as u32);
            }
            st.shard_keys.resize_with(s_count, Vec::new);
            st.shard_keys.iter_mut().for_each(Vec::clear);
            match form {
                PullForm::Rows => {
                    st.dedup.run(&st.keys, &mut st.unique, &mut st.index);
                    // The rows feed lays the unique keys out shard by
                    // shard: a shard's reply then decodes into one range
                    // of it, and its gradient rows are one range of the
                    // rows gradient, with no scatter or gather per row.
                    st.row_of.clear();
                    st.row_of.reserve(st.unique.len());
                    match home {
                        Some(h) => st.shard_keys[h].reserve(st.unique.len()),
                        None => {
                            // Keys hash evenly over the shards: twice a
                            // fair share holds a shard's keys but for a
                            // rare skew.
                            let share = 2 * st.unique.len().div_ceil(s_count);
                            for keys in &mut st.shard_keys {
                                keys.reserve(share);
                            }
                        }
                    }
                    for &k in &st.unique {
                        let s = route(k);
                        st.row_of.push(s as u32);
                        st.shard_keys[s].push(k);
                    }
                    st.shard_start.clear();
                    st.shard_start.push(0);
                    let mut end = 0;
                    for keys in &st.shard_keys {
                        end += keys.len();
                        st.shard_start.push(end);
                    }
                    let next = &mut st.next_row;
                    next.clear();
                    next.extend_from_slice(&st.shard_start[..s_count]);
                    for r in &mut st.row_of {
                        let s = *r as usize;
                        *r = next[s] as u32;
                        next[s] += 1;
                    }
                    for i in &mut st.index {
                        *i = st.row_of[*i as usize];
                    }
                }
                PullForm::Pooled => {
                    st.shard_offsets.resize_with(s_count, Vec::new);
                    for o in &mut st.shard_offsets {
                        o.clear();
                        o.push(0);
                    }
                    for b in 0..batch.len {
                        let (lo, hi) = (st.offsets[b] as usize, st.offsets[b + 1] as usize);
                        for &k in &st.keys[lo..hi] {
                            st.shard_keys[route(k)].push(k);
                        }
                        for s in 0..s_count {
                            st.shard_offsets[s].push(st.shard_keys[s].len() as u32);
                        }
                    }
                }
            }
        }
    }

    /// Group items into messages: fused, one message per shard holding
    /// all its items; unfused, one message per item.
    fn group(&self, items: Vec<(usize, Item)>) -> Vec<(usize, Vec<Item>)> {
        if self.fuse {
            let mut per: Vec<Vec<Item>> = vec![Vec::new(); self.layout.shards];
            for (s, it) in items {
                per[s].push(it);
            }
            per.into_iter()
                .enumerate()
                .filter(|(_, v)| !v.is_empty())
                .collect()
        } else {
            items.into_iter().map(|(s, it)| (s, vec![it])).collect()
        }
    }

    fn pull_items(&self) -> Vec<(usize, Item)> {
        let mut items = Vec::new();
        for (d, dp) in self.part.pulls().dense.iter().enumerate() {
            let s = self.dense_shard(dp.var);
            items.push((s, Item::Dense(d)));
        }
        for (l, st) in self.lookups.iter().enumerate() {
            for (s, keys) in st.shard_keys.iter().enumerate() {
                if !keys.is_empty() {
                    items.push((s, Item::Lookup(l, s)));
                }
            }
        }
        items
    }

    fn dense_shard(&self, var: VarId) -> usize {
        self.layout
            .home_shard
            .get(var.0 as usize)
            .copied()
            .flatten()
            .unwrap_or(0)
    }

    fn pull_requests(&self) -> (Vec<Request>, Vec<Vec<Item>>) {
        let pulls = self.part.pulls();
        let mut reqs = Vec::new();
        let mut metas = Vec::new();
        for (s, items) in self.group(self.pull_items()) {
            let len = items.iter().fold(pull_request_header_len(), |n, it| {
                n + match *it {
                    Item::Dense(_) => pull_dense_len(),
                    Item::Lookup(l, sh) => {
                        let st = &self.lookups[l];
                        match pulls.lookups[l].form {
                            PullForm::Rows => pull_rows_len(st.shard_keys[sh].len()),
                            PullForm::Pooled => pull_pooled_len(
                                st.shard_offsets[sh].len().saturating_sub(1),
                                st.shard_keys[sh].len(),
                            ),
                        }
                    }
                }
            });
            let mut buf = self.body(len);
            let mut w = PullRequestWriter::new(&mut buf);
            for it in &items {
                match *it {
                    Item::Dense(d) => {
                        w.dense(pulls.dense[d].var.0);
                    }
                    Item::Lookup(l, sh) => {
                        let var = pulls.lookups[l].spec.var.0;
                        let st = &self.lookups[l];
                        match pulls.lookups[l].form {
                            PullForm::Rows => {
                                w.rows(var, &st.shard_keys[sh]);
                            }
                            PullForm::Pooled => {
                                w.pooled(var, &st.shard_offsets[sh], &st.shard_keys[sh]);
                            }
                        }
                    }
                }
            }
            reqs.push(Request {
                shard: s,
                opcode: Opcode::SparsePull,
                body: self.payload(buf),
            });
            metas.push(items);
        }
        (reqs, metas)
    }

    /// Build the feeds from the pull replies `replies[first..]`. A rows
    /// feed reads its rows in place in the replies
    /// ([`LookupFeed::WireRows`]): their bodies move into `self.shared`
    /// until [`reclaim_replies`](Self::reclaim_replies) takes them back.
    fn feeds(
        &mut self,
        batch: &Batch,
        metas: &[Vec<Item>],
        first: usize,
    ) -> Result<StepFeeds, TrainError> {
        let pulls = self.part.pulls();
        let mut global_step = self.global_step;
        let b = batch.len;
        let mut dense: Vec<Option<Tensor>> = vec![None; pulls.dense.len()];
        // Pooled feeds sum the shards' partial sums, so they start at zero.
        let mut pooled: Vec<Vec<f32>> = pulls
            .lookups
            .iter()
            .map(|lp| match lp.form {
                PullForm::Rows => Vec::new(),
                PullForm::Pooled => vec![0.0; b * lp.dim],
            })
            .collect();
        self.shared.clear();
        // Per rows item: (lookup, shard, message, byte offset of its rows).
        let mut parts: Vec<(usize, usize, usize, usize)> = Vec::new();
        for (m, items) in metas.iter().enumerate() {
            let r = &mut self.replies[first + m];
            check(r, "pull")?;
            let body = Arc::new(std::mem::take(&mut r.body));
            let resp = PullResponse::parse(&body, &self.limits)
                .map_err(|e| TrainError::Remote(format!("pull reply: {e}")))?;
            global_step = global_step.max(resp.global_step);
            if resp.len() != items.len() {
                return Err(TrainError::Remote("pull reply item count".into()));
            }
            for (it, rep) in items.iter().zip(resp.items()) {
                match (*it, rep) {
                    (Item::Dense(d), PullReply::Dense { data, .. }) => {
                        let t = Tensor::new(pulls.dense[d].shape.clone(), data.to_vec())
                            .map_err(|e| TrainError::Remote(format!("dense pull: {e}")))?;
                        dense[d] = Some(t);
                    }
                    (Item::Lookup(l, sh), PullReply::Rows { dim, data, .. }) => {
                        let dim = dim as usize;
                        let lp = &pulls.lookups[l];
                        // Row starts are kept for the rows form only: a
                        // rows reply to a pooled pull is the peer's error.
                        let start = &self.lookups[l].shard_start;
                        if lp.form != PullForm::Rows
                            || dim != lp.dim
                            || data.len() != (start[sh + 1] - start[sh]) * dim
                        {
                            return Err(TrainError::Remote("rows reply shape".into()));
                        }
                        // The view borrows `body`: its offset there.
                        let at = data.as_bytes().as_ptr() as usize - body.as_ptr() as usize;
                        parts.push((l, sh, m, at));
                    }
                    (Item::Lookup(l, _), PullReply::Pooled { dim, data, .. }) => {
                        let dim = dim as usize;
                        let lp = &pulls.lookups[l];
                        if lp.form != PullForm::Pooled || dim != lp.dim || data.len() != b * dim {
                            return Err(TrainError::Remote("pooled reply shape".into()));
                        }
                        data.add_to(&mut pooled[l]);
                    }
                    _ => return Err(TrainError::Remote("pull reply item kind".into())),
                }
            }
            self.shared.push((first + m, body));
        }
        let mut dense_feeds = Vec::with_capacity(dense.len());
        for (d, t) in dense.into_iter().enumerate() {
            let t = t.ok_or_else(|| TrainError::Remote("dense variable not pulled".into()))?;
            dense_feeds.push((pulls.dense[d].var, t));
        }
        // A lookup's rows are laid out shard by shard (see `plan_lookups`),
        // whatever order its replies came in.
        parts.sort_unstable();
        let mut parts = parts.into_iter().peekable();
        let mut lookups = Vec::with_capacity(pooled.len());
        for (l, (lp, data)) in pulls.lookups.iter().zip(pooled).enumerate() {
            let st = &mut self.lookups[l];
            let feed = match lp.form {
                PullForm::Rows => {
                    let mine = std::iter::from_fn(|| parts.next_if(|p| p.0 == l));
                    let shared = &self.shared;
                    let rows = rows_feed(
                        lp.dim,
                        &st.shard_start,
                        mine.map(|(_, sh, m, at)| (sh, Arc::clone(&shared[m].1), at)),
                    )?;
                    LookupFeed::WireRows {
                        rows,
                        // Moved, not copied: the next step's plan rebuilds
                        // both, and pushing rows reads neither.
                        index: std::mem::take(&mut st.index),
                        offsets: std::mem::take(&mut st.offsets),
                    }
                }
                PullForm::Pooled => {
                    let mut data = data;
                    if lp.spec.combiner == Combiner::Mean {
                        for e in 0..b {
                            let n = st.offsets[e + 1] - st.offsets[e];
                            if n > 1 {
                                let inv = 1.0 / n as f32;
                                data[e * lp.dim..(e + 1) * lp.dim]
                                    .iter_mut()
                                    .for_each(|v| *v *= inv);
                            }
                        }
                    }
                    LookupFeed::Pooled(
                        Tensor::new(vec![b, lp.dim], data)
                            .map_err(|e| TrainError::Internal(e.to_string()))?,
                    )
                }
            };
            lookups.push(feed);
        }
        if parts.next().is_some() {
            return Err(TrainError::Remote("rows reply for a pooled lookup".into()));
        }
        let numeric = Tensor::new(vec![b, self.layout.num_dense], batch.numeric.clone())
            .map_err(|e| TrainError::Internal(e.to_string()))?;
        let labels = Tensor::new(vec![b, 1], batch.labels.clone())
            .map_err(|e| TrainError::Internal(e.to_string()))?;
        self.global_step = global_step;
        Ok(StepFeeds {
            numeric,
            labels,
            dense: dense_feeds,
            lookups,
        })
    }

    /// Take back the reply bodies the last feeds read in place, once the
    /// run that read them let go of them, and the rows feeds' `index` and
    /// `offsets` from `self.bufs`: the next exchange and plan reuse their
    /// allocations.
    fn reclaim_replies(&mut self) {
        for (i, body) in self.shared.drain(..) {
            if let (Ok(body), Some(r)) = (Arc::try_unwrap(body), self.replies.get_mut(i)) {
                r.body = body;
            }
        }
        for (l, st) in self.lookups.iter_mut().enumerate() {
            let f = self.bufs.take_rows_feed(l);
            if f.index.capacity() > 0 {
                st.index = f.index;
                st.offsets = f.offsets;
            }
        }
    }

    /// Build the pushes of a step's gradients. Every shard gets exactly one
    /// message flagged `completes_step`.
    fn push_requests(&self, out: &StepOutput, batch: &Batch) -> Result<Vec<Request>, TrainError> {
        let pulls = self.part.pulls();
        let b = batch.len;
        let mut items: Vec<(usize, Item)> = Vec::new();
        for (d, (var, _)) in out.dense_grads.iter().enumerate() {
            items.push((self.dense_shard(*var), Item::Dense(d)));
        }
        for (l, st) in self.lookups.iter().enumerate() {
            for (s, keys) in st.shard_keys.iter().enumerate() {
                if !keys.is_empty() {
                    items.push((s, Item::Lookup(l, s)));
                }
            }
        }
        // Lite with Mean: the gradient w.r.t. the partial sums is the
        // gradient w.r.t. the mean divided by the bag size.
        let mut scaled: Vec<Option<Vec<f32>>> = vec![None; pulls.lookups.len()];
        for (l, lp) in pulls.lookups.iter().enumerate() {
            if let (PullForm::Pooled, Combiner::Mean, Some(LookupGrad::Pooled(g))) =
                (lp.form, lp.spec.combiner, out.lookup_grads.get(l))
            {
                let st = &self.lookups[l];
                let mut v = g.data().to_vec();
                for e in 0..b {
                    let n = st.offsets[e + 1] - st.offsets[e];
                    if n > 1 {
                        let inv = 1.0 / n as f32;
                        v[e * lp.dim..(e + 1) * lp.dim]
                            .iter_mut()
                            .for_each(|x| *x *= inv);
                    }
                }
                scaled[l] = Some(v);
            }
        }
        let groups = self.group(items);
        let mut last_for_shard = vec![usize::MAX; self.layout.shards];
        for (m, (s, _)) in groups.iter().enumerate() {
            last_for_shard[*s] = m;
        }
        let mut reqs = Vec::with_capacity(groups.len() + self.layout.shards);
        for (m, (s, items)) in groups.iter().enumerate() {
            // Sized up front: a push carries a step's gradients, and a
            // buffer grown by doubling would copy them several times.
            let len = items.iter().fold(push_request_header_len(), |n, it| {
                n + match *it {
                    Item::Dense(d) => push_dense_len(out.dense_grads[d].1.len()),
                    Item::Lookup(l, sh) => {
                        let (dim, keys) =
                            (pulls.lookups[l].dim, self.lookups[l].shard_keys[sh].len());
                        match pulls.lookups[l].form {
                            PullForm::Rows => push_rows_len(keys, dim),
                            PullForm::Pooled => push_pooled_len(b, keys, dim),
                        }
                    }
                }
            });
            let mut buf = self.body(len);
            let mut w = PushRequestWriter::new(&mut buf, last_for_shard[*s] == m);
            for it in items {
                match *it {
                    Item::Dense(d) => {
                        let (var, g) = &out.dense_grads[d];
                        w.dense(var.0, g.data());
                    }
                    Item::Lookup(l, sh) => {
                        let lp = &pulls.lookups[l];
                        let st = &self.lookups[l];
                        let var = lp.spec.var.0;
                        let dim = lp.dim;
                        match (lp.form, out.lookup_grads.get(l)) {
                            (PullForm::Rows, Some(LookupGrad::Rows(g))) => {
                                let (lo, hi) = (st.shard_start[sh], st.shard_start[sh + 1]);
                                let grads = g.data().get(lo * dim..hi * dim).ok_or_else(|| {
                                    TrainError::Internal("rows gradient shape".into())
                                })?;
                                w.rows(var, dim as u32, &st.shard_keys[sh], grads);
                            }
                            (PullForm::Pooled, Some(LookupGrad::Pooled(g))) => {
                                let data = scaled[l].as_deref().unwrap_or(g.data());
                                w.pooled(
                                    var,
                                    dim as u32,
                                    &st.shard_offsets[sh],
                                    &st.shard_keys[sh],
                                    data,
                                );
                            }
                            _ => {
                                return Err(TrainError::Internal(
                                    "gradient form does not match the protocol".into(),
                                ))
                            }
                        }
                    }
                }
            }
            reqs.push(Request {
                shard: *s,
                opcode: Opcode::SparsePush,
                body: self.payload(buf),
            });
        }
        for (s, &last) in last_for_shard.iter().enumerate() {
            if last == usize::MAX {
                let mut buf = Vec::with_capacity(push_request_header_len());
                PushRequestWriter::new(&mut buf, true);
                reqs.push(Request {
                    shard: s,
                    opcode: Opcode::SparsePush,
                    body: bytes_body(buf),
                });
            }
        }
        Ok(reqs)
    }

    /// One training step on `batch`: send the previous step's pushes with
    /// this step's pulls, compute, and keep this step's pushes for the next
    /// call (or [`flush`](Self::flush)).
    pub fn step(&mut self, net: &mut dyn Exchange, batch: &Batch) -> Result<StepInfo, TrainError> {
        self.step_in_turn(net, batch, None)
    }

    /// [`step`](Self::step), whose pulls wait until every shard's global
    /// step reaches `turn` (`--bounded-delay`): the previous step's
    /// pushes, a `WAIT_STEP` to every shard and this step's pulls go in
    /// one exchange, since a shard applies the push before it holds the
    /// wait, and answers the pull behind it only once the wait is answered.
    pub fn step_in_turn(
        &mut self,
        net: &mut dyn Exchange,
        batch: &Batch,
        turn: Option<u64>,
    ) -> Result<StepInfo, TrainError> {
        self.plan_lookups(batch);
        let (pulls, metas) = self.pull_requests();
        let first = self.push_and_exchange(net, turn, pulls)?;
        let feeds = self.feeds(batch, &metas, first)?;
        if let Some(pool) = &self.pool {
            self.bufs = pool.take_run();
        }
        let out = self
            .part
            .forward_backward_with(&self.exec, feeds, &mut self.bufs)
            .map_err(|e| TrainError::Internal(format!("graph: {e}")))?;
        self.pending_push = self.push_requests(&out, batch)?;
        self.bufs.give_back(self.part.graph(), out.lookup_grads);
        self.reclaim_replies();
        if let Some(pool) = &self.pool {
            pool.put_run(std::mem::take(&mut self.bufs));
        }
        Ok(StepInfo {
            loss: out.loss,
            examples: batch.len,
            global_step: self.global_step,
        })
    }

    /// One exchange: the pending pushes, then with `wait` a `WAIT_STEP` to
    /// every shard, then `then`. The push and wait replies are checked and
    /// the staleness counted; the index of `then`'s first reply in
    /// `self.replies` is returned.
    fn push_and_exchange(
        &mut self,
        net: &mut dyn Exchange,
        wait: Option<u64>,
        then: Vec<Request>,
    ) -> Result<usize, TrainError> {
        let mut reqs = std::mem::take(&mut self.pending_push);
        let n_push = reqs.len();
        if let Some(step) = wait {
            reqs.extend((0..self.layout.shards).map(|s| Request {
                shard: s,
                opcode: Opcode::Rpc,
                body: bytes_body(Control::WaitStep(step).encode()),
            }));
        }
        let first = reqs.len();
        reqs.extend(then);
        self.shards.clear();
        self.shards.extend(reqs.iter().map(|r| r.shard));
        let mut replies = std::mem::take(&mut self.replies);
        let r = net.exchange(reqs, &mut replies);
        self.replies = replies;
        r?;
        for r in &self.replies[..n_push] {
            check(r, "push")?;
            let g = parse_push_response(&r.body)
                .map_err(|e| TrainError::Remote(format!("push reply: {e}")))?;
            self.global_step = self.global_step.max(g);
        }
        for r in &self.replies[n_push..first] {
            check(r, "WAIT_STEP")?;
        }
        let replies = self.shards.iter().zip(&self.replies);
        self.staleness.handle_exchange(
            replies.clone().take(n_push).map(|(&s, r)| (s, &r.body[..])),
            replies.skip(first).map(|(&s, r)| (s, &r.body[..])),
        );
        if let Some(step) = wait {
            self.global_step = self.global_step.max(step);
        }
        Ok(first)
    }

    /// Send the pending pushes and wait for their acknowledgements.
    pub fn flush(&mut self, net: &mut dyn Exchange) -> Result<(), TrainError> {
        self.push_and_exchange(net, None, Vec::new()).map(drop)
    }

    /// Send the pending pushes, then wait until every shard's global step
    /// reaches `step`, in one exchange (each shard applies the push before
    /// it holds the `WAIT_STEP`).
    pub fn flush_and_wait(&mut self, net: &mut dyn Exchange, step: u64) -> Result<(), TrainError> {
        self.push_and_exchange(net, Some(step), Vec::new())
            .map(drop)
    }

    /// The staleness of this worker's pushes so far.
    pub fn staleness(&self) -> &StalenessHistogram {
        self.staleness.histogram()
    }

    /// The `--sync` barrier: wait until every shard has seen `step` steps.
    pub fn barrier(&mut self, net: &mut dyn Exchange, step: u64) -> Result<(), TrainError> {
        let reqs = (0..self.layout.shards)
            .map(|s| Request {
                shard: s,
                opcode: Opcode::Rpc,
                body: bytes_body(Control::WaitStep(step).encode()),
            })
            .collect();
        let mut replies = std::mem::take(&mut self.replies);
        let r = net.exchange(reqs, &mut replies);
        self.replies = replies;
        r?;
        for r in &self.replies[..self.layout.shards] {
            check(r, "barrier")?;
        }
        Ok(())
    }

    /// Predictions for `batch` (evaluation): pulls, forward, no push.
    ///
    /// No push follows the pulls, so each shard pulled from is sent an
    /// empty pull after them, in the same exchange: a shard that keeps a
    /// worker's pulls for its next push (`dc_asgd`, `--staleness-lr`)
    /// drops them at once rather than holding them until this worker's
    /// next step is pushed. Its reply is not read: a shard that fails it
    /// only keeps the pulls until then, as one that ignores it does. Not
    /// where the shards cannot tell this worker's pulls apart (the gRPC
    /// baseline, [`Exchange::sender_known`]): they keep none.
    pub fn predict(
        &mut self,
        net: &mut dyn Exchange,
        batch: &Batch,
    ) -> Result<Vec<f32>, TrainError> {
        self.plan_lookups(batch);
        let (mut reqs, metas) = self.pull_requests();
        // The shards pulled from, where they keep this worker's pulls.
        let mut pulled = vec![false; self.layout.shards];
        if net.sender_known() {
            for r in &reqs {
                if let Some(p) = pulled.get_mut(r.shard) {
                    *p = true;
                }
            }
        }
        for (shard, _) in pulled.iter().enumerate().filter(|(_, &p)| p) {
            let mut buf = Vec::with_capacity(pull_request_header_len());
            PullRequestWriter::new(&mut buf);
            reqs.push(Request {
                shard,
                opcode: Opcode::SparsePull,
                body: bytes_body(buf),
            });
        }
        let mut replies = std::mem::take(&mut self.replies);
        let r = net.exchange(reqs, &mut replies);
        self.replies = replies;
        r?;
        let feeds = self.feeds(batch, &metas, 0)?;
        // No push follows an evaluation's pulls.
        self.staleness.forget_pulls();
        let probs = self
            .part
            .forward(&self.exec, feeds)
            .map_err(|e| TrainError::Internal(format!("graph: {e}")));
        self.reclaim_replies();
        probs
    }

    /// Send one control message to every shard and return the replies.
    pub fn control(
        &mut self,
        net: &mut dyn Exchange,
        c: &Control<'_>,
    ) -> Result<Vec<Vec<u8>>, TrainError> {
        control_all(net, self.layout.shards, c)
    }

    /// Highest global step seen.
    pub fn global_step(&self) -> u64 {
        self.global_step
    }
}

/// A lookup's rows feed from its rows replies, `(shard, body, byte offset
/// of the rows)` in shard order: shard `s`'s rows are
/// `shard_start[s]..shard_start[s + 1]`, and every shard with rows must
/// answer exactly once.
fn rows_feed(
    dim: usize,
    shard_start: &[usize],
    replies: impl Iterator<Item = (usize, Arc<Vec<u8>>, usize)>,
) -> Result<WireRows, TrainError> {
    let mut rows = WireRows::new(dim);
    for (sh, body, at) in replies {
        let (Some(&lo), Some(&hi)) = (shard_start.get(sh), shard_start.get(sh + 1)) else {
            return Err(TrainError::Remote(
                "rows reply from an unknown shard".into(),
            ));
        };
        if rows.rows() != lo {
            return Err(TrainError::Remote("rows reply repeated".into()));
        }
        rows.push(body, at, hi - lo)
            .map_err(|e| TrainError::Remote(format!("rows reply: {e}")))?;
    }
    if rows.rows() != shard_start.last().copied().unwrap_or(0) {
        return Err(TrainError::Remote("rows reply missing".into()));
    }
    Ok(rows)
}

/// Send one control message to shard `shard`; the reply body.
pub fn control_one(
    net: &mut dyn Exchange,
    shard: usize,
    c: &Control<'_>,
) -> Result<Vec<u8>, TrainError> {
    let reqs = vec![Request {
        shard,
        opcode: Opcode::Rpc,
        body: bytes_body(c.encode()),
    }];
    let mut replies = Vec::new();
    net.exchange(reqs, &mut replies)?;
    let r = replies
        .pop()
        .ok_or_else(|| TrainError::Internal("no reply to a control message".into()))?;
    check(&r, "control")?;
    Ok(r.body)
}

/// Send one control message to each of `shards` shards; the reply bodies.
pub fn control_all(
    net: &mut dyn Exchange,
    shards: usize,
    c: &Control<'_>,
) -> Result<Vec<Vec<u8>>, TrainError> {
    let reqs = (0..shards)
        .map(|s| Request {
            shard: s,
            opcode: Opcode::Rpc,
            body: bytes_body(c.encode()),
        })
        .collect();
    let mut replies = Vec::new();
    net.exchange(reqs, &mut replies)?;
    replies
        .into_iter()
        .map(|r| {
            check(&r, "control")?;
            Ok(r.body)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le(v: &[f32]) -> Arc<Vec<u8>> {
        Arc::new(v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }

    #[test]
    fn a_request_body_returns_to_the_pool_when_its_last_payload_drops() {
        let pool = WorkerBuffers::default();
        let mut buf = pool.take_body(100);
        assert!(buf.is_empty() && buf.capacity() >= 100);
        buf.extend_from_slice(b"push body");
        let at = buf.as_ptr();
        let body = Bytes::from_owner(PooledBody {
            buf,
            pool: pool.clone(),
        });
        let copy = body.slice(1..4);
        assert_eq!(&copy[..], b"ush");
        drop(body);
        assert_eq!(pool.idle(), (0, 0), "a slice still holds it");
        drop(copy);
        assert_eq!(pool.idle(), (0, 1));
        // The next body is the same allocation, emptied.
        let again = pool.take_body(10);
        assert!(again.is_empty() && again.as_ptr() == at);
        assert_eq!(pool.idle(), (0, 0));
        pool.put_body(Vec::new());
        assert_eq!(pool.idle(), (0, 0), "an empty vector is not kept");
        for _ in 0..MAX_IDLE_BODIES + 3 {
            pool.put_body(vec![0]);
        }
        assert_eq!(pool.idle(), (0, MAX_IDLE_BODIES));
        pool.put_run(RunBuffers::default());
        assert_eq!(pool.idle().0, 1);
        let _ = pool.take_run();
        let _ = pool.take_run();
        assert_eq!(pool.idle().0, 0);
    }

    /// One rows reply: its shard, its body and where its rows start.
    type RowsReply = (usize, Arc<Vec<u8>>, usize);

    /// Shards 0 and 2 hold rows (1 and 2 of them), shard 1 none.
    const STARTS: [usize; 4] = [0, 1, 1, 3];

    #[test]
    fn a_rows_feed_is_its_shards_ranges_in_order() {
        let (a, b) = (le(&[1.0, 2.0]), le(&[0.0, 3.0, 4.0, 5.0, 6.0]));
        let rows = rows_feed(2, &STARTS, [(0, a, 0), (2, b, 4)].into_iter()).unwrap();
        assert_eq!(rows.rows(), 3);
        assert_eq!(rows.to_tensor().data(), &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    }

    #[test]
    fn a_repeated_missing_short_or_stray_rows_reply_is_an_error() {
        let (a, b) = (le(&[1.0, 2.0]), le(&[3.0, 4.0, 5.0, 6.0]));
        let cases: [(&str, Vec<RowsReply>); 4] = [
            ("repeated", vec![(0, a.clone(), 0), (0, a.clone(), 0)]),
            ("missing", vec![(0, a.clone(), 0)]),
            ("rows reply: ", vec![(0, a.clone(), 0), (2, b.clone(), 4)]),
            ("unknown shard", vec![(0, a, 0), (3, b, 0)]),
        ];
        for (want, replies) in cases {
            match rows_feed(2, &STARTS, replies.into_iter()) {
                Err(TrainError::Remote(e)) => assert!(e.contains(want), "{want}: {e}"),
                other => panic!("{want}: {other:?}"),
            }
        }
    }

    /// In-process shards serving worker 0, their pull replies shared as a
    /// network server's are (a DC-ASGD shard's record of a pull refers to
    /// its reply); each pull reply is kept, and each request.
    struct Served {
        shards: Vec<crate::psserver::Service<crate::handler::ShardHandler>>,
        sent: Vec<(usize, Vec<u8>)>,
        pull_replies: Vec<Bytes>,
        /// Answers [`Exchange::sender_known`] with false (as gRPC's).
        anonymous: bool,
    }

    impl Exchange for Served {
        fn exchange(
            &mut self,
            reqs: Vec<Request>,
            replies: &mut Vec<Reply>,
        ) -> Result<(), TrainError> {
            replies.clear();
            for r in reqs {
                let body: Vec<u8> = r.body.segments().concat();
                let svc = &mut self.shards[r.shard];
                let crate::psserver::Reply::Now(status, bytes) =
                    svc.serve_from(Some(0), r.opcode, &body, Vec::with_capacity)
                else {
                    return Err(TrainError::Internal("not answered at once".into()));
                };
                if r.opcode == Opcode::SparsePull {
                    self.pull_replies.push(bytes.clone());
                    self.sent.push((r.shard, body));
                }
                replies.push(Reply {
                    status: Some(status),
                    body: bytes.to_vec(),
                });
            }
            Ok(())
        }

        fn traffic(&self) -> crate::net::Traffic {
            crate::net::Traffic::default()
        }

        fn sender_known(&self) -> bool {
            !self.anonymous
        }
    }

    fn batch(seed: u64, n: usize) -> Batch {
        use starwire_data::{MISSING_KEY, NUM_CATEGORICAL, NUM_NUMERIC};
        let mut b = Batch::with_capacity(n);
        let mut x = 2 * seed + 1;
        for i in 0..n {
            b.labels.push((i % 2) as f32);
            b.numeric
                .extend((0..NUM_NUMERIC).map(|j| (i + j) as f32 / 16.0));
            b.keys.extend((0..NUM_CATEGORICAL).map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                MISSING_KEY + 1 + x % 500
            }));
            b.len += 1;
        }
        b
    }

    /// An evaluation's pulls go, in their exchange, with an empty pull to
    /// each shard pulled from, after that shard's pulls: a DC-ASGD shard
    /// then holds nothing of them (no reference to their replies) once the
    /// prediction returns, where it held the last one until the worker's
    /// next push. Fused or not.
    #[test]
    fn an_evaluation_s_pulls_are_not_held_by_the_shards() {
        for fuse in [true, false] {
            let cfg = crate::TrainConfig {
                ps: 2,
                workers: 1,
                optimizer: starwire_ps::OptimizerKind::DcAsgd,
                tensor_fuse: fuse,
                ..crate::TrainConfig::default()
            };
            let plan = crate::cluster::plan(&cfg).unwrap();
            assert!(plan.shards >= 2);
            let shards = (0..plan.shards)
                .map(|s| {
                    let shard = crate::cluster::make_shard(&cfg, &plan, s, None).unwrap();
                    assert!(shard.config().optimizer.tracks_pulls());
                    crate::psserver::Service::new(crate::handler::ShardHandler::new(shard, s))
                        .sharing_pull_replies()
                })
                .collect();
            let mut net = Served {
                shards,
                sent: Vec::new(),
                pull_replies: Vec::new(),
                anonymous: false,
            };
            let mut core = WorkerCore::new(
                starwire_graph::partition(&plan.model, cfg.protocol),
                plan.layout.clone(),
                fuse,
                Executor::new(0).unwrap(),
            );
            core.step(&mut net, &batch(1, 16)).unwrap();
            // The step's pull is held by the shards until its push.
            assert!(!net.pull_replies.iter().all(Bytes::is_unique));
            core.flush(&mut net).unwrap();
            for seed in 2..5 {
                net.sent.clear();
                net.pull_replies.clear();
                let probs = core.predict(&mut net, &batch(seed, 16)).unwrap();
                assert_eq!(probs.len(), 16);
                assert!(
                    net.pull_replies.iter().all(Bytes::is_unique),
                    "fuse {fuse}: a shard holds an evaluation's pull reply"
                );
                let limits = Limits::default();
                let empty = |b: &[u8]| {
                    starwire_wire::ps::PullRequest::parse(b, &limits)
                        .unwrap()
                        .is_empty()
                };
                let mut pulled = 0;
                for shard in 0..plan.shards {
                    let to: Vec<bool> = net
                        .sent
                        .iter()
                        .filter(|(s, _)| *s == shard)
                        .map(|(_, b)| empty(b))
                        .collect();
                    let Some((last, pulls)) = to.split_last() else {
                        continue;
                    };
                    assert!(*last, "fuse {fuse}: shard {shard}: {to:?}");
                    assert!(!pulls.is_empty() && pulls.iter().all(|e| !e), "{to:?}");
                    pulled += 1;
                }
                assert!(pulled >= 2, "fuse {fuse}: {pulled} shards pulled from");
            }
            // Training goes on as before.
            core.step(&mut net, &batch(9, 16)).unwrap();
            core.flush(&mut net).unwrap();
            // Shards that cannot tell the sender (gRPC's) keep no pulls:
            // no empty pull goes to them.
            net.anonymous = true;
            net.sent.clear();
            core.predict(&mut net, &batch(10, 16)).unwrap();
            let limits = Limits::default();
            assert!(!net.sent.is_empty());
            for (_, b) in &net.sent {
                let r = starwire_wire::ps::PullRequest::parse(b, &limits).unwrap();
                assert!(
                    !r.is_empty(),
                    "fuse {fuse}: an empty pull to an anonymous PS"
                );
            }
        }
    }
}
