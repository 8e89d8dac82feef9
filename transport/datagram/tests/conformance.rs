//! The shared conformance suite over lossy datagrams under the reliability
//! core: every message delivered exactly once and in order despite 5 % loss
//! with duplication and reordering.

use starwire_datagram::{LossConfig, LossyLink, Reliable, ReliableConfig};
use starwire_transport::conformance;

fn pair(loss: LossConfig, seed: u64) -> (Reliable<LossyLink>, Reliable<LossyLink>) {
    let (la, lb) = LossyLink::pair(loss, seed);
    let cfg = ReliableConfig::default();
    (
        Reliable::new(la, cfg.clone()).expect("config a"),
        Reliable::new(lb, cfg).expect("config b"),
    )
}

#[test]
fn lossless_datagrams() {
    let mut seed = 0;
    conformance::run_all("datagram-0%", || {
        seed += 1;
        pair(LossConfig::lossless(1500), seed)
    });
}

#[test]
fn five_percent_loss_with_duplication_and_reordering() {
    for base in [1u64, 100] {
        let mut seed = base;
        conformance::run_all("datagram-5%", || {
            seed += 1;
            let loss = LossConfig {
                loss: 0.05,
                duplicate: 0.02,
                reorder: 0.05,
                ..LossConfig::lossless(1500)
            };
            pair(loss, seed)
        });
    }
}
