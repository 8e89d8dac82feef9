//! Setting a connection up: the ring sizes ([`RingConfig`]), what the
//! peer learns out of band ([`RemoteRing`]), their checks, and
//! [`PreparedRing`], a connection whose memory is registered and receive
//! WRs posted, waiting for the peer's ring.

use std::collections::VecDeque;

use starwire_transport::TransportError;

use super::{wr_id, RingConn, RingError, RingFault, RingStats, MIN_RECV_DEPTH, WR_RECV};
use crate::imm::{MAX_CREDIT_BYTES, MAX_CREDIT_RECVS, MAX_DATA_LEN, SLOT};
use crate::verbs::{Access, Completion, MemoryRegion, QpCaps, Verbs};

/// Sizes of the rings of every connection of one driver (its side of
/// each connection).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingConfig {
    /// Bytes of the local receive ring the peer writes into. A multiple of
    /// 128 (two slots), at most 128 MiB − 64 (what a credit immediate can
    /// return at once).
    pub ring_len: usize,
    /// Bytes of the local staging region frames are encoded into. A
    /// multiple of 64.
    pub staging_len: usize,
    /// Receive WRs kept posted: at most this many peer writes (frames and
    /// credit messages) may be in flight towards us. Between
    /// [`MIN_RECV_DEPTH`] and 1023, and within the QP's `max_recv_wr`.
    pub recv_depth: u32,
    /// Largest frame the connections send. `None` picks
    /// min(`ring_len` / 2, `staging_len`), assuming peers with rings of
    /// the same length. Either way it must fit half of each peer's ring
    /// and each queue pair's maximum message (checked when a connection
    /// is prepared and connected).
    pub max_frame_len: Option<usize>,
}

impl Default for RingConfig {
    fn default() -> Self {
        Self {
            ring_len: 1 << 20,
            staging_len: 1 << 20,
            recv_depth: 128,
            max_frame_len: None,
        }
    }
}

/// What one side tells the other out of band before connecting: where to
/// write and how many writes it may have in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRing {
    /// rkey of the receive ring.
    pub rkey: u32,
    /// Address of the ring's first byte (`remote_addr` of offset 0).
    pub addr: u64,
    /// Length of the receive ring in bytes.
    pub len: usize,
    /// Receive WRs posted for incoming writes.
    pub recv_depth: u32,
}

impl RemoteRing {
    /// Size of [`to_bytes`](Self::to_bytes).
    pub const ENCODED_LEN: usize = 24;

    /// Little-endian encoding for the out-of-band exchange:
    /// rkey (u32), recv_depth (u32), addr (u64), len (u64).
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0; Self::ENCODED_LEN];
        out[0..4].copy_from_slice(&self.rkey.to_le_bytes());
        out[4..8].copy_from_slice(&self.recv_depth.to_le_bytes());
        out[8..16].copy_from_slice(&self.addr.to_le_bytes());
        out[16..24].copy_from_slice(&(self.len as u64).to_le_bytes());
        out
    }

    /// Whether this ring, announced by a peer, can carry frames of
    /// `max_frame` bytes: its length and receive depth are in range, half
    /// of it holds a frame, and it does not run past the end of the
    /// address space. [`RdmaDriver::connect`](crate::RdmaDriver::connect)
    /// runs this check; a setup can run it
    /// ([`RdmaDriver::check_remote`](crate::RdmaDriver::check_remote))
    /// before connecting its queue pair.
    pub fn check(&self, max_frame: usize) -> Result<(), RingError> {
        check_remote(self, max_frame)
    }

    /// Inverse of [`to_bytes`](Self::to_bytes). Values are checked by
    /// [`check`](Self::check) and
    /// [`RdmaDriver::connect`](crate::RdmaDriver::connect).
    pub fn from_bytes(b: &[u8; Self::ENCODED_LEN]) -> Self {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut v = [0; 8];
            v.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(v)
        };
        Self {
            rkey: u32_at(0),
            recv_depth: u32_at(4),
            addr: u64_at(8),
            len: usize::try_from(u64_at(16)).unwrap_or(usize::MAX),
        }
    }
}

fn check_ring_shape(len: usize, recv_depth: u32) -> Result<(), String> {
    if len < 2 * SLOT || len % (2 * SLOT) != 0 {
        return Err(format!(
            "ring length {len} is not a non-zero multiple of {}",
            2 * SLOT
        ));
    }
    if len > MAX_CREDIT_BYTES {
        return Err(format!(
            "ring length {len} exceeds the {MAX_CREDIT_BYTES} bytes a credit can return"
        ));
    }
    if !(MIN_RECV_DEPTH..=MAX_CREDIT_RECVS).contains(&recv_depth) {
        return Err(format!(
            "receive depth {recv_depth} outside {MIN_RECV_DEPTH}..={MAX_CREDIT_RECVS}"
        ));
    }
    Ok(())
}

/// The validated shape of the rings of one driver: every connection uses
/// the same sizes and carries frames of up to `max_frame` bytes.
pub(crate) fn check_config(cfg: &RingConfig) -> Result<usize, RingError> {
    check_ring_shape(cfg.ring_len, cfg.recv_depth).map_err(RingError::Config)?;
    if cfg.staging_len < SLOT || cfg.staging_len % SLOT != 0 {
        return Err(RingError::Config(format!(
            "staging length {} is not a non-zero multiple of {SLOT}",
            cfg.staging_len
        )));
    }
    // Peers are assumed to use rings of our length until `connect` says
    // otherwise (and is refused if theirs is too short).
    let limit = (cfg.ring_len / 2).min(cfg.staging_len).min(MAX_DATA_LEN);
    match cfg.max_frame_len {
        None => Ok(limit),
        Some(m) if m <= limit => Ok(m),
        Some(m) => Err(RingError::Config(format!(
            "max_frame_len {m} exceeds {limit} (ring / 2, staging)"
        ))),
    }
}

/// Whether a peer's ring can carry frames of `max_frame` bytes.
pub(crate) fn check_remote(remote: &RemoteRing, max_frame: usize) -> Result<(), RingError> {
    check_ring_shape(remote.len, remote.recv_depth).map_err(RingError::Remote)?;
    // Every write lands at `addr + offset` for an offset below `len`: a
    // ring reaching past the end of the address space is refused here
    // rather than overflowing when frames are posted.
    let end = u64::try_from(remote.len)
        .ok()
        .and_then(|len| remote.addr.checked_add(len));
    if end.is_none() {
        return Err(RingError::Remote(format!(
            "a {}-byte ring at address {:#x} extends past the end of the address space",
            remote.len, remote.addr
        )));
    }
    if max_frame > remote.len / 2 {
        return Err(RingError::Remote(format!(
            "a {}-byte ring cannot carry the driver's {max_frame}-byte frames (at most ring / 2)",
            remote.len
        )));
    }
    Ok(())
}

/// A connection whose memory is registered and receive WRs posted,
/// waiting for the peer's [`RemoteRing`]. Completions that arrive before
/// (the peer may connect and write first) are held and replayed.
#[derive(Debug)]
pub(crate) struct PreparedRing {
    qpn: u32,
    slot: u32,
    caps: QpCaps,
    staging: MemoryRegion,
    ring: MemoryRegion,
    recv_depth: u32,
    next_recv: u32,
    early: Vec<Completion>,
    /// A fault of the driver's completion queue seen before connecting.
    fault: Option<RingFault>,
}

impl PreparedRing {
    /// Register the staging region and the receive ring of the connection
    /// in `slot` (over queue pair `qpn`) and post `cfg.recv_depth` receive
    /// WRs (before the peer can write, so no write ever meets an empty
    /// receive queue). On error nothing stays registered.
    pub(crate) fn new<V: Verbs>(
        verbs: &mut V,
        qpn: u32,
        slot: u32,
        cfg: &RingConfig,
        max_frame: usize,
    ) -> Result<Self, RingError> {
        let caps = verbs.qp_caps(qpn).ok_or(RingError::UnknownQp(qpn))?;
        if cfg.recv_depth > caps.max_recv_wr {
            return Err(RingError::Config(format!(
                "receive depth {} exceeds the QP's max_recv_wr {}",
                cfg.recv_depth, caps.max_recv_wr
            )));
        }
        if caps.max_send_wr == 0 {
            return Err(RingError::Config("QP has max_send_wr 0".into()));
        }
        if max_frame > caps.max_msg_size {
            return Err(RingError::Config(format!(
                "max frame {max_frame} exceeds the QP's maximum message {}",
                caps.max_msg_size
            )));
        }
        // The peer writes into the ring only: staging is registered
        // without remote write, so no key of it admits the peer's writes
        // (the ring lends staging as `&mut [u8]`).
        let staging = verbs.reg_mr(cfg.staging_len, Access::Local)?;
        let ring = match verbs.reg_mr(cfg.ring_len, Access::RemoteWrite) {
            Ok(ring) => ring,
            Err(e) => {
                let _ = verbs.dereg_mr(staging.lkey);
                return Err(e.into());
            }
        };
        let prepared = Self {
            qpn,
            slot,
            caps,
            staging,
            ring,
            recv_depth: cfg.recv_depth,
            next_recv: cfg.recv_depth,
            early: Vec::new(),
            fault: None,
        };
        for i in 0..cfg.recv_depth {
            if let Err(e) = verbs.post_recv(qpn, wr_id(WR_RECV, slot, i)) {
                prepared.release(verbs);
                return Err(e.into());
            }
        }
        Ok(prepared)
    }

    /// What to send to the peer.
    pub(crate) fn local_ring(&self) -> RemoteRing {
        RemoteRing {
            rkey: self.ring.rkey,
            addr: self.ring.addr,
            len: self.ring.len,
            recv_depth: self.recv_depth,
        }
    }

    /// The queue pair.
    pub(crate) fn qpn(&self) -> u32 {
        self.qpn
    }

    /// Send and receive WRs this connection may have outstanding: its
    /// share of the completion queue.
    pub(crate) fn cq_share(&self) -> u64 {
        u64::from(self.caps.max_send_wr) + u64::from(self.recv_depth)
    }

    /// Keep a completion that arrived before the peer's ring was known.
    pub(crate) fn hold(&mut self, wc: Completion) {
        if self.fault.is_none() {
            self.early.push(wc);
        }
    }

    /// `Err` once the connection has failed.
    pub(crate) fn check(&self) -> Result<(), TransportError> {
        match &self.fault {
            Some(f) => Err(TransportError::Link(f.to_string())),
            None => Ok(()),
        }
    }

    /// Record `fault`; returns the error to report the first time only.
    pub(crate) fn fail(&mut self, fault: RingFault) -> Option<TransportError> {
        if self.fault.is_some() {
            return None;
        }
        let e = TransportError::Link(fault.to_string());
        self.fault = Some(fault);
        self.early.clear();
        Some(e)
    }

    /// Deregister the connection's regions (the driver destroys its queue
    /// pair).
    pub(crate) fn release<V: Verbs>(&self, verbs: &mut V) {
        for lkey in [self.staging.lkey, self.ring.lkey] {
            if let Err(e) = verbs.dereg_mr(lkey) {
                tracing::warn!(%e, "rdma: deregistering a ring region failed");
            }
        }
    }

    /// Start the protocol against the peer's ring, which
    /// [`check_remote`] accepted, replaying the completions held so far. A
    /// fault they reveal is kept in the connection ([`RingConn::fault`])
    /// and returned, to be reported; one from before was reported already.
    pub(crate) fn connect<V: Verbs>(
        self,
        verbs: &mut V,
        remote: RemoteRing,
        max_frame: usize,
    ) -> (RingConn, Option<TransportError>) {
        let mut conn = RingConn {
            qpn: self.qpn,
            slot: self.slot,
            caps: self.caps,
            staging: self.staging,
            ring: self.ring,
            remote,
            max_frame,
            recv_depth: self.recv_depth,
            credit_recv_threshold: (self.recv_depth / 4).max(2),
            st_head: 0,
            st_tail: 0,
            st_used: 0,
            reservation: None,
            queued: VecDeque::new(),
            inflight: VecDeque::new(),
            next_data_wr: 0,
            next_credit_wr: 0,
            next_recv: self.next_recv,
            sq_outstanding: 0,
            r_tail: 0,
            r_credit: remote.len,
            peer_recvs: remote.recv_depth,
            l_head: 0,
            owed_bytes: 0,
            owed_recvs: 0,
            pending_rx: VecDeque::new(),
            fault: self.fault,
            stats: RingStats::default(),
        };
        let mut failed = None;
        for wc in &self.early {
            if let Err(f) = conn.on_completion(verbs, wc) {
                failed = conn.fail(f);
                break;
            }
        }
        (conn, failed)
    }
}
