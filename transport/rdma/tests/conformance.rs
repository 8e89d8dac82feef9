//! The shared backend conformance suite over the ring on a simulated QP.

use starwire_rdma::{PreparedRing, RingConfig, RingTransport, SimConfig, SimRcQp};
use starwire_transport::conformance;

fn pair(cfg: RingConfig) -> (RingTransport<SimRcQp>, RingTransport<SimRcQp>) {
    let (qa, qb) = SimRcQp::pair(SimConfig::default());
    let pa = PreparedRing::new(qa, cfg).expect("prepare a");
    let pb = PreparedRing::new(qb, cfg).expect("prepare b");
    let (ra, rb) = (pa.local_ring(), pb.local_ring());
    (
        pa.connect(rb).expect("connect a"),
        pb.connect(ra).expect("connect b"),
    )
}

#[test]
fn ring_over_sim_qp() {
    conformance::run_all("rdma-sim", || pair(RingConfig::default()));
}

#[test]
fn small_ring_over_sim_qp() {
    let cfg = RingConfig {
        ring_len: 16 * 1024,
        staging_len: 8 * 1024,
        recv_depth: 4,
        max_frame_len: None,
    };
    conformance::run_all("rdma-sim-small", || pair(cfg));
}
