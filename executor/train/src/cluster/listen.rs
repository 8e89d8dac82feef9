//! The PS tasks' listeners.
//!
//! Every worker dials every shard of a PS task at start-up, all at once:
//! 64 workers and 8 shards are 512 connections on one listening socket
//! within a few milliseconds. With the standard library's backlog (128)
//! the accept queue overflows, the kernel drops the SYNs past it, and
//! those workers' connects wait for the SYN's retransmission, one second
//! later. The listeners here ask for the largest backlog the kernel
//! allows (`net.core.somaxconn`).

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsRawFd;

use nix::sys::socket::{
    bind as bind_socket, listen, setsockopt, socket, sockopt, AddressFamily, Backlog, SockFlag,
    SockType, SockaddrIn, SockaddrIn6,
};

/// The accept queue asked for: `-1`, which Linux reads as
/// `net.core.somaxconn`; elsewhere the C library's `SOMAXCONN`.
#[cfg(any(target_os = "linux", target_os = "freebsd"))]
const BACKLOG: Backlog = Backlog::MAXALLOWABLE;
#[cfg(not(any(target_os = "linux", target_os = "freebsd")))]
const BACKLOG: Backlog = Backlog::MAXCONN;

/// A listening TCP socket at `addr` (`SO_REUSEADDR`, close-on-exec, as the
/// standard library's), with a backlog of [`BACKLOG`].
pub(super) fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let family = match addr {
        SocketAddr::V4(_) => AddressFamily::Inet,
        SocketAddr::V6(_) => AddressFamily::Inet6,
    };
    let fd = socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    match addr {
        SocketAddr::V4(a) => bind_socket(fd.as_raw_fd(), &SockaddrIn::from(a))?,
        SocketAddr::V6(a) => bind_socket(fd.as_raw_fd(), &SockaddrIn6::from(a))?,
    }
    listen(&fd, BACKLOG)?;
    Ok(TcpListener::from(fd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpStream;
    use std::time::{Duration, Instant};

    #[test]
    fn takes_more_connections_than_the_default_backlog_before_accepting() {
        let l = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = l.local_addr().unwrap();
        // 300 connects with nobody accepting: past a backlog of 128 they
        // would wait a second each for the SYN's retransmission.
        let t = Instant::now();
        let conns: Vec<TcpStream> = (0..300)
            .map(|_| TcpStream::connect_timeout(&addr, Duration::from_secs(30)).unwrap())
            .collect();
        let took = t.elapsed();
        assert!(
            took < Duration::from_millis(900),
            "{} connects took {took:?}",
            conns.len()
        );
        l.set_nonblocking(true).unwrap();
        let mut accepted = 0;
        while l.accept().is_ok() {
            accepted += 1;
        }
        assert_eq!(accepted, 300);
    }

    #[test]
    fn ipv6_and_a_taken_port() {
        let l = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let e = bind(l.local_addr().unwrap()).expect_err("in use");
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse);
        if let Ok(l6) = bind("[::1]:0".parse().unwrap()) {
            assert!(l6.local_addr().unwrap().is_ipv6());
        }
    }
}
