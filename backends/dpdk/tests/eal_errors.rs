//! EAL failures, in a process of their own (the EAL initialises once per
//! process): DPDK's reason comes back in a typed error, a missing af_xdp
//! interface is named before the EAL runs, and a failed initialisation is
//! final for the process.

use starwire_dpdk::{DpdkError, Eal};

#[test]
fn eal_errors_are_typed_and_carry_dpdks_reason() {
    match Eal::init(
        "--no-huge --no-pci --no-shconf -m 512 --vdev=net_af_xdp0,iface=starwire-no-such-if",
    ) {
        Err(DpdkError::InterfaceMissing { driver, iface, .. }) => {
            assert_eq!(driver, "net_af_xdp");
            assert_eq!(iface, "starwire-no-such-if");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        Eal::init("--vdev='net_ring0"),
        Err(DpdkError::EalArgs { .. })
    ));
    let bad = "--no-huge --no-pci --no-shconf -m 512 --starwire-not-an-eal-option";
    let e = Eal::init(bad).unwrap_err();
    match &e {
        DpdkError::EalInit {
            args,
            errno,
            reason,
        } => {
            assert_eq!(args, bad);
            assert_eq!(*errno, 22, "EINVAL for a bad option");
            assert!(!reason.is_empty());
        }
        other => panic!("{other:?}"),
    }
    assert!(e.to_string().contains("EAL initialisation"), "{e}");
    // Final: the same error for any later call.
    assert_eq!(
        Eal::init("--no-huge --no-pci --no-shconf -m 512").unwrap_err(),
        e
    );
    assert!(Eal::get().is_none());
}
