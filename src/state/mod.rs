//! The relay's own state, kept in the source database (`outboxd_state`): which relay `name`
//! owns which slot, its lease (holder, epoch, expiry) and the last position whose events were
//! all confirmed by the sink. The stored position moves only forward and is written only by
//! the lease holder of the current epoch.

pub mod postgres;

use std::time::Duration;

/// How long a lease lasts without renewal; a relay renews it about every second.
pub const LEASE_TTL: Duration = Duration::from_secs(10);
pub const RENEW_INTERVAL: Duration = Duration::from_secs(1);

/// Identifies this process as a lease holder: `host:pid:nonce`.
pub fn holder_id() -> String {
    format!(
        "{}:{}:{}",
        hostname(),
        std::process::id(),
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}

/// Whether a holder id names a process on this host that no longer exists (a relay killed with
/// SIGKILL leaves its lease behind; its successor on the same host need not wait it out).
pub fn holder_is_dead_locally(holder: &str) -> bool {
    let mut parts = holder.rsplitn(3, ':');
    let (_nonce, pid, host) = (parts.next(), parts.next(), parts.next());
    match (host, pid.and_then(|p| p.parse::<u32>().ok())) {
        (Some(host), Some(pid)) if host == hostname() => {
            pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists()
        }
        _ => false,
    }
}

/// A lease this process holds.
#[derive(Debug, Clone)]
pub struct Lease {
    pub name: String,
    pub holder: String,
    pub epoch: i64,
    /// No earlier run of this name finished its first start (its snapshot is not yet durable).
    pub first_start: bool,
    /// A replay from the table was requested (`offset set --replay-since`).
    pub replay_since: Option<chrono::DateTime<chrono::Utc>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_local_holders_are_recognised() {
        let me = holder_id();
        assert!(!holder_is_dead_locally(&me));
        let dead = format!("{}:{}:abcd1234", hostname(), u32::MAX - 7);
        assert!(holder_is_dead_locally(&dead));
        assert!(!holder_is_dead_locally("some-other-host:1:abcd"));
        assert!(!holder_is_dead_locally("garbage"));
    }
}
