//! The driver conformance suite over loopback TCP driven by io_uring: 64
//! connections on one driver at each end, in each receive mode, with
//! default settings and with small buffers.
#![cfg(target_os = "linux")]

mod common;

use common::{driver_pair, exchange};
use starwire_uring::{RecvMode, UringConfig};

/// Frames of every length up to `max_body` both ways on all 64
/// connections, then the conformance suite, on `cfg`.
fn check(name: &str, cfg: &UringConfig, max_body: usize) {
    let mut pair = driver_pair(cfg, 64);
    exchange(&mut pair, 6, max_body, name);
    drop(pair);
    starwire_transport::conformance::run_all_drivers(name, 64, |n| {
        let (a, a_ids, b, b_ids) = driver_pair(cfg, n);
        starwire_transport::conformance::DriverPair { a, a_ids, b, b_ids }
    });
}

/// Bodies up to this long with the default settings: long enough for
/// direct receives (`rx_direct_min`, 128 KiB), short enough to keep the
/// 64 connections quick.
const LONG: usize = 160 << 10;

#[test]
fn uring_default_config() {
    check("uring", &UringConfig::default(), LONG);
}

/// Receive buffers smaller than a frame: every large frame is reassembled
/// across buffers; few slots: back-pressure.
fn small(recv: RecvMode) -> UringConfig {
    UringConfig {
        recv,
        max_frame_len: 4096,
        tx_slots: 8,
        tx_slots_per_conn: 4,
        tx_queue_limit_bytes: 16 << 10,
        rx_buf_len: 1000,
        rx_bufs: 64,
        // Single and spin receives: frames straddle the own buffer's end.
        rx_conn_buf_len: 4096,
        zero_copy_threshold: 2048,
        // Loopback, but the zero-copy path and its fallback are under test.
        zero_copy_loopback: true,
        gather_copy_threshold: 512,
        ..UringConfig::default()
    }
}

/// The largest body of [`small`] settings.
const SMALL_BODY: usize = 4096 - starwire_transport::wire::HEADER_LEN;

#[test]
fn uring_small_buffers_straddle() {
    check("uring-small", &small(RecvMode::Multishot), SMALL_BODY);
}

/// Single receives of small buffers, and receives capped below a frame.
/// Without the zero-copy probe: on loopback its notification comes when
/// the receiver's copy of the data is freed, which the kernel may defer to
/// the (idle) CPU that allocated it; a probe waiting for it holds its
/// bytes, and under this configuration's 16 KiB queue limit that stopped
/// the connection's sends past the suite's idle limit (0.1 s here) in
/// every run tried.
#[test]
fn uring_single_small_buffers_straddle() {
    for chunk in [128 << 10, 700] {
        let cfg = UringConfig {
            recv_chunk_len: chunk,
            zero_copy_loopback: false,
            ..small(RecvMode::Single)
        };
        check("uring-single-small", &cfg, SMALL_BODY);
    }
}

#[test]
fn uring_multishot_receive() {
    let cfg = UringConfig {
        recv: RecvMode::Multishot,
        ..UringConfig::default()
    };
    check("uring-multishot", &cfg, LONG);
}

#[test]
fn uring_spin_receive() {
    let cfg = UringConfig {
        recv: RecvMode::Spin,
        ..UringConfig::default()
    };
    check("uring-spin", &cfg, LONG);
}

#[test]
fn uring_spin_small_buffers_straddle() {
    check("uring-spin-small", &small(RecvMode::Spin), SMALL_BODY);
}
