//! A client's TCP socket held apart from its client library, so the relay can cut it when the
//! lease's gate closes (the AMQP sink's and the NATS sink's `guard_wire`, the consumer runner):
//! a library that queues frames without bound would otherwise still write them. A leaf of its
//! own because RabbitMQ and NATS clients both use it, and neither is compiled in every build.

use std::sync::Arc;

/// The TCP socket under one lapin connection, duplicated so that it outlives lapin's handle
/// and the descriptor cannot be reused for another socket while it is held. lapin writes from
/// its own thread and queues frames without bound, so closing the connection through lapin
/// would still write what it queued; [`WireSocket::reset`] instead disconnects the socket
/// itself: the kernel sends a reset and drops whatever is still queued to be sent, and every
/// later write fails.
#[derive(Clone, Default)]
pub(crate) struct WireSocket(Arc<std::sync::Mutex<Option<std::os::fd::OwnedFd>>>);

impl WireSocket {
    /// Keeps a duplicate of `fd` (the AMQP client's socket, as it connects).
    #[cfg(feature = "rabbitmq")]
    pub(crate) fn keep(&self, fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<()> {
        let owned = fd.try_clone_to_owned()?;
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(owned);
        Ok(())
    }

    /// The TCP sockets of this process connected to one of `peers` now, by descriptor, for a
    /// client that does not hand out its socket (async-nats): each is kept as a duplicate,
    /// checked after duplicating (a descriptor closed or reused meanwhile is skipped or seen
    /// for what it is now).
    pub(crate) fn connected_to(peers: &[std::net::SocketAddr]) -> Vec<(i32, WireSocket)> {
        if peers.is_empty() {
            return Vec::new();
        }
        let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
            return Vec::new();
        };
        let mut found = Vec::new();
        for entry in dir.flatten() {
            let Some(fd) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<i32>().ok())
            else {
                continue;
            };
            // SAFETY: only duplicated, never closed through this borrow; a descriptor that was
            // closed since the listing fails to duplicate (EBADF).
            let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
            let Ok(owned) = borrowed.try_clone_to_owned() else {
                continue;
            };
            let stream = std::net::TcpStream::from(owned);
            if stream.peer_addr().is_ok_and(|p| peers.contains(&p)) {
                let socket = WireSocket::default();
                *socket.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(stream.into());
                found.push((fd, socket));
            }
        }
        found
    }

    /// Whether a socket was kept (the connection was made).
    pub(crate) fn is_kept(&self) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    /// Makes closing the socket (lapin dropping it, the process exiting) reset the connection
    /// rather than send what is still queued: for a publisher whose every message counts only
    /// once confirmed, a message still queued when it closes is one it gave up on.
    pub(crate) fn abort_on_close(&self) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let Some(fd) = guard.as_ref() else {
            return Ok(());
        };
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        // SAFETY: a valid descriptor we own, and a properly sized, initialised option value.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&linger as *const libc::linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    /// Resets the connection: nothing more leaves this socket, and what the kernel still
    /// held for the peer is discarded. Idempotent.
    pub(crate) fn reset(&self) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let Some(fd) = guard.as_ref() else {
            return Ok(());
        };
        // connect() to an AF_UNSPEC address disconnects a TCP socket (Linux: tcp_disconnect):
        // a RST is sent, the send queue purged, and the socket is left unconnected. Unlike
        // close() it works on a descriptor other threads (lapin's) still use, and unlike
        // shutdown() it does not first send what is queued.
        let addr = libc::sockaddr {
            sa_family: libc::AF_UNSPEC as libc::sa_family_t,
            sa_data: [0; 14],
        };
        // SAFETY: `fd` is a valid descriptor we own for the duration of the call, and `addr`
        // is a properly sized, initialised sockaddr.
        let rc = unsafe {
            libc::connect(
                fd.as_raw_fd(),
                &addr,
                std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }
}
