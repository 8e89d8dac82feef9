//! The local cluster's shape on the host it runs on.
//!
//! `NETWORK_PS_CORE_NUMBER` defaults to min(8, workers), DeepRec's value,
//! which a PS task and its workers in separate processes must agree on, so
//! it cannot depend on the host. In `starwire train` every PS reactor and
//! every worker thread share one host's CPUs: PS reactors beyond them only
//! add threads that take turns on the same cores, and a shard more for each
//! step's requests to fan out to (docs/TRAIN.md, "Where the time goes at 64
//! workers"). There, when the variable is not given, a PS task runs at most
//! one reactor per usable CPU, or as many as the checkpoint it resumes
//! from has.

use super::roles::read_manifest;
use super::TrainConfig;
use crate::TrainError;

/// Fits `cfg.ps_reactors` of the local cluster to this host when
/// `NETWORK_PS_CORE_NUMBER` was left at its default
/// (`cfg.ps_reactors_fit_host`): at most the usable CPUs, or the shards per
/// PS task of the checkpoint in `--checkpoint-dir` that the run resumes.
pub fn fit_local_host(cfg: &mut TrainConfig) -> Result<(), TrainError> {
    if !cfg.ps_reactors_fit_host {
        return Ok(());
    }
    let restored = match &cfg.checkpoint_dir {
        Some(d) => read_manifest(d)?.map(|m| m.shard_count),
        None => None,
    };
    let cpus = std::thread::available_parallelism().map_or(usize::MAX, |n| n.get());
    cfg.ps_reactors = local_ps_reactors(cfg.ps_reactors, cfg.ps, cpus, restored);
    Ok(())
}

/// Reactors per PS task: `default` cut down to `cpus`, at least 1; the
/// shards per task of a restored checkpoint of `restored_shards` instead,
/// when they divide evenly over the `ps` tasks (otherwise the resume
/// fails on the mismatch, naming the variable).
fn local_ps_reactors(
    default: usize,
    ps: usize,
    cpus: usize,
    restored_shards: Option<usize>,
) -> usize {
    let ps = ps.max(1);
    match restored_shards {
        Some(n) if n >= ps && n % ps == 0 => n / ps,
        _ => default.min(cpus).max(1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_cut_to_the_cpus() {
        // 64 workers' default of 8 on 2 CPUs; 2 workers' 2 unchanged.
        assert_eq!(local_ps_reactors(8, 1, 2, None), 2);
        assert_eq!(local_ps_reactors(2, 1, 2, None), 2);
        assert_eq!(local_ps_reactors(8, 1, 16, None), 8);
        assert_eq!(local_ps_reactors(8, 2, 0, None), 1);
    }

    #[test]
    fn a_resumed_checkpoint_keeps_its_shards() {
        assert_eq!(local_ps_reactors(2, 1, 2, Some(8)), 8);
        assert_eq!(local_ps_reactors(8, 2, 2, Some(8)), 4);
        // Shards that do not divide over the tasks: the default, and the
        // resume reports the mismatch.
        assert_eq!(local_ps_reactors(8, 3, 2, Some(8)), 2);
    }

    #[test]
    fn a_given_value_is_kept() {
        let mut cfg = TrainConfig {
            ps_reactors: 64,
            ps_reactors_fit_host: false,
            ..TrainConfig::default()
        };
        fit_local_host(&mut cfg).unwrap();
        assert_eq!(cfg.ps_reactors, 64);
        let cpus = std::thread::available_parallelism().map_or(usize::MAX, |n| n.get());
        cfg.ps_reactors_fit_host = true;
        fit_local_host(&mut cfg).unwrap();
        assert_eq!(cfg.ps_reactors, 64.min(cpus));
    }
}
