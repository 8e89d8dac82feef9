//! Kernel feature probing: which ops and setup flags this kernel has, and
//! what the backend falls back to without them.
// Registers a buffer ring to see whether the kernel takes one.
#![allow(unsafe_code)]

use io_uring::{opcode, IoUring, Probe};
use serde_json::json;

/// What the kernel offers and what the backend uses.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Features {
    /// Kernel release (`uname -r`).
    pub kernel: String,
    /// `IORING_OP_SEND`/`IORING_OP_RECV`.
    pub send_recv: bool,
    /// `IORING_OP_SENDMSG`.
    pub sendmsg: bool,
    /// `IORING_OP_SEND_ZC` (6.0).
    pub send_zc: bool,
    /// `IORING_OP_SENDMSG_ZC` (6.1).
    pub sendmsg_zc: bool,
    /// `IORING_OP_ASYNC_CANCEL`.
    pub async_cancel: bool,
    /// Provided-buffer rings (`IORING_REGISTER_PBUF_RING`, 5.19).
    pub pbuf_ring: bool,
    /// Incremental buffer consumption (`IOU_PBUF_RING_INC`, 6.12).
    pub pbuf_incremental: bool,
    /// Multishot receive (`IORING_RECV_MULTISHOT`, 6.0).
    pub recv_multishot: bool,
    /// `IORING_SETUP_DEFER_TASKRUN` (6.1) accepted.
    pub defer_taskrun: bool,
    /// `IORING_SETUP_COOP_TASKRUN` (5.19) accepted.
    pub coop_taskrun: bool,
    /// `IORING_SETUP_SINGLE_ISSUER` (6.0) accepted.
    pub single_issuer: bool,
    /// What fell back to a plain form, one line each.
    pub fallbacks: Vec<String>,
}

impl Features {
    /// The features as JSON, for `starwire info`.
    pub fn to_json(&self) -> serde_json::Value {
        json!({
            "kernel": self.kernel,
            "ops": {
                "send_recv": self.send_recv,
                "sendmsg": self.sendmsg,
                "send_zc": self.send_zc,
                "sendmsg_zc": self.sendmsg_zc,
                "async_cancel": self.async_cancel,
            },
            "pbuf_ring": self.pbuf_ring,
            "pbuf_incremental": self.pbuf_incremental,
            "recv_multishot": self.recv_multishot,
            "setup": {
                "defer_taskrun": self.defer_taskrun,
                "coop_taskrun": self.coop_taskrun,
                "single_issuer": self.single_issuer,
            },
            "fallbacks": self.fallbacks,
        })
    }

    /// Why io_uring cannot carry starwire here, if it cannot.
    pub fn unusable(&self) -> Option<String> {
        if !self.send_recv || !self.sendmsg {
            return Some(
                "the kernel lacks IORING_OP_SEND/RECV/SENDMSG (Linux >= 5.19 needed)".into(),
            );
        }
        if !self.pbuf_ring {
            return Some("provided-buffer rings are missing (Linux >= 5.19 needed)".into());
        }
        None
    }
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

fn kernel_at_least(release: &str, major: u32, minor: u32) -> bool {
    let mut it = release
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|p| p.parse::<u32>().ok());
    match (it.next(), it.next()) {
        (Some(a), Some(b)) => (a, b) >= (major, minor),
        _ => false,
    }
}

/// Probe the running kernel. An error means io_uring itself is unavailable
/// (`io_uring_setup` failed: an old kernel, `kernel.io_uring_disabled`, a
/// seccomp filter in a container).
pub fn probe() -> std::io::Result<Features> {
    // Mapped before the ring, so it is dropped after it.
    let buf_ring = crate::sys::BufRing::new(8);
    let ring = IoUring::new(8)?;
    let mut p = Probe::new();
    ring.submitter().register_probe(&mut p)?;
    let kernel = kernel_release();
    let mut f = Features {
        send_recv: p.is_supported(opcode::Send::CODE) && p.is_supported(opcode::Recv::CODE),
        sendmsg: p.is_supported(opcode::SendMsg::CODE),
        send_zc: p.is_supported(opcode::SendZc::CODE),
        sendmsg_zc: p.is_supported(opcode::SendMsgZc::CODE),
        async_cancel: p.is_supported(opcode::AsyncCancel::CODE),
        // Multishot receive has no opcode of its own to probe: it came
        // with 6.0.
        recv_multishot: kernel_at_least(&kernel, 6, 0),
        kernel,
        ..Features::default()
    };
    // Buffer rings: register and unregister one.
    if let Ok(br) = &buf_ring {
        // SAFETY: `br` outlives `ring` (made before it, and `ring` is
        // dropped below); no request uses the group.
        f.pbuf_ring = unsafe { br.register(&ring, 0, false) }.is_ok();
        if f.pbuf_ring {
            let _ = ring.submitter().unregister_buf_ring(0);
            // SAFETY: as above.
            f.pbuf_incremental = unsafe { br.register(&ring, 0, true) }.is_ok();
            if f.pbuf_incremental {
                let _ = ring.submitter().unregister_buf_ring(0);
            }
        }
    }
    drop(ring);
    f.defer_taskrun = IoUring::<io_uring::squeue::Entry, io_uring::cqueue::Entry>::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .setup_taskrun_flag()
        .build(8)
        .is_ok();
    f.single_issuer = f.defer_taskrun
        || IoUring::<io_uring::squeue::Entry, io_uring::cqueue::Entry>::builder()
            .setup_single_issuer()
            .build(8)
            .is_ok();
    f.coop_taskrun = IoUring::<io_uring::squeue::Entry, io_uring::cqueue::Entry>::builder()
        .setup_coop_taskrun()
        .setup_taskrun_flag()
        .build(8)
        .is_ok();
    if !f.coop_taskrun {
        f.fallbacks
            .push("COOP_TASKRUN -> default task work (IPIs)".to_owned());
    }
    if !f.single_issuer {
        f.fallbacks
            .push("SINGLE_ISSUER -> shared issuer".to_owned());
    }
    if f.pbuf_ring && !f.pbuf_incremental {
        f.fallbacks
            .push("incremental provided buffers -> one buffer per receive".to_owned());
    }
    if !f.recv_multishot {
        f.fallbacks
            .push("multishot RECV -> single-shot RECV with buffer select".to_owned());
    }
    if !f.sendmsg_zc {
        f.fallbacks.push("SENDMSG_ZC -> SENDMSG".to_owned());
    }
    if !f.send_zc {
        f.fallbacks
            .push("SEND_ZC (fixed buffer) -> SENDMSG".to_owned());
    }
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_versions_compare() {
        assert!(kernel_at_least("6.18.0-foo", 6, 1));
        assert!(kernel_at_least("6.1.12", 6, 1));
        assert!(!kernel_at_least("5.15.0-91-generic", 6, 0));
        assert!(!kernel_at_least("garbage", 6, 0));
    }
}
