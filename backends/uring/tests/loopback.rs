//! The io_uring driver against real sockets: bad input from a raw peer,
//! many connections on one driver, zero-copy fallback, parks, and the
//! memlock error in a child process without CAP_IPC_LOCK.
#![cfg(target_os = "linux")]

mod common;

use std::io::Write;
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{drain, frame, next_frames, poll_park_fd, raw_pair, solo, turn};
use starwire_transport::wire::{FrameError, Header, Opcode, HEADER_LEN};
use starwire_transport::{ConnId, Driver, Sleep, StreamDriver, TransportError};
use starwire_uring::{MemlockError, RecvMode, UringConfig, UringDriver, UringError};

/// The default settings in each receive mode: the bad-input tests run in
/// all three.
fn all_modes() -> [UringConfig; 3] {
    [RecvMode::Single, RecvMode::Multishot, RecvMode::Spin].map(|recv| UringConfig {
        recv,
        ..UringConfig::default()
    })
}

#[test]
fn garbage_after_good_frames_is_a_frame_error() {
    for cfg in all_modes() {
        let (mut raw, s) = raw_pair();
        let (mut d, id) = solo(s, &cfg);
        let mut bytes = frame(1, 10);
        bytes.extend(frame(2, 0));
        bytes.extend(b"this is not a starwire header, not at all");
        raw.write_all(&bytes).unwrap();
        let (got, err) = drain(&mut d, usize::MAX);
        assert_eq!(got, vec![frame(1, 10), frame(2, 0)]);
        assert!(
            matches!(err, Some(TransportError::Frame(FrameError::BadMagic(_)))),
            "{err:?}"
        );
        // Reported once; the connection is left out of the turns until it
        // is detached, and takes no more frames to send.
        for _ in 0..3 {
            let r = turn(&mut d, 8, &mut |_, _: &[u8]| panic!("no frame"));
            assert_eq!(r.map_err(|(c, _)| c), Ok(0), "{:?}", cfg.recv);
        }
        assert!(matches!(d.tx_reserve(id, 64), Err(TransportError::Closed)));
        assert!(d.conn_stats(id).is_some(), "attached until detached");
        d.detach(id);
        assert!(d.conn_stats(id).is_none());
        assert!(!d.tx_pending(id));
    }
}

#[test]
fn oversized_length_is_rejected_before_any_allocation() {
    for cfg in all_modes() {
        let (mut raw, s) = raw_pair();
        let (mut d, _) = solo(s, &cfg);
        // A header announcing a body far over max_frame_len.
        let h = Header::new(Opcode::Rpc, 9, (cfg.max_frame_len * 16) as u32);
        raw.write_all(&h.to_bytes()).unwrap();
        let (got, err) = drain(&mut d, usize::MAX);
        assert!(got.is_empty());
        assert!(matches!(err, Some(TransportError::Frame(_))), "{err:?}");
    }
}

#[test]
fn truncated_frame_then_eof() {
    for cfg in all_modes() {
        let (mut raw, s) = raw_pair();
        let (mut d, _) = solo(s, &cfg);
        let f = frame(1, 100);
        raw.write_all(&f[..60]).unwrap();
        raw.shutdown(Shutdown::Write).unwrap();
        let (got, err) = drain(&mut d, usize::MAX);
        assert!(got.is_empty());
        assert!(
            matches!(
                err,
                Some(TransportError::Frame(FrameError::Truncated {
                    needed: 132,
                    have: 60
                }))
            ),
            "{err:?}"
        );
    }
}

#[test]
fn peer_close_is_closed_after_frames() {
    for cfg in all_modes() {
        let (mut raw, s) = raw_pair();
        let (mut d, _) = solo(s, &cfg);
        raw.write_all(&frame(5, 3)).unwrap();
        drop(raw);
        let (got, err) = drain(&mut d, usize::MAX);
        assert_eq!(got, vec![frame(5, 3)]);
        assert!(matches!(err, Some(TransportError::Closed)), "{err:?}");
    }
}

/// A failing connection ends alone: its neighbours on the driver keep
/// carrying frames, in each mode, and its handle goes to the next
/// connection attached once it was detached.
#[test]
fn one_failed_connection_leaves_the_others_running() {
    for cfg in all_modes() {
        let mut d = UringDriver::new(&cfg).unwrap();
        let mut raws = Vec::new();
        let mut ids = Vec::new();
        for _ in 0..3 {
            let (raw, s) = raw_pair();
            raws.push(raw);
            ids.push(d.attach_stream(s).unwrap());
        }
        raws[1].write_all(b"not a starwire header, no").unwrap();
        raws[1].write_all(&[0u8; 16]).unwrap();
        let mut failed = None;
        let deadline = Instant::now() + Duration::from_secs(5);
        while failed.is_none() {
            assert!(Instant::now() < deadline, "{:?}: no failure", cfg.recv);
            if let Err((c, e)) = turn(&mut d, 8, &mut |_, _: &[u8]| panic!("no frame")) {
                failed = Some((c, e));
            }
        }
        let (c, e) = failed.unwrap();
        assert_eq!(c, ids[1], "{:?}", cfg.recv);
        assert!(matches!(e, TransportError::Frame(_)), "{e:?}");
        d.detach(c);
        for (k, i) in [0usize, 2].into_iter().enumerate() {
            raws[i].write_all(&frame(k as u64, 40)).unwrap();
        }
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        while got.len() < 2 {
            assert!(Instant::now() < deadline, "{:?}: {got:?}", cfg.recv);
            turn(&mut d, 8, &mut |c, f: &[u8]| got.push((c, f.to_vec()))).unwrap();
        }
        got.sort();
        assert_eq!(
            got,
            vec![(ids[0], frame(0, 40)), (ids[2], frame(1, 40))],
            "{:?}",
            cfg.recv
        );
        // The freed handle is taken again (once the kernel gave the
        // connection's requests back), and serves its new stream.
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut raw = loop {
            assert!(
                Instant::now() < deadline,
                "{:?}: slot never freed",
                cfg.recv
            );
            turn(&mut d, 8, &mut |_, _: &[u8]| panic!("no frame")).unwrap();
            let (raw, s) = raw_pair();
            let c = d.attach_stream(s).unwrap();
            if c == ids[1] {
                break raw;
            }
            d.detach(c);
        };
        raw.write_all(&frame(9, 9)).unwrap();
        let got = next_frames(&mut d, &format!("{:?}", cfg.recv));
        assert_eq!(got, vec![frame(9, 9)], "{:?}", cfg.recv);
    }
}

/// `n` connections from driver `a` to driver `b`, each sending `per_conn`
/// frames, at most `per_turn` a turn, with `send(driver, conn, seq)`
/// (false: back-pressure, retry next turn). One flush per driver per turn,
/// like a reactor. Returns the frames each connection received, the turns
/// taken and both drivers.
fn pump(
    cfg: &UringConfig,
    n: usize,
    per_conn: u64,
    per_turn: u64,
    mut send: impl FnMut(&mut UringDriver, ConnId, u64) -> bool,
) -> (Vec<Vec<Vec<u8>>>, u64, UringDriver, UringDriver) {
    let (mut a, ca, mut b, cb) = common::driver_pair(cfg, n);
    // Connection `i` of `b`, by its handle.
    let mut index = vec![usize::MAX; n];
    for (i, c) in cb.iter().enumerate() {
        index[c.index()] = i;
    }
    let mut sent = vec![0u64; n];
    let mut got: Vec<Vec<Vec<u8>>> = vec![Vec::new(); n];
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut turns = 0u64;
    while got.iter().map(Vec::len).sum::<usize>() < n * per_conn as usize {
        assert!(Instant::now() < deadline, "stalled");
        turns += 1;
        let now = Instant::now();
        for (i, &c) in ca.iter().enumerate() {
            let stop = sent[i].saturating_add(per_turn).min(per_conn);
            while sent[i] < stop && send(&mut a, c, sent[i]) {
                sent[i] += 1;
            }
        }
        a.flush(now);
        b.rx_burst(now, 64, &mut |c, f: &[u8]| {
            got[index[c.index()]].push(f.to_vec())
        });
        assert!(b.poll_failure().is_none() && a.poll_failure().is_none());
        b.flush(now);
    }
    (got, turns, a, b)
}

#[test]
fn more_connections_than_sq_entries_all_receive_in_spin_mode() {
    // 40 connections on rings of 8 SQ entries, receiving in spin mode: a
    // full SQ stops a pass over the connections, and the next pass starts
    // where it stopped. Starting at connection 0 every time, those past
    // the SQ's size never got a receive and this stalled.
    let cfg = UringConfig {
        sq_entries: 8,
        recv: RecvMode::Spin,
        ..UringConfig::default()
    };
    let (got, _, _, b) = pump(&cfg, 40, 5, 5, |d, c, seq| {
        let h = Header::new(Opcode::Rpc, seq, 0).to_bytes();
        d.tx_gather(c, &h, &[]).unwrap()
    });
    assert!(
        got.iter().all(|g| g.len() == 5),
        "{:?}",
        got.iter().map(Vec::len).collect::<Vec<_>>()
    );
    assert!(
        b.stats().sq_full > 0,
        "the SQ never filled: {:?}",
        b.stats()
    );
}

#[test]
fn loopback_connections_send_plainly_unless_asked() {
    // Sends far above the zero-copy threshold over loopback: by default no
    // zero-copy send is tried (the kernel would copy it and report so);
    // with `zero_copy_loopback` each connection tries one and falls back.
    let big = Bytes::from(vec![0x5a_u8; 64 << 10]);
    for (opt_in, n) in [(false, 2), (true, 2)] {
        let cfg = UringConfig {
            zero_copy_threshold: 16 << 10,
            zero_copy_loopback: opt_in,
            ..UringConfig::default()
        };
        let (got, _, a, _) = pump(&cfg, n, 8, 2, |d, c, seq| {
            let h = Header::new(Opcode::Rpc, seq, big.len() as u32).to_bytes();
            d.tx_gather(c, &h, std::slice::from_ref(&big)).unwrap()
        });
        assert!(got.iter().all(|g| g.len() == 8));
        let sa = a.stats();
        let zc_able = a.features().send_zc || a.features().sendmsg_zc;
        if opt_in && zc_able {
            assert!(sa.zc_sends > 0, "{sa:?}");
            assert_eq!(sa.zc_fallbacks, n as u64, "{sa:?}");
        } else {
            assert_eq!(sa.zc_sends, 0, "opt_in {opt_in}: {sa:?}");
            assert_eq!(sa.zc_fallbacks, 0, "{sa:?}");
        }
    }
}

#[test]
fn many_connections_share_one_driver_with_one_enter_per_turn() {
    for recv in [RecvMode::Single, RecvMode::Multishot] {
        let cfg = UringConfig {
            recv,
            zero_copy_threshold: 16 << 10,
            zero_copy_loopback: true,
            ..UringConfig::default()
        };
        let n = 8;
        let big = Bytes::from(vec![0xab_u8; 40 << 10]);
        let (got, turns, a, b) = pump(&cfg, n, 20, 1, |d, c, seq| {
            let h = Header::new(Opcode::Rpc, seq, big.len() as u32).to_bytes();
            d.tx_gather(c, &h, std::slice::from_ref(&big)).unwrap()
        });
        for g in &got {
            for (k, f) in g.iter().enumerate() {
                let h = Header::parse(f, u32::MAX, u32::MAX).unwrap();
                assert_eq!(h.request_id, k as u64, "order");
                assert!(f[HEADER_LEN..].iter().all(|&x| x == 0xab));
            }
        }
        let (sa, sb) = (a.stats(), b.stats());
        assert!(sa.enters <= turns && sb.enters <= turns, "{sa:?} {sb:?}");
        // Loopback always copies: connections that tried zero copy fell
        // back at their first report. A connection may have had a second
        // zero-copy send out before that report came (a send does not
        // wait for the last one's notification), so there may be more
        // reports than fallbacks, and never more fallbacks than
        // connections.
        assert!(sa.zc_sends > 0, "{sa:?}");
        assert!(
            sa.zc_fallbacks >= 1 && sa.zc_fallbacks <= n as u64,
            "{sa:?}"
        );
        assert!(sa.zc_fallbacks <= sa.zc_copied, "{sa:?}");
        assert!(sa.sends > sa.zc_sends);
        if recv == RecvMode::Multishot {
            // One arm per connection serves many completions.
            assert!(sb.recv_cqes > 4 * sb.recv_arms, "{sb:?}");
        } else {
            // One arm per completion: each is queued again (with the next
            // enter) after the one before completed.
            assert!(sb.recv_arms >= sb.recv_cqes, "{sb:?}");
            assert!(sb.recv_arms <= sb.recv_cqes + n as u64, "{sb:?}");
        }
    }
}

/// The message layer of 64 connections on one driver at each end, in each
/// receive mode: the client's requests (short and long, direct receives
/// among them) come back echoed by a server whose driver was made, and
/// its connections attached, on this thread and then run on another (a
/// reactor's life: built by its spawner, run by its thread).
#[test]
fn sessions_of_64_connections_echo_over_one_driver_each() {
    use starwire_transport::wire::Status;
    use starwire_transport::{
        ConnConfig, Connection, Incoming, Payload, PeerInfo, Sessions, TaskRole,
    };
    let peer = |role, incarnation| PeerInfo {
        role,
        job: "test".into(),
        task_index: 0,
        incarnation,
        shards: 1,
    };
    for cfg in all_modes() {
        let mode = cfg.recv;
        let n = 64;
        let per_conn = 12u64;
        let (a, a_ids, b, b_ids) = common::driver_pair(&cfg, n);
        let server_cfg = ConnConfig::new(peer(TaskRole::Ps, 2));
        let server = std::thread::spawn(move || {
            let mut s = Sessions::new(b);
            for &id in &b_ids {
                s.insert(id, server_cfg.clone());
            }
            let deadline = Instant::now() + Duration::from_secs(60);
            let mut answered = 0u64;
            while !s.is_empty() {
                assert!(Instant::now() < deadline, "{mode:?}: server stalled");
                s.turn(Instant::now(), &mut |_, conn: &mut Connection, m| {
                    if let Incoming::Request {
                        id, opcode, body, ..
                    } = m
                    {
                        conn.respond(id, opcode, Status::Ok, Payload::from(body.to_vec()))
                            .expect("respond");
                        answered += 1;
                    }
                });
                // The client's end closing ends each connection.
                while s.poll_failed().is_some() {}
            }
            (answered, s.driver().stats())
        });
        let mut s = Sessions::new(a);
        let client_cfg = ConnConfig::new(peer(TaskRole::Worker, 1));
        let body = |i: usize, k: u64| {
            // Every sixth request is long enough for direct receives.
            let len = if k % 6 == 5 {
                200 << 10
            } else {
                (i * 97 + k as usize * 1013) % 6000
            };
            vec![(i as u8) ^ (k as u8); len]
        };
        let mut want = std::collections::HashMap::new();
        for (i, &id) in a_ids.iter().enumerate() {
            s.insert(id, client_cfg.clone());
            for k in 0..per_conn {
                let b = body(i, k);
                let req = s
                    .conn(id)
                    .unwrap()
                    .request(Opcode::Rpc, 0, Payload::from(b.clone()), None)
                    .expect("request");
                want.insert((id, req), b);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        let total = want.len();
        let mut got = 0usize;
        while got < total {
            assert!(Instant::now() < deadline, "{mode:?}: {got} of {total}");
            s.turn(Instant::now(), &mut |c, _, m| {
                if let Incoming::Response {
                    id, status, body, ..
                } = m
                {
                    assert_eq!(status, Status::Ok);
                    let w = want.remove(&(c, id)).expect("a response to a request");
                    assert!(w == body, "{mode:?}: {c} response {id} differs");
                    got += 1;
                }
            });
            if let Some((c, _, e)) = s.poll_failed() {
                panic!("{mode:?}: {c} failed: {e}");
            }
        }
        let client = s.driver().stats();
        drop(s);
        let (answered, server) = server.join().expect("server");
        assert_eq!(answered, total as u64, "{mode:?}");
        assert!(
            server.frames_received >= total as u64,
            "{mode:?}: {server:?}"
        );
        assert!(
            client.frames_received >= total as u64,
            "{mode:?}: {client:?}"
        );
    }
}

/// A single receive takes at most `recv_chunk_len` bytes, however much
/// the socket holds: a burst already in the socket comes in bounded
/// pieces, each delivered (and answerable) before the next is taken.
#[test]
fn single_receives_take_a_burst_in_bounded_pieces() {
    let chunk = 8 << 10;
    let cfg = UringConfig {
        recv: RecvMode::Single,
        recv_chunk_len: chunk,
        ..UringConfig::default()
    };
    let (mut raw, s) = raw_pair();
    let (mut d, id) = solo(s, &cfg);
    // 64 frames of 1 KiB land in the socket before the driver looks.
    let frames: Vec<Vec<u8>> = (0..64).map(|k| frame(k, 1024 - HEADER_LEN)).collect();
    let total: usize = frames.iter().map(Vec::len).sum();
    raw.write_all(&frames.concat()).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let mut got = Vec::new();
    let mut per_burst = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while got.len() < frames.len() {
        assert!(Instant::now() < deadline, "stalled at {} frames", got.len());
        let n = turn(&mut d, usize::MAX, &mut |_, f: &[u8]| got.push(f.to_vec())).unwrap();
        if n > 0 {
            per_burst.push(n);
        }
    }
    assert_eq!(got, frames);
    let st = d.conn_stats(id).unwrap();
    assert_eq!(st.bytes_received, total as u64, "{st:?}");
    // 64 KiB in pieces of at most 8 KiB: at least 8 receives, and no
    // delivery of more frames than one piece holds.
    assert!(st.recv_cqes >= (total / chunk) as u64, "{st:?}");
    assert!(
        per_burst.iter().all(|&n| n <= chunk / 1024 + 1),
        "{per_burst:?}"
    );
}

#[test]
fn spin_mode_receives_in_the_turns_enter_without_multishot() {
    let cfg = UringConfig {
        recv: RecvMode::Spin,
        ..UringConfig::default()
    };
    let n = 4;
    let (got, turns, _a, b) = pump(&cfg, n, 200, u64::MAX, |d, c, seq| {
        let f = frame(seq, (seq as usize * 37) % 3000);
        let Some(buf) = d.tx_reserve(c, f.len()).unwrap() else {
            return false;
        };
        buf.copy_from_slice(&f);
        d.tx_commit(c, f.len());
        true
    });
    for g in &got {
        for (k, f) in g.iter().enumerate() {
            assert_eq!(f, &frame(k as u64, (k * 37) % 3000), "frame {k}");
        }
    }
    let sb = b.stats();
    // No receive is ever armed as multishot; each turn's one enter carries
    // the receives, so there are no more enters than turns.
    assert_eq!(sb.recv_arms, 0, "{sb:?}");
    assert!(sb.enters <= turns, "{sb:?} turns {turns}");
    assert!(sb.recv_cqes > 0 && sb.registered_enters > 0, "{sb:?}");
    assert!(sb.file_slots >= n as u32, "{sb:?}");
}

/// Spin and single receives go into the connection's own buffer, not the
/// provided ones: with a single 64-byte provided buffer, bursts of 4 KiB
/// frames arrive whole and no receive runs short of provided buffers
/// (`rx_enobufs`), where receives through the provided buffers could take
/// at most 64 bytes each.
#[test]
fn spin_and_single_receives_use_the_connections_own_buffer() {
    for recv in [RecvMode::Spin, RecvMode::Single] {
        let cfg = UringConfig {
            recv,
            rx_buf_len: 64,
            rx_bufs: 1,
            ..UringConfig::default()
        };
        let (mut raw, s) = raw_pair();
        let (mut d, _) = solo(s, &cfg);
        let mut want = Vec::new();
        for round in 0..8u64 {
            let burst: Vec<Vec<u8>> = (0..16).map(|k| frame(round * 100 + k, 4096)).collect();
            raw.write_all(&burst.concat()).unwrap();
            let (got, err) = drain(&mut d, 16);
            assert!(err.is_none(), "{recv:?}: {err:?}");
            assert_eq!(got, burst, "{recv:?} round {round}");
            want.extend(burst);
        }
        let st = d.stats();
        assert_eq!(st.rx_enobufs, 0, "{recv:?}: {st:?}");
        assert_eq!(st.frames_received, want.len() as u64, "{recv:?}: {st:?}");
        // 8 bursts of 64 KiB: far fewer receives than 64-byte pieces.
        assert!(st.recv_cqes < 200, "{recv:?}: {st:?}");
    }
}

/// A connection's own buffer shorter than a burst, and than a frame:
/// receives stop while it holds unconsumed bytes and start over at its
/// front once they were consumed; frames that straddle its end, or do not
/// fit it at all, are reassembled. Every frame arrives whole and in order.
#[test]
fn a_short_own_buffer_reassembles_frames_in_order() {
    for recv in [RecvMode::Spin, RecvMode::Single] {
        let cfg = UringConfig {
            recv,
            rx_conn_buf_len: 4096,
            // No direct receives: a 10000-byte frame goes through the
            // own buffer in pieces.
            rx_direct_min: usize::MAX,
            ..UringConfig::default()
        };
        let (mut raw, s) = raw_pair();
        let (mut d, _) = solo(s, &cfg);
        let sizes = [3000usize, 10, 10000, 0, 4064, 4065, 1, 2999];
        let frames: Vec<Vec<u8>> = (0..64u64)
            .map(|k| frame(k, sizes[k as usize % sizes.len()]))
            .collect();
        let bytes = frames.concat();
        let writer = std::thread::spawn(move || {
            raw.write_all(&bytes).unwrap();
            raw
        });
        // Delivered a few frames per turn, so the buffer holds unconsumed
        // bytes between receives.
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while got.len() < frames.len() && Instant::now() < deadline {
            turn(&mut d, 3, &mut |_, f: &[u8]| got.push(f.to_vec())).unwrap();
        }
        let _raw = writer.join().unwrap();
        assert_eq!(got.len(), frames.len(), "{recv:?}");
        assert!(got == frames, "{recv:?}: frames differ");
    }
}

#[test]
fn spin_mode_park_poll_wakes_the_reactor_and_takes_no_data() {
    let cfg = UringConfig {
        recv: RecvMode::Spin,
        ..UringConfig::default()
    };
    let (mut raw, s) = raw_pair();
    let (mut d, id) = solo(s, &cfg);
    d.flush(Instant::now());
    for round in 0..3u64 {
        // Nothing sent: the park times out.
        assert_eq!(poll_park_fd(&d, 50), 0, "round {round}: woke without data");
        d.flush(Instant::now());
        // Data: the armed poll wakes the park.
        let f = frame(round, 100);
        raw.write_all(&f).unwrap();
        assert_eq!(
            poll_park_fd(&d, 5000),
            1,
            "round {round}: data did not wake the park"
        );
        let got = next_frames(&mut d, &format!("round {round}"));
        assert_eq!(got, vec![f], "round {round}");
    }
    assert!(d.stats().park_polls >= 3, "{:?}", d.stats());
    d.detach(id);
    d.flush(Instant::now());
}

/// A ring that does not defer its completion work
/// (`defer_taskrun: false`: `COOP_TASKRUN`) cannot park in itself: its
/// reactor sleeps in `poll(2)` on the ring's descriptor (`Sleep::Fds`),
/// which data makes readable, in every receive mode. A deferring ring
/// sleeps in itself (`Sleep::Own`).
#[test]
fn a_ring_that_does_not_defer_its_work_parks_in_poll() {
    use nix::sys::eventfd::{EfdFlags, EventFd};
    use starwire_transport::reactor::ParkWaker;
    use std::os::fd::AsFd;
    let deferring = UringDriver::new(&UringConfig::default()).unwrap();
    if deferring.features().defer_taskrun {
        assert_eq!(deferring.sleep(), Sleep::Own);
    }
    for cfg in all_modes() {
        let mode = cfg.recv;
        let cfg = UringConfig {
            defer_taskrun: false,
            ..cfg
        };
        let (mut raw, s) = raw_pair();
        let (mut d, _) = solo(s, &cfg);
        assert_eq!(d.sleep(), Sleep::Fds, "{mode:?}");
        let efd = EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK).unwrap();
        let waker = ParkWaker {
            fd: efd.as_fd(),
            id: 1,
        };
        assert!(
            d.park(waker, Duration::from_millis(1)).is_none(),
            "{mode:?}"
        );
        d.flush(Instant::now());
        for round in 0..3u64 {
            assert_eq!(poll_park_fd(&d, 50), 0, "{mode:?} round {round}: no data");
            d.flush(Instant::now());
            let f = frame(round, 100 + round as usize);
            raw.write_all(&f).unwrap();
            assert_eq!(
                poll_park_fd(&d, 5000),
                1,
                "{mode:?} round {round}: data did not wake the poll"
            );
            let got = next_frames(&mut d, &format!("{mode:?} round {round}"));
            assert_eq!(got, vec![f], "{mode:?} round {round}");
        }
        assert_eq!(d.stats().ring_parks, 0, "{mode:?}");
    }
}

/// A reactor parks inside the ring (`Driver::park`): one enter that
/// sleeps until data, a wake-up of the reactor's eventfd, or the timeout;
/// in every receive mode. Data arriving while parked ends the park and is
/// received in order afterwards; a wake-up written before the park ends it
/// at once; a wake-up from another thread ends it early.
#[test]
fn parks_in_the_ring_end_by_input_by_the_waker_or_by_the_timeout() {
    use nix::sys::eventfd::{EfdFlags, EventFd};
    use starwire_transport::reactor::{ParkEnd, ParkWaker};
    use std::os::fd::AsFd;
    use std::sync::Arc;
    for cfg in all_modes() {
        let mode = cfg.recv;
        let (mut raw, s) = raw_pair();
        let (mut d, id) = solo(s, &cfg);
        assert_eq!(d.sleep(), Sleep::Own, "{mode:?}");
        d.flush(Instant::now());
        let efd = Arc::new(
            EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
                .unwrap(),
        );
        let park = |d: &mut UringDriver, ms: u64| {
            let waker = ParkWaker {
                fd: efd.as_fd(),
                id: 1,
            };
            d.park(waker, Duration::from_millis(ms))
                .expect("a DEFER_TASKRUN ring parks in itself")
        };
        for round in 0..3u64 {
            // Nothing: the timeout.
            let t0 = Instant::now();
            assert_eq!(park(&mut d, 40), ParkEnd::Timeout, "{mode:?} round {round}");
            assert!(
                t0.elapsed() >= Duration::from_millis(30),
                "{mode:?}: no sleep"
            );
            // A wake-up already written ends the park at once.
            efd.write(1).unwrap();
            let t0 = Instant::now();
            assert_eq!(park(&mut d, 5000), ParkEnd::Waker, "{mode:?} round {round}");
            assert!(t0.elapsed() < Duration::from_secs(2), "{mode:?}");
            efd.read().unwrap();
            // A wake-up from another thread while parked.
            let e = efd.clone();
            let waker = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(30));
                e.write(1).unwrap();
            });
            let t0 = Instant::now();
            assert_eq!(park(&mut d, 5000), ParkEnd::Waker, "{mode:?} round {round}");
            assert!(t0.elapsed() < Duration::from_secs(2), "{mode:?}");
            waker.join().unwrap();
            efd.read().unwrap();
            // Data from the peer while parked.
            let f = frame(round, 100 + round as usize);
            let mut peer = raw.try_clone().unwrap();
            let g = f.clone();
            let sender = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(30));
                peer.write_all(&g).unwrap();
            });
            let t0 = Instant::now();
            assert_eq!(park(&mut d, 5000), ParkEnd::Input, "{mode:?} round {round}");
            assert!(t0.elapsed() < Duration::from_secs(2), "{mode:?}");
            sender.join().unwrap();
            let got = next_frames(&mut d, &format!("{mode:?} round {round}"));
            assert_eq!(got, vec![f], "{mode:?} round {round}");
        }
        let st = d.stats();
        assert!(st.ring_parks >= 9, "{mode:?}: {st:?}");
        raw.write_all(&frame(99, 8)).unwrap();
        d.detach(id);
        d.flush(Instant::now());
    }
}

/// A new waker (another reactor run on the ring) gets a poll of its own,
/// even when its eventfd reuses the old one's number; the old poll's
/// cancellation is not taken for a wake-up. Also: a ring never entered is
/// enabled by its first park, and a spin-mode park is one enter.
#[test]
fn a_new_waker_on_a_reused_fd_number_still_ends_the_park() {
    use nix::sys::eventfd::{EfdFlags, EventFd};
    use starwire_transport::reactor::{ParkEnd, ParkWaker};
    use std::os::fd::{AsFd, AsRawFd, OwnedFd};
    for cfg in all_modes() {
        let mode = cfg.recv;
        let (_raw, s) = raw_pair();
        let (mut d, id) = solo(s, &cfg);
        // Never entered: the park enables the ring and arms the poll.
        let old = OwnedFd::from(EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK).unwrap());
        let waker = ParkWaker {
            fd: old.as_fd(),
            id: 100,
        };
        assert_eq!(
            d.park(waker, Duration::from_millis(30)),
            Some(ParkEnd::Timeout),
            "{mode:?}"
        );
        nix::unistd::write(&old, &1u64.to_ne_bytes()).unwrap();
        let before = d.stats().enters;
        assert_eq!(
            d.park(waker, Duration::from_secs(3)),
            Some(ParkEnd::Waker),
            "{mode:?}: the first park did not arm the poll"
        );
        assert_eq!(
            d.stats().enters - before,
            1,
            "{mode:?}: a park is one enter"
        );
        let mut b = [0u8; 8];
        nix::unistd::read(old.as_raw_fd(), &mut b).unwrap();
        // The poll fired; arm one again, then put another eventfd under
        // the same number (dup2 closes the old file there, atomically).
        assert_eq!(
            d.park(waker, Duration::from_millis(30)),
            Some(ParkEnd::Timeout),
            "{mode:?}"
        );
        let new = EventFd::from_value_and_flags(1, EfdFlags::EFD_NONBLOCK).unwrap();
        // SAFETY: both numbers are open descriptors of this test; the
        // number `old` owns now names the new eventfd, and `old` still
        // owns (and closes) it.
        assert!(unsafe { libc::dup2(new.as_raw_fd(), old.as_raw_fd()) } >= 0);
        drop(new);
        let waker = ParkWaker {
            fd: old.as_fd(),
            id: 101,
        };
        let t0 = Instant::now();
        assert_eq!(
            d.park(waker, Duration::from_secs(3)),
            Some(ParkEnd::Waker),
            "{mode:?}"
        );
        assert!(t0.elapsed() < Duration::from_secs(2), "{mode:?}");
        nix::unistd::read(old.as_raw_fd(), &mut b).unwrap();
        // The old poll's cancellation completed by now: no wake-up from it.
        assert_eq!(
            d.park(waker, Duration::from_millis(30)),
            Some(ParkEnd::Timeout),
            "{mode:?}: a cancelled poll woke the park"
        );
        d.detach(id);
        d.flush(Instant::now());
    }
}

/// Whether the kernel lists a TCP socket with inode `ino` as held by a
/// file (`/proc/net/tcp`; a socket no file refers to shows inode 0).
fn tcp_socket_listed(ino: u64) -> bool {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    table
        .lines()
        .skip(1)
        .any(|l| l.split_whitespace().nth(9) == Some(&ino.to_string()))
}

/// A detached connection lets its socket go: once the kernel gave its
/// requests back, the ring clears its slot of the registered file table
/// (the last reference), and no file refers to the socket any more. In
/// every receive mode; the slot carries a new connection afterwards.
#[test]
fn a_detached_connection_lets_its_socket_go() {
    use std::os::fd::AsRawFd;
    for cfg in all_modes() {
        let mode = cfg.recv;
        let (_raw, s) = raw_pair();
        let link = std::fs::read_link(format!("/proc/self/fd/{}", s.as_raw_fd())).unwrap();
        let ino: u64 = link
            .to_string_lossy()
            .trim_start_matches("socket:[")
            .trim_end_matches(']')
            .parse()
            .unwrap();
        let (mut d, id) = solo(s, &cfg);
        d.flush(Instant::now());
        assert!(tcp_socket_listed(ino), "{mode:?}: socket {ino} not listed");
        d.detach(id);
        let deadline = Instant::now() + Duration::from_secs(3);
        while tcp_socket_listed(ino) {
            assert!(
                Instant::now() < deadline,
                "{mode:?}: a file still holds socket {ino}"
            );
            d.flush(Instant::now());
            std::thread::sleep(Duration::from_millis(5));
        }
        // A new connection in the same place carries frames.
        let (mut raw2, s2) = raw_pair();
        assert_eq!(d.attach_stream(s2).unwrap(), id, "{mode:?}");
        let f = frame(5, 40);
        raw2.write_all(&f).unwrap();
        let got = next_frames(&mut d, &format!("{mode:?}"));
        assert_eq!(got, vec![f], "{mode:?}");
    }
}

/// After a park on the ring's eventfd (`wake_fds`, for a reactor that
/// polls other descriptors too, or whose park in the ring failed), the
/// next enter drains the eventfd with a read it submits itself: no
/// `read(2)` of its own, and the eventfd is quiet again for the next park.
#[test]
fn the_park_eventfd_is_drained_inside_the_next_enter() {
    let (mut raw, s) = raw_pair();
    let (mut d, _) = solo(s, &UringConfig::default());
    d.flush(Instant::now());
    for round in 0..3u64 {
        let f = frame(round, 64);
        raw.write_all(&f).unwrap();
        assert_eq!(
            poll_park_fd(&d, 5000),
            1,
            "round {round}: data did not signal"
        );
        let got = next_frames(&mut d, &format!("round {round}"));
        assert_eq!(got, vec![f], "round {round}");
        // Drained: the next park sleeps until its timeout.
        assert_eq!(
            poll_park_fd(&d, 30),
            0,
            "round {round}: the eventfd stayed readable"
        );
        d.flush(Instant::now());
    }
    let st = d.stats();
    assert!(st.eventfd_reads >= 3, "{st:?}");
    assert_eq!(st.eventfd_read_syscalls, 0, "{st:?}");
}

/// Set a socket buffer size option.
fn set_buf(s: &TcpStream, opt: libc::c_int, bytes: libc::c_int) {
    use std::os::fd::AsRawFd;
    // SAFETY: a valid socket and a pointer to an int of the given length.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            std::ptr::addr_of!(bytes).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(r, 0, "setsockopt");
}

#[test]
fn short_plain_sends_resume_in_order() {
    use std::io::Read;
    // A peer that does not read at first: the socket fills, the kernel
    // takes part of a send, and the rest must go out later, in order.
    for recv in [RecvMode::Single, RecvMode::Multishot, RecvMode::Spin] {
        let cfg = UringConfig {
            recv,
            zero_copy: false,
            // The test sizes the send buffer itself.
            loopback_send_buffer: None,
            ..UringConfig::default()
        };
        let (x, mut raw) = raw_pair();
        // Small socket buffers, so that the 9.6 MB below cannot all fit
        // whatever the kernel's autotuning would allow.
        set_buf(&x, libc::SO_SNDBUF, 32 << 10);
        set_buf(&raw, libc::SO_RCVBUF, 32 << 10);
        let (mut d, id) = solo(x, &cfg);
        let n = 160u64;
        let body = 60_000usize;
        let reader = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            let mut all = Vec::new();
            raw.read_to_end(&mut all).unwrap();
            all
        });
        let mut sent = 0u64;
        let deadline = Instant::now() + Duration::from_secs(20);
        while sent < n || d.tx_pending(id) {
            assert!(Instant::now() < deadline, "stalled at {sent}");
            let now = Instant::now();
            while sent < n {
                let f = Bytes::from(frame(sent, body)[HEADER_LEN..].to_vec());
                let h = Header::new(Opcode::Rpc, sent, body as u32).to_bytes();
                if !d.tx_gather(id, &h, std::slice::from_ref(&f)).unwrap() {
                    break;
                }
                sent += 1;
            }
            d.flush(now);
            // The receive pass refreshes the connection's view of its
            // sends.
            d.rx_burst(now, 8, &mut |_, _: &[u8]| panic!("no frame"));
            assert!(d.poll_failure().is_none());
        }
        let st = d.stats();
        d.detach(id);
        d.flush(Instant::now());
        let all = reader.join().unwrap();
        let want: Vec<u8> = (0..n).flat_map(|k| frame(k, body)).collect();
        assert_eq!(all.len(), want.len(), "{recv:?}");
        assert!(all == want, "{recv:?}: bytes differ");
        assert!(
            st.short_sends > 0,
            "{recv:?}: the socket never filled: {st:?}"
        );
    }
}

const CHILD_ENV: &str = "STARWIRE_URING_MEMLOCK_CHILD";

/// In the child: drop CAP_IPC_LOCK, lower RLIMIT_MEMLOCK to 1 MiB, and
/// ask for a ring registering 2 MiB. Prints the outcome for the parent.
fn memlock_child() {
    use caps::{CapSet, Capability};
    use nix::sys::resource::{setrlimit, Resource};
    for set in [CapSet::Effective, CapSet::Permitted] {
        caps::drop(None, set, Capability::CAP_IPC_LOCK).expect("drop CAP_IPC_LOCK");
    }
    setrlimit(Resource::RLIMIT_MEMLOCK, 1 << 20, 1 << 20).expect("setrlimit");
    match UringDriver::new(&UringConfig::default()) {
        Err(UringError::Memlock(e @ MemlockError::TooLow { .. })) => {
            println!("MEMLOCK-ERROR: {e}");
        }
        Err(e) => println!("OTHER-ERROR: {e}"),
        Ok(_) => println!("NO-ERROR"),
    }
}

#[test]
fn memlock_limit_too_low_is_a_clear_error() {
    if std::env::var_os(CHILD_ENV).is_some() {
        memlock_child();
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args([
            "memlock_limit_too_low_is_a_clear_error",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed: {stdout}");
    let line = stdout
        .lines()
        .find_map(|l| {
            ["MEMLOCK-ERROR", "OTHER-ERROR", "NO-ERROR"]
                .iter()
                .find_map(|k| l.find(k).map(|i| &l[i..]))
        })
        .unwrap_or_else(|| panic!("no outcome in {stdout}"));
    assert!(line.starts_with("MEMLOCK-ERROR"), "{line}");
    for want in [
        "RLIMIT_MEMLOCK is 1048576",
        "2097152",
        "ulimit -l",
        "LimitMEMLOCK=",
    ] {
        assert!(line.contains(want), "{want} missing: {line}");
    }
}

#[test]
fn loopback_connections_cap_their_send_buffer_unless_configured() {
    use nix::sys::socket::{getsockopt, setsockopt, sockopt::SndBuf};
    let cap = UringConfig::default()
        .loopback_send_buffer
        .expect("capped by default");
    // What the kernel makes of that request (doubled, clamped to
    // net.core.wmem_max), measured on a plain socket.
    let (probe, _peer) = raw_pair();
    setsockopt(&probe, SndBuf, &cap).unwrap();
    let capped = getsockopt(&probe, SndBuf).unwrap();
    for (cfg, want_cap) in [
        (UringConfig::default(), true),
        (
            UringConfig {
                loopback_send_buffer: None,
                ..UringConfig::default()
            },
            false,
        ),
    ] {
        let (x, _y) = raw_pair();
        let view = x.try_clone().unwrap();
        let _d = solo(x, &cfg);
        let got = getsockopt(&view, SndBuf).unwrap();
        assert_eq!(got == capped, want_cap, "SO_SNDBUF {got}, cap {capped}");
    }
}

/// Frames of these body lengths, long and short mixed: a long frame after
/// short ones, short ones after long ones, and long ones back to back.
const MIXED: [usize; 10] = [
    100,
    300 << 10,
    0,
    (1 << 20) - HEADER_LEN,
    (1 << 20) - HEADER_LEN,
    7,
    200 << 10,
    5000,
    (128 << 10) - HEADER_LEN,
    1,
];

#[test]
fn long_frames_are_received_straight_into_their_buffer() {
    for cfg in all_modes() {
        let (mut raw, s) = raw_pair();
        let (mut d, _) = solo(s, &cfg);
        let frames: Vec<Vec<u8>> = MIXED
            .iter()
            .enumerate()
            .map(|(i, &n)| frame(i as u64, n))
            .collect();
        let stream: Vec<u8> = frames.concat();
        // Odd pieces with pauses: headers split, bodies arriving in parts,
        // so direct receives come back short and multishot receives hold
        // part of a long frame when it is cancelled.
        let writer = std::thread::spawn(move || {
            for piece in stream.chunks(77_777) {
                raw.write_all(piece).unwrap();
                std::thread::sleep(Duration::from_millis(2));
            }
            raw
        });
        let (got, err) = drain(&mut d, frames.len());
        assert!(err.is_none(), "{:?}: {err:?}", cfg.recv);
        assert_eq!(got.len(), frames.len(), "{:?}", cfg.recv);
        for (i, (g, f)) in got.iter().zip(&frames).enumerate() {
            assert!(g == f, "{:?}: frame {i} differs", cfg.recv);
        }
        let st = d.stats();
        let long: usize = MIXED
            .iter()
            .filter(|&&n| n + HEADER_LEN >= cfg.rx_direct_min)
            .map(|&n| n + HEADER_LEN)
            .sum();
        // Most of the long frames' bytes came by direct receives (a long
        // frame's first piece may come through a provided buffer).
        assert!(
            st.direct_bytes as usize > long / 2,
            "{:?}: {} of {long} bytes direct",
            cfg.recv,
            st.direct_bytes
        );
        if cfg.recv == RecvMode::Multishot {
            assert!(st.direct_cancels > 0, "the multishot receive gave way");
        }
        // Back on the usual path: a short frame after the long ones.
        let mut raw = writer.join().unwrap();
        raw.write_all(&frame(99, 10)).unwrap();
        let (got, err) = drain(&mut d, 1);
        assert!(err.is_none(), "{err:?}");
        assert_eq!(got, vec![frame(99, 10)]);
    }
}

/// In single mode, the receive armed when a long frame's header comes is
/// cancelled for the direct receive every time, not only the first: each
/// of three long frames whose first bytes were taken before the receive
/// was armed again costs one cancel.
#[test]
fn single_receives_give_way_to_every_long_frame() {
    let cfg = UringConfig {
        recv: RecvMode::Single,
        rx_direct_min: 8192,
        ..UringConfig::default()
    };
    let (mut raw, s) = raw_pair();
    let (mut d, _) = solo(s, &cfg);
    // Flushes (each an enter and a reap) until the counters say `done`.
    let wait =
        |d: &mut UringDriver, what: &str, done: &dyn Fn(&starwire_uring::UringStats) -> bool| {
            let deadline = Instant::now() + Duration::from_secs(5);
            while !done(&d.stats()) {
                assert!(Instant::now() < deadline, "{what}: {:?}", d.stats());
                d.flush(Instant::now());
            }
        };
    let take = |d: &mut UringDriver, what: &str| {
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        while got.is_empty() {
            assert!(Instant::now() < deadline, "{what}: {:?}", d.stats());
            turn(d, 8, &mut |_, g: &[u8]| got.push(g.to_vec())).unwrap();
        }
        got
    };
    for round in 0..3u64 {
        // A short frame first: after a long one the next header comes by
        // a direct receive, and a short frame returns the connection to
        // single receives.
        let short = frame(100 + round, 10);
        raw.write_all(&short).unwrap();
        assert_eq!(take(&mut d, "short"), vec![short]);
        let f = frame(round, 20_000);
        let cqes = d.stats().recv_cqes;
        raw.write_all(&f[..1000]).unwrap();
        wait(&mut d, "first bytes", &|s| s.recv_cqes > cqes);
        // Armed again before the application looked at those bytes.
        let arms = d.stats().recv_arms;
        wait(&mut d, "armed again", &|s| s.recv_arms > arms);
        d.rx_burst(Instant::now(), 8, &mut |_, _: &[u8]| {
            panic!("not whole yet")
        });
        assert!(d.poll_failure().is_none());
        // The long header: the armed receive is cancelled for a direct one.
        wait(&mut d, "cancelled", &|s| s.direct_cancels > round);
        raw.write_all(&f[1000..]).unwrap();
        assert!(
            take(&mut d, "long") == vec![f],
            "round {round}: frame differs"
        );
    }
    assert_eq!(d.stats().direct_cancels, 3);
}

#[test]
fn long_frame_truncated_by_eof_is_a_frame_error() {
    for cfg in all_modes() {
        let (mut raw, s) = raw_pair();
        let (mut d, _) = solo(s, &cfg);
        let f = frame(3, 500 << 10);
        raw.write_all(&frame(2, 600 << 10)).unwrap();
        raw.write_all(&f[..300 << 10]).unwrap();
        raw.shutdown(Shutdown::Write).unwrap();
        let (got, err) = drain(&mut d, usize::MAX);
        assert_eq!(got, vec![frame(2, 600 << 10)], "{:?}", cfg.recv);
        assert!(
            matches!(
                err,
                Some(TransportError::Frame(FrameError::Truncated { needed, have }))
                    if needed == f.len() && have == 300 << 10
            ),
            "{:?}: {err:?}",
            cfg.recv
        );
    }
}

/// Read exactly `n` bytes from a raw socket.
fn read_n(raw: &mut TcpStream, n: usize) -> Vec<u8> {
    use std::io::Read;
    let mut v = vec![0; n];
    raw.read_exact(&mut v).unwrap();
    v
}

#[test]
fn frames_longer_than_a_slot_are_sent_in_order() {
    for cfg in all_modes() {
        let (raw, s) = raw_pair();
        let (mut d, id) = solo(s, &cfg);
        let slot = cfg.tx_slot_len;
        // By reservation (heap), by gather with a long segment (by
        // reference), by gather of many short segments (copied part over a
        // slot), with short frames between them.
        let long_reserved = frame(1, 3 * slot);
        let long_shared = frame(2, 5 * slot);
        let many_short = frame(3, 2 * slot + 17);
        let expect = [
            frame(0, 10),
            long_reserved.clone(),
            frame(9, 20),
            long_shared.clone(),
            many_short.clone(),
            frame(8, 30),
        ]
        .concat();
        let reader = std::thread::spawn(move || {
            let mut raw = raw;
            read_n(&mut raw, expect.len()) == expect
        });
        // Queue one frame with `what`, flushing under back-pressure.
        let send = |d: &mut UringDriver, what: &dyn Fn(&mut UringDriver) -> bool| {
            let deadline = Instant::now() + Duration::from_secs(5);
            while !what(d) {
                assert!(Instant::now() < deadline, "back-pressure never ended");
                d.flush(Instant::now());
                d.rx_burst(Instant::now(), 8, &mut |_, _: &[u8]| panic!("no frame"));
            }
        };
        let gather = |f: Vec<u8>| {
            move |d: &mut UringDriver| {
                d.tx_gather(
                    id,
                    &f[..HEADER_LEN],
                    &[Bytes::copy_from_slice(&f[HEADER_LEN..])],
                )
                .unwrap()
            }
        };
        send(&mut d, &gather(frame(0, 10)));
        send(
            &mut d,
            &|d: &mut UringDriver| match d.tx_reserve(id, long_reserved.len()).unwrap() {
                Some(b) => {
                    b.copy_from_slice(&long_reserved);
                    d.tx_commit(id, long_reserved.len());
                    true
                }
                None => false,
            },
        );
        send(&mut d, &gather(frame(9, 20)));
        send(&mut d, &gather(long_shared));
        send(&mut d, &|d: &mut UringDriver| {
            let segs: Vec<Bytes> = many_short[HEADER_LEN..]
                .chunks(100)
                .map(Bytes::copy_from_slice)
                .collect();
            d.tx_gather(id, &many_short[..HEADER_LEN], &segs).unwrap()
        });
        send(&mut d, &gather(frame(8, 30)));
        let deadline = Instant::now() + Duration::from_secs(5);
        while d.tx_pending(id) {
            assert!(Instant::now() < deadline, "sends never completed");
            turn(&mut d, 8, &mut |_, _: &[u8]| panic!("no frame")).unwrap();
        }
        assert!(reader.join().unwrap(), "{:?}: bytes differ", cfg.recv);
        assert_eq!(d.stats().tx_heap_frames, 2, "{:?}", cfg.recv);
    }
}

#[test]
fn detaching_a_connection_during_a_direct_receive_leaves_the_driver_working() {
    for cfg in all_modes() {
        let mut d = UringDriver::new(&cfg).unwrap();
        let (mut raw_x, x) = raw_pair();
        let (mut raw_y, y) = raw_pair();
        let cx = d.attach_stream(x).unwrap();
        let cy = d.attach_stream(y).unwrap();
        // Half of a long frame: its header starts a direct receive that
        // cannot finish.
        let long = frame(1, 1 << 19);
        raw_x.write_all(&long[..200 << 10]).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while d.stats().direct_recvs == 0 {
            assert!(
                Instant::now() < deadline,
                "{:?}: no direct receive",
                cfg.recv
            );
            turn(&mut d, 8, &mut |_, _: &[u8]| panic!("no frame yet")).unwrap();
        }
        d.flush(Instant::now());
        d.detach(cx);
        // The rest arrives after the detach (or fails: the socket was shut
        // down); the driver and its other connection carry on.
        let _ = raw_x.write_all(&long[200 << 10..]);
        raw_y.write_all(&frame(2, 10)).unwrap();
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        while got.is_empty() {
            assert!(
                Instant::now() < deadline,
                "{:?}: the other connection stalled",
                cfg.recv
            );
            turn(&mut d, 8, &mut |c, f: &[u8]| got.push((c, f.to_vec()))).unwrap();
        }
        assert_eq!(got, vec![(cy, frame(2, 10))], "{:?}", cfg.recv);
        for _ in 0..10 {
            d.flush(Instant::now());
        }
        d.detach(cy);
        drop(d);
    }
}

#[test]
fn spin_driver_with_a_quiet_peer_after_a_long_frame_is_idle() {
    // After a long frame the next header is received directly; those
    // non-blocking receives must not count as work, or a reactor whose
    // peer went quiet would never park.
    let cfg = UringConfig {
        recv: RecvMode::Spin,
        ..UringConfig::default()
    };
    let (mut raw, s) = raw_pair();
    let (mut d, _) = solo(s, &cfg);
    let long = frame(1, 300 << 10);
    raw.write_all(&long).unwrap();
    let got = next_frames(&mut d, "the long frame");
    assert!(got[0] == long);
    // The peer is quiet now: within a few turns the flush reports no work.
    let mut idle = false;
    for _ in 0..20 {
        let worked = d.flush(Instant::now());
        d.rx_burst(Instant::now(), 8, &mut |_, _: &[u8]| panic!("no frame"));
        assert!(d.poll_failure().is_none());
        if !worked {
            idle = true;
            break;
        }
    }
    assert!(
        idle,
        "turns with only empty direct receives counted as work"
    );
    assert!(
        d.stats().direct_recvs > 0,
        "the next header is received directly"
    );
    // And the next frame still arrives.
    raw.write_all(&frame(2, 5)).unwrap();
    assert_eq!(next_frames(&mut d, "the next frame"), vec![frame(2, 5)]);
}

#[test]
fn a_long_frames_buffer_is_given_back_after_a_run_of_short_frames() {
    // Direct receives on (the default), and off: then a long frame is
    // reassembled from small provided buffers into the same frame buffer,
    // which must be given back all the same.
    let direct_off = all_modes().map(|c| UringConfig {
        rx_direct_min: c.max_frame_len + 1,
        rx_buf_len: 16 * 1024,
        rx_bufs: 64,
        ..c
    });
    for cfg in all_modes().into_iter().chain(direct_off) {
        let (mut raw, s) = raw_pair();
        let (mut d, _) = solo(s, &cfg);
        let long = cfg.rx_direct_min.min(256 * 1024) + 1000;
        let mut id = 0u64;
        let mut next = |body: usize| {
            id += 1;
            frame(id, body)
        };
        // A long frame, 63 short ones: the buffer is kept.
        let mut sent: Vec<Vec<u8>> = vec![next(long)];
        sent.extend((0..63).map(|_| next(100)));
        raw.write_all(&sent.concat()).unwrap();
        let (got, err) = drain(&mut d, sent.len());
        assert!(err.is_none(), "{:?}: {err:?}", cfg.recv);
        assert!(got == sent, "{:?}: frames differ", cfg.recv);
        assert_eq!(d.stats().rx_buffers_released, 0, "{:?}", cfg.recv);
        // The 64th short frame gives it back; a long frame after that
        // still arrives whole, and keeps its buffer until the next run.
        let more = vec![next(100), next(long), next(7)];
        raw.write_all(&more.concat()).unwrap();
        let (got, err) = drain(&mut d, more.len());
        assert!(err.is_none(), "{:?}: {err:?}", cfg.recv);
        assert!(got == more, "{:?}: frames differ", cfg.recv);
        assert_eq!(d.stats().rx_buffers_released, 1, "{:?}", cfg.recv);
    }
}

/// A stream handed over in non-blocking mode (as an async runtime or a
/// non-blocking accept leaves it) still works in every mode: a receive
/// waiting for data must not come back as `EAGAIN`.
#[test]
fn a_non_blocking_stream_receives_in_every_mode() {
    for cfg in all_modes() {
        let (mut raw, s) = raw_pair();
        s.set_nonblocking(true).unwrap();
        let (mut d, _) = solo(s, &cfg);
        // Nothing there yet: a receive is armed (or tried) on an empty
        // socket.
        let (got, err) = drain(&mut d, 0);
        assert!(got.is_empty() && err.is_none());
        for _ in 0..3 {
            turn(&mut d, 8, &mut |_, _: &[u8]| {}).unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
        raw.write_all(&frame(1, 100)).unwrap();
        let (got, err) = drain(&mut d, 1);
        assert!(err.is_none(), "{:?}: {err:?}", cfg.recv);
        assert_eq!(got, vec![frame(1, 100)], "{:?}", cfg.recv);
    }
}
