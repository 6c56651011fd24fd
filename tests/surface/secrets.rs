//! No secret in any output: every form a connection string carries one in (a URL's password,
//! a NATS token URL, libpq keyword/value pairs, `password=`/`sslpassword=`/`passfile=` query
//! parameters, the sinks' URLs) fed to `config`, `check`, `status`, `setup`, `offset`, `prune`,
//! `keys forget` and `run`, through their success and error paths, at the debug log level;
//! stdout and stderr are searched for the secret.

use crate::common::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

/// Runs outboxd with `args` and `env` to its exit, or, with `until`, until stderr holds it
/// or it exits (then SIGTERM, and to its exit); returns stdout and stderr.
async fn output(args: &[String], env: &[(&str, &str)], until: Option<&str>) -> String {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut env = env.to_vec();
    env.push(("OUTBOXD_LOG_LEVEL", "debug"));
    let mut relay = Relay::start_with_env(&args, &env);
    if let Some(needle) = until {
        let deadline = std::time::Instant::now() + T;
        while !relay.stderr().contains(needle) && relay.child.try_wait().unwrap().is_none() {
            assert!(
                std::time::Instant::now() < deadline,
                "{args:?}: no {needle:?} within {T:?}:\n{}",
                relay.stderr()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if relay.child.try_wait().unwrap().is_none() {
            relay.signal("TERM");
        }
    }
    relay.wait_exit(T).await;
    format!("{}\n{}", relay.lines().join("\n"), relay.stderr_plain())
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// Asserts that `secret` is nowhere in `out` and that `expect` is (the command got as far as
/// the case means it to).
fn assert_clean(case: &str, out: &str, secret: &str, expect: &str) {
    assert!(
        !out.contains(secret),
        "{case}: the secret {secret:?} was printed:\n{out}"
    );
    assert!(
        out.contains(expect),
        "{case}: expected {expect:?} in:\n{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_form_reaches_any_output() {
    let db = PgDb::create("secrets").await;
    let my = MyDb::create("secrets").await;
    let name = unique("sec");
    let pg_url = |secret: &str| {
        format!(
            "postgres://postgres:{secret}@127.0.0.1:{}/{}",
            db.port, db.name
        )
    };
    // Source forms: (secret, DSN, what an error path shows instead of the secret).
    let kv = format!(
        "host=127.0.0.1 port={} user=postgres password='SecKv 02' dbname={}",
        db.port, db.name
    );
    let sources: Vec<(&str, String)> = vec![
        ("SecUrl01", pg_url("SecUrl01")),
        ("SecKv 02", kv),
        (
            "SecQp03",
            format!("postgres://postgres@127.0.0.1/{}?password=SecQp03", db.name),
        ),
        (
            "SecSsl04",
            format!(
                "postgres://postgres@127.0.0.1/{}?sslmode=disable&sslpassword=SecSsl04",
                db.name
            ),
        ),
        (
            "SecPf05",
            format!(
                "postgres://postgres@127.0.0.1/{}?passfile=/tmp/SecPf05",
                db.name
            ),
        ),
        (
            "SecMy06",
            format!("mysql://root:SecMy06@127.0.0.1:3306/{}", my.name),
        ),
        ("SecFile07", "file:///tmp/?password=SecFile07".to_string()),
        (
            "SecBad08",
            "postgres://postgres:SecBad08@@not a url/x".to_string(),
        ),
    ];
    for (secret, dsn) in &sources {
        let valid = *secret == "SecUrl01";
        let failed = if valid { "" } else { "error" };
        for (cmd, expect) in [
            ("config", "source = "),
            ("check", if valid { "ok   connect" } else { failed }),
            ("status", if valid { "relay " } else { failed }),
            ("setup", if valid { "ok   state table" } else { failed }),
            ("offset show", failed),
        ] {
            let mut args: Vec<String> = cmd.split(' ').map(str::to_string).collect();
            args.extend(strings(&["--table", "outbox", "--name", &name]));
            // The flag, and the environment variable.
            let by_flag = {
                let mut a = args.clone();
                a.extend(strings(&["--source", dsn]));
                output(&a, &[], None).await
            };
            assert_clean(
                &format!("{cmd} --source {secret}"),
                &by_flag,
                secret,
                expect,
            );
            let by_env = output(&args, &[("OUTBOXD_SOURCE", dsn)], None).await;
            assert_clean(
                &format!("{cmd} OUTBOXD_SOURCE {secret}"),
                &by_env,
                secret,
                expect,
            );
            if cmd == "config" {
                assert!(
                    by_env.contains("***"),
                    "config shows it redacted:\n{by_env}"
                );
            }
        }
        let prune = output(
            &strings(&["prune", "--source", dsn, "--table", "outbox", "--dry-run"]),
            &[],
            None,
        )
        .await;
        assert_clean(&format!("prune {secret}"), &prune, secret, failed);
        let forget = output(
            &strings(&[
                "keys",
                "forget",
                "--keystore",
                dsn,
                "--source",
                dsn,
                "--aggregate",
                "a1",
            ]),
            &[],
            None,
        )
        .await;
        assert_clean(&format!("keys forget {secret}"), &forget, secret, failed);
        // Parse errors show the DSN, redacted.
        if !valid && *secret != "SecMy06" {
            let status = output(
                &strings(&["status", "--source", dsn, "--name", &name]),
                &[],
                None,
            )
            .await;
            assert!(
                status.contains("***") || status.contains("unknown DSN parameter"),
                "{secret}: {status}"
            );
        }
    }

    // A relay from the valid source to stdout: its start, then a stop.
    let source = pg_url("SecUrl01");
    let run = output(
        &strings(&[
            "run", "--source", &source, "--table", "outbox", "--name", &name, "--sink", "stdout",
        ]),
        &[],
        Some("resuming"),
    )
    .await;
    assert_clean("run to stdout", &run, "SecUrl01", "resuming");
    for (secret, dsn) in sources.iter().skip(1) {
        let run = output(
            &strings(&["run", "--source", dsn, "--table", "outbox", "--name", &name]),
            &[("OUTBOXD_SINK", "stdout")],
            None,
        )
        .await;
        assert_clean(&format!("run --source {secret}"), &run, secret, "error");
    }

    // Sinks nothing listens for: `config`, `check` and a relay retrying to connect.
    let sinks = [
        ("SecTok09", "nats://SecTok09@127.0.0.1:1".to_string()),
        ("SecTls10", "tls://SecTls10@127.0.0.1:1".to_string()),
        (
            "SecAmqp11",
            "amqp://guest:SecAmqp11@127.0.0.1:1/%2f".to_string(),
        ),
        // Kafka's client keeps trying an address that refuses for its whole timeout: a port
        // that is no number fails at once, through the same error path with the URL.
        (
            "SecKafka12",
            "kafka://app:SecKafka12@127.0.0.1:nine".to_string(),
        ),
        (
            "SecStream13",
            "rabbitmq-stream://app:SecStream13@127.0.0.1:1/%2f".to_string(),
        ),
        (
            "SecAq14",
            "amqp://guest@127.0.0.1:1/%2f?password=SecAq14".to_string(),
        ),
    ];
    for (i, (secret, sink)) in sinks.iter().enumerate() {
        let config = output(
            &strings(&["config", "--source", &source, "--sink", sink]),
            &[],
            None,
        )
        .await;
        assert_clean(&format!("config --sink {secret}"), &config, secret, "***");
        let check = output(
            &strings(&[
                "check", "--source", &source, "--table", "outbox", "--name", &name, "--sink", sink,
            ]),
            &[],
            None,
        )
        .await;
        assert_clean(
            &format!("check --sink {secret}"),
            &check,
            secret,
            "ok   connect",
        );
        assert!(
            check.contains("***"),
            "check --sink {secret} shows the sink:\n{check}"
        );
        let relay = format!("{name}_{i}");
        let run = output(
            &strings(&[
                "run", "--source", &source, "--table", "outbox", "--name", &relay,
            ]),
            &[("OUTBOXD_SINK", sink)],
            Some("sink unavailable"),
        )
        .await;
        assert_clean(&format!("run --sink {secret}"), &run, secret, "sink");
    }
}
