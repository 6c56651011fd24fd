//! Least privilege, as docs/operations.md ("Grants") writes it: the page's own SQL, with names
//! unique to the test, makes the setup, run and consumer roles (users on MariaDB); then each
//! command runs as the role the page gives it: `setup` (refusing first, with the owner's
//! statement, what only the table's owner can do), `check` (each missing grant named with
//! its `GRANT`), `run` into RabbitMQ, the example consumer, `status`, `prune` of the inbox
//! and of the outbox, and a start on a state table an older version made (refused with the
//! fix; `setup` completes it). The roles are dropped at the end.

use crate::common::amqp::{self, Topology};
use crate::common::*;
use crate::consumer_support::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(90);
const EVENTS: usize = 20;

/// The SQL of docs/operations.md's block marked `<!-- sql: NAME -->`.
fn doc_sql(name: &str) -> String {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
        .unwrap();
    let marker = format!("<!-- sql: {name} -->\n```sql\n");
    let start = page
        .find(&marker)
        .unwrap_or_else(|| panic!("docs/operations.md has no block {marker:?}"))
        + marker.len();
    let len = page[start..].find("```").unwrap();
    page[start..start + len].to_string()
}

/// The test's names for the page's roles and relay.
struct Names {
    setup: String,
    run: String,
    consumer: String,
    relay: String,
}

impl Names {
    fn new() -> Names {
        Names {
            setup: unique("pv_setup"),
            run: unique("pv_run"),
            consumer: unique("pv_consumer"),
            relay: unique("billing"),
        }
    }

    /// The page's SQL with the test's names: roles, relay name, database (MariaDB), and no
    /// passwords (the local servers trust loopback).
    fn apply(&self, sql: &str, database: &str) -> String {
        sql.replace("outboxd_setup", &self.setup)
            .replace("outboxd_run", &self.run)
            .replace("orders_consumer", &self.consumer)
            .replace("outboxd_billing", &format!("outboxd_{}", self.relay))
            .replace(" PASSWORD '…'", "")
            .replace(" IDENTIFIED BY '…'", "")
            .replace(" app.", &format!(" `{database}`."))
    }

    fn all(&self) -> [&str; 3] {
        [&self.setup, &self.run, &self.consumer]
    }
}

/// Runs the outboxd binary to its exit: (exit code, stdout, stderr).
async fn outboxd(args: &[&str]) -> (i32, String, String) {
    let mut p = Relay::start(args);
    let code = p.wait_exit(T).await;
    (code, p.lines().join("\n"), p.stderr_plain())
}

/// [`outboxd`], asserting the exit code.
async fn expect(code: i32, args: &[&str]) -> (String, String) {
    let (got, out, err) = outboxd(args).await;
    assert_eq!(got, code, "{args:?}:\n{out}\n{err}");
    (out, err)
}

fn relay_as(source: &str, name: &str, exchange: &str) -> Proc {
    Proc::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_outboxd")),
        &[
            "run",
            "--source",
            source,
            "--name",
            name,
            "--exchange",
            exchange,
            "--log-level",
            "info,lapin=warn",
        ],
        &[("OUTBOXD_SINK", &amqp::url())],
    )
}

/// An invoice event: (aggregate id, a number as MariaDB's outbox wants it; topic; body).
fn invoice(i: usize) -> (String, &'static str, serde_json::Value) {
    let customer = i % 5;
    let body = serde_json::json!({"invoice_id": i, "customer": format!("cust-{customer}"), "total_cents": 100 + i});
    (customer.to_string(), "invoice.issued", body)
}

/// The roles, dropped at the end (with what they own and were granted in the database).
struct PgRoles {
    port: u16,
    database: String,
    names: Vec<String>,
}

impl Drop for PgRoles {
    fn drop(&mut self) {
        let (port, database, names) = (self.port, self.database.clone(), self.names.clone());
        run_detached(async move {
            let conninfo = format!("host=127.0.0.1 port={port} user=postgres dbname={database}");
            if let Ok((c, conn)) = tokio_postgres::connect(&conninfo, tokio_postgres::NoTls).await {
                tokio::spawn(conn);
                for n in &names {
                    let _ = c.batch_execute(&format!("DROP OWNED BY {n} CASCADE")).await;
                }
            }
            let Ok((c, conn)) =
                tokio_postgres::connect(&pg_admin(port), tokio_postgres::NoTls).await
            else {
                return;
            };
            tokio::spawn(conn);
            for n in &names {
                let _ = c.batch_execute(&format!("DROP ROLE IF EXISTS {n}")).await;
            }
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_roles_as_documented_run_every_command() {
    let db = PgDb::create("priv").await;
    let names = Names::new();
    let _roles = PgRoles {
        port: db.port,
        database: db.name.clone(),
        names: names.all().map(str::to_string).to_vec(),
    };
    let admin = db.client().await;
    // The inbox and the projection come from the migrations, run by their own role.
    setup_projection(&db.dsn()).await;
    admin
        .batch_execute(&names.apply(&doc_sql("postgres-roles"), &db.name))
        .await
        .unwrap();
    admin
        .batch_execute(&format!(
            "GRANT SELECT, INSERT, UPDATE ON invoice_totals, invoice_ledger TO {}",
            names.consumer
        ))
        .await
        .unwrap();
    let dsn = |role: &str| format!("postgres://{role}@127.0.0.1:{}/{}", db.port, db.name);
    let (setup, run, consumer) = (dsn(&names.setup), dsn(&names.run), dsn(&names.consumer));
    let name = names.relay.as_str();
    let slot = format!("outboxd_{name}");

    // setup: only the table's owner can make the publication; refused first, with its
    // statement, and nothing is created.
    let (out, err) = expect(2, &["setup", "--source", &setup, "--name", name]).await;
    assert!(
        out.contains("FAIL publication")
            && out.contains("role postgres (the owner")
            && out.contains(&format!("CREATE PUBLICATION \"outboxd_{name}\"")),
        "{out}\n{err}"
    );
    assert!(err.contains("nothing was created"), "{err}");
    let count = |sql: &'static str| {
        let admin = &admin;
        async move { admin.query_one(sql, &[]).await.unwrap().get::<_, i64>(0) }
    };
    assert_eq!(
        count("SELECT count(*) FROM pg_class WHERE relname = 'outboxd_state'").await,
        0
    );
    assert!(db.slot_confirmed(&slot).await.is_none());
    admin
        .batch_execute(&names.apply(&doc_sql("postgres-publication"), &db.name))
        .await
        .unwrap();
    let (out, _) = expect(0, &["setup", "--source", &setup, "--name", name]).await;
    for line in [
        "ok   state table outboxd_state".to_string(),
        format!("ok   publication outboxd_{name} on \"public\".\"outbox\" (exists)"),
        format!("ok   replication slot {slot} (created)"),
    ] {
        assert!(out.contains(&line), "{line:?} in\n{out}");
    }

    // check: a role without the grants gets each one with its statement; the run role passes.
    let (out, _) = expect(1, &["check", "--source", &consumer, "--name", name]).await;
    let c = &names.consumer;
    for fix in [
        format!("ALTER ROLE \"{c}\" WITH REPLICATION;"),
        format!("GRANT SELECT ON \"public\".\"outbox\" TO \"{c}\";"),
        format!("GRANT SELECT, INSERT, UPDATE ON outboxd_state TO \"{c}\";"),
    ] {
        assert!(out.contains(&fix), "{fix:?} in\n{out}");
    }
    let (out, _) = expect(0, &["check", "--source", &run, "--name", name]).await;
    assert!(
        out.contains(&format!(
            "ok   state table: role {} may read and write outboxd_state",
            names.run
        )),
        "{out}"
    );

    // run as the run role into RabbitMQ; the example consumer as the consumer role.
    let mut topo = Topology::new("xpriv").await;
    let mut relay = relay_as(&run, name, &topo.exchange);
    topo.wait_declared(T).await;
    let queue = topo.bind_queue("invoices", "invoice.#").await;
    let mut writer = db.client().await;
    let outbox = outboxd::Outbox::new("outbox").unwrap();
    let mut tx = writer.transaction().await.unwrap();
    for i in 0..EVENTS {
        let (customer, topic, body) = invoice(i);
        outbox
            .write(&mut tx, topic, &customer, &body)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let mut consuming = start_consumer(&consumer, &queue, "invoice_projection", &[]);
    wait_for("every event applied by the consumer role", T, || async {
        count("SELECT count(*) FROM processed_messages").await == EVENTS as i64
    })
    .await;
    stop(&mut consuming, T).await;
    assert_eq!(
        count("SELECT sum(invoices)::int8 FROM invoice_totals").await,
        EVENTS as i64
    );
    wait_for("the relay's stored position", T, || async {
        count("SELECT count(*) FROM outboxd_state WHERE position_lsn IS NOT NULL").await == 1
    })
    .await;
    let (out, _) = expect(0, &["status", "--source", &run, "--name", name]).await;
    let stored = out
        .lines()
        .find_map(|l| l.strip_prefix("stored position  "))
        .unwrap_or_default();
    assert!(
        outboxd::event::parse_lsn(stored).is_some(),
        "status shows the stored LSN: {out}"
    );
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());

    // prune: the consumer role its inbox, the run role the outbox.
    expect(
        0,
        &[
            "prune",
            "--source",
            &consumer,
            "--table",
            "processed_messages",
            "--older-than",
            "0s",
            "--force",
        ],
    )
    .await;
    assert_eq!(count("SELECT count(*) FROM processed_messages").await, 0);
    expect(
        0,
        &[
            "prune",
            "--source",
            &run,
            "--table",
            "outbox",
            "--older-than",
            "0s",
            "--force",
        ],
    )
    .await;
    assert_eq!(count("SELECT count(*) FROM outbox").await, 0);

    // A state table an older version made: the run role is refused with the fix, and setup
    // (its owner) completes it.
    admin
        .batch_execute("ALTER TABLE outboxd_state DROP COLUMN snapshot_key")
        .await
        .unwrap();
    let (_, err) = expect(
        2,
        &["run", "--source", &run, "--name", name, "--sink", "stdout"],
    )
    .await;
    assert!(
        err.contains("lacks the columns snapshot_key") && err.contains("outboxd setup"),
        "{err}"
    );
    expect(0, &["setup", "--source", &setup, "--name", name]).await;
    expect(0, &["check", "--source", &run, "--name", name]).await;

    // teardown by the setup role refuses the publication it does not own, before dropping
    // anything.
    let (_, err) = expect(
        2,
        &["teardown", "--source", &setup, "--name", name, "--yes"],
    )
    .await;
    assert!(
        err.contains(&format!("DROP PUBLICATION \"outboxd_{name}\"")),
        "{err}"
    );
    assert!(
        db.slot_confirmed(&slot).await.is_some(),
        "the slot is still there"
    );
}

/// The users, dropped at the end.
struct MyUsers(Vec<String>);

impl Drop for MyUsers {
    fn drop(&mut self) {
        let names = self.0.clone();
        run_detached(async move {
            use mysql_async::prelude::Queryable;
            let mut c = my_connect(None).await;
            for n in names {
                let _ = c.query_drop(format!("DROP USER IF EXISTS '{n}'@'%'")).await;
            }
            let _ = c.disconnect().await;
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_users_as_documented_run_every_command() {
    let my = MyDb::create("priv").await;
    let names = Names::new();
    let _users = MyUsers(names.all().map(str::to_string).to_vec());
    setup_projection(&my.dsn()).await;
    let mut admin = my.conn().await;
    my_exec(
        &mut admin,
        &names.apply(&doc_sql("mariadb-users"), &my.name),
    )
    .await;
    my_exec(
        &mut admin,
        &format!(
            "GRANT SELECT, INSERT, UPDATE ON `{0}`.invoice_totals TO '{1}'@'%';
             GRANT SELECT, INSERT, UPDATE ON `{0}`.invoice_ledger TO '{1}'@'%'",
            my.name, names.consumer
        ),
    )
    .await;
    let dsn = |user: &str| format!("mysql://{user}@127.0.0.1:{MY_PORT}/{}", my.name);
    let (setup, run, consumer) = (dsn(&names.setup), dsn(&names.run), dsn(&names.consumer));
    let name = names.relay.as_str();
    let state_grant = |user: &str| {
        format!(
            "GRANT SELECT, INSERT, UPDATE ON `{}`.outboxd_state TO '{user}'@'%';",
            my.name
        )
    };

    let (out, _) = expect(0, &["setup", "--source", &setup, "--name", name]).await;
    assert!(out.contains("ok   state table outboxd_state"), "{out}");
    // Before the grant the page gives after setup: check says which, run refuses with it.
    let (out, _) = expect(0, &["check", "--source", &run, "--name", name]).await;
    assert!(out.contains(&state_grant(&names.run)), "{out}");
    let (_, err) = expect(
        2,
        &["run", "--source", &run, "--name", name, "--sink", "stdout"],
    )
    .await;
    assert!(err.contains(&state_grant(&names.run)), "{err}");
    my_exec(
        &mut admin,
        &names.apply(&doc_sql("mariadb-after-setup"), &my.name),
    )
    .await;

    let (out, _) = expect(1, &["check", "--source", &consumer, "--name", name]).await;
    let c = &names.consumer;
    for fix in [
        format!("GRANT REPLICATION SLAVE, BINLOG MONITOR ON *.* TO '{c}'@'%';"),
        format!("GRANT SELECT ON `{}`.`outbox` TO '{c}'@'%'", my.name),
        state_grant(c),
    ] {
        assert!(out.contains(&fix), "{fix:?} in\n{out}");
    }
    let (out, _) = expect(0, &["check", "--source", &run, "--name", name]).await;
    assert!(
        out.contains(&format!(
            "ok   state table: user '{}'@'%' may read and write outboxd_state",
            names.run
        )),
        "{out}"
    );

    let mut topo = Topology::new("xpriv").await;
    let mut relay = relay_as(&run, name, &topo.exchange);
    topo.wait_declared(T).await;
    let queue = topo.bind_queue("invoices", "invoice.#").await;
    {
        let outbox = outboxd::Outbox::new("outbox").unwrap();
        let mut w = my.conn().await;
        let mut tx = w
            .start_transaction(mysql_async::TxOpts::default())
            .await
            .unwrap();
        for i in 0..EVENTS {
            let (customer, topic, body) = invoice(i);
            outbox
                .write(&mut tx, topic, &customer, &body)
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
    }
    let mut consuming = start_consumer(&consumer, &queue, "invoice_projection", &[]);
    let value = |sql: &'static str| {
        let my = &my;
        async move {
            let mut c = my.conn().await;
            my_value(&mut c, sql).await.unwrap_or_default()
        }
    };
    let events = EVENTS.to_string();
    wait_for("every event applied by the consumer user", T, || async {
        value("SELECT COUNT(*) FROM processed_messages").await == events
    })
    .await;
    stop(&mut consuming, T).await;
    assert_eq!(
        value("SELECT SUM(invoices) FROM invoice_totals").await,
        events
    );
    wait_for("the relay's stored position", T, || async {
        my.stored(name).await.is_some()
    })
    .await;
    let (out, _) = expect(0, &["status", "--source", &run, "--name", name]).await;
    assert!(
        out.contains("stored position  mariadb-bin") || out.contains("stored position  mysql-bin"),
        "{out}"
    );
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());

    expect(
        0,
        &[
            "prune",
            "--source",
            &consumer,
            "--table",
            "processed_messages",
            "--older-than",
            "0s",
            "--force",
        ],
    )
    .await;
    assert_eq!(value("SELECT COUNT(*) FROM processed_messages").await, "0");
    expect(
        0,
        &[
            "prune",
            "--source",
            &run,
            "--table",
            "outbox",
            "--older-than",
            "0s",
            "--force",
        ],
    )
    .await;
    assert_eq!(value("SELECT COUNT(*) FROM outbox").await, "0");

    my_exec(
        &mut admin,
        "ALTER TABLE outboxd_state DROP COLUMN snapshot_key",
    )
    .await;
    let (_, err) = expect(
        2,
        &["run", "--source", &run, "--name", name, "--sink", "stdout"],
    )
    .await;
    assert!(
        err.contains("lacks the columns snapshot_key") && err.contains("outboxd setup"),
        "{err}"
    );
    expect(0, &["setup", "--source", &setup, "--name", name]).await;
    expect(0, &["check", "--source", &run, "--name", name]).await;
    let (out, _) = expect(
        0,
        &["teardown", "--source", &setup, "--name", name, "--yes"],
    )
    .await;
    assert!(
        out.contains(&format!("ok   state of {name} (1 row)")),
        "{out}"
    );
}
