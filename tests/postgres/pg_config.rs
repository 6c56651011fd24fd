//! What users configure: variant outbox tables (renamed columns, bigint/uuid aggregate ids,
//! jsonb, headers and version), bad input with a clear error and the contract's exit codes,
//! and secrets that never reach the logs.

use crate::common;

use common::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renamed_columns_bigint_ids_jsonb_headers_and_version() {
    let db = PgDb::create("variant").await;
    let client = db.client().await;
    client
        .batch_execute(&format!(
            "CREATE TABLE app_events (
                event_id uuid PRIMARY KEY, aggregateid bigint NOT NULL, event_type text NOT NULL,
                body jsonb NOT NULL, occurred_at timestamptz NOT NULL, headers json, version int);
             -- The server's time zone must not matter.
             ALTER DATABASE {} SET timezone TO 'Asia/Kolkata';",
            db.name
        ))
        .await
        .unwrap();
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let dsn = db.dsn();
    let columns =
        "id=event_id,aggregate_id=aggregateid,topic=event_type,payload=body,created_at=occurred_at";
    let mut relay = Relay::start(&[
        "run",
        "--source",
        &dsn,
        "--name",
        &name,
        "--commit-offsets",
        "--table",
        "public.app_events",
        "--column",
        columns,
    ]);
    wait_for("slot active", T, || db.slot_active(&slot)).await;

    let mut client = db.client().await;
    let outbox = outboxd::Outbox::new("app_events")
        .unwrap()
        .with_columns(outboxd::ColumnMap::parse(&[columns.to_string()]).unwrap());
    let mut tx = client.transaction().await.unwrap();
    let headers = serde_json::json!({"tenant": "acme"});
    let payload = serde_json::json!({"b": 1, "a": [true, null]});
    let id_min = outbox
        .write_event(
            &mut tx,
            &outboxd::NewEvent {
                topic: "order.created",
                aggregate_id: &i64::MIN.to_string(),
                payload: &payload,
                headers: Some(&headers),
                version: Some(7),
            },
        )
        .await
        .unwrap();
    let id_max = outbox
        .write(&mut tx, "order.created", &i64::MAX.to_string(), &payload)
        .await
        .unwrap();
    assert!(
        outbox
            .write(&mut tx, "x", "not-a-number", &payload)
            .await
            .is_err(),
        "a bigint column refuses text ids"
    );
    tx.rollback().await.unwrap();
    let mut tx = client.transaction().await.unwrap();
    let id_min2 = outbox
        .write_event(
            &mut tx,
            &outboxd::NewEvent {
                topic: "order.created",
                aggregate_id: &i64::MIN.to_string(),
                payload: &payload,
                headers: Some(&headers),
                version: Some(7),
            },
        )
        .await
        .unwrap();
    let id_max2 = outbox
        .write(&mut tx, "order.created", &i64::MAX.to_string(), &payload)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_ne!(id_min, id_min2);
    let _ = id_max;

    wait_for("2 lines", T, || {
        let n = relay.line_count();
        async move { n >= 2 }
    })
    .await;
    let lines = parse_lines(&relay.lines());
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["id"], id_min2.to_string());
    assert_eq!(lines[0]["aggregate_id"], i64::MIN.to_string());
    assert_eq!(lines[1]["id"], id_max2.to_string());
    assert_eq!(lines[1]["aggregate_id"], i64::MAX.to_string());
    assert_eq!(lines[0]["payload"], payload);
    let created: String = client
        .query_one(
            "SELECT to_char(occurred_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') FROM app_events WHERE event_id = $1",
            &[&id_min2],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        lines[0]["created_at"], created,
        "UTC whatever the server's zone"
    );
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_mapped_column_stops_the_relay_with_the_fix() {
    let db = PgDb::create("dropcol").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let dsn = db.dsn();
    let mut relay = Relay::start(&["run", "--source", &dsn, "--name", &name, "--commit-offsets"]);
    wait_for("slot active", T, || db.slot_active(&slot)).await;
    let client = db.client().await;
    client
        .batch_execute(
            "ALTER TABLE outbox DROP COLUMN topic;
             INSERT INTO outbox (id, aggregate_id, payload) VALUES (gen_random_uuid(), 'a', '{}');",
        )
        .await
        .unwrap();
    let code = relay.wait_exit(T).await;
    let err = relay.stderr();
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("no column \"topic\"") && err.contains("fix:"),
        "{err}"
    );
    assert_eq!(relay.line_count(), 0, "never half a row");
}

/// A mapped column retyped to one the contract cannot read (`created_at` as text): the relay
/// stops with exit 2 and the fix at the first row of the new shape, publishes nothing of it,
/// and its stored position stays before that row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retyped_mapped_column_stops_the_relay_with_the_fix() {
    let db = PgDb::create("retype").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let dsn = db.dsn();
    let mut relay = Relay::start(&["run", "--source", &dsn, "--name", &name, "--commit-offsets"]);
    wait_for("slot active", T, || db.slot_active(&slot)).await;
    let mut client = db.client().await;
    let before = write_events(&mut client, 1, 2, "before.retype").await;
    wait_for("2 lines", T, || {
        let n = relay.line_count();
        async move { n >= 2 }
    })
    .await;
    client
        .batch_execute(
            "ALTER TABLE outbox ALTER COLUMN created_at TYPE text USING created_at::text;
             INSERT INTO outbox (id, aggregate_id, topic, payload, created_at)
             VALUES (gen_random_uuid(), 'a', 'after.retype', '{}', 'yesterday-ish');",
        )
        .await
        .unwrap();
    let code = relay.wait_exit(T).await;
    let err = relay.stderr();
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("created_at") && err.contains("fix:"), "{err}");
    assert_eq!(ids_of(&relay.lines()), before, "nothing of the retyped row");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_a_clear_error_with_the_contracts_exit_code() {
    let db = PgDb::create("badin").await;
    let dsn = db.dsn();
    let cases: Vec<(Vec<&str>, i32, &str)> = vec![
        (
            vec!["run", "--source", &dsn, "--name", "Bad-Name"],
            2,
            "--name",
        ),
        (
            vec!["run", "--source", "redis://x", "--name", "x"],
            2,
            "unsupported source scheme",
        ),
        (
            vec![
                "run", "--source", &dsn, "--name", "nosuch", "--table", "nosuch",
            ],
            2,
            "does not exist",
        ),
        (
            vec!["run", "--source", &dsn, "--column", "bogus=x"],
            2,
            "unknown column",
        ),
        (
            vec!["run", "--source", &dsn, "--sink", "redis://x"],
            2,
            "unsupported sink scheme",
        ),
        (
            vec!["run", "--source", &dsn, "--confirm-timeout", "5 parsecs"],
            2,
            "unknown unit",
        ),
        (vec!["run"], 2, "no source given"),
        (vec!["frobnicate"], 2, "unrecognized subcommand"),
        (
            vec!["teardown", "--source", &dsn, "--name", "x"],
            2,
            "--yes",
        ),
    ];
    for (args, code, needle) in cases {
        let mut r = Relay::start(&args);
        let got = r.wait_exit(T).await;
        let err = r.stderr();
        assert_eq!(got, code, "{args:?}: {err}");
        assert!(
            err.contains(needle),
            "{args:?} should say {needle:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_never_reach_logs_or_help() {
    let db = PgDb::create("secret").await;
    let secret = "s3cr3t-Pw-77";
    // Trust auth accepts any password: the relay runs, and must warn about argv.
    let dsn = format!("postgres://postgres:{secret}@127.0.0.1:5432/{}", db.name);
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let mut relay = Relay::start(&[
        "run",
        "--source",
        &dsn,
        "--name",
        &name,
        "--log-level",
        "debug",
    ]);
    wait_for("slot active", T, || db.slot_active(&slot)).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0);
    let err = relay.stderr();
    assert!(
        err.contains("carries a password"),
        "argv password warned about: {err}"
    );
    assert!(!err.contains(secret), "password leaked into the log");

    // An error path with the password in the environment and a missing table.
    let mut failing = Relay::start_with_env(
        &["run", "--name", "x", "--table", "missing_table"],
        &[("OUTBOXD_SOURCE", &dsn)],
    );
    assert_eq!(failing.wait_exit(T).await, 2);
    let err = failing.stderr();
    assert!(
        !err.contains(secret) && !err.contains("carries a password"),
        "{err}"
    );

    // --source-file with only the password, and --help with the DSN in the environment.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pw");
    std::fs::write(&file, format!("{secret}\n")).unwrap();
    // 0600: a looser file is refused before the DSN is used at all.
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let mut from_file = Relay::start(&[
        "run",
        "--source",
        &format!("postgres://postgres@127.0.0.1:5432/{}", db.name),
        "--source-file",
        file.to_str().unwrap(),
        "--name",
        "y",
        "--table",
        "missing_table",
    ]);
    assert_eq!(from_file.wait_exit(T).await, 2);
    let err = from_file.stderr();
    assert!(
        err.contains("missing_table") && !err.contains("permissions"),
        "the file was read and the DSN used: {err}"
    );
    assert!(!err.contains(secret));
    let mut help = Relay::start_with_env(&["run", "--help"], &[("OUTBOXD_SOURCE", &dsn)]);
    assert_eq!(help.wait_exit(T).await, 0);
    let out = help.lines().join("\n");
    assert!(out.contains("--source") && !out.contains(secret), "{out}");
}

/// Every form a password could take in a log line: the text, percent-encoded, and the byte
/// list a `Debug` of raw bytes prints (how an AMQP frame dump shows the SASL PLAIN response).
fn leaked_forms(secret: &str) -> Vec<String> {
    let bytes = |sep: &str| {
        secret
            .bytes()
            .map(|b| b.to_string())
            .collect::<Vec<_>>()
            .join(sep)
    };
    vec![
        secret.to_string(),
        percent_encoding::utf8_percent_encode(secret, percent_encoding::NON_ALPHANUMERIC)
            .to_string(),
        bytes(", "),
        bytes(","),
        secret.bytes().map(|b| format!("{b:02x}")).collect(),
    ]
}

#[track_caller]
fn assert_no_secret(what: &str, text: &str, secrets: &[&str]) {
    for s in secrets {
        for form in leaked_forms(s) {
            assert!(
                !text.contains(&form),
                "{what}: the password appears (as {form:?}) in:\n{text}"
            );
        }
    }
}

/// `--log-level trace`, the most the log can say, over a whole run against a broker user with
/// a password of the test's own: connecting to Postgres and RabbitMQ, publishing, stopping;
/// then a sink that is not there (connection retries) and a wrong broker password (the login
/// refused), `outboxd check`, and `--help`. No line holds either password in any encoding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_logging_never_prints_a_password() {
    const PG_SECRET: &str = "Sup3r-S3cret-pw-7a1f";
    const AMQP_SECRET: &str = "Amqp-S3cret-pw-9c2e";
    const WRONG_SECRET: &str = "Wr0ng-S3cret-pw-4d6b";
    let secrets = [PG_SECRET, AMQP_SECRET, WRONG_SECRET];
    let db = PgDb::create("tracepw").await;
    let user = amqp::TempUser::create("tracepw", AMQP_SECRET);
    let mut topo = amqp::Topology::new("xtracepw").await;
    // Trust authentication ignores the password, but the DSN carries it through every
    // connection's configuration.
    let source = format!("postgres://postgres:{PG_SECRET}@127.0.0.1:5432/{}", db.name);
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let exchange = topo.exchange.clone();
    let run = |sink: &str| {
        Relay::start_with_env(
            &[
                "run",
                "--name",
                &name,
                "--exchange",
                &exchange,
                "--log-level",
                "trace",
            ],
            &[("OUTBOXD_SOURCE", &source), ("OUTBOXD_SINK", sink)],
        )
    };

    // A whole run: connect, declare, publish, confirm, stop.
    let mut relay = run(&user.url(5672));
    wait_for("the relay's slot to be active", T, || db.slot_active(&slot)).await;
    topo.wait_declared(T).await;
    let q = topo.bind_queue("all", "#").await;
    let mut client = db.client().await;
    let written = write_events(&mut client, 1, 3, "trace.pw").await;
    wait_for("the events in the queue", T, || async {
        topo.queue_len(&q).await as usize >= written.len()
    })
    .await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());
    let err = relay.stderr_plain();
    assert!(
        err.contains(" TRACE ") && err.contains("tokio_postgres"),
        "trace-level output was written:\n{err}"
    );
    assert!(
        err.contains(" DEBUG lapin"),
        "the AMQP client's debug lines still are"
    );
    assert_no_secret("outboxd run", &err, &secrets);

    // Nothing listens on the sink's port: the relay retries, logging each failure.
    let closed = free_local_port();
    let mut relay = run(&format!(
        "amqp://{}:{WRONG_SECRET}@127.0.0.1:{closed}/%2f",
        user.name
    ));
    wait_for("two sink failures logged", T, || {
        let n = relay.stderr_plain().matches("sink unavailable").count();
        async move { n >= 2 }
    })
    .await;
    // SIGKILL: only what it printed matters here (and while it waits to reconnect it stops on
    // SIGTERM only at the shutdown timeout).
    relay.sigkill();
    assert_no_secret(
        "outboxd run, sink unreachable",
        &relay.stderr_plain(),
        &secrets,
    );

    // The wrong password: the broker refuses the login, a configuration error.
    let mut relay = run(&format!(
        "amqp://{}:{WRONG_SECRET}@127.0.0.1:5672/%2f",
        user.name
    ));
    assert_eq!(relay.wait_exit(T).await, 2, "stderr:\n{}", relay.stderr());
    let err = relay.stderr_plain();
    assert!(err.contains("refused the login"), "{err}");
    assert_no_secret("outboxd run, login refused", &err, &secrets);

    // The preflight, with both connections tried.
    let mut check = Relay::start_with_env(
        &[
            "check",
            "--name",
            &name,
            "--exchange",
            &exchange,
            "--log-level",
            "trace",
        ],
        &[
            ("OUTBOXD_SOURCE", &source),
            ("OUTBOXD_SINK", &user.url(5672)),
        ],
    );
    let code = check.wait_exit(T).await;
    let out = format!("{}\n{}", check.lines().join("\n"), check.stderr_plain());
    assert!(code == 0 || code == 1, "check ran: {code}\n{out}");
    assert!(
        out.contains(" TRACE "),
        "trace-level output was written:\n{out}"
    );
    assert_no_secret("outboxd check", &out, &secrets);

    // --help prints the environment's values nowhere.
    for args in [
        vec!["--help"],
        vec!["run", "--help"],
        vec!["check", "--help"],
    ] {
        let mut help = Relay::start_with_env(
            &args,
            &[
                ("OUTBOXD_SOURCE", &source),
                ("OUTBOXD_SINK", &user.url(5672)),
            ],
        );
        assert_eq!(help.wait_exit(T).await, 0);
        let out = format!("{}\n{}", help.lines().join("\n"), help.stderr());
        assert!(out.contains("Usage"), "{out}");
        assert_no_secret(&format!("outboxd {args:?}"), &out, &secrets);
    }
}

/// A secret file of its own in `dir`, with `mode`.
fn secret_file(dir: &std::path::Path, name: &str, text: &str, mode: u32) -> String {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    path.to_str().unwrap().to_string()
}

/// Whether the relay created its slot (it does so first thing once its configuration is read).
async fn slot_exists(slot: &str) -> bool {
    pg_connect(PG_ADMIN)
        .await
        .query_opt(
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .is_some()
}

/// `--source-file`, `--sink-file`, `--keystore-file` and `--sink-key` refuse a file other
/// users may read (0644, 0640, 0604) before anything starts: exit status 2, the file's mode
/// and the exact `chmod 600` fix, no slot, nothing on stdout, and the secret never printed.
/// The same files at 0600 are read and used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loose_secret_files_are_refused_with_the_fix() {
    const SECRET: &str = "F1le-S3cret-pw-3e8d";
    let db = PgDb::create("secfile").await;
    let dir = tempfile::tempdir().unwrap();
    let dsn_with_secret = format!("postgres://postgres:{SECRET}@127.0.0.1:5432/{}", db.name);
    let plain_dsn = db.dsn();
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let exchange = unique("xsecfile");
    let client_key = "/etc/rabbitmq/outboxd-tls/client.key";
    let key_text = std::fs::read_to_string(client_key)
        .unwrap_or_else(|e| panic!("{client_key}: {e}: run `sudo scripts/services.sh`"));

    // (flag, what the file holds, the rest of the command line)
    type Case<'a> = (&'a str, String, Vec<&'a str>);
    let cases: Vec<Case> = vec![
        (
            "--source-file",
            format!("{dsn_with_secret}\n"),
            vec!["run", "--name", &name],
        ),
        (
            "--source-file",
            format!("{SECRET}\n"),
            vec!["check", "--source", &plain_dsn, "--name", &name],
        ),
        (
            "--sink-file",
            format!("{SECRET}\n"),
            vec![
                "run",
                "--source",
                &plain_dsn,
                "--name",
                &name,
                "--sink",
                "amqp://guest@127.0.0.1:5672/%2f",
                "--exchange",
                &exchange,
            ],
        ),
        (
            "--keystore-file",
            format!("{dsn_with_secret}\n"),
            vec!["keys", "forget", "--aggregate", "agg-1", "--yes"],
        ),
        (
            "--sink-key",
            key_text.clone(),
            vec![
                "run",
                "--source",
                &plain_dsn,
                "--name",
                &name,
                "--sink",
                "amqps://guest:guest@127.0.0.1:5671/%2f",
                "--sink-ca",
                "/etc/rabbitmq/outboxd-tls/ca.pem",
                "--sink-cert",
                "/etc/rabbitmq/outboxd-tls/client.pem",
                "--exchange",
                &exchange,
            ],
        ),
        (
            "--sink-key",
            key_text.clone(),
            vec![
                "run",
                "--source",
                &plain_dsn,
                "--name",
                &name,
                "--sink",
                "tls://127.0.0.1:4222",
                "--sink-cert",
                "/etc/rabbitmq/outboxd-tls/client.pem",
                "--stream",
                "SECFILE",
                "--subject",
                "secfile.{topic}",
            ],
        ),
    ];
    for (i, (flag, text, args)) in cases.iter().enumerate() {
        for mode in [0o644, 0o640, 0o604] {
            let path = secret_file(dir.path(), &format!("loose-{i}-{mode:o}"), text, mode);
            let mut argv = args.clone();
            argv.extend([*flag, path.as_str()]);
            let mut r = Relay::start(&argv);
            assert_eq!(r.wait_exit(T).await, 2, "{argv:?}: {}", r.stderr());
            let err = r.stderr();
            assert!(
                err.contains(&format!(
                    "{path} has group or other permissions (mode 0{mode:o})"
                )),
                "{argv:?} names the file and its mode: {err}"
            );
            assert!(
                err.contains(&format!("fix: chmod 600 {path}")),
                "{argv:?} gives the fix: {err}"
            );
            assert!(!err.contains(SECRET), "{argv:?} printed the secret: {err}");
            assert!(r.lines().is_empty(), "{argv:?} printed: {:?}", r.lines());
            assert!(
                !slot_exists(&slot).await,
                "{argv:?} started: the slot exists"
            );
        }
    }

    // 0600: each file is read and used.
    let source = secret_file(dir.path(), "source", &format!("{dsn_with_secret}\n"), 0o600);
    let mut r = Relay::start(&["run", "--name", &name, "--source-file", &source]);
    wait_for("the relay started from --source-file", T, || {
        db.slot_active(&slot)
    })
    .await;
    r.signal("TERM");
    assert_eq!(r.wait_exit(T).await, 0, "{}", r.stderr());
    assert!(!r.stderr().contains(SECRET));

    let password = secret_file(dir.path(), "sink", "guest\n", 0o600);
    let mut topo = amqp::Topology::new("xsecfile").await;
    let mut r = Relay::start(&[
        "run",
        "--source",
        &plain_dsn,
        "--name",
        &name,
        "--sink",
        "amqp://guest@127.0.0.1:5672/%2f",
        "--sink-file",
        &password,
        "--exchange",
        &topo.exchange,
    ]);
    // The exchange is declared once the broker accepted the file's password.
    topo.wait_declared(T).await;
    let q = topo.bind_queue("all", "#").await;
    let mut client = db.client().await;
    let written = write_events(&mut client, 1, 2, "secret.file").await;
    wait_for(
        "the events published with the file's password",
        T,
        || async { topo.queue_len(&q).await as usize >= written.len() },
    )
    .await;
    r.signal("TERM");
    assert_eq!(r.wait_exit(T).await, 0, "{}", r.stderr());

    let key = secret_file(dir.path(), "client.key", &key_text, 0o600);
    let mut r = Relay::start(&[
        "run",
        "--source",
        &plain_dsn,
        "--name",
        &name,
        "--sink",
        "amqps://guest:guest@127.0.0.1:5671/%2f",
        "--sink-ca",
        "/etc/rabbitmq/outboxd-tls/ca.pem",
        "--sink-cert",
        "/etc/rabbitmq/outboxd-tls/client.pem",
        "--sink-key",
        &key,
        "--exchange",
        &topo.exchange,
    ]);
    let more = write_events(&mut client, 1, 2, "secret.key").await;
    wait_for(
        "the events published over TLS with the file's key",
        T,
        || async { topo.queue_len(&q).await as usize >= written.len() + more.len() },
    )
    .await;
    r.signal("TERM");
    assert_eq!(r.wait_exit(T).await, 0, "{}", r.stderr());

    let keystore = secret_file(
        dir.path(),
        "keystore",
        &format!("{dsn_with_secret}\n"),
        0o600,
    );
    let mut r = Relay::start(&[
        "keys",
        "forget",
        "--aggregate",
        "agg-1",
        "--yes",
        "--source",
        &plain_dsn,
        "--keystore-file",
        &keystore,
    ]);
    let code = r.wait_exit(T).await;
    let err = r.stderr();
    assert!(
        !err.contains("permissions") && !err.contains(SECRET),
        "the 0600 keystore file is read: {err}"
    );
    // The aggregate never had a data key: forget says so, which it can only know from the
    // keystore the file named.
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("has no live data key"), "{err}");
    let tables = client
        .query_one(
            "SELECT count(*) FROM pg_tables WHERE tablename = 'outboxd_data_keys'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0);
    assert_eq!(tables, 1, "forget reached the keystore database");
}
