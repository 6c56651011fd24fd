//! The members of a fleet shared by several processes: each process keeps a heartbeat row in
//! `outboxd_fleet_members` of a coordination database (Postgres), renewed every second with an
//! expiry; the live members are the rows not yet expired. Each process runs the sources that
//! rendezvous hashing over the live members gives it (`share::owner`), so a process that joins
//! takes its share within a renewal, and a process that dies (its row expires) has its sources
//! taken over by the others, each run then waiting as a standby for the dead process's lease
//! to expire. A process that cannot reach the coordination database keeps the members it last
//! saw: the sources' own leases still keep two processes from publishing at once.

use super::share::{owner, Share};
use crate::dsn::DbDsn;
use crate::Error;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// How often a member renews its row.
pub const HEARTBEAT: Duration = Duration::from_secs(1);

const TABLE_DDL: &str = "CREATE TABLE IF NOT EXISTS outboxd_fleet_members (
    fleet text NOT NULL,
    member text NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (fleet, member))";

/// This process's membership of fleet `fleet`.
pub struct Members {
    dsn: DbDsn,
    fleet: String,
    me: String,
    ttl: Duration,
    live: RwLock<Vec<String>>,
    changed: watch::Sender<u64>,
}

impl std::fmt::Debug for Members {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Members")
            .field("fleet", &self.fleet)
            .field("me", &self.me)
            .finish_non_exhaustive()
    }
}

impl Members {
    /// Joins fleet `fleet` in the coordination database `dsn` (creating its table) as a member
    /// whose row expires `ttl` after its last renewal, and reads the live members once, so the
    /// fleet starts with its share.
    pub async fn join(dsn: DbDsn, fleet: &str, ttl: Duration) -> Result<Arc<Members>, Error> {
        let members = Arc::new(Members {
            dsn,
            fleet: fleet.to_string(),
            me: crate::state::holder_id(),
            ttl: ttl.max(HEARTBEAT * 2),
            live: RwLock::new(Vec::new()),
            changed: watch::channel(0).0,
        });
        let client = members.connect().await?;
        client.batch_execute(TABLE_DDL).await?;
        members.beat(&client).await?;
        Ok(members)
    }

    /// This member's id.
    pub fn me(&self) -> &str {
        &self.me
    }

    /// The live members as last read.
    pub fn live(&self) -> Vec<String> {
        self.live.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    async fn connect(&self) -> Result<tokio_postgres::Client, Error> {
        crate::db::postgres::connect_sql(&self.dsn, "outboxd_fleet").await
    }

    /// Renews this member's row and reads the live members.
    async fn beat(&self, client: &tokio_postgres::Client) -> Result<(), Error> {
        let ttl_ms = self.ttl.as_millis() as f64;
        client
            .execute(
                "INSERT INTO outboxd_fleet_members (fleet, member, expires_at)
                 VALUES ($1, $2, now() + make_interval(secs => $3::float8 / 1000))
                 ON CONFLICT (fleet, member) DO UPDATE SET expires_at = EXCLUDED.expires_at",
                &[&self.fleet, &self.me, &ttl_ms],
            )
            .await?;
        let rows = client
            .query(
                "SELECT member FROM outboxd_fleet_members
                 WHERE fleet = $1 AND expires_at > now() ORDER BY member",
                &[&self.fleet],
            )
            .await?;
        let now: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
        let mut live = self.live.write().unwrap_or_else(|p| p.into_inner());
        if *live != now {
            tracing::info!(members = now.len(), me = %self.me, "fleet members changed: {}", now.join(", "));
            *live = now;
            self.changed.send_modify(|n| *n += 1);
        }
        Ok(())
    }

    /// Renews the row every [`HEARTBEAT`] until `shutdown`, then leaves (deletes the row, so
    /// the others take this process's sources at once). A failed renewal is logged and
    /// retried on a new session; the members last read stay in force meanwhile.
    pub async fn keep(self: Arc<Self>, shutdown: CancellationToken) {
        let mut client: Option<tokio_postgres::Client> = None;
        let mut reported = false;
        loop {
            if client.as_ref().is_none_or(|c| c.is_closed()) {
                client = self.connect().await.ok();
            }
            let result = match &client {
                Some(c) => self.beat(c).await,
                None => Err(Error::Other("cannot connect".into())),
            };
            match result {
                Ok(()) => reported = false,
                Err(e) if !reported => {
                    reported = true;
                    tracing::warn!(
                        "fleet membership: cannot renew (keeping the members last seen): {e}"
                    );
                    client = None;
                }
                Err(_) => client = None,
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(HEARTBEAT) => {}
            }
        }
    }

    /// Deletes this member's row (a graceful stop, after its sources stopped).
    pub async fn leave(&self) {
        let Ok(c) = self.connect().await else { return };
        let _ = c
            .execute(
                "DELETE FROM outboxd_fleet_members WHERE fleet = $1 AND (member = $2 OR expires_at < now() - interval '1 hour')",
                &[&self.fleet, &self.me],
            )
            .await;
    }
}

impl Share for Members {
    fn owns(&self, source: &str) -> bool {
        let live = self.live.read().unwrap_or_else(|p| p.into_inner());
        owner(source, &live) == Some(self.me.as_str())
    }

    fn changed(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }
}
