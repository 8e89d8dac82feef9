//! The soak's traffic: checksummed, sequenced message bodies, the
//! client that sends them and checks every answer, and the echoing
//! server.

use super::remote;
use super::*;

pub(super) const SEQ_HDR: usize = 16;

/// Order-sensitive checksum of `seq` and `data`: every 8-byte word goes
/// through a bijective mix, so any change of one word changes the result.
pub(super) fn checksum(seq: u64, data: &[u8]) -> u64 {
    let mut h = 0x243f_6a88_85a3_08d3u64 ^ seq.wrapping_mul(0xff51_afd7_ed55_8ccd);
    let mut words = data.chunks_exact(8);
    for w in &mut words {
        let v = u64::from_le_bytes(w.try_into().unwrap_or([0; 8]));
        h = (h ^ v).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
    }
    let rest = words.remainder();
    let mut last = [0u8; 8];
    last[..rest.len()].copy_from_slice(rest);
    h = (h ^ u64::from_le_bytes(last)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    h ^ data.len() as u64
}

pub(super) fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// Payload length for message `seq` of connection `conn`: mostly small,
/// some medium, a few up to `max`.
pub(super) fn payload_len(conn: u64, seq: u64, max: usize) -> usize {
    let r = mix(conn << 40 ^ seq);
    let bucket = r % 100;
    let cap = match bucket {
        0..=69 => 256,
        70..=94 => 4096,
        _ => max,
    }
    .min(max);
    if cap == 0 {
        0
    } else {
        ((r >> 8) % (cap as u64 + 1)) as usize
    }
}

/// `[seq u64][checksum u64][payload]`.
pub(super) fn make_body(seq: u64, len: usize, salt: u64) -> Payload {
    let mut v = Vec::with_capacity(SEQ_HDR + len);
    v.extend_from_slice(&seq.to_le_bytes());
    v.extend_from_slice(&[0u8; 8]);
    let base = mix(seq ^ salt);
    v.extend((0..len).map(|i| (base as usize).wrapping_add(i.wrapping_mul(131)) as u8));
    let sum = checksum(seq, &v[SEQ_HDR..]);
    v[8..16].copy_from_slice(&sum.to_le_bytes());
    Payload::from(v)
}

/// Decode and verify a body: `Some(seq)` when the checksum matches.
pub(super) fn check_body(body: &[u8]) -> Option<u64> {
    if body.len() < SEQ_HDR {
        return None;
    }
    let seq = u64::from_le_bytes(body[..8].try_into().ok()?);
    let sum = u64::from_le_bytes(body[8..16].try_into().ok()?);
    (checksum(seq, &body[SEQ_HDR..]) == sum).then_some(seq)
}

/// In-order tracking of sequence numbers on one stream.
#[derive(Debug, Default)]
pub(super) struct SeqTrack {
    pub(super) next: u64,
    pub(super) missing: HashSet<u64>,
}

impl SeqTrack {
    /// Note `seq`; counts duplicates and out-of-order arrivals.
    pub(super) fn see(&mut self, seq: u64, c: &mut Counts) {
        if seq == self.next {
            self.next += 1;
        } else if seq > self.next {
            // A gap: the skipped ones may still come (reordered) or never
            // (lost, counted by the requester).
            if seq - self.next <= 1 << 16 {
                self.missing.extend(self.next..seq);
            }
            self.next = seq + 1;
        } else if self.missing.remove(&seq) {
            c.out_of_order += 1;
        } else {
            c.duplicated += 1;
        }
    }
}

/// One client connection's bookkeeping.
pub(super) struct ClientConn {
    /// The connection's number in the whole soak (payload sizes and
    /// contents derive from it).
    pub(super) index: u64,
    pub(super) next_seq: u64,
    /// By request id.
    pub(super) outstanding: HashMap<u64, Pending>,
    pub(super) track: SeqTrack,
    /// The connection's [`Connection::unmatched_responses`] as last added
    /// to the counts.
    pub(super) unmatched_seen: u64,
}

/// A request waiting for its answer.
#[derive(Debug, Clone, Copy)]
pub(super) struct Pending {
    pub(super) seq: u64,
    /// Its payload bytes.
    pub(super) bytes: u64,
    /// The turn that sent it (its round trip's start).
    pub(super) sent: Instant,
}

impl ClientConn {
    /// Add what `conn` dropped as unmatched since the last look.
    pub(super) fn sync_unmatched(&mut self, conn: &Connection, counts: &mut Counts) {
        sync_unmatched(&mut self.unmatched_seen, conn, counts);
    }
}

/// Add what `conn` dropped as unmatched since `seen` (its
/// [`Connection::unmatched_responses`] as last added to `counts`).
fn sync_unmatched(seen: &mut u64, conn: &Connection, counts: &mut Counts) {
    let now = conn.unmatched_responses();
    counts.unmatched_responses += now.saturating_sub(*seen);
    *seen = now;
}

/// The client's role on one reactor: keeps `inflight` requests
/// outstanding on each of its connections until `stop_sending`, checks
/// every response, and closes the connections once all are answered or
/// at `give_up`.
pub(super) struct SoakClient {
    /// Connection `k` attached here is number `first + k * step` of the
    /// whole soak.
    pub(super) first: u64,
    pub(super) step: u64,
    pub(super) attached: u64,
    /// By [`ConnId::index`]; `None` once the connection ended.
    pub(super) conns: Vec<Option<ClientConn>>,
    pub(super) inflight: usize,
    pub(super) max_size: usize,
    pub(super) stop_sending: Instant,
    pub(super) give_up: Instant,
    /// Whether the last turn was before `stop_sending`.
    pub(super) sending: bool,
    pub(super) counts: Counts,
    /// The round trips of the `answered` requests, merged into the
    /// soak's a few times a second.
    pub(super) round_trips: RoundTripFeed,
    /// Whether the soak's server runs in this process: it counts its
    /// refusals (in its `corrupted`), so this client counts the ones it
    /// gets apart (`refused`), not again in `rejected`.
    pub(super) server_here: bool,
    /// Faults injected on connections that ended (and went).
    pub(super) faults: FaultCounts,
    pub(super) done: bool,
    pub(super) cells: SoakCells,
    /// The reactor's driver counters, published a few times a second.
    pub(super) driver: DriverCells,
}

/// `slots[id.index()]`, if there.
pub(super) fn slot<T>(slots: &mut [Option<T>], id: ConnId) -> Option<&mut T> {
    slots.get_mut(id.index()).and_then(Option::as_mut)
}

/// `slots[id.index()] = value`, growing `slots` as needed.
pub(super) fn put<T>(slots: &mut Vec<Option<T>>, id: ConnId, value: T) {
    if slots.len() <= id.index() {
        slots.resize_with(id.index() + 1, || None);
    }
    slots[id.index()] = Some(value);
}

impl SoakClient {
    /// Add what every connection still attached dropped as unmatched.
    pub(super) fn sync_unmatched<D: Driver>(&mut self, sessions: &Sessions<D>) {
        for (i, c) in self.conns.iter_mut().enumerate() {
            let Some(c) = c else { continue };
            if let Some(conn) = sessions.conn_ref(ConnId::new(i as u32)) {
                c.sync_unmatched(conn, &mut self.counts);
            }
        }
    }

    /// Publish the counts at `/metrics`.
    pub(super) fn publish(&self) {
        self.cells.publish(self.counts.published());
    }

    /// What is still unanswered is lost (and published); every
    /// connection is closed.
    pub(super) fn finish<D: Driver>(&mut self, sessions: &mut Sessions<D>) {
        // The client sent until `stop_sending`, whether or not answers
        // came that long: its throughput is over that time at least.
        if self.counts.messages > 0 {
            self.counts.span.extend_to(self.stop_sending);
        }
        self.sync_unmatched(sessions);
        for (i, c) in self.conns.iter_mut().enumerate() {
            let Some(c) = c else { continue };
            self.counts.lost += c.outstanding.len() as u64;
            c.outstanding.clear();
            if let Some(conn) = sessions.conn(ConnId::new(i as u32)) {
                conn.close();
            }
        }
        self.done = true;
        self.publish();
        self.round_trips.flush();
        self.driver.publish(&sessions.driver().counters());
    }
}

/// Whether an answer is the soak server's refusal of a request it found
/// corrupted: `BadRequest` with no body. Every answer of its that is `Ok`
/// carries a checked body (at least [`SEQ_HDR`] bytes), so a status
/// garbled on the way into `BadRequest` still has one.
pub(super) fn is_refusal(status: Status, body: &[u8]) -> bool {
    status == Status::BadRequest && body.is_empty()
}

/// Check one answer, received at `now`. `server_here`: whether the
/// server runs in this process and counts its own refusals
/// ([`SoakClient::server_here`]). Returns the round trip of the request
/// it answered (every answered one, as `msgs_per_s` counts them); `None`
/// when no request waited for it.
pub(super) fn on_response(
    outstanding: &mut HashMap<u64, Pending>,
    track: &mut SeqTrack,
    counts: &mut Counts,
    server_here: bool,
    m: Incoming<'_>,
    now: Instant,
) -> Option<Duration> {
    let Incoming::Response {
        id, status, body, ..
    } = m
    else {
        return None;
    };
    let Some(pending) = outstanding.remove(&id) else {
        // The connection drops a response no request waits for (counted
        // in `unmatched_responses`): this is one it delivered anyway.
        counts.duplicated += 1;
        return None;
    };
    counts.answered += 1;
    counts.payload_bytes += pending.bytes + body.len() as u64;
    counts.span.extend_to(now);
    let rtt = Some(now.saturating_duration_since(pending.sent));
    if server_here && is_refusal(status, body) {
        // The server's refusal of a request it found corrupted, which it
        // counts in its `corrupted`: counted apart, not twice as a failure.
        counts.refused += 1;
        return rtt;
    }
    if status != Status::Ok {
        // A status garbled on the way (the frame header has no checksum),
        // or the refusal of a server in another process, which only this
        // client reports. Either way a failure.
        counts.rejected += 1;
        return rtt;
    }
    match check_body(body) {
        Some(seq) if seq == pending.seq => track.see(seq, counts),
        _ => counts.corrupted += 1,
    }
    rtt
}

impl<D: SoakDriver> Service<D> for SoakClient {
    fn on_attach(&mut self, id: ConnId, _shard: u32, _now: Instant) {
        let index = self.first + self.attached * self.step;
        self.attached += 1;
        put(
            &mut self.conns,
            id,
            ClientConn {
                index,
                next_seq: 0,
                outstanding: HashMap::new(),
                track: SeqTrack::default(),
                unmatched_seen: 0,
            },
        );
    }

    fn on_message(
        &mut self,
        id: ConnId,
        _conn: &mut Connection,
        msg: Incoming<'_>,
        now: Instant,
    ) -> Result<(), ConnError> {
        if let Some(c) = slot(&mut self.conns, id) {
            let rtt = on_response(
                &mut c.outstanding,
                &mut c.track,
                &mut self.counts,
                self.server_here,
                msg,
                now,
            );
            if let Some(rtt) = rtt {
                self.round_trips.record(rtt);
            }
        }
        Ok(())
    }

    fn on_closed(
        &mut self,
        id: ConnId,
        conn: &mut Connection,
        _error: &ConnError,
        driver: &D,
        _now: Instant,
    ) {
        self.faults.add(driver.fault_stats(id));
        let Some(mut c) = self.conns.get_mut(id.index()).and_then(Option::take) else {
            return;
        };
        c.sync_unmatched(conn, &mut self.counts);
        // Closed by the soak's end: counted there.
        if !self.done {
            self.counts.failed += 1;
            self.counts.lost += c.outstanding.len() as u64;
        }
    }

    fn poll(&mut self, sessions: &mut Sessions<D>, now: Instant) -> bool {
        if self.done {
            return false;
        }
        if self.driver.due(now) {
            self.driver.publish(&sessions.driver().counters());
            self.sync_unmatched(sessions);
            self.round_trips.flush();
        }
        self.publish();
        self.sending = now < self.stop_sending;
        if !self.sending {
            let all_quiet = self
                .conns
                .iter()
                .flatten()
                .all(|c| c.outstanding.is_empty());
            if all_quiet || now >= self.give_up {
                self.finish(sessions);
                return true;
            }
            return false;
        }
        let mut sent = false;
        for (i, c) in self.conns.iter_mut().enumerate() {
            let Some(c) = c else { continue };
            let Some(conn) = sessions.conn(ConnId::new(i as u32)) else {
                continue;
            };
            while c.outstanding.len() < self.inflight {
                let seq = c.next_seq;
                let body = make_body(seq, payload_len(c.index, seq, self.max_size), c.index);
                let bytes = body.len() as u64;
                match conn.request(Opcode::Rpc, 0, body, None) {
                    Ok(id) => {
                        let pending = Pending {
                            seq,
                            bytes,
                            sent: now,
                        };
                        c.outstanding.insert(id, pending);
                        c.next_seq += 1;
                        self.counts.messages += 1;
                        self.counts.span.begin(now);
                        sent = true;
                    }
                    Err(_) => break,
                }
            }
        }
        sent
    }

    fn next_deadline(&self) -> Option<Instant> {
        Some(if self.sending {
            self.stop_sending
        } else {
            self.give_up
        })
    }

    fn finished(&self) -> bool {
        self.done
    }
}

/// One server connection's bookkeeping.
#[derive(Debug, Default)]
pub(super) struct ServerConn {
    pub(super) track: SeqTrack,
    /// The connection's [`Connection::unmatched_responses`] as last added
    /// to the counts.
    pub(super) unmatched_seen: u64,
}

/// The server's role on one reactor: checks and answers every request.
pub(super) struct SoakServer {
    /// By [`ConnId::index`]; `None` once the connection ended.
    pub(super) conns: Vec<Option<ServerConn>>,
    pub(super) counts: Counts,
    /// Beside its client, in this process: where the server publishes its
    /// share of the report's counts ([`Counts::server_share`]), in the
    /// cells of the client's series. A `--listen` server publishes none.
    pub(super) cells: Option<SoakCells>,
    /// Faults injected on connections that ended (and went).
    pub(super) faults: FaultCounts,
    /// The reactor's driver counters, published a few times a second.
    pub(super) driver: DriverCells,
    /// Where a server in a process of its own counts the connections that
    /// ended (it ends once all have); with it, a connection that ends
    /// other than by the client's close is a failed one.
    pub(super) closes: remote::Closes,
}

impl SoakServer {
    pub(super) fn new(lay: &Layout, backend: &str) -> Self {
        Self {
            conns: Vec::new(),
            counts: Counts::default(),
            cells: None,
            faults: FaultCounts::default(),
            driver: DriverCells::new(&lay.telemetry, backend),
            closes: remote::Closes::default(),
        }
    }

    /// A server whose client runs in this process: it publishes its
    /// share of the report's counts in `t`, where the client reactors
    /// publish theirs, so each series is the report's field.
    pub(super) fn beside_its_client(mut self, t: &Telemetry) -> Self {
        self.cells = Some(SoakCells::new(t));
        self
    }

    /// Add what every connection still attached dropped as unmatched.
    pub(super) fn sync_unmatched<D: Driver>(&mut self, sessions: &Sessions<D>) {
        for (i, c) in self.conns.iter_mut().enumerate() {
            let Some(c) = c else { continue };
            if let Some(conn) = sessions.conn_ref(ConnId::new(i as u32)) {
                sync_unmatched(&mut c.unmatched_seen, conn, &mut self.counts);
            }
        }
    }

    /// Publish its share of the counts, if beside its client.
    pub(super) fn publish(&self) {
        if let Some(cells) = &self.cells {
            cells.publish(self.counts.server_share().published());
        }
    }
}

/// Check and answer one request, received at `now`.
pub(super) fn serve_request(
    track: &mut SeqTrack,
    counts: &mut Counts,
    conn: &mut Connection,
    m: Incoming<'_>,
    now: Instant,
) {
    let Incoming::Request {
        id, opcode, body, ..
    } = m
    else {
        return;
    };
    counts.messages += 1;
    counts.span.begin(now);
    let (status, reply) = match check_body(body) {
        Some(seq) => {
            track.see(seq, counts);
            let len = (mix(seq) % 1024) as usize;
            (Status::Ok, make_body(seq, len, !seq))
        }
        None => {
            counts.corrupted += 1;
            // A refusal: what the client's `is_refusal` recognises.
            (Status::BadRequest, Payload::empty())
        }
    };
    let bytes = (body.len() + reply.len()) as u64;
    if conn.respond(id, opcode, status, reply).is_ok() {
        counts.answered += 1;
        counts.payload_bytes += bytes;
        counts.span.extend_to(now);
    }
}

impl<D: SoakDriver> Service<D> for SoakServer {
    fn on_attach(&mut self, id: ConnId, _shard: u32, _now: Instant) {
        put(&mut self.conns, id, ServerConn::default());
    }

    fn poll(&mut self, sessions: &mut Sessions<D>, now: Instant) -> bool {
        if self.driver.due(now) {
            self.driver.publish(&sessions.driver().counters());
            self.sync_unmatched(sessions);
        }
        self.publish();
        false
    }

    fn on_message(
        &mut self,
        id: ConnId,
        conn: &mut Connection,
        msg: Incoming<'_>,
        now: Instant,
    ) -> Result<(), ConnError> {
        if let Some(c) = slot(&mut self.conns, id) {
            serve_request(&mut c.track, &mut self.counts, conn, msg, now);
        }
        Ok(())
    }

    fn on_closed(
        &mut self,
        id: ConnId,
        conn: &mut Connection,
        error: &ConnError,
        driver: &D,
        _now: Instant,
    ) {
        self.faults.add(driver.fault_stats(id));
        // The server sends no requests: any response it gets is unmatched.
        let mut seen = self
            .conns
            .get_mut(id.index())
            .and_then(Option::take)
            .map_or(0, |c| c.unmatched_seen);
        sync_unmatched(&mut seen, conn, &mut self.counts);
        if self.closes.counting() {
            if !matches!(error, ConnError::Closed) {
                tracing::warn!(conn = id.index(), "soak connection failed: {error}");
                self.counts.failed += 1;
            }
            self.closes.note();
        }
    }
}
