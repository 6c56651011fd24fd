//! The operator's commands for a Postgres source: `check` (a preflight with one line per check
//! and the exact fix for each failure), `status` (position, head, lag, slot, lease) and
//! `offset show|set`. They print to stdout; failures that stop them are errors as usual.

use crate::diagnostics::{line, CheckLine, Level};
use crate::dsn::DbDsn;
use crate::event::{format_lsn, parse_lsn};
use crate::outbox::{pg_ident, pg_literal, ColumnMap, TableName};
use crate::source::postgres::{self as pg, admin, rows::RowMapper, snapshot, version};
use crate::state;
use crate::Error;
use serde::Serialize;
use tokio_postgres::Client;

/// Everything `check` looks at for a Postgres source.
pub struct PgTarget<'a> {
    pub dsn: &'a DbDsn,
    pub name: &'a str,
    /// The outbox tables (`--table`, one or more): each is checked, and the publication must
    /// cover all of them.
    pub tables: &'a [TableName],
    pub columns: &'a ColumnMap,
    pub slot: &'a str,
    pub publication: &'a str,
    /// `--standby`: a physical standby whose failover-slot settings are checked too.
    pub standby: Option<&'a DbDsn>,
}

/// Roles of managed Postgres services that matter for logical replication, and the service.
/// `rds_replication` (or `rds_superuser`, the master user's role) grants it on Amazon RDS and
/// Aurora; `cloudsqlsuperuser` members on Cloud
/// SQL may give themselves the REPLICATION attribute (which is what the walsender checks).
pub(crate) const MANAGED_ROLES: &[(&str, &str)] = &[
    ("rds_replication", "Amazon RDS / Aurora"),
    ("rds_superuser", "Amazon RDS / Aurora"),
    ("cloudsqlsuperuser", "Google Cloud SQL"),
];

/// What `check` found about the current role's right to replicate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicationGrant {
    pub user: String,
    pub superuser: bool,
    /// The REPLICATION attribute (self-hosted, Cloud SQL, Azure, Supabase, Crunchy, …).
    pub replication: bool,
    /// The [`MANAGED_ROLES`] the role is a member of (directly or through other roles).
    pub(crate) memberships: Vec<String>,
}

impl ReplicationGrant {
    /// The check line: which grant was found, or what to run.
    pub fn judge(&self) -> (Level, String, Option<String>) {
        let user = &self.user;
        let service = |r: &str| {
            MANAGED_ROLES
                .iter()
                .find(|(n, _)| *n == r)
                .map(|(_, s)| *s)
                .unwrap_or("")
        };
        if self.superuser {
            return (Level::Ok, format!("role {user}: superuser"), None);
        }
        if let Some(r) = ["rds_replication", "rds_superuser"]
            .into_iter()
            .find(|r| self.memberships.iter().any(|m| m == r))
        {
            return (
                Level::Ok,
                format!("role {user}: member of {r} ({})", service(r)),
                None,
            );
        }
        if self.replication {
            let via = if self.memberships.iter().any(|m| m == "cloudsqlsuperuser") {
                " (member of cloudsqlsuperuser: Google Cloud SQL)"
            } else {
                ""
            };
            return (
                Level::Ok,
                format!("role {user}: REPLICATION attribute{via}"),
                None,
            );
        }
        if self.memberships.iter().any(|m| m == "cloudsqlsuperuser") {
            // Cloud SQL's walsender still wants the attribute, which a cloudsqlsuperuser
            // member may set on itself: not a failure, but not enough yet.
            return (
                Level::Warn,
                format!("role {user}: member of cloudsqlsuperuser (Google Cloud SQL) without the REPLICATION attribute"),
                Some(format!("ALTER ROLE {} WITH REPLICATION;  (as a cloudsqlsuperuser member, with the flag cloudsql.logical_decoding=on)", pg_ident(user))),
            );
        }
        (
            Level::Fail,
            format!("role {user} lacks REPLICATION (and is no member of rds_replication)"),
            Some(format!(
                "ALTER ROLE {u} WITH REPLICATION;  (Amazon RDS / Aurora: GRANT rds_replication TO {u};)",
                u = pg_ident(user)
            )),
        )
    }
}

/// How to get `wal_level = logical`, given which managed-service settings the server has.
pub(crate) fn wal_level_fix(managed_settings: &[String]) -> String {
    if managed_settings
        .iter()
        .any(|s| s == "rds.logical_replication")
    {
        "set rds.logical_replication = 1 in the instance's DB parameter group (Aurora: the DB cluster parameter group), then reboot the instance (docs/managed-postgres.md)".into()
    } else if managed_settings
        .iter()
        .any(|s| s == "cloudsql.logical_decoding")
    {
        "gcloud sql instances patch INSTANCE --database-flags=cloudsql.logical_decoding=on (restarts the instance; docs/managed-postgres.md)".into()
    } else {
        "ALTER SYSTEM SET wal_level = logical; then restart Postgres (managed services: docs/managed-postgres.md)".into()
    }
}

/// Runs every Postgres check; never stops at the first failure.
pub async fn check_postgres(t: &PgTarget<'_>) -> Vec<CheckLine> {
    let mut out = Vec::new();
    let client = match pg::connect_sql(t.dsn, "outboxd_check").await {
        Ok(c) => {
            out.push(line(
                Level::Ok,
                "connect",
                format!("{}:{} database {}", t.dsn.host, t.dsn.port, t.dsn.database),
                None,
            ));
            c
        }
        Err(e) => {
            out.push(line(
                Level::Fail,
                "connect",
                e.to_string(),
                Some(format!(
                    "make Postgres reachable at {}:{} for user {} (pg_hba.conf, password, sslmode)",
                    t.dsn.host, t.dsn.port, t.dsn.user
                )),
            ));
            return out;
        }
    };
    if let Err(e) = check_server(&client, t, &mut out).await {
        out.push(line(Level::Fail, "query", e.to_string(), None));
    }
    out
}

async fn setting(client: &Client, name: &str) -> Result<String, Error> {
    Ok(client
        .query_one("SELECT setting FROM pg_settings WHERE name = $1", &[&name])
        .await?
        .get(0))
}

/// The server's side of `check`: version, settings, the role's grants, each outbox table with
/// its publication, the slot, and (with `--standby`) the failover settings. One helper per
/// subject, in the order the lines are printed.
async fn check_server(
    client: &Client,
    t: &PgTarget<'_>,
    out: &mut Vec<CheckLine>,
) -> Result<(), Error> {
    let server = version::ServerVersion::of(client).await?;
    out.push(version::version_line(server));
    out.push(check_wal_level(client).await?);
    check_capacity(client, t.slot, out).await?;
    let user = check_replication_grant(client, out).await?;
    for table in t.tables {
        check_table(client, t, table, &user, out).await?;
        out.push(check_publication(client, t.publication, table).await?);
    }
    let state_readable = check_state_table(client, &user, out).await?;
    let details = version::slot_details(client, server, t.slot).await?;
    out.push(check_slot(client, t, details.as_ref(), state_readable).await?);
    let settings = version::settings(client, server).await?;
    out.extend(version::settings_lines(
        server,
        &settings,
        t.slot,
        details.as_ref(),
    ));
    if let Some(standby) = t.standby {
        out.extend(version::standby_lines(client, standby, t.slot).await);
    }
    Ok(())
}

/// `wal_level` must be `logical`; the fix names a managed service's own setting where it has one.
async fn check_wal_level(client: &Client) -> Result<CheckLine, Error> {
    let level = admin::wal_level(client).await?;
    Ok(if level == "logical" {
        line(Level::Ok, "wal_level", "logical", None)
    } else {
        // Managed services do not allow ALTER SYSTEM: their own setting turns it on.
        let managed: Vec<String> = client
            .query(
                "SELECT name::text FROM pg_settings WHERE name IN ('rds.logical_replication', 'cloudsql.logical_decoding')",
                &[],
            )
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        line(
            Level::Fail,
            "wal_level",
            format!("{level}, logical decoding needs logical"),
            Some(wal_level_fix(&managed)),
        )
    })
}

/// Room for one more slot and walsender, and whether an abandoned slot could fill the disk.
async fn check_capacity(
    client: &Client,
    slot: &str,
    out: &mut Vec<CheckLine>,
) -> Result<(), Error> {
    let max_slots: i64 = setting(client, "max_replication_slots")
        .await?
        .parse()
        .unwrap_or(0);
    let used: i64 = client
        .query_one("SELECT count(*) FROM pg_replication_slots", &[])
        .await?
        .get(0);
    let ours_exists = admin::slot(client, slot).await?.is_some();
    let needed = used + if ours_exists { 0 } else { 1 };
    out.push(if needed <= max_slots {
        line(
            Level::Ok,
            "max_replication_slots",
            format!("{max_slots} ({used} in use)"),
            None,
        )
    } else {
        line(
            Level::Fail,
            "max_replication_slots",
            format!("{max_slots}, all {used} in use"),
            Some(format!(
                "ALTER SYSTEM SET max_replication_slots = {}; then restart Postgres",
                used + 10
            )),
        )
    });

    let senders: i64 = setting(client, "max_wal_senders")
        .await?
        .parse()
        .unwrap_or(0);
    let active: i64 = client
        .query_one("SELECT count(*) FROM pg_stat_replication", &[])
        .await?
        .get(0);
    out.push(if senders > active {
        line(
            Level::Ok,
            "max_wal_senders",
            format!("{senders} ({active} in use)"),
            None,
        )
    } else {
        line(
            Level::Fail,
            "max_wal_senders",
            format!("{senders}, all in use"),
            Some(format!(
                "ALTER SYSTEM SET max_wal_senders = {}; then restart Postgres",
                active + 10
            )),
        )
    });

    let keep = setting(client, "max_slot_wal_keep_size").await?;
    out.push(if keep == "-1" {
        line(Level::Warn, "max_slot_wal_keep_size", "unlimited: an abandoned slot can fill the disk", Some("ALTER SYSTEM SET max_slot_wal_keep_size = '50GB'; SELECT pg_reload_conf();  -- or monitor `outboxd status`".into()))
    } else {
        line(Level::Ok, "max_slot_wal_keep_size", format!("{keep} MB"), None)
    });
    Ok(())
}

/// The role's right to replicate (an attribute, or a managed service's role); returns the role.
async fn check_replication_grant(
    client: &Client,
    out: &mut Vec<CheckLine>,
) -> Result<String, Error> {
    let grant = replication_grant(client).await?;
    let (level, detail, fix) = grant.judge();
    out.push(line(level, "replication privilege", detail, fix));
    Ok(grant.user)
}

/// What the session's role holds that lets it replicate.
pub async fn replication_grant(client: &Client) -> Result<ReplicationGrant, Error> {
    // Managed services grant logical replication without the REPLICATION attribute (Amazon
    // RDS / Aurora: membership of rds_replication) or through their admin role: membership
    // is transitive (`pg_has_role … MEMBER`), so the RDS master user (rds_superuser) counts.
    let role = client
        .query_one(
            "SELECT rolname::text, rolsuper, rolreplication,
                    ARRAY(SELECT g.rolname::text FROM pg_roles g
                          WHERE g.rolname = ANY($1) AND pg_has_role(current_user, g.oid, 'MEMBER')
                          ORDER BY g.rolname)
             FROM pg_roles WHERE rolname = current_user",
            &[&MANAGED_ROLES.iter().map(|(r, _)| *r).collect::<Vec<_>>()],
        )
        .await?;
    Ok(ReplicationGrant {
        user: role.get(0),
        superuser: role.get(1),
        replication: role.get(2),
        memberships: role.get(3),
    })
}

/// One outbox table: it exists, maps onto the column map, and the role may read it.
async fn check_table(
    client: &Client,
    t: &PgTarget<'_>,
    table: &TableName,
    user: &str,
    out: &mut Vec<CheckLine>,
) -> Result<(), Error> {
    let exists: bool = client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table.pg_quoted()])
        .await?
        .get(0);
    if !exists {
        out.push(line(
            Level::Fail,
            "outbox table",
            format!("{} does not exist", table.pg_quoted()),
            Some(format!("psql -f migrations/postgres/001_outbox.sql  (or `outboxd setup --create-table --table {}`)", table.pg_quoted())),
        ));
    } else {
        let rel = snapshot::table_relation(client, table).await?;
        let mut mapper = RowMapper::new(table.clone(), t.columns.clone());
        out.push(match mapper.relation(rel) {
            Ok(()) => line(
                Level::Ok,
                "outbox table",
                format!(
                    "{} has the mapped columns with usable types",
                    table.pg_quoted()
                ),
                None,
            ),
            Err(Error::Config { problem, fix }) => {
                line(Level::Fail, "outbox table", problem, Some(fix))
            }
            Err(e) => line(Level::Fail, "outbox table", e.to_string(), None),
        });
        let privileged: bool = client
            .query_one(
                "SELECT has_table_privilege($1, 'SELECT')",
                &[&table.pg_quoted()],
            )
            .await?
            .get(0);
        if !privileged {
            out.push(line(
                Level::Fail,
                "table privilege",
                format!("{user} cannot SELECT {}", table.pg_quoted()),
                Some(format!(
                    "GRANT SELECT ON {} TO {};",
                    table.pg_quoted(),
                    pg_ident(user)
                )),
            ));
        }
    }
    Ok(())
}

/// `outboxd_state`: complete, and the role may read and write it (each missing privilege with
/// its `GRANT`); where it is missing or old, whether this role's first run can make it so or
/// `outboxd setup` must. Returns whether the role may read it.
async fn check_state_table(
    client: &Client,
    user: &str,
    out: &mut Vec<CheckLine>,
) -> Result<bool, Error> {
    use state::postgres::{gap, Gap};
    let row = client
        .query_one(
            "SELECT coalesce(has_schema_privilege(current_schema(), 'CREATE'), false),
                    coalesce((SELECT pg_has_role(relowner, 'USAGE') FROM pg_class
                               WHERE oid = to_regclass('outboxd_state')), false)",
            &[],
        )
        .await?;
    let (may_create, owner): (bool, bool) = (row.get(0), row.get(1));
    let setup = "outboxd setup  (as the setup role, docs/operations.md \"Grants\")".to_string();
    match gap(client).await? {
        Some(Gap::Table) => {
            out.push(if may_create {
                line(
                    Level::Ok,
                    "state table",
                    "outboxd_state does not exist yet (`outboxd setup` or the first `outboxd run` creates it)",
                    None,
                )
            } else {
                line(
                    Level::Fail,
                    "state table",
                    format!("outboxd_state does not exist, and role {user} may not create it"),
                    Some(format!(
                        "{setup}; then GRANT SELECT, INSERT, UPDATE ON outboxd_state TO {};",
                        pg_ident(user)
                    )),
                )
            });
            return Ok(false);
        }
        Some(Gap::Columns(missing)) if !owner => out.push(line(
            Level::Fail,
            "state table",
            format!(
                "outboxd_state lacks the columns {} of this version, and role {user} is not its owner",
                missing.join(", ")
            ),
            Some(setup),
        )),
        Some(Gap::Columns(missing)) => out.push(line(
            Level::Ok,
            "state table",
            format!(
                "outboxd_state lacks the columns {} of this version: the next start adds them",
                missing.join(", ")
            ),
            None,
        )),
        None => {}
    }
    let missing = state::postgres::missing_state_privileges(client).await?;
    if missing.is_empty() {
        out.push(line(
            Level::Ok,
            "state table",
            format!("role {user} may read and write outboxd_state"),
            None,
        ));
    } else {
        out.push(line(
            Level::Fail,
            "state table",
            format!("role {user} lacks {} on outboxd_state", missing.join(", ")),
            Some(format!(
                "GRANT {} ON outboxd_state TO {};",
                missing.join(", "),
                pg_ident(user)
            )),
        ));
    }
    Ok(!missing.contains(&"SELECT"))
}

/// The publication exists, publishes inserts of `table`, and (partitioned) under its root's name.
async fn check_publication(
    client: &Client,
    publication: &str,
    table: &TableName,
) -> Result<CheckLine, Error> {
    let pub_row = client
        .query_opt(
            "SELECT pubinsert, pubviaroot FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await?;
    let covers: bool = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3)",
            &[&publication, &table.pg_schema(), &table.name],
        )
        .await?
        .get(0);
    // Only the table's owner can add it to a publication: the fix says who, when it is not
    // this role.
    let blocker = admin::publication_blocker(client, publication, std::slice::from_ref(table))
        .await?
        .map(
            |(refusal, statement)| match refusal.into_error(&statement) {
                Error::Config { problem, fix } => format!("{fix}  ({problem})"),
                other => other.to_string(),
            },
        );
    let create_pub = blocker.clone().unwrap_or_else(|| {
        format!(
            "CREATE PUBLICATION {} FOR TABLE {} WITH (publish = 'insert', publish_via_partition_root = true);  -- or `outboxd setup`",
            pg_ident(publication),
            table.pg_quoted()
        )
    });
    let partitioned = admin::is_partitioned(client, table).await?;
    Ok(match pub_row {
        Some(r) if partitioned && !r.get::<_, bool>(1) => line(
            Level::Fail,
            "publication",
            format!("{} publishes the partitions of {} under their own names (publish_via_partition_root is off)", publication, table.pg_quoted()),
            Some(format!("ALTER PUBLICATION {} SET (publish = 'insert', publish_via_partition_root = true);", pg_ident(publication))),
        ),
        None => line(Level::Fail, "publication", format!("{} does not exist", publication), Some(create_pub)),
        Some(r) if r.get::<_, bool>(0) && covers => line(Level::Ok, "publication", format!("{} publishes inserts of {}", publication, table.pg_quoted()), None),
        Some(_) => line(
            Level::Fail,
            "publication",
            format!("{} does not publish inserts of {}", publication, table.pg_quoted()),
            Some(blocker.unwrap_or_else(|| format!("ALTER PUBLICATION {0} ADD TABLE {1}; ALTER PUBLICATION {0} SET (publish = 'insert');  -- or `outboxd setup`", pg_ident(publication), table.pg_quoted()))),
        ),
    })
}

/// The slot: missing (fine before the first run, not once a position is stored), invalidated,
/// of another plugin, or usable.
async fn check_slot(
    client: &Client,
    t: &PgTarget<'_>,
    details: Option<&version::SlotDetails>,
    state_readable: bool,
) -> Result<CheckLine, Error> {
    // A state row the role may not read was reported with its grant already.
    let state_row = match state_readable {
        true => state::postgres::load(client, t.name).await?,
        false => None,
    };
    let reason = details
        .and_then(|d| d.invalidation_reason.as_deref())
        .map(|r| format!(", invalidation_reason {r}"))
        .unwrap_or_default();
    Ok(match admin::slot(client, t.slot).await? {
        None if state_row.as_ref().is_some_and(|s| s.initialized) => line(
            Level::Fail,
            "replication slot",
            format!(
                "{} is gone but relay {} has a stored position: events may be lost",
                t.slot, t.name
            ),
            Some(admin::lost_slot_fix(t.name, t.slot)),
        ),
        None => line(
            Level::Warn,
            "replication slot",
            format!(
                "{} does not exist yet (the first `outboxd run` creates it)",
                t.slot
            ),
            Some(format!(
                "outboxd setup --name {}  -- creates it now",
                t.name
            )),
        ),
        Some(s) if s.wal_status.as_deref() == Some("lost") => line(
            Level::Fail,
            "replication slot",
            format!("{} was invalidated (wal_status lost{reason})", t.slot),
            Some(admin::lost_slot_fix(t.name, t.slot)),
        ),
        Some(s) if s.plugin.as_deref() != Some("pgoutput") => line(
            Level::Fail,
            "replication slot",
            format!("{} uses plugin {:?}, not pgoutput", t.slot, s.plugin),
            Some(format!(
                "SELECT pg_drop_replication_slot({}); then `outboxd setup`",
                pg_literal(t.slot)
            )),
        ),
        Some(s) => line(
            if s.wal_status.as_deref() == Some("unreserved") {
                Level::Warn
            } else {
                Level::Ok
            },
            "replication slot",
            format!(
                "{} (wal_status {}, {})",
                t.slot,
                s.wal_status.as_deref().unwrap_or("?"),
                if s.active { "active" } else { "inactive" }
            ),
            None,
        ),
    })
}

/// What `status` shows.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    pub name: String,
    /// `PostgreSQL 17.10`.
    pub(crate) server_version: String,
    pub slot: String,
    pub stored_position: Option<String>,
    pub slot_confirmed: Option<String>,
    pub server_head: String,
    pub lag_bytes: Option<i64>,
    pub(crate) lag_seconds: Option<f64>,
    pub slot_active: Option<bool>,
    pub wal_status: Option<String>,
    pub(crate) retained_wal_bytes: Option<i64>,
    pub lease_holder: Option<String>,
    pub lease_live: bool,
    pub epoch: Option<i64>,
    pub(crate) replay_requested_since: Option<String>,
    /// 17+: why the slot was invalidated, since when it is unused, whether it is a failover
    /// slot and whether it is a standby's synchronised copy (`None` below 17).
    pub(crate) invalidation_reason: Option<String>,
    pub(crate) inactive_since: Option<String>,
    pub failover: Option<bool>,
    pub synced: Option<bool>,
    /// What the lease holder's running snapshot, replay or catch-up has got to, as it last
    /// stored it (`crate::progress::summary`).
    pub progress: Option<serde_json::Value>,
    /// `status --standby`: the standby's copy of the slot (17+), and whether a failover to
    /// that standby keeps it; `None` without `--standby`.
    pub standby: Option<StandbyStatus>,
}

/// The standby's side of `status --standby`.
#[derive(Debug, Clone, Serialize)]
pub struct StandbyStatus {
    /// `host:port` of the standby.
    pub at: String,
    /// Its copy of the relay's slot; `None` when it has none.
    pub copy: Option<version::StandbyCopy>,
    /// `synced AND NOT temporary AND invalidation_reason IS NULL`.
    pub ready: bool,
    /// What went wrong reading it (unreachable, no failover slots below 17).
    pub problem: Option<String>,
}

/// Reads the standby's copy of `slot` for `status --standby`; a problem is shown, not fatal.
async fn standby_status(standby: &DbDsn, slot: &str) -> StandbyStatus {
    let at = format!("{}:{}", standby.host, standby.port);
    let read = async {
        let sb = pg::connect_sql(standby, "outboxd_status").await?;
        let v = version::ServerVersion::of(&sb).await?;
        if !v.has_failover_slots() {
            return Err(Error::Other(format!(
                "PostgreSQL {v} has no failover slots: a failover to it loses the slot"
            )));
        }
        version::standby_copy(&sb, slot).await
    };
    match read.await {
        Ok(copy) => StandbyStatus {
            at,
            ready: copy.as_ref().is_some_and(|c| c.ready()),
            copy,
            problem: None,
        },
        Err(e) => StandbyStatus {
            at,
            copy: None,
            ready: false,
            problem: Some(e.to_string()),
        },
    }
}

/// The server's WAL head (`pg_current_wal_lsn()`), as `status` shows it.
pub async fn wal_head(client: &tokio_postgres::Client) -> Result<u64, Error> {
    let head: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .get(0);
    crate::event::parse_lsn(&head)
        .ok_or_else(|| Error::Other(format!("the server's WAL head {head:?} is not an LSN")))
}

pub async fn status_postgres(
    dsn: &DbDsn,
    name: &str,
    slot: &str,
    standby: Option<&DbDsn>,
) -> Result<Status, Error> {
    let client = pg::connect_sql(dsn, "outboxd_status").await?;
    let head: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .get(0);
    let s = client
        .query_opt(
            "SELECT confirmed_flush_lsn::text, active, wal_status,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::int8,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::int8,
                    (SELECT extract(epoch FROM r.flush_lag)::float8 FROM pg_stat_replication r WHERE r.pid = s.active_pid)
               FROM pg_replication_slots s WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    let row = state::postgres::load(&client, name).await?;
    let server = version::ServerVersion::of(&client).await?;
    let details = version::slot_details(&client, server, slot).await?;
    Ok(Status {
        name: name.to_string(),
        server_version: format!("PostgreSQL {server}"),
        slot: slot.to_string(),
        stored_position: row.as_ref().and_then(|r| r.position_lsn).map(format_lsn),
        slot_confirmed: s.as_ref().and_then(|s| s.get(0)),
        server_head: head,
        lag_bytes: s.as_ref().and_then(|s| s.get(3)),
        lag_seconds: s.as_ref().and_then(|s| s.get(5)),
        slot_active: s.as_ref().map(|s| s.get(1)),
        wal_status: s.as_ref().and_then(|s| s.get(2)),
        retained_wal_bytes: s.as_ref().and_then(|s| s.get(4)),
        lease_holder: row.as_ref().and_then(|r| r.lease_holder.clone()),
        lease_live: row.as_ref().is_some_and(|r| r.lease_live),
        epoch: row.as_ref().map(|r| r.epoch),
        replay_requested_since: row
            .as_ref()
            .and_then(|r| r.replay_since)
            .map(|t| t.to_rfc3339()),
        invalidation_reason: details.as_ref().and_then(|d| d.invalidation_reason.clone()),
        inactive_since: details.as_ref().and_then(|d| d.inactive_since.clone()),
        failover: details.as_ref().map(|d| d.failover),
        synced: details.as_ref().map(|d| d.synced),
        progress: state::postgres::load_progress(&client, name)
            .await
            .and_then(|p| serde_json::from_str(&p).ok()),
        standby: match standby {
            Some(sb) => Some(standby_status(sb, slot).await),
            None => None,
        },
    })
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let o = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
        writeln!(f, "relay            {}", self.name)?;
        writeln!(f, "server           {}", self.server_version)?;
        writeln!(f, "stored position  {}", o(&self.stored_position))?;
        writeln!(
            f,
            "slot             {} (confirmed {}, {}, wal_status {})",
            self.slot,
            o(&self.slot_confirmed),
            match self.slot_active {
                Some(true) => "active",
                Some(false) => "inactive",
                None => "missing",
            },
            o(&self.wal_status)
        )?;
        if let Some(failover) = self.failover {
            writeln!(
                f,
                "slot (17+)       failover {}, synced {}, inactive since {}, invalidation_reason {}",
                if failover { "yes" } else { "no" },
                if self.synced == Some(true) { "yes" } else { "no" },
                o(&self.inactive_since),
                o(&self.invalidation_reason)
            )?;
        }
        if let Some(sb) = &self.standby {
            let state = match (&sb.copy, &sb.problem) {
                (_, Some(p)) => p.clone(),
                (None, None) => "no copy of the slot (not synchronised)".into(),
                (Some(c), None) => format!(
                    "{}: {}",
                    c.describe(),
                    if sb.ready {
                        "ready for a failover"
                    } else {
                        "NOT ready: a promotion now loses the slot"
                    }
                ),
            };
            writeln!(f, "standby slot     {} on {}: {state}", self.slot, sb.at)?;
        }
        writeln!(f, "server head      {}", self.server_head)?;
        writeln!(
            f,
            "lag              {} bytes, {} s",
            self.lag_bytes.map(|b| b.to_string()).unwrap_or("-".into()),
            self.lag_seconds
                .map(|s| format!("{s:.3}"))
                .unwrap_or("-".into())
        )?;
        writeln!(
            f,
            "retained WAL     {} bytes",
            self.retained_wal_bytes
                .map(|b| b.to_string())
                .unwrap_or("-".into())
        )?;
        crate::diagnostics::write_lease(f, self.lease_holder.as_deref(), self.lease_live)?;
        crate::diagnostics::write_progress(f, self.progress.as_ref(), self.lease_live)?;
        if let Some(s) = &self.replay_requested_since {
            write!(f, "\nreplay requested since {s}")?;
        }
        Ok(())
    }
}

/// `offset set --lsn`: moves the slot forward (skipping events). A logical slot cannot move
/// backwards; replays go through the table (`--replay-since`).
pub async fn advance_slot(dsn: &DbDsn, name: &str, slot: &str, lsn: &str) -> Result<String, Error> {
    let target = parse_lsn(lsn).ok_or_else(|| {
        Error::config(
            format!("{lsn:?} is not an LSN"),
            "write it as Postgres does, e.g. 0/16B3748",
        )
    })?;
    let client = pg::connect_sql(dsn, "outboxd_offset").await?;
    if let Some(row) = state::postgres::load(&client, name).await? {
        if row.lease_live
            && row
                .lease_holder
                .as_deref()
                .is_some_and(|h| !state::holder_is_dead_locally(h))
        {
            return Err(Error::config(
                format!(
                    "relay {name:?} is running (lease held by {})",
                    row.lease_holder.unwrap_or_default()
                ),
                "stop it first",
            ));
        }
    }
    let info = admin::slot(&client, slot).await?.ok_or_else(|| {
        Error::config(
            format!("slot {slot:?} does not exist"),
            format!("outboxd setup --name {name}"),
        )
    })?;
    let current = info.confirmed_flush_lsn.unwrap_or(0);
    if target < current {
        return Err(Error::config(
            format!("{lsn} is before the slot's position {}: a logical slot cannot move backwards", format_lsn(current)),
            format!("to publish again, replay from the table: outboxd offset set --name {name} --replay-since <RFC 3339 time>"),
        ));
    }
    let row = client
        .query_one(
            "SELECT end_lsn::text FROM pg_replication_slot_advance($1, $2::text::pg_lsn)",
            &[&slot, &lsn],
        )
        .await?;
    let end: String = row.get(0);
    // A slot taken over from another consumer (Debezium's) has no state row yet.
    let has_state: bool = client
        .query_one("SELECT to_regclass('outboxd_state') IS NOT NULL", &[])
        .await?
        .get(0);
    if has_state {
        client
            .execute(
                "UPDATE outboxd_state SET position_lsn = $2::text::pg_lsn, position = $2, updated_at = now() WHERE name = $1",
                &[&name, &end],
            )
            .await?;
    }
    Ok(end)
}

#[cfg(test)]
mod grant_tests {
    use super::*;

    fn grant(superuser: bool, replication: bool, memberships: &[&str]) -> ReplicationGrant {
        ReplicationGrant {
            user: "app".into(),
            superuser,
            replication,
            memberships: memberships.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn each_grant_is_named() {
        let (l, d, _) = grant(false, false, &["rds_replication"]).judge();
        assert_eq!(l, Level::Ok);
        assert!(d.contains("rds_replication") && d.contains("RDS"), "{d}");
        let (l, d, _) = grant(false, false, &["rds_superuser"]).judge();
        assert_eq!(l, Level::Ok);
        assert!(d.contains("member of rds_superuser"), "{d}");
        let (l, d, _) = grant(false, true, &[]).judge();
        assert_eq!(l, Level::Ok);
        assert!(d.contains("REPLICATION attribute"), "{d}");
        let (l, d, _) = grant(false, true, &["cloudsqlsuperuser"]).judge();
        assert_eq!(l, Level::Ok);
        assert!(d.contains("Cloud SQL"), "{d}");
        let (l, d, fix) = grant(false, false, &["cloudsqlsuperuser"]).judge();
        assert_eq!(l, Level::Warn);
        assert!(d.contains("cloudsqlsuperuser"), "{d}");
        assert!(fix.unwrap().contains("WITH REPLICATION"));
        let (l, d, _) = grant(true, false, &[]).judge();
        assert_eq!((l, d.as_str()), (Level::Ok, "role app: superuser"));
        let (l, _, fix) = grant(false, false, &[]).judge();
        assert_eq!(l, Level::Fail);
        let fix = fix.unwrap();
        assert!(
            fix.contains("WITH REPLICATION") && fix.contains("GRANT rds_replication"),
            "{fix}"
        );
    }

    #[test]
    fn wal_level_fix_names_the_services_setting() {
        assert!(wal_level_fix(&["rds.logical_replication".into()]).contains("parameter group"));
        assert!(wal_level_fix(&["cloudsql.logical_decoding".into()])
            .contains("cloudsql.logical_decoding=on"));
        assert!(wal_level_fix(&[]).starts_with("ALTER SYSTEM SET wal_level = logical"));
    }
}
