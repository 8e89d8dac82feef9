//! Tests on real verbs. They need an RDMA device (or two), so they are
//! `#[ignore]`d in the normal suite and run explicitly where one exists:
//! `ci/verbs-vm.sh` runs them in an emulated guest between the Soft-RoCE
//! devices rxe0 and rxe1.
//!
//! `STARWIRE_RDMA_DEVICE` names the device of the client side (default:
//! the first found), `STARWIRE_RDMA_PEER_DEVICE` that of the server side
//! (default: the same device, connected to itself).
//!
//! ```text
//! STARWIRE_RDMA_DEVICE=rxe0 STARWIRE_RDMA_PEER_DEVICE=rxe1 \
//!     cargo test -p starwire-verbs --test hardware -- --ignored --test-threads 1
//! ```

use std::time::Instant;

use starwire_rdma::{RdmaDriver, RingConfig};
use starwire_transport::conformance::{run_all_drivers, DriverPair};
use starwire_transport::{ConnId, Driver};
use starwire_verbs::{connect_local, DeviceSpec, NicConfig, VerbsDevice, VerbsNic, VerbsRdma};

fn spec(var: &str) -> DeviceSpec {
    DeviceSpec {
        name: std::env::var(var).ok().filter(|s| !s.is_empty()),
        ..DeviceSpec::default()
    }
}

/// The two devices named by the environment.
fn devices() -> (VerbsDevice, VerbsDevice) {
    let a = VerbsDevice::open(&spec("STARWIRE_RDMA_DEVICE")).expect("client device");
    let peer = spec("STARWIRE_RDMA_PEER_DEVICE");
    let b = if peer.name.is_none() {
        a.clone()
    } else {
        VerbsDevice::open(&peer).expect("server device")
    };
    (a, b)
}

/// Rings small enough for 64 connections in a small guest.
fn ring() -> RingConfig {
    RingConfig {
        ring_len: 16 * 1024,
        staging_len: 8 * 1024,
        recv_depth: 16,
        max_frame_len: None,
    }
}

fn nic_config() -> NicConfig {
    NicConfig {
        cq_depth: 8192,
        max_send_wr: 64,
        max_recv_wr: 32,
        ..NicConfig::default()
    }
}

fn driver(dev: &VerbsDevice) -> VerbsRdma {
    let nic = VerbsNic::new(dev, nic_config()).expect("verbs of a reactor");
    RdmaDriver::new(nic, ring()).expect("driver")
}

/// Two drivers joined by `n` connections over real queue pairs.
fn pair(devs: &(VerbsDevice, VerbsDevice), n: usize) -> DriverPair<VerbsRdma, VerbsRdma> {
    let mut a = driver(&devs.0);
    let mut b = driver(&devs.1);
    let (mut a_ids, mut b_ids) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let (ca, cb) = connect_local(&mut a, &mut b).expect("connect");
        a_ids.push(ca);
        b_ids.push(cb);
    }
    DriverPair { a, a_ids, b, b_ids }
}

/// The conformance suite every driver passes, on 64 connections of one
/// driver per side, over real verbs.
#[test]
#[ignore = "needs an RDMA device (STARWIRE_RDMA_DEVICE, STARWIRE_RDMA_PEER_DEVICE)"]
fn conformance_over_real_verbs() {
    let devs = devices();
    eprintln!(
        "verbs conformance: {} (port {}, {}) <-> {} (port {}, {})",
        devs.0.name(),
        devs.0.port(),
        devs.0.gid(),
        devs.1.name(),
        devs.1.port(),
        devs.1.gid()
    );
    run_all_drivers("verbs", 64, |n| pair(&devs, n));
    eprintln!("verbs conformance: all cases passed");
}

/// Frames over 16 connections, every byte checked, and the counters the
/// emulated guest reports (timings there mean nothing): doorbells per
/// flush, work requests per frame, credit writes per frame.
#[test]
#[ignore = "needs an RDMA device (STARWIRE_RDMA_DEVICE, STARWIRE_RDMA_PEER_DEVICE)"]
fn frames_arrive_intact_and_counters_add_up() {
    let devs = devices();
    let n = 16;
    let rounds = 200u32;
    let DriverPair {
        mut a,
        a_ids,
        mut b,
        b_ids,
    } = pair(&devs, n);
    let index: std::collections::HashMap<ConnId, usize> =
        b_ids.iter().enumerate().map(|(i, &c)| (c, i)).collect();
    let frame = |conn: usize, seq: u32| -> Vec<u8> {
        let len = 1 + (seq as usize * 131 + conn * 17) % 3000;
        (0..len)
            .map(|i| (conn as u8) ^ (seq as u8).wrapping_mul(31) ^ i as u8)
            .collect()
    };
    let mut next_send = vec![0u32; n];
    let mut next_recv = vec![0u32; n];
    let mut frames = 0u64;
    let start = Instant::now();
    while next_recv.iter().any(|&r| r < rounds) {
        assert!(
            start.elapsed().as_secs() < 300,
            "no progress: received {next_recv:?}"
        );
        let now = Instant::now();
        for (i, &c) in a_ids.iter().enumerate() {
            while next_send[i] < rounds {
                let f = frame(i, next_send[i]);
                let Some(buf) = a.tx_reserve(c, f.len()).expect("connection up") else {
                    break;
                };
                buf.copy_from_slice(&f);
                a.tx_commit(c, f.len());
                next_send[i] += 1;
            }
        }
        a.flush(now);
        b.rx_burst(now, 64, &mut |c, got| {
            let i = index[&c];
            assert_eq!(
                got,
                frame(i, next_recv[i]),
                "connection {i} frame {}",
                next_recv[i]
            );
            next_recv[i] += 1;
            frames += 1;
        });
        b.flush(now);
        a.rx_burst(now, 64, &mut |_, _| panic!("nothing is sent back"));
        assert!(a.poll_failure().is_none() && b.poll_failure().is_none());
    }
    let (sa, sb) = (a.stats(), b.stats());
    let (na, nb) = (a.verbs().stats(), b.verbs().stats());
    let credit_writes: u64 = b_ids
        .iter()
        .map(|&c| b.ring(c).expect("connected").stats().credit_writes)
        .sum();
    let data_writes: u64 = a_ids
        .iter()
        .map(|&c| a.ring(c).expect("connected").stats().data_writes)
        .sum();
    assert_eq!(frames, u64::from(rounds) * n as u64);
    assert_eq!(data_writes, frames);
    assert!(sa.doorbells <= sa.flushes);
    eprintln!(
        "verbs counters: {frames} frames on {n} connections; sender: {} flushes, {} doorbells \
         rung, {} ibv_post_send ({:.2} per flush), {} send WRs ({:.3} per frame), {} inline, \
         {} signalled, {} implied completions; receiver: {} credit writes ({:.3} per frame), \
         {} receive WRs re-posted, {} CQEs; parks {} / {}",
        sa.flushes,
        sa.doorbells,
        na.post_sends,
        na.post_sends as f64 / sa.flushes.max(1) as f64,
        na.send_wrs,
        na.send_wrs as f64 / frames as f64,
        na.inline_wrs,
        na.signaled_wrs,
        na.implied_completions,
        credit_writes,
        credit_writes as f64 / frames as f64,
        nb.recv_wrs,
        nb.cqes,
        sa.parks,
        sb.parks,
    );
}
