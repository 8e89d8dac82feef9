//! Pinning real threads (the machine has at least one CPU; CPU 0 is used
//! only if the process may run there).

use starwire_placement::{
    current_cpu, current_thread_affinity, pin_current_thread, pin_current_thread_within,
    set_current_thread_affinity, CpuSet, Placement, PlacementError, ReactorMode, Topology,
};

/// Runs `f` on a fresh thread so pinning never leaks into other tests.
fn on_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(f).join().unwrap()
}

#[test]
fn pins_to_one_cpu_and_restores() {
    on_thread(|| {
        let usable = CpuSet::process_affinity().unwrap();
        let cpu = if usable.contains(0) {
            0
        } else {
            usable.first().unwrap()
        };
        let before = current_thread_affinity().unwrap();
        pin_current_thread(cpu).unwrap();
        assert_eq!(
            current_thread_affinity().unwrap(),
            std::iter::once(cpu).collect::<CpuSet>()
        );
        assert_eq!(current_cpu().unwrap(), cpu);
        // The process mask (main thread) is untouched by pinning this thread.
        assert_eq!(CpuSet::process_affinity().unwrap(), usable);
        set_current_thread_affinity(&before).unwrap();
        assert_eq!(current_thread_affinity().unwrap(), before);
    });
}

#[test]
fn pins_to_last_usable_cpu() {
    on_thread(|| {
        let cpu = CpuSet::process_affinity().unwrap().last().unwrap();
        pin_current_thread(cpu).unwrap();
        let affinity = current_thread_affinity().unwrap();
        assert_eq!(affinity.len(), 1);
        assert!(affinity.contains(cpu));
    });
}

#[test]
fn pinning_errors_are_typed() {
    on_thread(|| {
        let before = current_thread_affinity().unwrap();
        let capacity = CpuSet::affinity_capacity();
        assert!(matches!(
            pin_current_thread(capacity),
            Err(PlacementError::CpuOutOfRange { cpu, .. }) if cpu == capacity
        ));
        // A CPU id the affinity mask can hold but this machine does not have.
        let absent = capacity - 1;
        if !CpuSet::process_affinity().unwrap().contains(absent) {
            let err = pin_current_thread(absent).unwrap_err();
            assert!(matches!(err, PlacementError::SetAffinity { .. }), "{err:?}");
            assert!(std::error::Error::source(&err).is_some());
        }
        let usable: CpuSet = "0".parse().unwrap();
        assert!(matches!(
            pin_current_thread_within(1, &usable),
            Err(PlacementError::CpuNotUsable { cpu: 1, .. })
        ));
        assert!(matches!(
            set_current_thread_affinity(&CpuSet::new()),
            Err(PlacementError::EmptyAffinity)
        ));
        // Failed pins leave the thread as it was.
        assert_eq!(current_thread_affinity().unwrap(), before);
    });
}

#[test]
fn plan_applies_on_reactor_threads() {
    let usable = CpuSet::process_affinity().unwrap();
    let topology = Topology::detect().unwrap();
    let plan = starwire_placement::plan(
        &Placement::MaxPack,
        usable.len(),
        ReactorMode::Polling,
        &usable,
        &topology,
    )
    .unwrap();
    assert_eq!(plan.reactors.len(), usable.len());
    let handles: Vec<_> = plan
        .reactors
        .iter()
        .copied()
        .map(|reactor| {
            std::thread::spawn(move || {
                reactor.apply_to_current_thread().unwrap();
                (reactor.cpu, current_thread_affinity().unwrap())
            })
        })
        .collect();
    for handle in handles {
        let (cpu, affinity) = handle.join().unwrap();
        let cpu = cpu.unwrap();
        assert_eq!(affinity, std::iter::once(cpu).collect::<CpuSet>());
    }
}
