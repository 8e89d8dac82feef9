//! Over a reliable backend nothing repairs injected faults, so each must
//! surface as a typed error or a checksum/sequence failure, never as a
//! silently accepted message.

use std::collections::HashSet;

use starwire_transport::conformance::{link_pairs, Pair};
use starwire_transport::testing::{FaultSpec, Faulty, MemTransport};
use starwire_transport::wire::Opcode;
use starwire_transport::{ConnId, Connection, Incoming, Payload};

fn fnv1a(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn message(seq: u64) -> Vec<u8> {
    let len = 16 + (seq as usize * 37) % 300;
    let mut m = vec![0u8; len];
    m[..8].copy_from_slice(&seq.to_le_bytes());
    for (i, b) in m[16..].iter_mut().enumerate() {
        *b = (seq as usize + i) as u8;
    }
    let sum = fnv1a(&m[16..]) ^ seq;
    m[8..16].copy_from_slice(&sum.to_le_bytes());
    m
}

#[derive(Debug, Default)]
struct Verdict {
    accepted: u64,
    checksum_failures: u64,
    gaps: u64,
    out_of_order: u64,
    duplicates: u64,
    connection_error: Option<String>,
}

fn run(spec: FaultSpec, n: u64) -> (Verdict, starwire_transport::testing::FaultStats) {
    let mut p = Pair::new(link_pairs(1, || {
        let (a, b) = MemTransport::pair(1024, 64);
        (a, Faulty::new(b, spec))
    }));
    let (ia, ib) = (p.a_ids[0], p.b_ids[0]);
    let mut v = Verdict::default();
    let mut next_expected = 0u64;
    let mut seen = HashSet::new();
    let mut sent = 0u64;
    let mut rounds = 0u64;
    let mut on_b = |_: ConnId, _: &mut Connection, m: Incoming<'_>| {
        if let Incoming::Request { body, .. } = m {
            if body.len() < 16 {
                v.checksum_failures += 1;
                return;
            }
            let seq = u64::from_le_bytes(body[..8].try_into().expect("8"));
            let sum = u64::from_le_bytes(body[8..16].try_into().expect("8"));
            if fnv1a(&body[16..]) ^ seq != sum {
                v.checksum_failures += 1;
                return;
            }
            if !seen.insert(seq) {
                v.duplicates += 1;
            } else if seq > next_expected {
                v.gaps += 1;
            } else if seq < next_expected {
                v.out_of_order += 1;
            }
            v.accepted += 1;
            next_expected = next_expected.max(seq + 1);
        }
    };
    let closed = |c: Option<&Connection>| c.map_or(true, Connection::is_closed);
    loop {
        while sent < n {
            match p
                .a(0)
                .send_oneway(Opcode::Tensors, 0, Payload::from(message(sent)))
            {
                Ok(()) => sent += 1,
                Err(_) => break,
            }
        }
        let now = p.now;
        p.a.turn(now, &mut |_, _, _| {});
        p.b.turn(now, &mut on_b);
        // A failed connection is closed; its faults are counted before
        // `poll_failed` detaches (and drops) its link.
        if closed(p.a.conn_ref(ia)) || closed(p.b.conn_ref(ib)) {
            break;
        }
        p.now += std::time::Duration::from_micros(50);
        rounds += 1;
        if (sent == n && p.a(0).queued() == 0 && rounds > 20_000) || rounds > 200_000 {
            break;
        }
    }
    let stats = p.b.driver().link(ib).expect("attached").stats();
    let failed = p.b.poll_failed().or_else(|| p.a.poll_failed());
    v.connection_error = failed.map(|(_, _, e)| e.to_string());
    (v, stats)
}

#[test]
fn clean_run_accepts_everything() {
    let (v, stats) = run(FaultSpec::default(), 3000);
    assert_eq!(
        stats.dropped + stats.corrupted + stats.delayed + stats.reordered,
        0
    );
    assert_eq!(v.accepted, 3000);
    assert_eq!(
        v.checksum_failures + v.gaps + v.out_of_order + v.duplicates,
        0
    );
    assert!(v.connection_error.is_none());
}

#[test]
fn every_kind_of_fault_is_detected() {
    for (name, spec) in [
        ("drop", "drop=0.01"),
        ("corrupt", "corrupt=0.01"),
        ("reorder", "reorder=0.01"),
        ("delay", "delay=0.01,delay_ms=1"),
        ("all", "drop=0.01,corrupt=0.001,reorder=0.01,delay=0.01"),
    ] {
        for seed in 1..=3u64 {
            let spec: FaultSpec = format!("{spec},seed={seed}").parse().expect("spec");
            let (v, stats) = run(spec, 3000);
            let injected = stats.dropped + stats.corrupted + stats.delayed + stats.reordered;
            assert!(injected > 0, "{name}/{seed}: no fault injected");
            let detected = v.checksum_failures + v.gaps + v.out_of_order + v.duplicates;
            assert!(
                detected > 0 || v.connection_error.is_some(),
                "{name}/{seed}: {injected} faults went unnoticed: {v:?}"
            );
            // Whatever was accepted passed its checksum: no corrupted
            // message counts as a success.
            assert!(v.accepted <= 3000);
        }
    }
}

#[test]
fn fault_spec_parses_and_rejects() {
    let s: FaultSpec = "drop=0.01,corrupt=0.001,seed=3".parse().expect("ok");
    assert_eq!(s.drop, 0.01);
    assert_eq!(s.corrupt, 0.001);
    assert_eq!(s.seed, 3);
    assert!("drop=2".parse::<FaultSpec>().is_err());
    assert!("bogus=0.1".parse::<FaultSpec>().is_err());
    assert!("drop".parse::<FaultSpec>().is_err());
    let round: FaultSpec = s.to_string().parse().expect("display parses back");
    assert_eq!(round, s);
}
