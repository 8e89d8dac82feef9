use super::*;

fn poll_all(nic: &mut SimNic) -> Vec<Completion> {
    let mut buf = [Completion::default(); 16];
    let mut all = Vec::new();
    for _ in 0..100 {
        let n = nic.poll_cq(&mut buf).expect("poll_cq");
        if n == 0 {
            break;
        }
        all.extend_from_slice(&buf[..n]);
    }
    all
}

fn local(mr: &MemoryRegion, offset: usize, len: usize) -> LocalSlice {
    LocalSlice {
        lkey: mr.lkey,
        offset,
        len,
    }
}

fn remote(mr: &MemoryRegion, offset: u64) -> RemoteSlice {
    RemoteSlice {
        rkey: mr.rkey,
        addr: mr.addr + offset,
    }
}

/// Two NICs with one connected queue pair: (a, qp on a, b, qp on b).
fn connected(cfg: SimConfig) -> (SimNic, u32, SimNic, u32) {
    let (mut a, mut b) = SimNic::pair(cfg);
    let (qa, qb) = a.connect_qp(&mut b).unwrap();
    (a, qa, b, qb)
}

#[test]
fn a_nic_can_move_to_another_thread() {
    fn send<T: Send>(t: T) -> T {
        t
    }
    let (a, b) = SimNic::pair(SimConfig::default());
    let mut a = std::thread::spawn(move || send(a)).join().unwrap();
    let mr = a.reg_mr(8, Access::RemoteWrite).unwrap();
    let a = std::thread::spawn(move || send(a)).join().unwrap();
    a.mr_mem(mr.lkey).unwrap().write(0, b"moved").unwrap();
    let mut back = [0; 5];
    a.mr_mem(mr.lkey).unwrap().read(0, &mut back).unwrap();
    assert_eq!(&back, b"moved");
    drop(b);
}

#[test]
fn write_with_imm_lands_and_completes_both_sides() {
    let (mut a, qa, mut b, qb) = connected(SimConfig::default());
    let src = a.reg_mr(64, Access::RemoteWrite).unwrap();
    let dst = b.reg_mr(64, Access::RemoteWrite).unwrap();
    a.mr_mem(src.lkey).unwrap().write(0, b"ping").unwrap();
    b.post_recv(qb, 77).unwrap();
    a.post_write_with_imm(qa, 5, local(&src, 0, 4), remote(&dst, 10), 0xabc)
        .unwrap();
    // Staged until the doorbell.
    assert!(poll_all(&mut b).is_empty());
    assert_eq!(b.posted_recvs(qb), 1);
    a.ring_doorbell().unwrap();
    assert_eq!(a.doorbells(), 1);
    let send = poll_all(&mut a);
    assert_eq!(send.len(), 1);
    assert_eq!((send[0].wr_id, send[0].qp_num), (5, qa));
    assert_eq!(send[0].status, WcStatus::Success);
    assert_eq!(send[0].opcode, WcOpcode::RdmaWrite);
    let recv = poll_all(&mut b);
    assert_eq!(recv.len(), 1);
    assert_eq!((recv[0].wr_id, recv[0].qp_num), (77, qb));
    assert_eq!(recv[0].opcode, WcOpcode::RecvRdmaWithImm);
    assert_eq!(recv[0].imm, Some(0xabc));
    assert_eq!(recv[0].byte_len, 4);
    let mut landed = [0; 4];
    b.mr_mem(dst.lkey).unwrap().read(10, &mut landed).unwrap();
    assert_eq!(&landed, b"ping");
}

#[test]
fn many_queue_pairs_share_one_cq_and_one_doorbell() {
    let (mut a, mut b) = SimNic::pair(SimConfig::default());
    let src = a.reg_mr(64, Access::RemoteWrite).unwrap();
    let dst = b.reg_mr(64 * 8, Access::RemoteWrite).unwrap();
    let qps: Vec<(u32, u32)> = (0..8).map(|_| a.connect_qp(&mut b).unwrap()).collect();
    for (i, &(qa, qb)) in qps.iter().enumerate() {
        b.post_recv(qb, 100 + i as u64).unwrap();
        // One region of the protection domain serves every queue pair.
        a.post_write_with_imm(
            qa,
            i as u64,
            local(&src, 0, 8),
            remote(&dst, 64 * i as u64),
            i as u32,
        )
        .unwrap();
    }
    a.ring_doorbell().unwrap();
    assert_eq!(a.doorbells(), 1);
    let sends = poll_all(&mut a);
    let mut seen: Vec<(u64, u32)> = sends.iter().map(|w| (w.wr_id, w.qp_num)).collect();
    seen.sort_unstable();
    let want: Vec<(u64, u32)> = qps
        .iter()
        .enumerate()
        .map(|(i, q)| (i as u64, q.0))
        .collect();
    assert_eq!(seen, want);
    let recvs = poll_all(&mut b);
    assert_eq!(recvs.len(), 8);
    for wc in recvs {
        let i = qps
            .iter()
            .position(|q| q.1 == wc.qp_num)
            .expect("a queue pair of b");
        assert_eq!((wc.wr_id, wc.imm), (100 + i as u64, Some(i as u32)));
    }
}

#[test]
fn an_error_on_one_queue_pair_leaves_the_others_running() {
    let (mut a, mut b) = SimNic::pair(SimConfig::default());
    let src = a.reg_mr(64, Access::RemoteWrite).unwrap();
    let dst = b.reg_mr(64, Access::RemoteWrite).unwrap();
    let (q1, p1) = a.connect_qp(&mut b).unwrap();
    let (q2, p2) = a.connect_qp(&mut b).unwrap();
    b.post_recv(p1, 1).unwrap();
    b.post_recv(p2, 2).unwrap();
    // q1 writes past the region; q2 writes inside it.
    a.post_write_with_imm(q1, 10, local(&src, 0, 16), remote(&dst, 56), 0)
        .unwrap();
    a.post_write_with_imm(q2, 20, local(&src, 0, 8), remote(&dst, 0), 0)
        .unwrap();
    a.ring_doorbell().unwrap();
    assert_eq!(a.qp_state(q1), Some(QpState::Error));
    assert_eq!(a.qp_state(q2), Some(QpState::ReadyToSend));
    let mut wcs: Vec<_> = poll_all(&mut a)
        .iter()
        .map(|w| (w.qp_num, w.wr_id, w.status))
        .collect();
    wcs.sort_unstable_by_key(|w| w.1);
    assert_eq!(
        wcs,
        vec![
            (q1, 10, WcStatus::RemoteAccess),
            (q2, 20, WcStatus::Success)
        ]
    );
    assert_eq!(poll_all(&mut b).len(), 1);
    assert_eq!(b.posted_recvs(p1), 1);
}

#[test]
fn destroying_a_queue_pair_cleans_its_completions() {
    let (mut a, qa, mut b, qb) = connected(SimConfig::default());
    let src = a.reg_mr(8, Access::RemoteWrite).unwrap();
    let dst = b.reg_mr(8, Access::RemoteWrite).unwrap();
    let (qa2, _qb2) = a.connect_qp(&mut b).unwrap();
    b.post_recv(qb, 0).unwrap();
    a.post_write_with_imm(qa, 1, local(&src, 0, 8), remote(&dst, 0), 0)
        .unwrap();
    a.post_recv(qa2, 9).unwrap();
    a.ring_doorbell().unwrap();
    a.destroy_qp(qa).unwrap();
    assert_eq!(a.qp_state(qa), None);
    assert!(poll_all(&mut a).is_empty(), "qa's completion went with it");
    assert_eq!(
        a.destroy_qp(qa),
        Err(VerbsError::DestroyQp {
            qpn: qa,
            errno: Errno::EINVAL
        })
    );
    // The peer's queue pair finds nobody answering.
    let bsrc = b.reg_mr(8, Access::RemoteWrite).unwrap();
    b.post_write_with_imm(qb, 7, local(&bsrc, 0, 8), remote(&src, 0), 0)
        .unwrap();
    b.ring_doorbell().unwrap();
    let wcs: Vec<_> = poll_all(&mut b)
        .iter()
        .map(|w| (w.wr_id, w.status))
        .collect();
    assert!(wcs.contains(&(7, WcStatus::RetryExceeded)), "{wcs:?}");
    assert!(
        wcs.contains(&(0, WcStatus::Success)),
        "a's write landed first"
    );
    // The other queue pair of a is untouched.
    assert_eq!(a.posted_recvs(qa2), 1);
}

/// A region registered without remote write takes no peer's write, even
/// with its rkey and in bounds; the local side still reads and writes it.
#[test]
fn a_local_region_refuses_remote_writes() {
    let (mut a, qa, mut b, qb) = connected(SimConfig::default());
    let src = a.reg_mr(8, Access::RemoteWrite).unwrap();
    let dst = b.reg_mr(8, Access::Local).unwrap();
    b.mr_mem(dst.lkey).unwrap().write(0, b"mine").unwrap();
    b.post_recv(qb, 0).unwrap();
    a.post_write_with_imm(qa, 1, local(&src, 0, 8), remote(&dst, 0), 0)
        .unwrap();
    a.ring_doorbell().unwrap();
    assert_eq!(poll_all(&mut a)[0].status, WcStatus::RemoteAccess);
    let mut kept = [0; 4];
    b.mr_mem(dst.lkey).unwrap().read(0, &mut kept).unwrap();
    assert_eq!(&kept, b"mine");
    b.dereg_mr(dst.lkey).unwrap();
}

#[test]
fn a_deregistered_region_is_gone_for_the_peer() {
    let (mut a, qa, mut b, qb) = connected(SimConfig::default());
    let src = a.reg_mr(8, Access::RemoteWrite).unwrap();
    let dst = b.reg_mr(8, Access::RemoteWrite).unwrap();
    b.dereg_mr(dst.lkey).unwrap();
    assert!(b.mr_mem(dst.lkey).is_none());
    assert_eq!(b.region_count(), 0);
    assert!(matches!(
        b.dereg_mr(dst.lkey),
        Err(VerbsError::DeregMr { .. })
    ));
    b.post_recv(qb, 0).unwrap();
    a.post_write_with_imm(qa, 1, local(&src, 0, 8), remote(&dst, 0), 0)
        .unwrap();
    a.ring_doorbell().unwrap();
    assert_eq!(poll_all(&mut a)[0].status, WcStatus::RemoteAccess);
}

#[test]
fn queue_pairs_on_two_fabrics_cannot_connect() {
    let (mut a, _) = SimNic::pair(SimConfig::default());
    let (mut c, _) = SimNic::pair(SimConfig::default());
    assert_eq!(
        a.connect_qp(&mut c),
        Err(VerbsError::CreateQp {
            errno: Errno::EINVAL
        })
    );
    assert_eq!(a.qp_caps(0x11), None);
    assert!(matches!(
        a.post_recv(0x11, 0),
        Err(VerbsError::PostRecv { .. })
    ));
}

#[test]
fn zero_length_write_delivers_only_the_immediate() {
    let (mut a, qa, mut b, qb) = connected(SimConfig::default());
    let src = a.reg_mr(8, Access::RemoteWrite).unwrap();
    let dst = b.reg_mr(8, Access::RemoteWrite).unwrap();
    b.post_recv(qb, 1).unwrap();
    a.post_write_with_imm(qa, 1, local(&src, 0, 0), remote(&dst, 8), 42)
        .unwrap();
    a.ring_doorbell().unwrap();
    let recv = poll_all(&mut b);
    assert_eq!((recv[0].imm, recv[0].byte_len), (Some(42), 0));
}

#[test]
fn remote_access_out_of_bounds_errors_and_flushes() {
    let (mut a, qa, mut b, qb) = connected(SimConfig::default());
    let src = a.reg_mr(64, Access::RemoteWrite).unwrap();
    let dst = b.reg_mr(64, Access::RemoteWrite).unwrap();
    a.post_recv(qa, 900).unwrap();
    for i in 0..3 {
        b.post_recv(qb, i).unwrap();
    }
    a.post_write_with_imm(qa, 1, local(&src, 0, 16), remote(&dst, 56), 0)
        .unwrap();
    a.post_write_with_imm(qa, 2, local(&src, 0, 8), remote(&dst, 0), 0)
        .unwrap();
    a.ring_doorbell().unwrap();
    assert_eq!(a.qp_state(qa), Some(QpState::Error));
    let wcs = poll_all(&mut a);
    let statuses: Vec<_> = wcs.iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(
        statuses,
        vec![
            (1, WcStatus::RemoteAccess),
            (2, WcStatus::WrFlush),
            (900, WcStatus::WrFlush)
        ]
    );
    // Later posts flush too.
    a.post_write_with_imm(qa, 3, local(&src, 0, 8), remote(&dst, 0), 0)
        .unwrap();
    a.ring_doorbell().unwrap();
    a.post_recv(qa, 901).unwrap();
    let later: Vec<_> = poll_all(&mut a)
        .iter()
        .map(|w| (w.wr_id, w.status))
        .collect();
    assert_eq!(
        later,
        vec![(3, WcStatus::WrFlush), (901, WcStatus::WrFlush)]
    );
    // Nothing landed at the peer, no recv consumed.
    assert!(poll_all(&mut b).is_empty());
    assert_eq!(b.posted_recvs(qb), 3);
    // The peer's next write finds nobody answering.
    let bsrc = b.reg_mr(8, Access::RemoteWrite).unwrap();
    b.post_write_with_imm(qb, 9, local(&bsrc, 0, 8), remote(&src, 0), 0)
        .unwrap();
    b.ring_doorbell().unwrap();
    assert_eq!(poll_all(&mut b)[0].status, WcStatus::RetryExceeded);
}

#[test]
fn wrong_key_is_a_remote_access_error() {
    let (mut a, qa, mut b, qb) = connected(SimConfig::default());
    let src = a.reg_mr(64, Access::RemoteWrite).unwrap();
    let dst = b.reg_mr(64, Access::RemoteWrite).unwrap();
    b.post_recv(qb, 0).unwrap();
    let lkey_as_rkey = RemoteSlice {
        rkey: dst.lkey,
        addr: dst.addr,
    };
    a.post_write_with_imm(qa, 1, local(&src, 0, 8), lkey_as_rkey, 0)
        .unwrap();
    a.ring_doorbell().unwrap();
    assert_eq!(poll_all(&mut a)[0].status, WcStatus::RemoteAccess);
}

#[test]
fn local_slice_outside_region_is_a_protection_error() {
    let (mut a, qa, mut b, qb) = connected(SimConfig::default());
    let src = a.reg_mr(16, Access::RemoteWrite).unwrap();
    let dst = b.reg_mr(64, Access::RemoteWrite).unwrap();
    b.post_recv(qb, 0).unwrap();
    a.post_write_with_imm(qa, 1, local(&src, 8, 16), remote(&dst, 0), 0)
        .unwrap();
    a.ring_doorbell().unwrap();
    assert_eq!(poll_all(&mut a)[0].status, WcStatus::LocalProtection);
    assert_eq!(a.qp_state(qa), Some(QpState::Error));
}

#[test]
fn rnr_blocks_then_recovers_when_a_recv_is_posted() {
    let (mut a, qa, mut b, qb) = connected(SimConfig::default());
    let src = a.reg_mr(8, Access::RemoteWrite).unwrap();
    let dst = b.reg_mr(8, Access::RemoteWrite).unwrap();
    a.post_write_with_imm(qa, 1, local(&src, 0, 8), remote(&dst, 0), 1)
        .unwrap();
    a.ring_doorbell().unwrap();
    assert!(poll_all(&mut a).is_empty());
    b.post_recv(qb, 0).unwrap();
    assert_eq!(poll_all(&mut a)[0].status, WcStatus::Success);
    assert_eq!(poll_all(&mut b)[0].imm, Some(1));
}

#[test]
fn rnr_retry_exhaustion_is_an_error_completion() {
    let cfg = SimConfig {
        rnr_retry: 2,
        ..SimConfig::default()
    };
    let (mut a, qa, mut b, _qb) = connected(cfg);
    let src = a.reg_mr(8, Access::RemoteWrite).unwrap();
    let dst = b.reg_mr(8, Access::RemoteWrite).unwrap();
    a.post_write_with_imm(qa, 1, local(&src, 0, 8), remote(&dst, 0), 1)
        .unwrap();
    a.post_write_with_imm(qa, 2, local(&src, 0, 8), remote(&dst, 0), 2)
        .unwrap();
    a.ring_doorbell().unwrap();
    let mut seen = Vec::new();
    for _ in 0..10 {
        seen.extend(poll_all(&mut a));
        if !seen.is_empty() {
            break;
        }
    }
    let statuses: Vec<_> = seen.iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(
        statuses,
        vec![(1, WcStatus::RnrRetryExceeded), (2, WcStatus::WrFlush)]
    );
    assert_eq!(a.qp_state(qa), Some(QpState::Error));
    assert!(poll_all(&mut b).is_empty());
}

#[test]
fn posting_beyond_queue_capacity_fails_until_completions_are_polled() {
    let cfg = SimConfig {
        max_send_wr: 2,
        max_recv_wr: 1,
        ..SimConfig::default()
    };
    let (mut a, qa, mut b, qb) = connected(cfg);
    let src = a.reg_mr(8, Access::RemoteWrite).unwrap();
    let dst = b.reg_mr(8, Access::RemoteWrite).unwrap();
    b.post_recv(qb, 0).unwrap();
    assert_eq!(
        b.post_recv(qb, 1),
        Err(VerbsError::PostRecv {
            wr_id: 1,
            errno: Errno::ENOMEM
        })
    );
    a.post_write_with_imm(qa, 1, local(&src, 0, 0), remote(&dst, 0), 0)
        .unwrap();
    a.post_write_with_imm(qa, 2, local(&src, 0, 0), remote(&dst, 0), 0)
        .unwrap();
    assert_eq!(
        a.post_write_with_imm(qa, 3, local(&src, 0, 0), remote(&dst, 0), 0),
        Err(VerbsError::PostSend {
            wr_id: 3,
            errno: Errno::ENOMEM
        })
    );
    a.ring_doorbell().unwrap();
    // WR 1 completed; WR 2 waits for a receive WR (RNR).
    let mut one = [Completion::default(); 1];
    assert_eq!(a.poll_cq(&mut one), Ok(1));
    assert_eq!((one[0].wr_id, one[0].status), (1, WcStatus::Success));
    a.post_write_with_imm(qa, 3, local(&src, 0, 0), remote(&dst, 0), 0)
        .unwrap();
    // The receive slot frees once b polls the completion.
    assert_eq!(b.poll_cq(&mut one), Ok(1));
    b.post_recv(qb, 1).unwrap();
}

#[test]
fn cq_overrun_fails_poll_and_errors_every_queue_pair() {
    let (mut c, mut d) = SimNic::pair(SimConfig {
        cq_depth: 2,
        ..SimConfig::default()
    });
    let (qc, qd) = c.connect_qp(&mut d).unwrap();
    let (qc2, _) = c.connect_qp(&mut d).unwrap();
    let cs = c.reg_mr(8, Access::RemoteWrite).unwrap();
    let dr = d.reg_mr(8, Access::RemoteWrite).unwrap();
    for i in 0..3 {
        d.post_recv(qd, i).unwrap();
        c.post_write_with_imm(qc, i, local(&cs, 0, 0), remote(&dr, 0), 0)
            .unwrap();
    }
    c.ring_doorbell().unwrap();
    let mut one = [Completion::default(); 1];
    let overrun = Err(VerbsError::PollCq {
        errno: Errno::EOVERFLOW,
    });
    assert_eq!(c.poll_cq(&mut one), overrun);
    assert_eq!(c.poll_cq(&mut one), overrun, "the CQ stays broken");
    assert_eq!(c.qp_state(qc), Some(QpState::Error));
    assert_eq!(c.qp_state(qc2), Some(QpState::Error));
}
