//! `outboxd setup` and `outboxd teardown`, on Postgres (state table, publication, slot,
//! notify trigger) and MySQL/MariaDB (binlog checks, state table): what `run` needs, created
//! idempotently, and dropped again.

use super::{resolve_source, Resolved, SourceArgs};
use crate::dsn::{self, SourceDsn};
use crate::outbox::{Mode, TableName};
use crate::source::postgres::{self as pg, admin, version};
use crate::Error;
use clap::{ArgMatches, Args};

#[derive(Debug, Clone, Args)]
pub struct SetupArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    /// Also create the outbox table (the columns of migrations/*/001_outbox.sql) when it does not exist.
    #[arg(long, env = "OUTBOXD_CREATE_TABLE")]
    pub create_table: bool,
    /// Install the trigger that wakes poll-mode relays (`run --mode poll --notify`).
    #[arg(long, env = "OUTBOXD_NOTIFY")]
    pub notify: bool,
    /// Poll mode only: create the table (and trigger) but no slot or publication.
    #[arg(long, env = "OUTBOXD_MODE", value_enum, default_value_t = Mode::Cdc)]
    pub mode: Mode,
    /// Create the replication slot as a failover slot (PostgreSQL 17+): a physical standby
    /// with sync_replication_slots = on keeps a copy the relay resumes from after a failover
    /// (docs/operations.md, failover runbook). Refused below 17.
    #[arg(long, env = "OUTBOXD_FAILOVER_SLOT")]
    pub failover_slot: bool,
}

#[derive(Debug, Clone, Args)]
pub struct TeardownArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    /// Confirm: the slot, publication and stored position are dropped.
    #[arg(long)]
    pub yes: bool,
}

pub(super) async fn setup(args: SetupArgs, m: &ArgMatches) -> Result<(), Error> {
    let r = resolve_source(&args.source, m)?;
    let dsn = match r.source.clone() {
        SourceDsn::Postgres(dsn) => dsn,
        SourceDsn::Mysql(dsn) => return setup_mysql(dsn, &r, &args).await,
        SourceDsn::File(_) => return Err(Error::config(
            "a binlog-file source needs no setup",
            "run it directly: outboxd run --source file:///path/binlog.000001 --table db.outbox",
        )),
    };
    let client = pg::connect_sql(&dsn, "outboxd_setup").await?;
    // Refused before anything is created, the outbox table included: a half-done setup is
    // worse than none.
    let server = version::ServerVersion::of(&client).await?;
    if args.failover_slot && !server.has_failover_slots() {
        return Err(version::failover_refused(server));
    }
    for table in &r.tables {
        if args.create_table {
            let created = admin::create_outbox_table(&client, table).await?;
            println!(
                "ok   outbox table {} ({})",
                table.pg_quoted(),
                if created { "created" } else { "exists" }
            );
        }
        admin::require_table(&client, table).await?;
        if args.notify {
            client
                .batch_execute(&crate::source::postgres::poll::notify_trigger_sql(table))
                .await?;
            println!(
                "ok   notify trigger on {} (channel {})",
                table.pg_quoted(),
                crate::source::postgres::poll::notify_channel(table)
            );
        }
    }
    if args.mode == Mode::Poll {
        for table in &r.tables {
            let change =
                crate::source::postgres::poll::ensure_seq(&client, table, &r.columns).await?;
            println!(
                "ok   poll order on {}: column {} ({}), index on ({}, {}) ({})",
                table.pg_quoted(),
                r.columns.get(crate::outbox::Column::Seq),
                if change.column_added {
                    "added"
                } else {
                    "exists"
                },
                r.columns.get(crate::outbox::Column::CreatedAt),
                r.columns.get(crate::outbox::Column::Seq),
                if change.index_created {
                    "created"
                } else {
                    "exists"
                },
            );
        }
        return Ok(());
    }
    admin::require_logical(&client).await?;
    // What another role must do first is found before anything is created, all of it.
    let blocked = blockers(&client, &r).await?;
    if !blocked.is_empty() {
        for l in &blocked {
            println!("{l}");
        }
        return Err(Error::config(
            format!(
                "setup cannot finish as this role: {} step{} above need{} the table's owner or a DBA; nothing was created",
                blocked.len(),
                if blocked.len() == 1 { "" } else { "s" },
                if blocked.len() == 1 { "s" } else { "" },
            ),
            "run each fix above as the role it names (docs/operations.md, \"Grants\"), then `outboxd setup` again",
        ));
    }
    crate::state::postgres::ensure_table(&client).await?;
    println!("ok   state table outboxd_state");
    let list = r
        .tables
        .iter()
        .map(TableName::pg_quoted)
        .collect::<Vec<_>>()
        .join(", ");
    match admin::ensure_publication(&client, &r.publication, &r.tables).await? {
        admin::PublicationChange::Created => {
            println!("ok   publication {} on {list} (created)", r.publication)
        }
        admin::PublicationChange::Exists => {
            println!("ok   publication {} on {list} (exists)", r.publication)
        }
        admin::PublicationChange::Added(added) => println!(
            "ok   publication {} on {list}: added {} — a running relay publishes their inserts committed from now on; rows already in them are not published (replay them with `outboxd offset set --replay-since` if needed)",
            r.publication,
            added.iter().map(TableName::pg_quoted).collect::<Vec<_>>().join(", ")
        ),
    }
    match admin::slot(&client, &r.slot).await? {
        Some(_) if args.failover_slot => {
            let failover = version::slot_details(&client, server, &r.slot)
                .await?
                .is_some_and(|d| d.failover);
            if !failover {
                return Err(Error::config(
                    format!("replication slot {} exists but is not a failover slot", r.slot),
                    format!(
                        "psql \"host={} port={} user={} dbname={} replication=database\" -c 'ALTER_REPLICATION_SLOT {} (FAILOVER true)'  (with the relay stopped)",
                        dsn.host, dsn.port, dsn.user, dsn.database,
                        r.slot
                    ),
                ));
            }
            println!("ok   replication slot {} (exists, failover)", r.slot)
        }
        Some(_) => println!("ok   replication slot {} (exists)", r.slot),
        None => {
            let state = crate::state::postgres::load(&client, &r.name).await?;
            if state.is_some_and(|s| s.initialized) {
                return Err(Error::PositionLost {
                    problem: format!(
                        "relay {:?} has state but its slot {:?} is gone",
                        r.name, r.slot
                    ),
                    fix: admin::lost_slot_fix(&r.name, &r.slot),
                });
            }
            admin::create_slot_as(&client, &r.slot, args.failover_slot).await?;
            println!(
                "ok   replication slot {} (created{})",
                r.slot,
                if args.failover_slot { ", failover" } else { "" }
            );
        }
    }
    Ok(())
}

/// The steps of a Postgres `setup` the session's role may not take, each as a failed check
/// line naming who can and what to run: creating (or completing) `outboxd_state`, creating
/// the publication or adding tables to it (only a table's owner can), creating the slot (the
/// REPLICATION attribute).
async fn blockers(
    client: &tokio_postgres::Client,
    r: &Resolved,
) -> Result<Vec<crate::diagnostics::CheckLine>, Error> {
    use crate::diagnostics::{line, Level};
    use crate::outbox::pg_ident;
    use crate::state::postgres::{gap, Gap};
    let mut out = Vec::new();
    let row = client
        .query_one(
            "SELECT current_user::text, coalesce(current_schema()::text, ''),
                    coalesce(has_schema_privilege(current_schema(), 'CREATE'), false),
                    (SELECT pg_get_userbyid(relowner)::text FROM pg_class
                      WHERE oid = to_regclass('outboxd_state') AND NOT pg_has_role(relowner, 'USAGE'))",
            &[],
        )
        .await?;
    let (user, schema, may_create, foreign_owner): (String, String, bool, Option<String>) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    match gap(client).await? {
        Some(Gap::Table) if !may_create => out.push(line(
            Level::Fail,
            "state table",
            format!("outboxd_state does not exist, and role {user} may not create tables in schema {schema:?}"),
            Some(format!(
                "GRANT CREATE ON SCHEMA {} TO {};  (as the schema's owner or a superuser)",
                pg_ident(&schema),
                pg_ident(&user)
            )),
        )),
        Some(gap @ Gap::Columns(_)) => {
            if let Some(owner) = foreign_owner {
                let Error::Config { problem, fix } = crate::state::postgres::gap_refused(
                    &gap,
                    &user,
                    &format!("it belongs to role {owner}"),
                ) else {
                    unreachable!("a configuration error")
                };
                out.push(line(Level::Fail, "state table", problem, Some(fix)));
            }
        }
        _ => {}
    }
    if let Some((refusal, statement)) =
        admin::publication_blocker(client, &r.publication, &r.tables).await?
    {
        let Error::Config { problem, fix } = refusal.into_error(&statement) else {
            unreachable!("a configuration error")
        };
        out.push(line(Level::Fail, "publication", problem, Some(fix)));
    }
    if admin::slot(client, &r.slot).await?.is_none() {
        let grant = pg::diagnostics::replication_grant(client).await?;
        if let (Level::Fail, detail, fix) = grant.judge() {
            out.push(line(
                Level::Fail,
                "replication slot",
                format!("{} cannot be created: {detail}", r.slot),
                fix,
            ));
        }
    }
    Ok(out)
}

pub(super) async fn teardown(args: TeardownArgs, m: &ArgMatches) -> Result<(), Error> {
    let r = resolve_source(&args.source, m)?;
    let dsn = match r.source.clone() {
        SourceDsn::Postgres(dsn) => dsn,
        SourceDsn::Mysql(dsn) => return teardown_mysql(dsn, &r, args.yes).await,
        SourceDsn::File(_) => {
            return Err(Error::config(
                "a binlog-file source keeps no state",
                "nothing to tear down",
            ))
        }
    };
    if !args.yes {
        return Err(Error::config(
            format!(
                "teardown drops slot {}, publication {} and the stored position of relay {:?}",
                r.slot, r.publication, r.name
            ),
            "add --yes to confirm",
        ));
    }
    let client = pg::connect_sql(&dsn, "outboxd_teardown").await?;
    if let Some(state) = crate::state::postgres::load(&client, &r.name).await? {
        if state.lease_live {
            if let Some(h) = state
                .lease_holder
                .filter(|h| !crate::state::holder_is_dead_locally(h))
            {
                return Err(Error::config(
                    format!("relay {:?} is running (lease held by {h})", r.name),
                    "stop it first",
                ));
            }
        }
    }
    // Only the publication's owner can drop it: refused before anything is dropped.
    if let Some(owner) = admin::publication_foreign_owner(&client, &r.publication).await? {
        return Err(Error::config(
            format!(
                "publication {} belongs to role {owner}, and only its owner can drop it",
                r.publication
            ),
            format!(
                "as role {owner} (or a superuser): DROP PUBLICATION {};  then `outboxd teardown` again",
                crate::outbox::pg_ident(&r.publication)
            ),
        ));
    }
    let dropped = admin::drop_slot(&client, &r.slot).await?;
    println!(
        "ok   replication slot {} ({})",
        r.slot,
        if dropped { "dropped" } else { "absent" }
    );
    admin::drop_publication(&client, &r.publication).await?;
    println!("ok   publication {} (dropped)", r.publication);
    let n = crate::state::postgres::delete(&client, &r.name).await?;
    println!(
        "ok   state of {} ({} row{})",
        r.name,
        n,
        if n == 1 { "" } else { "s" }
    );
    Ok(())
}

/// `setup` for MySQL/MariaDB: the binlog settings and the table are checked, the state table
/// created. (There is no slot or publication: the binlog is read from a position.)
async fn setup_mysql(dsn: dsn::DbDsn, r: &Resolved, args: &SetupArgs) -> Result<(), Error> {
    use crate::source::mysql::{self as my, admin as my_admin};
    if args.notify {
        return Err(Error::config(
            "--notify installs a Postgres LISTEN/NOTIFY trigger; MySQL has none",
            "drop --notify",
        ));
    }
    let mut conn = my::connect_sql(&dsn).await?;
    let tables =
        crate::source::mysql::log::outbox_tables(&dsn, &r.tables, &r.columns, Default::default())?;
    if args.create_table {
        for table in &tables {
            let created = my_admin::create_outbox_table(&mut conn, table).await?;
            println!(
                "ok   outbox table {} ({})",
                table.quoted(),
                if created { "created" } else { "exists" }
            );
        }
    }
    if args.mode == Mode::Poll {
        // No binlog and no state: poll mode needs only the table.
        for table in &tables {
            my_admin::require_table(&mut conn, table).await?;
            println!("ok   outbox table {}", table.quoted());
        }
        return Ok(());
    }
    let settings = my_admin::require_binlog(&mut conn).await?;
    println!(
        "ok   binlog: log_bin=ON binlog_format=ROW binlog_row_image=FULL binlog_row_metadata=FULL ({})",
        settings.version
    );
    for table in &tables {
        my_admin::require_table(&mut conn, table).await?;
        println!("ok   outbox table {}", table.quoted());
    }
    crate::state::mysql::ensure_table(&mut conn).await?;
    println!("ok   state table outboxd_state");
    Ok(())
}

/// `teardown` for MySQL/MariaDB: the relay's state row (its stored position) goes.
async fn teardown_mysql(dsn: dsn::DbDsn, r: &Resolved, yes: bool) -> Result<(), Error> {
    if !yes {
        return Err(Error::config(
            format!("teardown drops the stored position of relay {:?}", r.name),
            "add --yes to confirm",
        ));
    }
    let mut conn = crate::db::mysql::connect_sql(&dsn).await?;
    if let Some(state) = crate::state::mysql::load(&mut conn, &r.name).await? {
        if state.lease_live {
            if let Some(h) = state
                .lease_holder
                .filter(|h| !crate::state::holder_is_dead_locally(h))
            {
                return Err(Error::config(
                    format!("relay {:?} is running (lease held by {h})", r.name),
                    "stop it first",
                ));
            }
        }
    }
    let n = crate::state::mysql::delete(&mut conn, &r.name).await?;
    println!(
        "ok   state of {} ({} row{})",
        r.name,
        n,
        if n == 1 { "" } else { "s" }
    );
    Ok(())
}
