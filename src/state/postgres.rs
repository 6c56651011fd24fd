//! `outboxd_state` in a Postgres source database: creation, the lease, and position writes that
//! can never move backwards or come from a relay that lost its lease.

use super::checkpoint::Checkpointer;
pub use super::Gap;
use super::{Lease, StateStore, Stored, LEASE_TTL};
use crate::dsn::DbDsn;
use crate::event::{format_lsn, parse_lsn, Checkpoint};
use crate::telemetry::events::{InternalEvent, SlotRetainedWal};
use crate::Error;
use tokio_postgres::{Client, Statement};

/// The lease keeper's view of a Postgres state table: one session, reconnected on demand.
pub struct PgStateStore {
    dsn: DbDsn,
    app: String,
    client: Option<Client>,
    /// [`RENEW`] prepared on `client` (dropped with it): a renewal is then one round trip,
    /// not a parse, an execute and a close.
    renew_statement: Option<Statement>,
    /// The slot whose retained WAL is reported as a metric, every few renewals (and which
    /// [`StateStore::acquire`] records for the relay name).
    slot: Option<String>,
    /// The publication [`StateStore::acquire`] records for the relay name.
    publication: Option<String>,
    renewals: u64,
    /// The run's return path: told what the row holds after each position write (the slot is
    /// confirmed only up to that) and when the server is shutting down.
    checkpoints: Option<Checkpointer>,
}

impl PgStateStore {
    pub fn new(dsn: DbDsn, app: String) -> Self {
        PgStateStore {
            dsn,
            app,
            client: None,
            renew_statement: None,
            slot: None,
            publication: None,
            renewals: 0,
            checkpoints: None,
        }
    }

    /// Reports each position write (and what the row holds after it), and a server found
    /// shutting down, to the run's return path: the Postgres source confirms the slot from it.
    pub fn with_checkpointer(mut self, checkpoints: Checkpointer) -> Self {
        self.checkpoints = Some(checkpoints);
        self
    }

    pub fn with_slot(mut self, slot: &str) -> Self {
        self.slot = Some(slot.to_string());
        self
    }

    pub fn with_publication(mut self, publication: &str) -> Self {
        self.publication = Some(publication.to_string());
        self
    }

    async fn client(&mut self) -> Result<&mut Client, Error> {
        if self.client.as_ref().is_none_or(|c| c.is_closed()) {
            self.client = Some(crate::db::postgres::connect_sql(&self.dsn, &self.app).await?);
            self.renew_statement = None;
        }
        Ok(self.client.as_mut().expect("connected above"))
    }

    /// The session and [`RENEW`] prepared on it.
    async fn renew_statement(&mut self) -> Result<(&Client, Statement), Error> {
        self.client().await?;
        let client = self.client.as_ref().expect("connected above");
        let statement = match &self.renew_statement {
            Some(s) => s.clone(),
            None => {
                let s = client.prepare(RENEW).await?;
                self.renew_statement = Some(s.clone());
                s
            }
        };
        Ok((client, statement))
    }

    async fn renew_once(
        &mut self,
        lease: &Lease,
        position: Option<&Checkpoint>,
        commit: &DurableCommit,
    ) -> Result<(), Error> {
        let (lsn, snapshot_key) = match position {
            Some(Checkpoint::Lsn(l)) => (Some(*l), None),
            Some(Checkpoint::Snapshot { key, .. }) => (None, Some(key.as_str())),
            _ => (None, None),
        };
        let r = match self.renew_statement().await {
            Ok((client, statement)) => renew(client, &statement, lease, lsn, commit).await,
            Err(e) => Err(e),
        };
        if let (Ok(held), Some(l), Some(cp)) = (&r, lsn, &self.checkpoints) {
            cp.written(l, *held);
        }
        let r = r.map(drop);
        let r = match (r, snapshot_key) {
            (Ok(()), Some(key)) => store_snapshot_key(self.client().await?, lease, key).await,
            (r, _) => r,
        };
        self.renewals += 1;
        if r.is_ok() && self.renewals % 5 == 1 {
            if let (Some(slot), Some(c)) = (&self.slot, &self.client) {
                let retained: Option<i64> = c
                    .query_opt(
                        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::int8 FROM pg_replication_slots WHERE slot_name = $1",
                        &[slot],
                    )
                    .await
                    .ok()
                    .flatten()
                    .and_then(|row| row.get(0));
                if let Some(b) = retained {
                    SlotRetainedWal { bytes: b }.emit();
                }
            }
        }
        if matches!(&r, Err(e) if !matches!(e, Error::Leadership(_))) {
            self.client = None;
        }
        r
    }
}

impl StateStore for PgStateStore {
    /// Needs [`PgStateStore::with_slot`] and [`PgStateStore::with_publication`]: the row
    /// records both, and refuses a relay name that uses another slot.
    async fn acquire(
        &mut self,
        name: &str,
        holder: &str,
    ) -> Result<(Lease, Option<Checkpoint>), Error> {
        let (Some(slot), Some(publication)) = (self.slot.clone(), self.publication.clone()) else {
            return Err(Error::Other(
                "a Postgres state store takes a lease only for a slot and a publication".into(),
            ));
        };
        let client = self.client().await?;
        let lease = acquire(client, name, &slot, &publication, holder).await?;
        let at = load(client, name).await?.and_then(|row| row.position_lsn);
        Ok((lease, at.map(Checkpoint::Lsn)))
    }

    async fn load(&mut self, name: &str) -> Result<Option<Stored>, Error> {
        Ok(load(self.client().await?, name)
            .await?
            .map(|row| row.stored()))
    }

    async fn renew(
        &mut self,
        lease: &Lease,
        position: Option<&Checkpoint>,
        commit: &DurableCommit,
    ) -> Result<(), Error> {
        let r = self.renew_once(lease, position, commit).await;
        if let (Err(e), Some(cp)) = (&r, &self.checkpoints) {
            if crate::db::postgres::is_server_stopping(e) {
                cp.server_stopping();
            }
        }
        r
    }

    async fn release(&mut self, lease: &Lease) -> Result<(), Error> {
        release(self.client().await?, lease).await
    }

    fn abandon(&mut self) {
        self.client = None;
    }

    fn return_path(&mut self, returns: Checkpointer) {
        self.checkpoints = Some(returns);
    }

    async fn mark_initialized(&mut self, lease: &Lease) -> Result<(), Error> {
        mark_initialized(self.client().await?, lease).await
    }

    async fn report_progress(
        &mut self,
        lease: &Lease,
        progress: Option<&str>,
    ) -> Result<(), Error> {
        self.client()
            .await?
            .execute(
                "UPDATE outboxd_state SET progress = $3 WHERE name = $1 AND epoch = $2",
                &[&lease.name, &lease.epoch, &progress],
            )
            .await?;
        Ok(())
    }

    async fn record_stream_start(
        &mut self,
        lease: &Lease,
        at: &Checkpoint,
        created: bool,
    ) -> Result<(), Error> {
        record_slot_start(self.client().await?, lease, lsn(at)?, created).await
    }

    async fn restart(
        &mut self,
        lease: &Lease,
        replay_since: Option<chrono::DateTime<chrono::Utc>>,
    ) -> Result<(), Error> {
        let client = self.client().await?;
        match replay_since {
            Some(since) => set_replay(client, lease, since).await,
            None => restart_first_start(client, lease).await,
        }
    }

    async fn replace_position(&mut self, lease: &Lease, marker: &Checkpoint) -> Result<(), Error> {
        let at = format_lsn(lsn(marker)?);
        let n = self
            .client()
            .await?
            .execute(
                "UPDATE outboxd_state SET position_lsn = $3::text::pg_lsn, position = $3, updated_at = now()
                  WHERE name = $1 AND epoch = $2 AND lease_holder = $4",
                &[&lease.name, &lease.epoch, &at, &lease.holder],
            )
            .await?;
        if n == 0 {
            return Err(lost(lease));
        }
        Ok(())
    }
}

/// The LSN of a Postgres position.
fn lsn(cp: &Checkpoint) -> Result<u64, Error> {
    match cp {
        Checkpoint::Lsn(l) => Ok(*l),
        other => Err(Error::Other(format!(
            "a {other} position cannot be stored for a Postgres source"
        ))),
    }
}

pub const DDL: &str = "CREATE TABLE IF NOT EXISTS outboxd_state (
    name              text PRIMARY KEY,
    source            text NOT NULL,
    slot              text,
    publication       text,
    epoch             bigint NOT NULL DEFAULT 0,
    lease_holder      text,
    lease_renewed_at  timestamptz,
    lease_expires_at  timestamptz,
    position          text,
    position_lsn      pg_lsn,
    binlog_file       text,
    binlog_pos        bigint,
    gtid_state        text,
    commit_gap_ms     bigint,
    replay_since      timestamptz,
    position_commit_at timestamptz,
    slot_created_lsn  pg_lsn,
    snapshot_key      text,
    progress          text,
    initialized_at    timestamptz,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now()
)";

/// What the state row says about a relay name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateRow {
    pub name: String,
    pub slot: Option<String>,
    pub publication: Option<String>,
    pub epoch: i64,
    pub lease_holder: Option<String>,
    pub lease_live: bool,
    pub position_lsn: Option<u64>,
    pub initialized: bool,
    /// A replay from the table asked for with `offset set --replay-since`.
    pub replay_since: Option<chrono::DateTime<chrono::Utc>>,
    pub lease_expires_at: Option<chrono::DateTime<chrono::Utc>>,
    pub updated_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Commit time of the last transaction whose events were all confirmed.
    pub position_commit_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Largest commit-minus-created_at gap seen (long producer transactions), in ms.
    pub commit_gap_ms: Option<i64>,
    pub created_at: Option<chrono::DateTime<chrono::Utc>>,
    /// An unfinished first start's snapshot: the last row whose publication is durable.
    pub snapshot_key: Option<String>,
    /// Where the slot this row follows started, as this relay name created (or first adopted)
    /// it. From then on the slot is confirmed only up to positions stored in this row, so a
    /// slot ahead of both was moved by something else: see [`slot_replaced`].
    pub slot_created_lsn: Option<u64>,
}

impl StateRow {
    /// The row as every store describes its record.
    pub fn stored(&self) -> Stored {
        Stored {
            position: self.position_lsn.map(Checkpoint::Lsn),
            initialized: self.initialized,
            snapshot_key: self.snapshot_key.clone(),
            commit: DurableCommit {
                commit_at: self.position_commit_at,
                max_gap_ms: self.commit_gap_ms,
            },
            stream_start: self.slot_created_lsn.map(Checkpoint::Lsn),
            created_at: self.created_at,
        }
    }
}

/// What the state table lacks, read from the catalog (which every role may read): `None` when
/// it is complete, so that a start needs no DDL and a role that does not own the table runs.
pub async fn gap(client: &Client) -> Result<Option<Gap>, Error> {
    let row = client
        .query_opt(
            "SELECT ARRAY(SELECT attname::text FROM pg_attribute
                           WHERE attrelid = c.oid AND attnum > 0 AND NOT attisdropped)
               FROM (SELECT to_regclass('outboxd_state') AS oid) c WHERE c.oid IS NOT NULL",
            &[],
        )
        .await?;
    let Some(row) = row else {
        return Ok(Some(Gap::Table));
    };
    let have: Vec<String> = row.get(0);
    let missing: Vec<&'static str> = ADDED_COLUMNS
        .iter()
        .map(|(name, _)| *name)
        .filter(|name| !have.iter().any(|h| h == name))
        .collect();
    Ok((!missing.is_empty()).then_some(Gap::Columns(missing)))
}

/// Creates the state table, or adds the columns added after the first release, when the
/// catalog says something is missing ([`gap`]); changes nothing otherwise. The DDL runs in one
/// implicit transaction holding the setup lock: relays starting together on a fresh database
/// would otherwise collide inside `CREATE TABLE IF NOT EXISTS`. A role that may not make the
/// change (the relay's own role, which owns nothing) is refused with what to run instead.
pub async fn ensure_table(client: &Client) -> Result<(), Error> {
    let Some(missing) = gap(client).await? else {
        return Ok(());
    };
    let added = ADDED_COLUMNS
        .iter()
        .map(|(name, ty)| format!("ALTER TABLE outboxd_state ADD COLUMN IF NOT EXISTS {name} {ty}"))
        .collect::<Vec<_>>()
        .join("; ");
    let r = client
        .batch_execute(&format!(
            "SET LOCAL client_min_messages = warning; SELECT pg_advisory_xact_lock({lock}); {DDL}; {added}",
            lock = crate::db::postgres::SETUP_LOCK,
        ))
        .await;
    match r {
        Ok(()) => Ok(()),
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) => {
            // Another session (`outboxd setup`) may have made the change meanwhile.
            if gap(client).await?.is_none() {
                return Ok(());
            }
            let user = current_user(client).await?;
            Err(gap_refused(
                &missing,
                &user,
                &crate::db::postgres::describe_pg_error(&e),
            ))
        }
        Err(e) => Err(e.into()),
    }
}

/// The session's role.
pub async fn current_user(client: &Client) -> Result<String, Error> {
    Ok(client
        .query_one("SELECT current_user::text", &[])
        .await?
        .get(0))
}

/// The refusal of a state table that `user` may not create or complete, with the fix.
pub fn gap_refused(gap: &Gap, user: &str, why: &str) -> Error {
    let role = crate::names::pg_ident(user);
    match gap {
        Gap::Table => Error::config(
            format!("outboxd_state does not exist in this database, and role {user} may not create it ({why})"),
            format!(
                "run `outboxd setup` as the setup role (docs/operations.md, \"Grants\"), then GRANT SELECT, INSERT, UPDATE ON outboxd_state TO {role};"
            ),
        ),
        Gap::Columns(missing) => Error::config(
            format!(
                "outboxd_state lacks the columns {} that this version of outboxd uses, and role {user} may not add them: only its owner can ({why})",
                missing.join(", ")
            ),
            format!(
                "run `outboxd setup` as the setup role (docs/operations.md, \"Grants\"), or as the table's owner: {}",
                ADDED_COLUMNS
                    .iter()
                    .filter(|(name, _)| missing.contains(name))
                    .map(|(name, ty)| format!("ALTER TABLE outboxd_state ADD COLUMN IF NOT EXISTS {name} {ty};"))
                    .collect::<Vec<_>>()
                    .join(" ")
            ),
        ),
    }
}

/// The privileges a relay's role needs on `outboxd_state`: reading its row, inserting it on
/// the first start, and updating the lease and position.
pub(crate) const STATE_PRIVILEGES: [&str; 3] = ["SELECT", "INSERT", "UPDATE"];

/// An error of a statement on `outboxd_state`: a missing privilege becomes the `GRANT` that
/// fixes it (checked against the catalog, so it names exactly what is missing).
pub(crate) async fn state_refused(client: &Client, e: Error) -> Error {
    if e.sqlstate() != Some("42501") {
        return e;
    }
    let Ok(missing) = missing_state_privileges(client).await else {
        return e;
    };
    let Ok(user) = current_user(client).await else {
        return e;
    };
    if missing.is_empty() {
        return e;
    }
    Error::config(
        format!(
            "role {user} lacks {} on outboxd_state ({e})",
            missing.join(", ")
        ),
        format!(
            "GRANT {} ON outboxd_state TO {};",
            missing.join(", "),
            crate::names::pg_ident(&user)
        ),
    )
}

/// Which of [`STATE_PRIVILEGES`] the session's role lacks on an existing `outboxd_state`.
pub(crate) async fn missing_state_privileges(client: &Client) -> Result<Vec<&'static str>, Error> {
    let mut missing = Vec::new();
    for p in STATE_PRIVILEGES {
        let has: bool = client
            .query_one("SELECT has_table_privilege('outboxd_state', $1)", &[&p])
            .await?
            .get(0);
        if !has {
            missing.push(p);
        }
    }
    Ok(missing)
}

/// Columns added after the first release, for state tables created before them.
const ADDED_COLUMNS: [(&str, &str); 5] = [
    ("replay_since", "timestamptz"),
    ("position_commit_at", "timestamptz"),
    ("slot_created_lsn", "pg_lsn"),
    ("snapshot_key", "text"),
    ("progress", "text"),
];

pub async fn table_exists(client: &Client) -> Result<bool, Error> {
    let row = client
        .query_one("SELECT to_regclass('outboxd_state') IS NOT NULL", &[])
        .await?;
    Ok(row.get(0))
}

pub async fn load(client: &Client, name: &str) -> Result<Option<StateRow>, Error> {
    if !table_exists(client).await? {
        return Ok(None);
    }
    let row = match client
        .query_opt(
            "SELECT name, slot, publication, epoch, lease_holder,
                    coalesce(lease_expires_at > now(), false), position_lsn::text,
                    initialized_at IS NOT NULL, replay_since, lease_expires_at, updated_at,
                    position_commit_at, commit_gap_ms, created_at, snapshot_key, slot_created_lsn::text
               FROM outboxd_state WHERE name = $1",
            &[&name],
        )
        .await
    {
        Ok(row) => row,
        Err(e) => return Err(state_refused(client, e.into()).await),
    };
    Ok(row.map(|r| StateRow {
        name: r.get(0),
        slot: r.get(1),
        publication: r.get(2),
        epoch: r.get(3),
        lease_holder: r.get(4),
        lease_live: r.get(5),
        position_lsn: r.get::<_, Option<String>>(6).and_then(|s| parse_lsn(&s)),
        initialized: r.get(7),
        replay_since: r.get(8),
        lease_expires_at: r.get(9),
        updated_at: r.get(10),
        position_commit_at: r.get(11),
        commit_gap_ms: r.get(12),
        created_at: r.get(13),
        snapshot_key: r.get(14),
        slot_created_lsn: r.get::<_, Option<String>>(15).and_then(|s| parse_lsn(&s)),
    }))
}

/// What the lease holder of relay `name` last said of its running phase (see
/// `crate::progress::summary`); `None` when nothing runs, or before the column exists.
pub(crate) async fn load_progress(client: &Client, name: &str) -> Option<String> {
    client
        .query_opt(
            "SELECT progress FROM outboxd_state WHERE name = $1",
            &[&name],
        )
        .await
        .ok()??
        .get(0)
}

/// Whether the slot was replaced behind this relay's back (dropped and created again under
/// the same name, or moved by hand): its confirmed position is past everything this relay
/// name ever let it confirm. The relay confirms to the slot only positions already stored in
/// the row (see `state::checkpoint::slot_confirm`), so a legitimate slot is never ahead of
/// max(stored position, where the slot started); a slot created anew is, because it starts at
/// the WAL's head, past every position stored before. `None` also when the row predates
/// [`StateRow::slot_created_lsn`] (nothing to compare with yet).
pub(crate) fn slot_replaced(
    name: &str,
    slot: &str,
    stored: &Stored,
    confirmed: Option<u64>,
) -> Option<String> {
    let floor = stored.stream_start.as_ref().and_then(Checkpoint::lsn)?;
    let confirmed = confirmed?;
    let bound = floor.max(
        stored
            .position
            .as_ref()
            .and_then(Checkpoint::lsn)
            .unwrap_or(0),
    );
    (confirmed > bound).then(|| {
        format!(
            "replication slot {:?} confirms {} but relay {:?} never confirmed past {}: the slot was dropped and created again \
             (or advanced by hand), so the events between those positions were never relayed",
            slot,
            format_lsn(confirmed),
            name,
            format_lsn(bound),
        )
    })
}

/// Whether the row holds a position this server never wrote: one past its WAL's flush LSN
/// (`flush`). Every position a relay stores came from this server's walsender, which sends
/// only flushed WAL, so such a row was carried over from another cluster (a dump and restore, a
/// logical upgrade, a blue/green switch). Resuming from it would skip every event up to it and
/// confirm the slot there; its `slot_created_lsn`, just as foreign, would hide a replaced slot.
pub fn foreign_position(name: &str, stored: &Stored, flush: u64) -> Option<String> {
    let lsn_of = |c: &Option<Checkpoint>| c.as_ref().and_then(Checkpoint::lsn);
    let (what, at) = match (lsn_of(&stored.position), lsn_of(&stored.stream_start)) {
        (Some(p), _) if p > flush => ("stored position", p),
        (_, Some(c)) if c > flush => ("slot start", c),
        _ => return None,
    };
    Some(format!(
        "the {what} {} of relay {:?} is ahead of this server's WAL (flushed up to {}): the state row was written \
         by another server (a dump and restore, a logical upgrade, a blue/green switch), so its position means nothing \
         here and resuming from it would skip every event up to it",
        format_lsn(at),
        name,
        format_lsn(flush),
    ))
}

/// Records where the slot this relay follows starts: always when this relay just created it
/// (`created`), otherwise only when nothing was recorded yet (a slot made by `outboxd setup`,
/// or a state row from before this was recorded).
pub(crate) async fn record_slot_start(
    client: &Client,
    lease: &Lease,
    at: u64,
    created: bool,
) -> Result<(), Error> {
    let n = client
        .execute(
            "UPDATE outboxd_state SET slot_created_lsn = CASE WHEN $4 OR slot_created_lsn IS NULL
                                                          THEN $3::text::pg_lsn ELSE slot_created_lsn END
              WHERE name = $1 AND epoch = $2",
            &[&lease.name, &lease.epoch, &format_lsn(at), &created],
        )
        .await?;
    if n == 0 {
        return Err(lost(lease));
    }
    Ok(())
}

/// Takes the lease for `name`, creating the state row on first use. Refused while another
/// live process holds it.
pub async fn acquire(
    client: &mut Client,
    name: &str,
    slot: &str,
    publication: &str,
    holder: &str,
) -> Result<Lease, Error> {
    ensure_table(client).await?;
    match acquire_row(client, name, slot, publication, holder).await {
        Err(e) => Err(state_refused(client, e).await),
        ok => ok,
    }
}

async fn acquire_row(
    client: &mut Client,
    name: &str,
    slot: &str,
    publication: &str,
    holder: &str,
) -> Result<Lease, Error> {
    let tx = client.transaction().await?;
    tx.execute(
        "INSERT INTO outboxd_state (name, source, slot, publication) VALUES ($1, 'postgres', $2, $3)
         ON CONFLICT (name) DO NOTHING",
        &[&name, &slot, &publication],
    )
    .await?;
    let row = tx
        .query_one(
            "SELECT lease_holder, coalesce(lease_expires_at > now(), false), initialized_at IS NOT NULL,
                    source, slot, replay_since
               FROM outboxd_state WHERE name = $1 FOR UPDATE",
            &[&name],
        )
        .await?;
    let current: Option<String> = row.get(0);
    let live: bool = row.get(1);
    let initialized: bool = row.get(2);
    let source: String = row.get(3);
    let stored_slot: Option<String> = row.get(4);
    let replay_since: Option<chrono::DateTime<chrono::Utc>> = row.get(5);
    if source != "postgres" {
        return Err(Error::config(
            format!("relay name {name:?} belongs to a {source} source in this database"),
            "choose another --name",
        ));
    }
    if let Some(s) = &stored_slot {
        if s != slot {
            return Err(Error::config(
                format!("relay {name:?} uses slot {s:?}, not {slot:?}"),
                format!("run with --slot {s}, or `outboxd teardown --name {name}` to start over"),
            ));
        }
    }
    super::take_over(name, current.as_deref(), live, holder)?;
    let epoch: i64 = tx
        .query_one(
            "UPDATE outboxd_state SET epoch = epoch + 1, lease_holder = $2, lease_renewed_at = now(),
                    lease_expires_at = now() + make_interval(secs => $3), updated_at = now()
              WHERE name = $1 RETURNING epoch",
            &[&name, &holder, &(LEASE_TTL.as_secs_f64())],
        )
        .await?
        .get(0);
    tx.commit().await?;
    Ok(Lease {
        name: name.to_string(),
        holder: holder.to_string(),
        epoch,
        first_start: !initialized,
        replay_since,
    })
}

/// Marks the first start (or a requested replay) as done: the snapshot it published is
/// durable, so a later start streams only.
pub async fn mark_initialized(client: &Client, lease: &Lease) -> Result<(), Error> {
    let n = client
        .execute(
            "UPDATE outboxd_state SET initialized_at = coalesce(initialized_at, now()), replay_since = NULL,
                    snapshot_key = NULL
              WHERE name = $1 AND epoch = $2",
            &[&lease.name, &lease.epoch],
        )
        .await?;
    if n == 0 {
        return Err(lost(lease));
    }
    Ok(())
}

/// Records how far the first start's snapshot (or a replay) is durable: a crash goes on after
/// this row instead of reading the table again from the start.
pub(crate) async fn store_snapshot_key(
    client: &Client,
    lease: &Lease,
    key: &str,
) -> Result<(), Error> {
    let n = client
        .execute(
            "UPDATE outboxd_state SET snapshot_key = $3 WHERE name = $1 AND epoch = $2",
            &[&lease.name, &lease.epoch, &key],
        )
        .await?;
    if n == 0 {
        return Err(lost(lease));
    }
    Ok(())
}

use super::lost;

/// The renewal ([`renew`]): prepared once per session, as it is the one statement an idle relay
/// sends every second.
pub(crate) const RENEW: &str = "UPDATE outboxd_state
                SET lease_renewed_at = now(),
                    lease_expires_at = now() + make_interval(secs => $4),
                    position_lsn = CASE WHEN $3::text IS NOT NULL
                                         AND (position_lsn IS NULL OR $3::pg_lsn > position_lsn)
                                        THEN $3::pg_lsn ELSE position_lsn END,
                    position = CASE WHEN $3::text IS NOT NULL
                                     AND (position_lsn IS NULL OR $3::pg_lsn > position_lsn)
                                    THEN $3::text ELSE position END,
                    position_commit_at = greatest(position_commit_at, $6),
                    commit_gap_ms = greatest(commit_gap_ms, $7),
                    updated_at = now()
              WHERE name = $1 AND epoch = $2 AND lease_holder = $5
          RETURNING position_lsn::text";

/// Renews the lease and, when given, stores a newer position (`statement`: [`RENEW`] prepared on
/// `client`). A position older than the stored one is ignored by the statement itself, so the
/// row can never move backwards. Returns the position the row holds afterwards.
pub async fn renew(
    client: &Client,
    statement: &Statement,
    lease: &Lease,
    position: Option<u64>,
    commit: &DurableCommit,
) -> Result<Option<u64>, Error> {
    let pos_text = position.map(format_lsn);
    let row = client
        .query_opt(
            statement,
            &[
                &lease.name,
                &lease.epoch,
                &pos_text,
                &(LEASE_TTL.as_secs_f64()),
                &lease.holder,
                &commit.commit_at,
                &commit.max_gap_ms,
            ],
        )
        .await?;
    let Some(row) = row else {
        return Err(lost(lease));
    };
    Ok(row.get::<_, Option<String>>(0).and_then(|s| parse_lsn(&s)))
}

pub use super::DurableCommit;

/// Records a replay the next start must perform (recovery), while holding the lease, and
/// forgets the lost position: the stream starts again at a fresh slot, whose positions must
/// replace it. A stored position is never lowered by a renewal, so one kept here (a foreign
/// one past everything the fresh slot will reach) would be what the next start resumes from.
/// The commit time and gap stay: a replay cut off before it is durable starts from them again.
pub(crate) async fn set_replay(
    client: &Client,
    lease: &Lease,
    since: chrono::DateTime<chrono::Utc>,
) -> Result<(), Error> {
    let n = client
        .execute(
            "UPDATE outboxd_state SET replay_since = $3, snapshot_key = NULL, position_lsn = NULL, position = NULL,
                    slot_created_lsn = NULL, updated_at = now()
              WHERE name = $1 AND epoch = $2",
            &[&lease.name, &lease.epoch, &since],
        )
        .await?;
    if n == 0 {
        return Err(lost(lease));
    }
    Ok(())
}

/// Starts an interrupted first start over after its position was lost (recovery): its
/// snapshot's progress, stored position and slot start are forgotten, so the next slot and
/// snapshot begin afresh.
pub(crate) async fn restart_first_start(client: &Client, lease: &Lease) -> Result<(), Error> {
    let n = client
        .execute(
            "UPDATE outboxd_state SET snapshot_key = NULL, position_lsn = NULL, position = NULL, slot_created_lsn = NULL,
                    updated_at = now()
              WHERE name = $1 AND epoch = $2",
            &[&lease.name, &lease.epoch],
        )
        .await?;
    if n == 0 {
        return Err(lost(lease));
    }
    Ok(())
}

/// Gives the lease up at a clean shutdown, so the next start need not wait for it to expire.
pub async fn release(client: &Client, lease: &Lease) -> Result<(), Error> {
    client
        .execute(
            "UPDATE outboxd_state SET lease_holder = NULL, lease_expires_at = NULL, updated_at = now()
              WHERE name = $1 AND epoch = $2 AND lease_holder = $3",
            &[&lease.name, &lease.epoch, &lease.holder],
        )
        .await?;
    Ok(())
}

/// Asks the next start to publish the table's rows created since `since` before streaming
/// (`offset set --replay-since`). Refused while a live relay holds the lease.
pub async fn request_replay(
    client: &Client,
    name: &str,
    since: chrono::DateTime<chrono::Utc>,
) -> Result<(), Error> {
    let n = client
        .execute(
            "UPDATE outboxd_state SET replay_since = $2, snapshot_key = NULL, updated_at = now()
              WHERE name = $1 AND (lease_holder IS NULL OR lease_expires_at < now())",
            &[&name, &since],
        )
        .await?;
    if n == 0 {
        return Err(Error::config(
            format!("relay {name:?} has no state, or is running"),
            "stop the relay first (or check --name)",
        ));
    }
    Ok(())
}

/// Deletes the state of `name` (teardown).
pub async fn delete(client: &Client, name: &str) -> Result<u64, Error> {
    if !table_exists(client).await? {
        return Ok(0);
    }
    Ok(client
        .execute("DELETE FROM outboxd_state WHERE name = $1", &[&name])
        .await?)
}
