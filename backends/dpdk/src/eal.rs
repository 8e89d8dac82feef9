//! The EAL: initialised once per process, from `--eal "ARGS"` or
//! `STARWIRE_EAL_ARGS`, and the registration of reactor threads with it.

use std::cell::Cell;
use std::path::Path;
use std::sync::{Mutex, OnceLock};

use crate::error::DpdkError;
use crate::ffi;

/// The environment variable read for EAL arguments when no `--eal` is given.
pub const EAL_ARGS_ENV: &str = "STARWIRE_EAL_ARGS";

/// Split EAL arguments into words: whitespace separates, `'…'` and `"…"`
/// group (a backslash escapes the next character outside single quotes).
pub fn split_args(args: &str) -> Result<Vec<String>, DpdkError> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = args.chars();
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            '\'' | '"' => {
                in_word = true;
                let mut closed = false;
                while let Some(d) = chars.next() {
                    if d == c {
                        closed = true;
                        break;
                    }
                    if d == '\\' && c == '"' {
                        if let Some(e) = chars.next() {
                            cur.push(e);
                        }
                        continue;
                    }
                    cur.push(d);
                }
                if !closed {
                    return Err(DpdkError::EalArgs {
                        args: args.to_owned(),
                        why: format!("unterminated {c} quote"),
                    });
                }
            }
            '\\' => {
                in_word = true;
                if let Some(e) = chars.next() {
                    cur.push(e);
                }
            }
            c => {
                in_word = true;
                cur.push(c);
            }
        }
    }
    if in_word {
        words.push(cur);
    }
    Ok(words)
}

/// The EAL arguments to use: `cli` (from `--eal`) if given, else
/// `STARWIRE_EAL_ARGS`, else none (DPDK's defaults: hugepages and PCI
/// devices).
pub fn eal_args(cli: Option<&str>) -> String {
    match cli {
        Some(a) => a.to_owned(),
        None => std::env::var(EAL_ARGS_ENV).unwrap_or_default(),
    }
}

/// `--vdev` values among the words, in either `--vdev=X` or `--vdev X`
/// form.
fn vdevs(words: &[String]) -> Vec<&str> {
    let mut out = Vec::new();
    let mut it = words.iter();
    while let Some(w) = it.next() {
        if let Some(v) = w.strip_prefix("--vdev=") {
            out.push(v);
        } else if w == "--vdev" {
            if let Some(v) = it.next() {
                out.push(v.as_str());
            }
        }
    }
    out
}

/// Fail with [`DpdkError::InterfaceMissing`] when an af_xdp or af_packet
/// device names an interface that `net_class` (normally `/sys/class/net`)
/// does not list.
fn check_interfaces(words: &[String], net_class: &Path) -> Result<(), DpdkError> {
    for vdev in vdevs(words) {
        let mut parts = vdev.split(',');
        let name = parts.next().unwrap_or_default();
        let Some(driver) = ["net_af_xdp", "net_af_packet"]
            .into_iter()
            .find(|d| name.starts_with(d))
        else {
            continue;
        };
        for kv in parts {
            if let Some(iface) = kv.strip_prefix("iface=") {
                if iface.is_empty() || iface.contains('/') || !net_class.join(iface).exists() {
                    return Err(DpdkError::InterfaceMissing {
                        driver: driver.to_owned(),
                        vdev: vdev.to_owned(),
                        iface: iface.to_owned(),
                    });
                }
            }
        }
    }
    Ok(())
}

/// The running EAL of this process; see [`Eal::init`].
#[derive(Debug)]
pub struct Eal {
    args: String,
}

/// The outcome of the one initialisation of this process.
static EAL: OnceLock<Result<Eal, DpdkError>> = OnceLock::new();
/// Serialises the first initialisation (the interface check and
/// `rte_eal_init` run once, under it).
static INIT: Mutex<()> = Mutex::new(());

impl Eal {
    /// Initialise the EAL with `args` (split like a shell would), once per
    /// process. Later calls with the same arguments return the same EAL;
    /// with other arguments they fail with
    /// [`DpdkError::EalAlreadyInitialised`]. A failed initialisation is
    /// final for the process too (DPDK cannot always be initialised again
    /// after a failure), and later calls return its error.
    ///
    /// `rte_eal_init` pins the calling thread to the main lcore's CPU;
    /// starwire places its threads itself, so the caller's CPU affinity is
    /// put back afterwards. The calling thread stays the main lcore.
    pub fn init(args: &str) -> Result<&'static Eal, DpdkError> {
        let words = split_args(args)?;
        let _guard = INIT.lock().unwrap_or_else(|e| e.into_inner());
        if EAL.get().is_none() {
            // Before the EAL, whose own report would be a generic probe
            // failure; and not final, as nothing was initialised.
            check_interfaces(&words, Path::new("/sys/class/net"))?;
        }
        let outcome = EAL.get_or_init(|| {
            let mut argv = vec!["starwire".to_owned()];
            argv.extend(words.iter().cloned());
            let affinity = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).ok();
            let result = ffi::eal_init(&argv);
            if let Some(set) = affinity {
                if let Err(e) = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set) {
                    tracing::warn!(%e, "restoring CPU affinity after rte_eal_init");
                }
            }
            result.map_err(|(errno, reason)| DpdkError::EalInit {
                args: args.to_owned(),
                errno,
                reason,
            })?;
            tracing::info!(args, ports = ffi::port_count(), "DPDK EAL initialised");
            Ok(Eal {
                args: args.to_owned(),
            })
        });
        match outcome {
            Ok(eal) if split_args(&eal.args).ok().as_deref() == Some(&words[..]) => Ok(eal),
            Ok(eal) => Err(DpdkError::EalAlreadyInitialised {
                running: eal.args.clone(),
                asked: args.to_owned(),
            }),
            Err(e) => Err(e.clone()),
        }
    }

    /// The EAL of this process, if [`init`](Self::init) succeeded.
    pub fn get() -> Option<&'static Eal> {
        EAL.get().and_then(|r| r.as_ref().ok())
    }

    /// The arguments the EAL runs with.
    pub fn args(&self) -> &str {
        &self.args
    }

    /// Ports the EAL probed.
    pub fn ports(&self) -> u16 {
        ffi::port_count()
    }

    /// Make the calling thread an EAL thread (`rte_thread_register`), so
    /// mempool caches work on it; reactor threads that DPDK did not start
    /// call this before their first burst. Idempotent per thread; the id
    /// is given back when the thread exits. Returns the thread's lcore id.
    pub fn register_thread(&self) -> Result<u32, DpdkError> {
        thread_local! {
            static REGISTERED: Registration = const { Registration(Cell::new(false)) };
        }
        if let Some(id) = ffi::lcore_id() {
            return Ok(id);
        }
        let id = ffi::register_thread()
            .map_err(|(errno, reason)| DpdkError::ThreadRegister { errno, reason })?;
        REGISTERED.with(|r| r.0.set(true));
        Ok(id)
    }
}

/// Unregisters the thread's lcore id when the thread exits.
struct Registration(Cell<bool>);

impl Drop for Registration {
    fn drop(&mut self) {
        if self.0.get() {
            ffi::unregister_thread();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_like_a_shell() {
        let w = split_args(" --no-huge  -m 512 --vdev='net_af_xdp,iface=v A' \"x\\\"y\" a\\ b ")
            .unwrap();
        assert_eq!(
            w,
            [
                "--no-huge",
                "-m",
                "512",
                "--vdev=net_af_xdp,iface=v A",
                "x\"y",
                "a b"
            ]
        );
        assert_eq!(split_args("").unwrap(), Vec::<String>::new());
        assert_eq!(split_args("''").unwrap(), [""]);
        assert!(matches!(
            split_args("--vdev='net_ring0"),
            Err(DpdkError::EalArgs { .. })
        ));
    }

    #[test]
    fn finds_vdevs_in_both_forms() {
        let w = split_args("--vdev=net_ring0 -m 1 --vdev net_af_packet0,iface=x").unwrap();
        assert_eq!(vdevs(&w), ["net_ring0", "net_af_packet0,iface=x"]);
    }

    #[test]
    fn missing_af_xdp_interface_is_named() {
        let dir = std::env::temp_dir().join(format!("starwire-dpdk-net-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("vethA")).unwrap();
        let ok =
            split_args("--vdev=net_af_xdp0,iface=vethA,start_queue=0 --vdev=net_ring0").unwrap();
        assert_eq!(check_interfaces(&ok, &dir), Ok(()));
        let bad = split_args("--vdev net_af_xdp1,iface=vethZ").unwrap();
        match check_interfaces(&bad, &dir) {
            Err(DpdkError::InterfaceMissing { driver, iface, .. }) => {
                assert_eq!((driver.as_str(), iface.as_str()), ("net_af_xdp", "vethZ"));
            }
            other => panic!("{other:?}"),
        }
        let bad = split_args("--vdev=net_af_packet0,iface=../vethA").unwrap();
        assert!(check_interfaces(&bad, &dir).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
