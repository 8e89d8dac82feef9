//! Frames straight over two drivers, without the message layer.

use std::collections::HashMap;
use std::time::Instant;

use bytes::Bytes;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use starwire_wire::{Header, Opcode, HEADER_LEN};

use super::{DriverPair, IDLE_LIMIT, STEP};
use crate::driver::{ConnId, Driver};

/// Frames each connection carries each way.
const FRAMES_PER_FLOW: usize = 40;
/// Frames taken from each connection per receive pass: fewer than a flow
/// holds, so frames wait in the drivers between passes.
const RX_PER_CONN: usize = 16;
/// Bodies are cut from a random block of this (prime) length, starting at
/// an offset that depends on the frame, so two frames rarely match.
const PATTERN_LEN: usize = 509;

/// What one connection carries one way: `sizes[k]` is frame `k`'s length.
#[derive(Debug)]
struct Flow {
    sizes: Vec<usize>,
    sent: usize,
    got: usize,
}

impl Flow {
    /// Flow `dir` (0: a to b, 1: b to a) of connection `i` of `n`. Mostly
    /// small frames, some bare headers, one of the largest size last, and
    /// one whose size sweeps `HEADER_LEN..=max` over the `2n` flows.
    fn new(dir: usize, i: usize, n: usize, max: usize) -> Self {
        let mut rng = SmallRng::seed_from_u64(((dir as u64) << 32) | i as u64);
        let small = (max - HEADER_LEN).min(4096);
        let mut sizes: Vec<usize> = (0..FRAMES_PER_FLOW)
            .map(|k| match k % 10 {
                1 => HEADER_LEN,
                _ => HEADER_LEN + rng.gen_range(0..=small),
            })
            .collect();
        let flows = 2 * n;
        sizes[FRAMES_PER_FLOW / 2] =
            HEADER_LEN + (max - HEADER_LEN) * (2 * i + dir) / (flows - 1).max(1);
        sizes[FRAMES_PER_FLOW - 1] = max;
        Self {
            sizes,
            sent: 0,
            got: 0,
        }
    }
}

/// The request id naming frame `seq` of flow `dir` of connection `i`.
fn frame_id(dir: usize, i: usize, seq: usize) -> u64 {
    ((dir as u64) << 62) | ((i as u64) << 32) | seq as u64
}

fn describe(id: u64) -> String {
    let dir = if id >> 62 == 0 { "a to b" } else { "b to a" };
    format!(
        "frame {} of connection {} ({dir})",
        id as u32,
        (id >> 32) & 0x3fff_ffff
    )
}

/// Write the frame named `id`, `out.len()` bytes long.
fn write_frame(out: &mut [u8], id: u64, pat: &[u8]) {
    let body_len = u32::try_from(out.len() - HEADER_LEN).expect("frame under 4 GiB");
    Header::new(Opcode::Rpc, id, body_len).emit(out);
    let at = (id % PATTERN_LEN as u64) as usize;
    for chunk in out[HEADER_LEN..].chunks_mut(PATTERN_LEN) {
        chunk.copy_from_slice(&pat[at..at + chunk.len()]);
    }
}

/// Queue frames of `flow` on `conn` until the driver pushes back,
/// alternating the in-place and the gather paths.
fn send<D: Driver>(
    d: &mut D,
    conn: ConnId,
    dir: usize,
    i: usize,
    flow: &mut Flow,
    pat: &[u8],
    scratch: &mut Vec<u8>,
) {
    while flow.sent < flow.sizes.len() {
        let id = frame_id(dir, i, flow.sent);
        let len = flow.sizes[flow.sent];
        let queued = if flow.sent % 2 == 0 {
            match d.tx_reserve(conn, len).expect("tx_reserve") {
                Some(buf) => {
                    write_frame(&mut buf[..len], id, pat);
                    d.tx_commit(conn, len);
                    true
                }
                None => false,
            }
        } else {
            scratch.resize(len, 0);
            write_frame(scratch, id, pat);
            let (head, body) = scratch.split_at(HEADER_LEN);
            let (x, y) = body.split_at(body.len() / 2);
            let segs = [Bytes::copy_from_slice(x), Bytes::copy_from_slice(y)];
            d.tx_gather(conn, head, &segs).expect("tx_gather")
        };
        if !queued {
            return;
        }
        flow.sent += 1;
    }
}

/// Check that `f`, received on connection `j`, is the next frame of `flow`.
fn receive(f: &[u8], dir: usize, j: usize, flow: &mut Flow, pat: &[u8]) {
    let want = frame_id(dir, j, flow.got);
    let h = Header::parse(f, u32::MAX, u32::MAX)
        .unwrap_or_else(|e| panic!("{} arrived with a bad header: {e}", describe(want)));
    assert!(
        h.request_id == want,
        "{} arrived where {} was due",
        describe(h.request_id),
        describe(want)
    );
    let len = flow.sizes.get(flow.got).copied().unwrap_or(0);
    assert_eq!(f.len(), len, "{} has the wrong length", describe(want));
    let at = (want % PATTERN_LEN as u64) as usize;
    for chunk in f[HEADER_LEN..].chunks(PATTERN_LEN) {
        assert!(
            chunk == &pat[at..at + chunk.len()],
            "{} differs",
            describe(want)
        );
    }
    flow.got += 1;
}

/// Frames straight over the drivers, both ways on every connection at
/// once: every size up to the maximum, in order, exactly once, through
/// both `tx_reserve` and `tx_gather`, each connection queueing until its
/// driver pushes back. Every frame names its connection; a frame seen on
/// another connection fails the case.
pub fn frames_in_order<A: Driver, B: Driver>(drivers: DriverPair<A, B>) {
    let DriverPair {
        mut a,
        a_ids,
        mut b,
        b_ids,
    } = drivers;
    let n = a_ids.len();
    let max = a.max_frame_len().min(b.max_frame_len());
    assert!(
        max > HEADER_LEN,
        "a maximum frame of {max} bytes holds no body"
    );
    let mut pat = vec![0u8; PATTERN_LEN];
    SmallRng::seed_from_u64(1).fill(&mut pat[..]);
    pat.extend_from_within(..);
    let index = |ids: &[ConnId]| -> HashMap<ConnId, usize> {
        ids.iter().enumerate().map(|(i, &id)| (id, i)).collect()
    };
    let (a_index, b_index) = (index(&a_ids), index(&b_ids));
    let mut ab: Vec<Flow> = (0..n).map(|i| Flow::new(0, i, n, max)).collect();
    let mut ba: Vec<Flow> = (0..n).map(|i| Flow::new(1, i, n, max)).collect();
    let progress =
        |ab: &[Flow], ba: &[Flow]| -> usize { ab.iter().chain(ba).map(|f| f.sent + f.got).sum() };
    let total = 4 * n * FRAMES_PER_FLOW;
    let mut scratch = Vec::new();
    let mut now = Instant::now();
    let mut idle = 0;
    loop {
        let before = progress(&ab, &ba);
        if before == total {
            break;
        }
        for (i, (&id, flow)) in a_ids.iter().zip(&mut ab).enumerate() {
            send(&mut a, id, 0, i, flow, &pat, &mut scratch);
        }
        for (i, (&id, flow)) in b_ids.iter().zip(&mut ba).enumerate() {
            send(&mut b, id, 1, i, flow, &pat, &mut scratch);
        }
        a.flush(now);
        b.flush(now);
        b.rx_burst(now, RX_PER_CONN, &mut |id, f| {
            let j = *b_index
                .get(&id)
                .unwrap_or_else(|| panic!("b received on unknown {id}"));
            receive(f, 0, j, &mut ab[j], &pat);
        });
        a.rx_burst(now, RX_PER_CONN, &mut |id, f| {
            let j = *a_index
                .get(&id)
                .unwrap_or_else(|| panic!("a received on unknown {id}"));
            receive(f, 1, j, &mut ba[j], &pat);
        });
        if let Some((id, e)) = a.poll_failure() {
            panic!("{id} failed at a: {e}");
        }
        if let Some((id, e)) = b.poll_failure() {
            panic!("{id} failed at b: {e}");
        }
        if progress(&ab, &ba) != before {
            idle = 0;
            now += STEP;
            continue;
        }
        idle += 1;
        assert!(
            idle < IDLE_LIMIT,
            "frames stalled at {before} of {total} sends and receipts"
        );
        // Nothing moved: let time pass to the next timer.
        let next = [a.poll_timeout(), b.poll_timeout()]
            .into_iter()
            .flatten()
            .min();
        now = match next {
            Some(t) if t > now => t,
            _ => now + STEP,
        };
    }
}
