//! [`PsShard`]: the state of one PS reactor and its request handlers.

use bytes::Bytes;
use rustc_hash::{FxHashMap, FxHashSet};
use starwire_wire::ps::{
    self, put_f32s, DecodeError, Limits, PullItem, PullRequest, PullResponseWriter, PushItem,
    PushRequest,
};

use crate::applied::AppliedSteps;
use crate::checkpoint::MAX_WORKER_INDEX;
use crate::error::{PsError, ShardConfigError};
use crate::keyhash::KeySet;
use crate::optim::{OptimizerConfig, Pulled};
use crate::pulls::{Pulls, WorkerPulls};
use crate::table::same_keys;
use crate::table::{EmbeddingTable, NoRoom, TableFull, TablePolicy, TableStats};
use crate::var::{VarDef, VarKind};

/// Configuration of a shard.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShardConfig {
    /// Seed of every initial value (see [`crate::var`]).
    pub seed: u64,
    /// Optimizer of every variable.
    pub optimizer: OptimizerConfig,
    /// Frequency filter: a key gets a row on its `filter_freq`-th pull
    /// request (0/1: first); a key counts at most once per request.
    pub filter_freq: u32,
    /// Rows not touched in the last `steps_to_live` global steps are evicted (0: never).
    pub steps_to_live: u64,
    /// Eviction runs when the global step becomes a multiple of this (0: only
    /// when [`PsShard::evict`] is called).
    pub evict_interval: u64,
    /// Bound on the keys each table's frequency filter counts at once.
    pub filter_capacity: usize,
    /// DeepRec `default_value_dim`: new embedding rows copy row
    /// `key % default_value_dim` of a per-table default value matrix
    /// (0: each key initialised by itself). See [`TablePolicy`].
    pub default_value_dim: usize,
    /// Codec limits applied to requests.
    pub limits: Limits,
    /// Largest pull reply, in bytes (`--max-reply-bytes`): a pull whose
    /// reply would be larger is refused before anything is allocated.
    pub max_reply_bytes: usize,
    /// Most rows of each table on this shard (`--max-rows`).
    pub max_rows: usize,
}

/// The default of [`ShardConfig::max_reply_bytes`] (`--max-reply-bytes`).
pub const DEFAULT_MAX_REPLY_BYTES: usize = 256 << 20;

impl Default for ShardConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            optimizer: OptimizerConfig::sgd(0.01),
            filter_freq: 0,
            steps_to_live: 0,
            evict_interval: 100,
            filter_capacity: TablePolicy::default().filter_capacity,
            default_value_dim: TablePolicy::default().default_value_dim,
            limits: Limits::default(),
            max_reply_bytes: DEFAULT_MAX_REPLY_BYTES,
            max_rows: TablePolicy::default().max_rows,
        }
    }
}

/// A dense variable held whole by this shard.
#[derive(Debug, Clone)]
pub struct DenseVar {
    pub(crate) def: VarDef,
    pub(crate) values: Vec<f32>,
    pub(crate) slots: Vec<f32>,
    pub(crate) updates: u64,
    /// Gradient accumulated during one push (scratch, not state).
    pub(crate) acc: Vec<f32>,
    pub(crate) touched: bool,
}

/// Equality of the state (definition, values, slots, update count), not of
/// the push scratch buffer.
impl PartialEq for DenseVar {
    fn eq(&self, o: &Self) -> bool {
        self.def == o.def
            && self.values == o.values
            && self.slots == o.slots
            && self.updates == o.updates
    }
}

impl DenseVar {
    /// The variable.
    pub fn def(&self) -> &VarDef {
        &self.def
    }
    /// Current values.
    pub fn values(&self) -> &[f32] {
        &self.values
    }
    /// Optimizer slots (slot after slot).
    pub fn slots(&self) -> &[f32] {
        &self.slots
    }
    /// Number of optimizer updates applied.
    pub fn updates(&self) -> u64 {
        self.updates
    }
}

/// A variable of the shard.
// A shard holds a handful of these, each reached through a reference:
// boxing the table would add an indirection to every row lookup to save
// memory that does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Var {
    /// A dense variable.
    Dense(DenseVar),
    /// This shard's piece of an embedding table.
    Table(EmbeddingTable),
}

impl Var {
    pub(crate) fn id(&self) -> u32 {
        match self {
            Var::Dense(d) => d.def.id,
            Var::Table(t) => t.def.id,
        }
    }
}

/// Bytes and message counters for the runtime's report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ShardStats {
    /// Pull requests handled successfully.
    pub pulls: u64,
    /// Push requests handled successfully.
    pub pushes: u64,
    /// Requests rejected with an error.
    pub errors: u64,
    /// Request bytes handled (pull and push, including rejected ones).
    pub request_bytes: u64,
    /// Response bytes written.
    pub response_bytes: u64,
}

/// A summary of a shard for the runtime's report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ShardReport {
    /// The shard's index.
    pub shard_index: usize,
    /// Completed global steps.
    pub global_step: u64,
    /// Request/response counters.
    pub io: ShardStats,
    /// Embedding rows held, over all tables.
    pub rows: u64,
    /// Keys counted by the frequency filters and not admitted yet.
    pub pending: u64,
    /// Table counters summed over all tables.
    pub tables: TableStats,
}

/// One parameter-server shard (one per PS reactor).
#[derive(Debug)]
pub struct PsShard {
    pub(crate) shard_index: usize,
    pub(crate) cfg: ShardConfig,
    pub(crate) vars: Vec<Var>,
    pub(crate) index: FxHashMap<u32, usize>,
    pub(crate) global_step: u64,
    pub(crate) stats: ShardStats,
    /// Each worker's pushes applied (kept in the checkpoint).
    pub(crate) applied: AppliedSteps,
    /// Each worker's last pull, when the optimizer reads it
    /// ([`OptimizerConfig::tracks_pulls`]); not state a checkpoint keeps.
    pulls: Pulls,
    /// The pulls of workers below this index are recorded in `pulls`
    /// (none for a `--sync` run: see [`Self::set_recorded_workers`]).
    recorded_workers: u32,
    // Scratch reused across requests (not state).
    touched: Vec<usize>,
    /// By variable: the items of the push being handled.
    items_of: Vec<u32>,
    pulled: Vec<usize>,
    sum: Vec<f32>,
    /// Per variable: the keys a pull could add to it (an upper bound).
    new_rows: Vec<u64>,
    missing: KeySet,
}

impl PsShard {
    /// [`Self::new`], after checking its arguments: the optimizer's
    /// hyper-parameters ([`OptimizerConfig::validate`]) and that no two
    /// variables share an id. A shard built from a configuration that is
    /// not the program's own should be built with this.
    pub fn try_new(
        shard_index: usize,
        vars: &[VarDef],
        cfg: ShardConfig,
    ) -> Result<Self, ShardConfigError> {
        cfg.optimizer.validate()?;
        let mut ids = FxHashSet::default();
        if let Some(v) = vars.iter().find(|v| !ids.insert(v.id)) {
            return Err(ShardConfigError::DuplicateVariable(v.id));
        }
        Ok(Self::new(shard_index, vars, cfg))
    }

    /// A shard holding `vars`: the dense variables assigned to it and every
    /// embedding table (of which it holds the keys that hash to it). The
    /// optimizer's hyper-parameters are not checked ([`Self::try_new`]
    /// checks them).
    ///
    /// # Panics
    ///
    /// If two variables share an id (a configuration bug, not input).
    pub fn new(shard_index: usize, vars: &[VarDef], cfg: ShardConfig) -> Self {
        let mut sorted: Vec<&VarDef> = vars.iter().collect();
        sorted.sort_by_key(|v| v.id);
        let policy = TablePolicy {
            filter_freq: cfg.filter_freq,
            steps_to_live: cfg.steps_to_live,
            filter_capacity: cfg.filter_capacity,
            default_value_dim: cfg.default_value_dim,
            max_rows: cfg.max_rows,
        };
        let mut out = Vec::with_capacity(sorted.len());
        let mut index = FxHashMap::default();
        for def in sorted {
            assert!(
                index.insert(def.id, out.len()).is_none(),
                "duplicate variable id {}",
                def.id
            );
            out.push(match &def.kind {
                VarKind::Dense { .. } => {
                    let n = def.width();
                    let mut values = vec![0.0; n];
                    def.init_values(cfg.seed, 0, &mut values);
                    let mut slots = vec![0.0; n * cfg.optimizer.slots()];
                    cfg.optimizer.init_slots(&mut slots);
                    Var::Dense(DenseVar {
                        def: def.clone(),
                        values,
                        slots,
                        updates: 0,
                        acc: Vec::new(),
                        touched: false,
                    })
                }
                VarKind::Embedding { dim } => Var::Table(EmbeddingTable::new(
                    def.clone(),
                    *dim,
                    cfg.seed,
                    cfg.optimizer,
                    policy,
                )),
            });
        }
        Self {
            shard_index,
            cfg,
            vars: out,
            index,
            global_step: 0,
            stats: ShardStats::default(),
            applied: AppliedSteps::default(),
            pulls: Pulls::default(),
            recorded_workers: u32::MAX,
            touched: Vec::new(),
            items_of: vec![0; vars.len()],
            pulled: Vec::new(),
            sum: Vec::new(),
            new_rows: Vec::new(),
            missing: KeySet::default(),
        }
    }

    /// This shard's index.
    pub fn shard_index(&self) -> usize {
        self.shard_index
    }
    /// The configuration.
    pub fn config(&self) -> &ShardConfig {
        &self.cfg
    }
    /// Number of completed global steps.
    pub fn global_step(&self) -> u64 {
        self.global_step
    }
    /// Request/response counters.
    pub fn stats(&self) -> ShardStats {
        self.stats
    }
    /// Counters of the shard and of all its tables.
    pub fn report(&self) -> ShardReport {
        let mut r = ShardReport {
            shard_index: self.shard_index,
            global_step: self.global_step,
            io: self.stats,
            ..ShardReport::default()
        };
        for v in &self.vars {
            if let Var::Table(t) = v {
                let s = t.stats();
                r.rows += t.len() as u64;
                r.pending += t.pending_len() as u64;
                r.tables.admitted += s.admitted;
                r.tables.filtered_pulls += s.filtered_pulls;
                r.tables.filter_overflow += s.filter_overflow;
                r.tables.evicted += s.evicted;
                r.tables.ignored_pushes += s.ignored_pushes;
            }
        }
        r
    }

    /// The variables, sorted by id.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }
    /// The variable `id`.
    pub fn var(&self, id: u32) -> Option<&Var> {
        self.index.get(&id).map(|&i| &self.vars[i])
    }
    /// The table `id`, if it is an embedding.
    pub fn table(&self, id: u32) -> Option<&EmbeddingTable> {
        match self.var(id)? {
            Var::Table(t) => Some(t),
            Var::Dense(_) => None,
        }
    }
    /// The dense variable `id`.
    pub fn dense(&self, id: u32) -> Option<&DenseVar> {
        match self.var(id)? {
            Var::Dense(d) => Some(d),
            Var::Table(_) => None,
        }
    }

    /// Make room in each table `id` of `rows` for its number of rows (a
    /// capacity hint; ids that are not tables of this shard are skipped):
    /// its key map sized and its reserved blocks mapped and faulted in by
    /// the process's prefault thread ([`EmbeddingTable::reserve`]). Each
    /// table does it when its first row comes, so a PS no worker trains
    /// holds no memory for them; with `now`, the blocks of every table
    /// are started at once instead, block 0 of each first (for a PS whose
    /// workers are sure to come, as the local cluster's are: the faulting
    /// then overlaps the cluster's start). Returns the tables found.
    pub fn reserve_rows(
        &mut self,
        rows: impl IntoIterator<Item = (u32, usize)>,
        now: bool,
    ) -> usize {
        let mut found = 0;
        let mut orders = Vec::new();
        for (id, n) in rows {
            let Some(&i) = self.index.get(&id) else {
                continue;
            };
            if let Var::Table(t) = &mut self.vars[i] {
                found += 1;
                t.reserve(n);
                if now {
                    orders.extend(t.take_prefault());
                }
            }
        }
        crate::table::prefault::spawn(orders);
        found
    }

    /// Run TTL eviction on every table at the current global step; returns rows removed.
    pub fn evict(&mut self) -> usize {
        let step = self.global_step;
        self.vars
            .iter_mut()
            .map(|v| match v {
                Var::Table(t) => t.evict(step),
                Var::Dense(_) => 0,
            })
            .sum()
    }

    fn lookup(&self, var: u32) -> Result<usize, PsError> {
        self.index
            .get(&var)
            .copied()
            .ok_or(PsError::UnknownVariable(var))
    }

    fn kind_check(&self, var: u32, item: &'static str, want_table: bool) -> Result<usize, PsError> {
        let i = self.lookup(var)?;
        match (&self.vars[i], want_table) {
            (Var::Table(_), true) | (Var::Dense(_), false) => Ok(i),
            (Var::Table(_), false) => Err(PsError::KindMismatch {
                var,
                item,
                var_kind: "embedding",
            }),
            (Var::Dense(_), true) => Err(PsError::KindMismatch {
                var,
                item,
                var_kind: "dense",
            }),
        }
    }

    /// Answer a pull request: `req` is the body, the response is written to
    /// `out` (cleared first). Creates rows of admitted keys; counts filter
    /// pulls. A reply of more than `limits.max_elems` floats is refused
    /// (`Oversized`). On error `out` is left empty and the error counted.
    /// A pull refused before any row is read (a request that does not
    /// decode, a wrong kind, a reply too large, a table it could take past
    /// `max_rows`) changes nothing else. One that fails making a row (no
    /// memory, no row index left) keeps what its keys before that row did
    /// (rows made, with their initial values; rows' access times; filter
    /// counts), and the failing key's filter count: a key refused a row at
    /// the threshold gets it on its next pull with room.
    pub fn handle_pull(&mut self, req: &[u8], out: &mut Vec<u8>) -> Result<(), PsError> {
        self.handle_pull_from(None, req, out)
    }

    /// [`Self::handle_pull`] of worker `worker` (its task index), when the
    /// sender is known: with an optimizer that reads what a push was
    /// computed on ([`OptimizerConfig::tracks_pulls`]), the pulled rows'
    /// update counts (and values, for DC-ASGD) are kept for its next push;
    /// a pull of no items drops what was kept of the worker's pulls (the
    /// worker sends one after pulls no push of its own follows, as an
    /// evaluation's). Whatever the optimizer, its rows items' keys' places
    /// in the key maps are kept, where its push of the same keys looks
    /// first.
    pub fn handle_pull_from(
        &mut self,
        worker: Option<u32>,
        req: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), PsError> {
        self.pull_recorded(worker, req, out, false)
    }

    /// [`Self::handle_pull_from`] of worker `worker` whose reply `out` is
    /// about to leave as shared bytes: a record of pulled values (DC-ASGD)
    /// reads them from the reply instead of copying them, once it is
    /// given with [`Self::attach_pull_reply`], which the caller must do
    /// before the worker's next request to this shard (until then the
    /// record has no values).
    pub fn handle_pull_shared(
        &mut self,
        worker: u32,
        req: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), PsError> {
        self.pull_recorded(Some(worker), req, out, true)
    }

    /// The reply `out` of worker `worker`'s last [`Self::handle_pull_shared`],
    /// as it left: the shard keeps a reference to it while the record of
    /// the pull lasts (until the worker's push of it is applied).
    pub fn attach_pull_reply(&mut self, worker: u32, reply: &Bytes) {
        if let Some(rec) = self.pulls.get_mut(worker) {
            rec.attach_reply(reply);
        }
    }

    /// Record the pulls of workers `0..n` only, for their pushes (all by
    /// default; only an optimizer that reads them,
    /// [`OptimizerConfig::tracks_pulls`], records any). A shard serving a
    /// synchronous run (`--sync`) records none: its workers' pushes are
    /// merged and applied as one push of no worker, which no record
    /// matches, so a record would only grow, by a whole pull per worker
    /// per step. An asynchronous run records its training workers' only:
    /// a sender past them (the local cluster's evaluator) never pushes.
    /// Changing it drops the records kept.
    pub fn set_recorded_workers(&mut self, n: u32) {
        self.recorded_workers = n;
        self.pulls = Pulls::default();
    }

    /// See [`Self::set_recorded_workers`].
    pub fn recorded_workers(&self) -> u32 {
        self.recorded_workers
    }

    /// Workers' pull records dropped because they held more than
    /// [`crate::pulls::MAX_RECORD_BYTES`] with no push (see
    /// [`crate::pulls`]): pushes applied without part of what they were
    /// computed on.
    pub fn pull_records_dropped(&self) -> u64 {
        self.pulls.dropped()
    }

    /// The keys (a dense variable counts as one) held by the workers'
    /// pull records.
    #[cfg(test)]
    pub(crate) fn recorded_pull_keys(&self) -> usize {
        self.pulls.recorded_keys()
    }

    fn pull_recorded(
        &mut self,
        worker: Option<u32>,
        req: &[u8],
        out: &mut Vec<u8>,
        shared: bool,
    ) -> Result<(), PsError> {
        out.clear();
        self.stats.request_bytes += req.len() as u64;
        check_worker(worker)?;
        let r = self.handle_pull_inner(worker, req, out);
        match &r {
            Ok(()) => {
                let tracks = self.cfg.optimizer.tracks_pulls();
                if let Some(w) = worker.filter(|&w| tracks && w < self.recorded_workers) {
                    self.record_pull(w, req, out, shared);
                }
                self.stats.pulls += 1;
                self.stats.response_bytes += out.len() as u64;
            }
            Err(_) => {
                self.stats.errors += 1;
                out.clear();
            }
        }
        r
    }

    fn handle_pull_inner(
        &mut self,
        worker: Option<u32>,
        req: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), PsError> {
        let view = PullRequest::parse(req, &self.cfg.limits)?;
        // Validate every item and size the response before changing
        // anything: each check is O(1) per item.
        let max_reply = self.cfg.max_reply_bytes as u64;
        let mut size = 16u64;
        let mut tables = false;
        for item in view.items() {
            let (i, n) = match item {
                PullItem::Dense { var } => (self.kind_check(var, "dense", false)?, 1),
                PullItem::Rows { var, keys } => (self.kind_check(var, "rows", true)?, keys.len()),
                PullItem::Pooled { var, offsets, .. } => {
                    (self.kind_check(var, "pooled", true)?, offsets.len() - 1)
                }
            };
            let w = match &self.vars[i] {
                Var::Dense(d) => d.values.len(),
                Var::Table(t) => t.dim(),
            };
            let elems = n.saturating_mul(w) as u64;
            if elems > self.cfg.limits.max_elems {
                return Err(DecodeError::Oversized {
                    what: "reply",
                    len: elems,
                    max: self.cfg.limits.max_elems,
                }
                .into());
            }
            size = size.saturating_add(16 + 4 * elems);
            if size > max_reply {
                return Err(PsError::ReplyTooLarge {
                    at_least: size,
                    max: max_reply,
                });
            }
            if let Some(keys) = item.keys() {
                if !tables {
                    self.new_rows.clear();
                    self.new_rows.resize(self.vars.len(), 0);
                    tables = true;
                }
                self.new_rows[i] += keys.len() as u64;
            }
        }
        if tables {
            self.check_room(&view)?;
        }
        // Bounded by `max_reply_bytes` above; a refused allocation is
        // answered, not fatal.
        out.try_reserve(size as usize)
            .map_err(|_| PsError::OutOfMemory { what: "pull reply" })?;
        let step = self.global_step;
        let mut w = PullResponseWriter::new(out, step);
        let mut failed = None;
        for item in view.items() {
            // Indices were checked above.
            let Some(&i) = self.index.get(&item.var()) else {
                continue;
            };
            match (item, &mut self.vars[i]) {
                (PullItem::Dense { var }, Var::Dense(d)) => {
                    put_f32s(w.dense(var, d.values.len() as u32), &d.values);
                }
                (PullItem::Rows { var, keys }, Var::Table(t)) => {
                    let dim = t.dim();
                    let out = w.rows(var, dim as u32, keys.len() as u32);
                    self.pulled.push(i);
                    if let Err(e) = t.pull_rows_into(keys, step, out, worker) {
                        failed = Some(e);
                        break;
                    }
                }
                (PullItem::Pooled { var, offsets, keys }, Var::Table(t)) => {
                    let dim = t.dim();
                    let batch = offsets.len() - 1;
                    let out = w.pooled(var, dim as u32, batch as u32);
                    let sum = &mut self.sum;
                    sum.clear();
                    sum.resize(dim, 0.0);
                    let mut start = 0usize;
                    self.pulled.push(i);
                    'pooled: for end in offsets.iter().skip(1) {
                        let end = end as usize;
                        sum.fill(0.0);
                        for k in keys.slice(start, end).iter() {
                            match t.pull_once(k, step) {
                                Ok(Some(row)) => {
                                    for (a, x) in sum.iter_mut().zip(&row[..dim]) {
                                        *a += x;
                                    }
                                }
                                Ok(None) => {}
                                Err(e) => {
                                    failed = Some(e);
                                    break 'pooled;
                                }
                            }
                        }
                        put_f32s(out, sum);
                        start = end;
                    }
                    if failed.is_some() {
                        break;
                    }
                }
                // Kinds were checked above.
                _ => {}
            }
        }
        // The filter counts a key at most once per request (see `lib.rs`).
        for &i in &self.pulled {
            if let Var::Table(t) = &mut self.vars[i] {
                t.end_request();
            }
        }
        self.pulled.clear();
        match failed {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// Keep what worker `w` pulled with `req` (a pull already answered
    /// with `reply`, whose rows items are recorded from it; `shared`: by
    /// their place in it, the reply to be attached). A pull of no items
    /// drops the worker's record instead: no push follows what it pulled
    /// before (see [`crate::pulls`]).
    fn record_pull(&mut self, w: u32, req: &[u8], reply: &[u8], shared: bool) {
        let base = reply.as_ptr() as usize;
        let Ok(view) = PullRequest::parse(req, &self.cfg.limits) else {
            return;
        };
        if view.is_empty() {
            self.pulls.drop_record(w);
            return;
        }
        // The variables it pulls (read only for a record past its bound):
        // pulling one the record holds again is what may drop it (see
        // `crate::pulls`).
        let index = &self.index;
        let pulled = view
            .items()
            .filter_map(|item| index.get(&item.var()).copied());
        let Some(rec) = self.pulls.begin_pull(w, self.vars.len(), pulled) else {
            return;
        };
        let values = self.cfg.optimizer.kind.needs_pulled_values();
        let updates = crate::pulls::keeps_updates(&self.cfg.optimizer);
        // One reply per item, in the request's order.
        let reply = ps::PullResponse::parse(reply, &self.cfg.limits).ok();
        let mut replies = reply.iter().flat_map(|r| r.items());
        for item in view.items() {
            let answer = replies.next();
            let Some(&i) = self.index.get(&item.var()) else {
                continue;
            };
            match (item, &self.vars[i]) {
                (PullItem::Dense { .. }, Var::Dense(d)) => {
                    let u = updates.then_some(d.updates);
                    rec.record(i as u32, 0, u, values.then_some(&d.values[..]));
                }
                (PullItem::Rows { var, keys }, Var::Table(t)) => match answer {
                    Some(ps::PullReply::Rows { var: v, data, .. }) if v == var => {
                        // The rows' byte offset in the reply they are in.
                        let at = shared.then(|| data.as_bytes().as_ptr() as usize - base);
                        t.record_pulled_rows(i as u32, keys, data, at, rec);
                    }
                    _ => t.record_pulled(i as u32, keys.iter(), rec),
                },
                (PullItem::Pooled { keys, .. }, Var::Table(t)) => {
                    t.record_pulled(i as u32, keys.iter(), rec);
                }
                _ => {}
            }
        }
    }

    /// The first variable of the push whose accumulated gradient is not
    /// finite.
    fn non_finite(&self) -> Option<u32> {
        self.touched.iter().find_map(|&i| {
            let finite = match &self.vars[i] {
                Var::Dense(d) => !d.touched || all_finite(&d.acc),
                Var::Table(t) => t.accumulated_finite(),
            };
            (!finite).then(|| self.vars[i].id())
        })
    }

    /// Refuse a pull that could take a table past
    /// [`ShardConfig::max_rows`] before it creates any row. `new_rows`
    /// holds each table's keys in the request: when those fit, no probe is
    /// made; only a table near its cap has the request's keys counted
    /// (each distinct key without a row once). A key the frequency filter
    /// would still hold back counts as a row: the check errs on refusing.
    fn check_room(&mut self, view: &PullRequest<'_>) -> Result<(), PsError> {
        let max = self.cfg.max_rows as u64;
        for i in 0..self.new_rows.len() {
            let want = self.new_rows[i];
            let Var::Table(t) = &self.vars[i] else {
                continue;
            };
            if want == 0 || t.len() as u64 + want <= max {
                continue;
            }
            self.missing.clear();
            let mut missing = 0usize;
            for item in view.items() {
                if self.index.get(&item.var()) != Some(&i) {
                    continue;
                }
                if let Some(keys) = item.keys() {
                    missing += t.count_missing(keys.iter(), &mut self.missing);
                }
            }
            if t.len() as u64 + missing as u64 > max {
                return Err(PsError::TableFull(TableFull {
                    var: t.def.id,
                    rows: t.len(),
                    why: NoRoom::MaxRows,
                }));
            }
        }
        Ok(())
    }

    /// A push of worker `worker` (its task index): applied as
    /// [`handle_push`](Self::handle_push) does, unless the shard applied
    /// this push of the worker before (a restarted worker replaying a
    /// step, see [`crate::applied`]); then it is only acknowledged, the
    /// response carrying the global step. True when applied.
    pub fn handle_worker_push(
        &mut self,
        worker: u32,
        req: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<bool, PsError> {
        check_worker(Some(worker))?;
        // A header that does not decode is the push's error to report.
        let Ok(completes) = PushRequest::peek_completes_step(req) else {
            return self.handle_push_from(Some(worker), req, out).map(|()| true);
        };
        if !self.applied.handle_push(worker, completes) {
            out.clear();
            ps::write_push_response(out, self.global_step);
            return Ok(false);
        }
        self.handle_push_from(Some(worker), req, out)?;
        self.applied.handle_applied(worker);
        Ok(true)
    }

    /// With `--sync`, a push of worker `worker` that the caller keeps to
    /// apply later, summed into its step (`completes`: the step's last):
    /// numbered as [`handle_worker_push`](Self::handle_worker_push) numbers
    /// it. False when this shard holds that push already, applied or kept
    /// (a restarted worker replaying its step): it is only acknowledged.
    /// Call [`handle_kept`](Self::handle_kept) once it was kept.
    pub fn handle_numbered(&mut self, worker: u32, completes: bool) -> Result<bool, PsError> {
        check_worker(Some(worker))?;
        Ok(self.applied.handle_push(worker, completes))
    }

    /// The push [`handle_numbered`](Self::handle_numbered) let through was
    /// kept: the shard holds it from now on.
    pub fn handle_kept(&mut self, worker: u32) {
        self.applied.handle_applied(worker);
    }

    /// The position of `worker`'s pushes this shard counts as applied
    /// (kept ones included), if it heard from the worker.
    pub fn applied_position(&self, worker: u32) -> Option<crate::applied::Position> {
        self.applied.position(worker)
    }

    /// Take `worker`'s applied position back to `to`: the pushes counted
    /// after it were kept for a step never applied (see
    /// [`crate::applied::AppliedSteps::rewind`]).
    pub fn rewind_applied(&mut self, worker: u32, to: crate::applied::Position) {
        self.applied.rewind(worker, to);
    }

    /// Worker `worker`'s next push is the first of its step `at` (it was
    /// restarted; see [`crate::applied`]).
    pub fn handle_resume(&mut self, worker: u32, at: u64) -> Result<(), PsError> {
        check_worker(Some(worker))?;
        Ok(self.applied.handle_resume(worker, at)?)
    }

    /// Each worker's pushes applied, by task index.
    pub fn applied_steps(&self) -> &AppliedSteps {
        &self.applied
    }

    /// Apply a push request and write the push response to `out` (cleared
    /// first). Duplicate keys across the whole request are summed before the
    /// optimizer runs, as are several dense items for one variable. When the
    /// request completes a step, the global step advances and, every
    /// `evict_interval` steps, TTL eviction runs. On error nothing is changed.
    pub fn handle_push(&mut self, req: &[u8], out: &mut Vec<u8>) -> Result<(), PsError> {
        self.handle_push_from(None, req, out)
    }

    /// The error [`handle_push`](Self::handle_push) would refuse push
    /// `req` with for what it holds, found without applying it or
    /// changing anything (counters included): it must decode against this
    /// shard's limits, each item must name a variable of this shard of
    /// the item's kind and width (the first item that does not is the
    /// error, as there), and every gradient it applies must be finite.
    ///
    /// With `--sync` a worker's push is checked so as it arrives, before
    /// it is kept for its step, so that only its sender fails. A push
    /// that passes can still be refused for a sum that is not finite: of
    /// its duplicate keys, or of a gathered step's pushes.
    fn check_push(&self, req: &[u8]) -> Result<(), PsError> {
        let view = PushRequest::parse(req, &self.cfg.limits)?;
        for item in view.items() {
            match item {
                PushItem::Dense { var, grad } => {
                    let i = self.kind_check(var, "dense", false)?;
                    self.shape_check(i, var, "tensor", grad.len() as u64)?;
                }
                PushItem::Rows { var, dim, .. } => {
                    let i = self.kind_check(var, "rows", true)?;
                    self.shape_check(i, var, "row", dim.into())?;
                }
                PushItem::Pooled { var, dim, .. } => {
                    let i = self.kind_check(var, "pooled", true)?;
                    self.shape_check(i, var, "row", dim.into())?;
                }
            }
        }
        // Every item's variable is known: a NaN or an infinity is refused
        // as `handle_push` refuses it, naming a variable it is in.
        for item in view.items() {
            let finite = match item {
                PushItem::Dense { grad, .. } => grad.all_finite(),
                PushItem::Rows { grads, .. } => grads.all_finite(),
                // An example's gradient goes to each key of its bag: one
                // with no keys is not applied.
                PushItem::Pooled {
                    dim,
                    offsets,
                    grads,
                    ..
                } => {
                    let dim = dim as usize;
                    let mut start = 0u32;
                    offsets.iter().skip(1).enumerate().all(|(b, end)| {
                        let used = end > start;
                        start = end;
                        !used || grads.slice(b * dim, (b + 1) * dim).all_finite()
                    })
                }
            };
            if !finite {
                return Err(PsError::NonFinite { var: item.var() });
            }
        }
        Ok(())
    }

    /// [`Self::check_push`] of a push about to be kept for its `--sync`
    /// step, counted: a push it refuses never reaches the shard again, so
    /// it is counted here as [`Self::handle_push`] counts a push it
    /// refuses (its request bytes and one error). A push that passes is
    /// not counted here: its items are counted with the merged push of its
    /// step, when that is handled.
    pub fn handle_push_check(&mut self, req: &[u8]) -> Result<(), PsError> {
        let r = self.check_push(req);
        if r.is_err() {
            self.stats.request_bytes += req.len() as u64;
            self.stats.errors += 1;
        }
        r
    }

    /// [`Self::handle_push`] of worker `worker` (its task index), when the
    /// sender is known: an optimizer that reads what a push was computed
    /// on ([`OptimizerConfig::tracks_pulls`]) gets each row's staleness
    /// and pulled values from the worker's last pull
    /// ([`Self::handle_pull_from`]).
    pub fn handle_push_from(
        &mut self,
        worker: Option<u32>,
        req: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), PsError> {
        out.clear();
        self.stats.request_bytes += req.len() as u64;
        check_worker(worker)?;
        let tracked = worker.filter(|_| self.cfg.optimizer.tracks_pulls());
        let mut rec = tracked.and_then(|w| self.pulls.take(w));
        let r = self.handle_push_inner(worker, rec.as_mut(), req, out);
        if let (Some(w), Some(mut rec)) = (tracked, rec) {
            rec.end_push();
            self.pulls.put_back(w, rec);
            if r.is_ok() {
                self.pulls.release(w, &self.touched);
            }
        }
        match &r {
            Ok(()) => {
                self.stats.pushes += 1;
                self.stats.response_bytes += out.len() as u64;
            }
            Err(_) => {
                self.stats.errors += 1;
                out.clear();
            }
        }
        r
    }

    fn shape_check(&self, i: usize, var: u32, what: &'static str, got: u64) -> Result<(), PsError> {
        let expected = match &self.vars[i] {
            Var::Dense(d) => d.values.len(),
            Var::Table(t) => t.dim(),
        } as u64;
        if expected != got {
            return Err(PsError::ShapeMismatch {
                var,
                what,
                expected,
                got,
            });
        }
        Ok(())
    }

    fn handle_push_inner(
        &mut self,
        worker: Option<u32>,
        mut rec: Option<&mut WorkerPulls>,
        req: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), PsError> {
        let view = PushRequest::parse(req, &self.cfg.limits)?;
        self.items_of.iter_mut().for_each(|n| *n = 0);
        // Each variable once, however many items name it (a gathered
        // `--sync` step has one per worker): the finiteness check and the
        // update below run once per variable.
        self.touched.clear();
        for item in view.items() {
            if let Some(&i) = self.index.get(&item.var()) {
                if self.items_of[i] == 0 {
                    self.touched.push(i);
                }
                self.items_of[i] += 1;
            }
            match item {
                PushItem::Dense { var, grad } => {
                    let i = self.kind_check(var, "dense", false)?;
                    self.shape_check(i, var, "tensor", grad.len() as u64)?;
                }
                PushItem::Rows {
                    var,
                    dim,
                    keys,
                    grads,
                } => {
                    let i = self.kind_check(var, "rows", true)?;
                    self.shape_check(i, var, "row", dim.into())?;
                    debug_assert_eq!(grads.len(), keys.len() * dim as usize);
                }
                PushItem::Pooled { var, dim, .. } => {
                    let i = self.kind_check(var, "pooled", true)?;
                    self.shape_check(i, var, "row", dim.into())?;
                }
            }
        }
        let step = self.global_step;
        // The first variable whose gradients, applied straight from the
        // request below, are not finite.
        let mut direct_non_finite = None;
        // Some table's item is applied straight from the request.
        let mut any_direct = false;
        for item in view.items() {
            let var = item.var();
            let Some(&i) = self.index.get(&var) else {
                continue;
            };
            match (item, &mut self.vars[i]) {
                (PushItem::Dense { grad, .. }, Var::Dense(d)) => {
                    if !d.touched {
                        d.acc.clear();
                        d.acc.resize(d.values.len(), 0.0);
                        d.touched = true;
                    }
                    grad.add_to(&mut d.acc);
                }
                (
                    PushItem::Rows {
                        dim, keys, grads, ..
                    },
                    Var::Table(t),
                ) => {
                    // A table's only item in the request, with unique keys,
                    // updates its rows without going through the
                    // accumulator (there is nothing to sum), once the
                    // whole push is known to be finite. A push applied
                    // with its worker's pull does so when it pushes the
                    // rows pulled, in order.
                    let in_order = rec
                        .as_deref()
                        .map_or(true, |r| same_keys(keys, r.var(i as u32)));
                    if in_order && self.items_of[i] == 1 {
                        if let Some(finite) = t.prepare_direct(keys, grads, step, worker) {
                            any_direct = true;
                            if !finite && direct_non_finite.is_none() {
                                direct_non_finite = Some(var);
                            }
                            continue;
                        }
                    }
                    let dim = dim as usize;
                    for (j, k) in keys.iter().enumerate() {
                        t.accumulate(k, grads.slice(j * dim, (j + 1) * dim));
                    }
                }
                (
                    PushItem::Pooled {
                        dim,
                        offsets,
                        keys,
                        grads,
                        ..
                    },
                    Var::Table(t),
                ) => {
                    let dim = dim as usize;
                    let mut start = 0usize;
                    for (b, end) in offsets.iter().skip(1).enumerate() {
                        let end = end as usize;
                        let g = grads.slice(b * dim, (b + 1) * dim);
                        for k in keys.slice(start, end).iter() {
                            t.accumulate(k, g);
                        }
                        start = end;
                    }
                }
                _ => {}
            }
        }
        // A NaN or an infinity would spread to every weight it touches:
        // refuse the push before any variable changes. The check runs over
        // the accumulated (deduplicated) gradients, which are in cache, and
        // also catches finite gradients whose sum overflows.
        if let Some(var) = direct_non_finite.or_else(|| self.non_finite()) {
            for &i in &self.touched {
                match &mut self.vars[i] {
                    Var::Dense(d) => d.touched = false,
                    Var::Table(t) => t.discard_accumulated(),
                }
            }
            return Err(PsError::NonFinite { var });
        }
        let opt = self.cfg.optimizer;
        for &i in &self.touched {
            match &mut self.vars[i] {
                Var::Dense(d) if d.touched => {
                    d.touched = false;
                    let pulled = match rec.as_deref_mut() {
                        Some(r) => r.pulled(i as u32, 0, d.updates, d.values.len()),
                        None => Pulled::default(),
                    };
                    d.updates += 1;
                    opt.apply_stale(&mut d.values, &mut d.slots, &d.acc, d.updates, step, pulled);
                }
                Var::Table(t) if t.has_accumulated() => match rec.as_deref_mut() {
                    Some(r) => {
                        t.apply_accumulated_stale(step, i as u32, r);
                    }
                    None => {
                        t.apply_accumulated_at(step);
                    }
                },
                _ => {}
            }
        }
        // Walked again only for those items: the request of a gathered
        // step, whose tables have many items each, is not read a third time.
        if any_direct {
            for item in view.items() {
                let PushItem::Rows { var, grads, .. } = item else {
                    continue;
                };
                match self.index.get(&var).map(|&i| (i, &mut self.vars[i])) {
                    Some((i, Var::Table(t))) if self.items_of[i] == 1 => {
                        match rec.as_deref().and_then(|r| r.var(i as u32)) {
                            Some(pulled) => t.push_rows_direct_stale(grads, step, pulled),
                            None => t.push_rows_direct(grads, step),
                        }
                    }
                    _ => {}
                }
            }
        }
        if view.completes_step {
            self.global_step += 1;
            let iv = self.cfg.evict_interval;
            if self.cfg.steps_to_live > 0 && iv > 0 && self.global_step % iv == 0 {
                self.evict();
            }
        }
        ps::write_push_response(out, self.global_step);
        Ok(())
    }
}

/// True when no value of `v` is NaN or infinite. The fold has no early
/// exit, so it vectorises.
pub(crate) fn all_finite(v: &[f32]) -> bool {
    v.iter().fold(true, |ok, x| ok & x.is_finite())
}

/// What a shard keeps per worker (applied pushes, last pulls) is indexed
/// by the worker's task index: one beyond the bound is refused rather
/// than sizing those tables.
fn check_worker(worker: Option<u32>) -> Result<(), PsError> {
    match worker {
        Some(w) if w > MAX_WORKER_INDEX => Err(PsError::WorkerIndex(w)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::var::Init;
    use starwire_wire::ps::{PullRequestWriter, PushRequestWriter};

    const EMB: u32 = 1;
    const W: u32 = 2;

    fn shard() -> PsShard {
        shard_with(OptimizerConfig::sgd(1.0))
    }

    fn shard_with(optimizer: OptimizerConfig) -> PsShard {
        let vars = [
            VarDef {
                id: W,
                name: "w".into(),
                kind: VarKind::Dense { shape: vec![2] },
                init: Init::Zeros,
            },
            VarDef {
                id: EMB,
                name: "emb".into(),
                kind: VarKind::Embedding { dim: 2 },
                init: Init::Zeros,
            },
        ];
        let cfg = ShardConfig {
            optimizer,
            ..ShardConfig::default()
        };
        PsShard::new(0, &vars, cfg)
    }

    #[test]
    fn try_new_refuses_a_bad_optimizer_and_duplicate_ids() {
        let var = |id| VarDef {
            id,
            name: format!("v{id}"),
            kind: VarKind::Dense { shape: vec![1] },
            init: Init::Zeros,
        };
        let bad = ShardConfig {
            optimizer: OptimizerConfig {
                epsilon: 0.0,
                ..OptimizerConfig::adam(0.1)
            },
            ..ShardConfig::default()
        };
        match PsShard::try_new(0, &[var(1)], bad) {
            Err(ShardConfigError::Optimizer(e)) => assert_eq!(e.field, "epsilon"),
            other => panic!("{other:?}"),
        }
        let dup = PsShard::try_new(0, &[var(1), var(2), var(1)], ShardConfig::default());
        assert_eq!(dup.unwrap_err(), ShardConfigError::DuplicateVariable(1));
        let s = PsShard::try_new(3, &[var(2), var(1)], ShardConfig::default()).unwrap();
        assert_eq!((s.shard_index(), s.vars().len()), (3, 2));
    }

    /// Pull `keys` of the table, which creates their rows.
    fn pull_rows(s: &mut PsShard, keys: &[u64]) {
        let mut req = Vec::new();
        PullRequestWriter::new(&mut req).rows(EMB, keys);
        s.handle_pull(&req, &mut Vec::new()).unwrap();
    }

    /// A worker's pulls with no push of its own between them (as a
    /// `--sync` step's: its push is merged into one of no worker) pile up
    /// in its record; a shard that records no pulls keeps none.
    #[test]
    fn a_shard_that_records_no_pulls_keeps_none_of_a_worker_s_pulls() {
        let mut s = shard();
        s.cfg.optimizer = OptimizerConfig::with_kind(crate::OptimizerKind::DcAsgd, 0.5);
        assert_eq!(s.recorded_workers(), u32::MAX);
        let mut req = Vec::new();
        PullRequestWriter::new(&mut req).rows(EMB, &[7, 8]).dense(W);
        let mut out = Vec::new();
        for step in 1..=3 {
            s.handle_pull_from(Some(0), &req, &mut out).unwrap();
            assert_eq!(s.recorded_pull_keys(), 3 * step);
            // The step's merged push (no worker) uses up no record.
            let mut push = Vec::new();
            PushRequestWriter::new(&mut push, true).rows(EMB, 2, &[7, 8], &[1.0; 4]);
            s.handle_push(&push, &mut Vec::new()).unwrap();
        }
        s.set_recorded_workers(0);
        assert_eq!(s.recorded_pull_keys(), 0);
        for _ in 0..3 {
            s.handle_pull_from(Some(0), &req, &mut out).unwrap();
            s.handle_pull_shared(1, &req, &mut out).unwrap();
            s.attach_pull_reply(1, &Bytes::copy_from_slice(&out));
            assert_eq!(s.recorded_pull_keys(), 0);
        }
        // A worker's own push then finds no record, as an unknown sender's.
        let mut push = Vec::new();
        PushRequestWriter::new(&mut push, true).rows(EMB, 2, &[7, 8], &[1.0; 4]);
        s.handle_push_from(Some(0), &push, &mut out).unwrap();
        assert_eq!(s.recorded_pull_keys(), 0);
    }

    /// A worker that pulls and never pushes holds a bounded record: past
    /// the limit its next pull starts the record again, and its push is
    /// matched with that pull.
    #[test]
    fn a_worker_that_only_pulls_holds_a_bounded_record() {
        let mut s = shard_with(OptimizerConfig::with_kind(
            crate::OptimizerKind::DcAsgd,
            0.5,
        ));
        // Two keys of width 2 and the dense variable: 2 x (8 + 8) + (8 + 8)
        // bytes a pull of keys and values. Three pulls are not past the
        // limit: the fifth finds four past it and starts again.
        s.pulls.set_limit(3 * 48);
        let mut out = Vec::new();
        for i in 0..1000u64 {
            let mut req = Vec::new();
            PullRequestWriter::new(&mut req)
                .rows(EMB, &[2 * i, 2 * i + 1])
                .dense(W);
            s.handle_pull_from(Some(0), &req, &mut out).unwrap();
            assert!(s.recorded_pull_keys() <= 4 * 3, "pull {i}");
        }
        assert_eq!(s.pull_records_dropped(), 249);
        // The push of the last pull finds it.
        let emb = s.index[&EMB] as u32;
        let rec = s.pulls.get_mut(0).unwrap();
        assert_eq!(rec.var(emb).unwrap().keys.last(), Some(&1999));
        assert!(rec.pulled(emb, 1999, 0, 2).values.is_some());
        let mut push = Vec::new();
        PushRequestWriter::new(&mut push, true)
            .rows(EMB, 2, &[1998, 1999], &[1.0; 4])
            .dense(W, &[1.0, 1.0]);
        s.handle_push_from(Some(0), &push, &mut out).unwrap();
        assert_eq!(s.recorded_pull_keys(), 0);
        // A worker that pushes after each pull never reaches it.
        let mut req = Vec::new();
        PullRequestWriter::new(&mut req)
            .rows(EMB, &[1998, 1999])
            .dense(W);
        for _ in 0..10 {
            s.handle_pull_from(Some(0), &req, &mut out).unwrap();
            s.handle_push_from(Some(0), &push, &mut out).unwrap();
        }
        assert_eq!(s.pull_records_dropped(), 249);
        // One step's pulls, one variable per request (no fusion), are
        // never dropped, however far past the limit they go together.
        s.pulls.set_limit(20);
        let mut emb = Vec::new();
        PullRequestWriter::new(&mut emb).rows(EMB, &[1998, 1999]);
        let mut w = Vec::new();
        PullRequestWriter::new(&mut w).dense(W);
        for _ in 0..3 {
            s.handle_pull_from(Some(0), &emb, &mut out).unwrap();
            s.handle_pull_from(Some(0), &w, &mut out).unwrap();
            assert_eq!(s.recorded_pull_keys(), 3);
            s.handle_push_from(Some(0), &push, &mut out).unwrap();
        }
        assert_eq!(s.pull_records_dropped(), 249);
        // Pulling a variable it holds again is a new step's pull.
        s.handle_pull_from(Some(0), &emb, &mut out).unwrap();
        s.handle_pull_from(Some(0), &w, &mut out).unwrap();
        s.handle_pull_from(Some(0), &emb, &mut out).unwrap();
        assert_eq!(s.pull_records_dropped(), 250);
        assert_eq!(s.recorded_pull_keys(), 2);
    }

    /// Worker 0's evaluation between epochs follows each batch's pull with
    /// a pull of no items: the worker's record then holds nothing of the
    /// evaluation (nor a reference to its replies), the empty pull is
    /// answered as any pull, and the next step's pull is recorded alone,
    /// for its push.
    #[test]
    fn an_empty_pull_drops_what_the_worker_s_record_holds() {
        let mut s = shard_with(OptimizerConfig::with_kind(
            crate::OptimizerKind::DcAsgd,
            0.5,
        ));
        let emb = s.index[&EMB] as u32;
        let mut step = Vec::new();
        PullRequestWriter::new(&mut step)
            .rows(EMB, &[7, 8])
            .dense(W);
        let mut eval = Vec::new();
        PullRequestWriter::new(&mut eval)
            .rows(EMB, &[7, 9, 10])
            .dense(W);
        let mut empty = Vec::new();
        PullRequestWriter::new(&mut empty);
        let mut push = Vec::new();
        PushRequestWriter::new(&mut push, true)
            .rows(EMB, 2, &[7, 8], &[1.0; 4])
            .dense(W, &[1.0, 1.0]);
        let mut out = Vec::new();
        s.handle_pull_from(Some(0), &step, &mut out).unwrap();
        assert_eq!(s.recorded_pull_keys(), 3);
        s.handle_push_from(Some(0), &push, &mut out).unwrap();
        assert_eq!(s.recorded_pull_keys(), 0);
        // The evaluation: two batches, their replies copied, then two
        // whose replies the record refers to (a network server's).
        for shared in [false, false, true, true] {
            let reply = if shared {
                s.handle_pull_shared(0, &eval, &mut out).unwrap();
                let reply = Bytes::copy_from_slice(&out);
                s.attach_pull_reply(0, &reply);
                assert!(!reply.is_unique(), "the record refers to the reply");
                Some(reply)
            } else {
                s.handle_pull_from(Some(0), &eval, &mut out).unwrap();
                None
            };
            assert_eq!(s.recorded_pull_keys(), 4);
            let pulls = s.stats().pulls;
            if shared {
                s.handle_pull_shared(0, &empty, &mut out).unwrap();
                s.attach_pull_reply(0, &Bytes::copy_from_slice(&out));
            } else {
                s.handle_pull_from(Some(0), &empty, &mut out).unwrap();
            }
            assert_eq!(s.recorded_pull_keys(), 0);
            assert!(reply.map_or(true, |r| r.is_unique()), "reply released");
            let r = ps::PullResponse::parse(&out, &Limits::default()).unwrap();
            assert!(r.is_empty());
            assert_eq!(r.global_step, 1);
            assert_eq!(s.stats().pulls, pulls + 1);
        }
        // The next step's pull is recorded alone, and its push uses it up.
        s.handle_pull_from(Some(0), &step, &mut out).unwrap();
        assert_eq!(s.recorded_pull_keys(), 3);
        let rec = s.pulls.get_mut(0).unwrap();
        assert_eq!(rec.var(emb).unwrap().keys, [7, 8]);
        s.handle_push_from(Some(0), &push, &mut out).unwrap();
        assert_eq!(s.recorded_pull_keys(), 0);
        assert_eq!(s.global_step(), 2);
        // An empty pull of a worker with no record, or not recorded (the
        // evaluator past the training workers), changes nothing.
        s.handle_pull_from(Some(5), &empty, &mut out).unwrap();
        s.set_recorded_workers(1);
        s.handle_pull_from(Some(1), &eval, &mut out).unwrap();
        s.handle_pull_from(Some(1), &empty, &mut out).unwrap();
        assert_eq!(s.recorded_pull_keys(), 0);
        assert_eq!(s.stats().errors, 0);
    }

    /// A push with several items per variable, as a gathered `--sync`
    /// step has one per worker, touches each variable once, in the order
    /// of its first item, and sums the items before the update.
    #[test]
    fn a_push_of_many_items_per_variable_touches_each_variable_once() {
        let mut s = shard();
        let mut out = Vec::new();
        let mut req = Vec::new();
        pull_rows(&mut s, &[7, 8]);
        let mut w = PushRequestWriter::new(&mut req, true);
        for worker in 0..6 {
            let g = worker as f32;
            w.rows(EMB, 2, &[7, 8], &[g, g, 1.0, 1.0])
                .dense(W, &[g, 2.0]);
        }
        s.handle_push(&req, &mut out).unwrap();
        let (emb, w) = (s.index[&EMB], s.index[&W]);
        assert_eq!(s.touched, [emb, w]);
        // SGD at lr 1 on the sums: 0 + 1 + ... + 5 = 15, and 6 × 1, 6 × 2.
        assert_eq!(s.table(EMB).unwrap().get(7).unwrap(), &[-15.0, -15.0]);
        assert_eq!(s.table(EMB).unwrap().get(8).unwrap(), &[-6.0, -6.0]);
        assert_eq!(s.dense(W).unwrap().values(), &[-15.0, -12.0]);
    }

    /// A non-finite gradient in a later item of a variable refuses the
    /// whole push, naming that variable, and changes nothing.
    #[test]
    fn a_non_finite_later_item_refuses_the_push() {
        let mut s = shard();
        let mut out = Vec::new();
        let mut req = Vec::new();
        pull_rows(&mut s, &[7]);
        let mut w = PushRequestWriter::new(&mut req, true);
        w.dense(W, &[1.0, 1.0]).rows(EMB, 2, &[7], &[1.0, 1.0]);
        w.dense(W, &[1.0, 1.0]).rows(EMB, 2, &[7], &[f32::NAN, 1.0]);
        assert!(matches!(
            s.handle_push(&req, &mut out),
            Err(PsError::NonFinite { var: EMB })
        ));
        assert_eq!(s.table(EMB).unwrap().get(7).unwrap(), &[0.0, 0.0]);
        assert_eq!(s.dense(W).unwrap().values(), &[0.0, 0.0]);
        assert_eq!(s.global_step(), 0);
        // The next push is applied as usual.
        req.clear();
        PushRequestWriter::new(&mut req, true).rows(EMB, 2, &[7], &[1.0, 1.0]);
        s.handle_push(&req, &mut out).unwrap();
        assert_eq!(s.table(EMB).unwrap().get(7).unwrap(), &[-1.0, -1.0]);
    }
}
