//! The key tooling's safety rules as a user meets them: keyring writers (`keys rotate`, `keys
//! retire`) serialise on a lock and never undo each other nor another program's change, a
//! symlinked keyring keeps its target, owner and mode; `reencrypt --keystore` seals under the
//! aggregate's data key so that `keys forget` erases everything, and `keys forget` refuses while
//! anything of the aggregate would still open, and with `--vacuum` leaves no copy of the wrapped
//! key in the key table's pages; destructive confirmations never come from the config file,
//! and a config file's sections scope keys to one command.

use crate::common::*;
use crate::crypto_cli::outboxd;
use outboxd::crypto::{self, Encryptor, Keyring, Schema};
use serde_json::{json, Value};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use uuid::Uuid;

const T: Duration = Duration::from_secs(60);

fn keyring_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The ids of the keys that still have material, and the current one.
fn live_keys(path: &Path) -> (Vec<String>, String) {
    let v = keyring_json(path);
    let live = v["keys"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|k| k["key"].is_string())
        .map(|k| k["id"].as_str().unwrap().to_string())
        .collect();
    (live, v["current"].as_str().unwrap().to_string())
}

/// A keyring with two keys (the first one previous, so that it may be retired).
fn two_key_ring(path: &Path) -> (String, String) {
    let mut k = Keyring::generate(8).unwrap();
    let first = k.current_id().to_string();
    let second = k.rotate();
    k.save_new(path).unwrap();
    (first, second)
}

/// Starts `outboxd args…` with stderr going to a file (read while it runs).
fn spawn(args: &[&str], stderr: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(args)
        .env_remove("OUTBOXD_KEYRING")
        .env_remove("OUTBOXD_KEYS")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(stderr).unwrap())
        .spawn()
        .unwrap()
}

fn wait_child(child: &mut Child, stderr: &Path) -> (i32, String) {
    let deadline = Instant::now() + T;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return (
                s.code().unwrap_or(-1),
                std::fs::read_to_string(stderr).unwrap(),
            );
        }
        assert!(
            Instant::now() < deadline,
            "outboxd did not exit: {}",
            std::fs::read_to_string(stderr).unwrap()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Holds an exclusive lock on the outbox table (an open transaction), so that `keys retire
/// --source` blocks in its scan, and waits until it does: the window in which another writer
/// used to slip in.
struct BlockedScan {
    blocker: tokio_postgres::Client,
}

impl BlockedScan {
    async fn start(db: &PgDb) -> BlockedScan {
        let blocker = db.client().await;
        blocker
            .batch_execute("BEGIN; LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
            .await
            .unwrap();
        BlockedScan { blocker }
    }

    async fn wait_blocked(&self, db: &PgDb) {
        let admin = db.client().await;
        let name = db.name.clone();
        wait_for("keys retire waits on the table lock", T, || {
            let admin = &admin;
            let name = name.clone();
            async move {
                let n: i64 = admin
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 \
                         AND wait_event_type = 'Lock' AND query LIKE '%regexp_matches%'",
                        &[&name],
                    )
                    .await
                    .unwrap()
                    .get(0);
                n > 0
            }
        })
        .await;
    }

    async fn release(self) {
        self.blocker.batch_execute("ROLLBACK").await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_rotate_during_a_retire_scan_waits_and_neither_change_is_lost() {
    let db = PgDb::create("ring_race").await;
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.json");
    let (first, second) = two_key_ring(&keys);
    let k = keys.to_str().unwrap();
    let dsn = db.dsn();

    let scan = BlockedScan::start(&db).await;
    let retire_err = dir.path().join("retire.err");
    let mut retire = spawn(
        &[
            "keys", "retire", &first, "--keys", k, "--source", &dsn, "--yes",
        ],
        &retire_err,
    );
    scan.wait_blocked(&db).await;

    // A rotation while retire holds the keyring: it waits for the lock (and says so).
    let rotate_err = dir.path().join("rotate.err");
    let mut rotate = spawn(&["keys", "rotate", "--keys", k], &rotate_err);
    wait_for("rotate exits or waits for the keyring lock", T, || {
        let done = rotate.try_wait().unwrap().is_some();
        let waiting = std::fs::read_to_string(&rotate_err)
            .unwrap()
            .contains("waiting for the keyring lock");
        async move { done || waiting }
    })
    .await;
    scan.release().await;
    let (code, err) = wait_child(&mut retire, &retire_err);
    assert_eq!(code, 0, "retire: {err}");
    let (code, err) = wait_child(&mut rotate, &rotate_err);
    assert_eq!(code, 0, "rotate: {err}");

    // Both changes hold: the first key retired, and the rotation's new key current.
    let (live, current) = live_keys(&keys);
    assert!(!live.contains(&first), "the retire was undone: {live:?}");
    assert_ne!(
        current, second,
        "the key rotate added was lost (current is still {second}); rotate said: {err}"
    );
    assert!(
        live.contains(&current) && live.contains(&second),
        "{live:?}"
    );
    assert!(Keyring::load(&keys).is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyring_changed_by_another_program_during_retire_is_not_overwritten() {
    let db = PgDb::create("ring_changed").await;
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.json");
    let (first, _) = two_key_ring(&keys);
    let k = keys.to_str().unwrap();
    let dsn = db.dsn();

    let scan = BlockedScan::start(&db).await;
    let retire_err = dir.path().join("retire.err");
    let mut retire = spawn(
        &[
            "keys", "retire", &first, "--keys", k, "--source", &dsn, "--yes",
        ],
        &retire_err,
    );
    scan.wait_blocked(&db).await;
    // Another program (an editor, a restore, an older outboxd) rewrites the file in place.
    let mut changed = Keyring::load(&keys).unwrap();
    let added = changed.rotate();
    std::fs::write(&keys, changed.to_json().as_bytes()).unwrap();
    scan.release().await;

    let (code, err) = wait_child(&mut retire, &retire_err);
    assert_ne!(
        code, 0,
        "retire overwrote a keyring changed under it: {err}"
    );
    assert!(err.contains("changed since"), "{err}");
    assert!(err.contains("run the command again"), "{err}");
    let (live, current) = live_keys(&keys);
    assert_eq!(current, added, "the other program's change was lost");
    assert!(live.contains(&first), "nothing was retired: {live:?}");
}

#[cfg(unix)]
#[test]
fn keys_rotate_writes_through_a_symlink_and_keeps_the_owner_and_mode() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = tempfile::tempdir().unwrap();
    let secrets = dir.path().join("secrets");
    std::fs::create_dir(&secrets).unwrap();
    let target = secrets.join("keys.json");
    two_key_ring(&target);
    // A group the ring belongs to that is not root's primary one, and a read-only mode: both
    // are the operator's choices and must survive a rewrite.
    std::os::unix::fs::chown(&target, None, Some(65534)).unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o400)).unwrap();
    let before = std::fs::metadata(&target).unwrap();
    let link = dir.path().join("keys.json");
    std::os::unix::fs::symlink(&target, &link).unwrap();

    let r = outboxd(
        &["keys", "rotate", "--keys", link.to_str().unwrap()],
        "",
        &[],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);

    let link_meta = std::fs::symlink_metadata(&link).unwrap();
    assert!(
        link_meta.file_type().is_symlink(),
        "the symlink was replaced by a regular file"
    );
    let after = std::fs::metadata(&target).unwrap();
    let (live, current) = live_keys(&target);
    assert_eq!(live.len(), 3, "the rotation reached the target: {live:?}");
    assert!(r.stdout.contains(&current), "{}", r.stdout);
    assert_eq!(
        (after.uid(), after.gid()),
        (before.uid(), before.gid()),
        "owner"
    );
    assert_eq!(after.mode() & 0o7777, 0o400, "mode");
    // No temporary or lock debris beside the link; the lock file lives beside the target.
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
}

// ---- config file: destructive confirmations and scopes ----

#[test]
fn yes_in_a_config_file_never_confirms_a_destructive_command() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.json");
    let (first, _) = two_key_ring(&keys);
    let conf = dir.path().join("outboxd.toml");
    std::fs::write(&conf, "yes = true\n").unwrap();
    let o = outboxd(
        &[
            "keys",
            "retire",
            &first,
            "--keys",
            keys.to_str().unwrap(),
            "--config",
            conf.to_str().unwrap(),
        ],
        "",
        &[],
    );
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(
        o.stderr.contains("\"yes\"") && o.stderr.contains("pass --yes on the command line"),
        "{}",
        o.stderr
    );
    let (live, _) = live_keys(&keys);
    assert!(live.contains(&first), "the key was retired: {live:?}");
    // In a command's section too.
    std::fs::write(&conf, "[keys.forget]\nyes = true\n").unwrap();
    let o = outboxd(
        &[
            "keys",
            "list",
            "--keys",
            keys.to_str().unwrap(),
            "--config",
            conf.to_str().unwrap(),
        ],
        "",
        &[],
    );
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(
        o.stderr.contains("pass --yes on the command line"),
        "{}",
        o.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_for_prune_in_a_config_file_never_skips_the_retire_check() {
    let db = PgDb::create("conf_force").await;
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.json");
    let keyring = Keyring::generate(8).unwrap();
    let first = keyring.current_id().to_string();
    keyring.save_new(&keys).unwrap();
    let schema = Schema::from_pointers(&["/name"]);
    let outbox = outboxd::Outbox::new("outbox")
        .unwrap()
        .with_encryption(Encryptor::new(keyring.clone(), schema));
    let mut client = db.client().await;
    let mut tx = client.transaction().await.unwrap();
    outbox
        .write(&mut tx, "t", "a", &json!({"name": "Ayşe"}))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        outboxd(
            &["keys", "rotate", "--keys", keys.to_str().unwrap()],
            "",
            &[]
        )
        .code,
        0
    );

    let conf = dir.path().join("outboxd.toml");
    for text in ["force = true\n", "[prune]\nforce = true\n"] {
        std::fs::write(&conf, text).unwrap();
        let o = outboxd(
            &[
                "keys",
                "retire",
                &first,
                "--keys",
                keys.to_str().unwrap(),
                "--source",
                &db.dsn(),
                "--yes",
                "--config",
                conf.to_str().unwrap(),
            ],
            "",
            &[],
        );
        assert_ne!(o.code, 0, "{text:?}: retired a key rows use: {}", o.stderr);
        assert!(
            o.stderr.contains("pass --force on the command line"),
            "{text:?}: {}",
            o.stderr
        );
        let (live, _) = live_keys(&keys);
        assert!(live.contains(&first), "{text:?}: retired: {live:?}");
    }
}

// ---- crypto-shredding: reencrypt under data keys, forget verifies ----

fn shred_schema() -> Schema {
    Schema::from_pointers(&["/customer/name", "/customer/tax_id"])
}

fn shred_payload(i: usize) -> Value {
    json!({"invoice": i, "customer": {"name": format!("Ayşe {i}"), "tax_id": format!("TAX{i:05}")}})
}

async fn stored(client: &tokio_postgres::Client) -> Vec<(Uuid, String, Value)> {
    client
        .query(
            "SELECT id, aggregate_id, payload::text FROM outbox ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| {
            (
                r.get(0),
                r.get(1),
                serde_json::from_str(&r.get::<_, String>(2)).unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reencrypt_with_a_keystore_seals_old_rows_under_the_aggregates_data_key() {
    let db = PgDb::create("shred_reenc").await;
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.json");
    let keyring = Keyring::generate(8).unwrap();
    keyring.save_new(&keys).unwrap();
    let schema_path = dir.path().join("schema.json");
    std::fs::write(
        &schema_path,
        r#"{"customer": {"properties": {"name": {"x-gdpr-sensitive": true}, "tax_id": {"x-gdpr-sensitive": true}}}}"#,
    )
    .unwrap();
    let dsn = db.dsn();
    let mut client = db.client().await;
    // Rows written before encryption (clear) and before the keystore (under the keyring key).
    let clear = outboxd::Outbox::new("outbox").unwrap();
    let ring_only = outboxd::Outbox::new("outbox")
        .unwrap()
        .with_encryption(Encryptor::new(keyring.clone(), shred_schema()));
    let mut tx = client.transaction().await.unwrap();
    for i in 0..6 {
        let agg = if i % 2 == 0 { "cust-A" } else { "cust-B" };
        let ob = if i < 3 { &clear } else { &ring_only };
        ob.write(&mut tx, "t", agg, &shred_payload(i))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();

    let k = keys.to_str().unwrap();
    let (code, out, err) = {
        let o = outboxd(
            &[
                "reencrypt",
                "--source",
                &dsn,
                "--keys",
                k,
                "--schema",
                schema_path.to_str().unwrap(),
                "--keystore",
                &dsn,
                "--include-pending",
            ],
            "",
            &[],
        );
        (o.code, o.stdout, o.stderr)
    };
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("rewrote 6"), "{out}");
    let rows = stored(&client).await;
    let ks = crypto::shred::Keystore::connect(&dsn).await.unwrap();
    let enc = Encryptor::new(keyring.clone(), Schema::default()).with_keystore(ks);
    let mut per_agg = std::collections::BTreeMap::new();
    for (id, agg, v) in &rows {
        let ids = crypto::key_ids_in(v);
        assert_eq!(ids.len(), 1, "{v}");
        let kid = ids.keys().next().unwrap().clone();
        assert!(
            kid.starts_with("d-"),
            "row {id} of {agg} sealed under keyring key {kid}, not its aggregate's data key"
        );
        assert_eq!(per_agg.entry(agg.clone()).or_insert(kid.clone()), &kid);
        assert_eq!(enc.decrypt_event(*id, v).await.unwrap().erased.len(), 0);
    }

    // Forget A: every row of A is erased, B still reads.
    let o = outboxd(
        &[
            "keys",
            "forget",
            "--aggregate",
            "cust-A",
            "--keystore",
            &dsn,
            "--source",
            &dsn,
            "--yes",
        ],
        "",
        &[],
    );
    assert_eq!(o.code, 0, "{}", o.stderr);
    for (i, (id, agg, v)) in rows.iter().enumerate() {
        let d = enc.decrypt_event(*id, v).await.unwrap();
        if agg == "cust-A" {
            assert_eq!(d.erased, vec!["/customer/name", "/customer/tax_id"], "{id}");
            assert!(!d.payload.to_string().contains("Ayşe"), "{}", d.payload);
        } else {
            assert_eq!(d.payload, shred_payload(i));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_forget_refuses_while_rows_of_the_aggregate_would_still_open() {
    let db = PgDb::create("shred_verify").await;
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.json");
    let keyring = Keyring::generate(8).unwrap();
    keyring.save_new(&keys).unwrap();
    let dsn = db.dsn();
    let mut client = db.client().await;
    let ring_only = outboxd::Outbox::new("outbox")
        .unwrap()
        .with_encryption(Encryptor::new(keyring.clone(), shred_schema()));
    let ks = crypto::shred::Keystore::connect(&dsn).await.unwrap();
    let with_ks = outboxd::Outbox::new("outbox")
        .unwrap()
        .with_encryption(Encryptor::new(keyring.clone(), shred_schema()).with_keystore(ks));
    let mut tx = client.transaction().await.unwrap();
    let old = ring_only
        .write(&mut tx, "t", "cust-A", &shred_payload(0))
        .await
        .unwrap();
    with_ks
        .write(&mut tx, "t", "cust-A", &shred_payload(1))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let forget = || {
        outboxd(
            &[
                "keys",
                "forget",
                "--aggregate",
                "cust-A",
                "--keystore",
                &dsn,
                "--source",
                &dsn,
                "--yes",
            ],
            "",
            &[],
        )
    };
    let o = forget();
    assert_eq!(
        o.code, 1,
        "forgot although a row would still open: {}",
        o.stderr
    );
    assert!(o.stderr.contains(&old.to_string()), "{}", o.stderr);
    assert!(o.stderr.contains(keyring.current_id()), "{}", o.stderr);
    assert!(
        o.stderr.contains("outboxd reencrypt") && o.stderr.contains("--keystore"),
        "{}",
        o.stderr
    );
    // Nothing was forgotten: every row still reads.
    let rows = stored(&client).await;
    let ks = crypto::shred::Keystore::connect(&dsn).await.unwrap();
    let enc = Encryptor::new(keyring.clone(), Schema::default()).with_keystore(ks);
    for (id, _, v) in &rows {
        assert!(enc.decrypt_event(*id, v).await.unwrap().erased.is_empty());
    }

    // Without --source it cannot verify, and says how to.
    let o = outboxd(
        &[
            "keys",
            "forget",
            "--aggregate",
            "cust-A",
            "--keystore",
            &dsn,
            "--yes",
        ],
        "",
        &[],
    );
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(o.stderr.contains("--source"), "{}", o.stderr);

    // The fix it names works: reencrypt moves the row under the data key, then forget holds.
    let schema_path = dir.path().join("schema.json");
    std::fs::write(
        &schema_path,
        r#"{"customer": {"properties": {"name": {"x-gdpr-sensitive": true}}}}"#,
    )
    .unwrap();
    let r = outboxd(
        &[
            "reencrypt",
            "--source",
            &dsn,
            "--keys",
            keys.to_str().unwrap(),
            "--schema",
            schema_path.to_str().unwrap(),
            "--keystore",
            &dsn,
            "--include-pending",
        ],
        "",
        &[],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let o = forget();
    assert_eq!(o.code, 0, "{}", o.stderr);
    for (id, _, v) in &stored(&client).await {
        assert_eq!(
            enc.decrypt_event(*id, v).await.unwrap().erased.len(),
            2,
            "{id}"
        );
    }
}

// ---- keys retire waits for relays to publish the log ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_retire_refuses_while_a_relay_has_not_published_the_log() {
    let db = PgDb::create("retire_lag").await;
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.json");
    let (first, _) = two_key_ring(&keys);
    let k = keys.to_str().unwrap().to_string();
    let dsn = db.dsn();
    let name = unique("r");
    let mut client = db.client().await;

    // A relay that ran once (its state and slot exist), then stopped.
    let mut relay = Relay::start(&["run", "--source", &dsn, "--name", &name, "--commit-offsets"]);
    write_events(&mut client, 1, 1, "t").await;
    let admin = db.client().await;
    wait_for("the relay stores a position", T, || {
        let (admin, name) = (&admin, name.clone());
        async move {
            admin
                .query_opt(
                    "SELECT 1 FROM outboxd_state WHERE name = $1 AND position_lsn IS NOT NULL",
                    &[&name],
                )
                .await
                .ok()
                .flatten()
                .is_some()
        }
    })
    .await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());

    // Events written meanwhile and deleted from the table (the table count cannot see them):
    // they sit in the log, unpublished, sealed under whatever key the producer had.
    let ids = write_events(&mut client, 1, 2, "t").await;
    client
        .execute("DELETE FROM outbox WHERE id = ANY($1)", &[&ids])
        .await
        .unwrap();
    let retire = |timeout: &str, stderr: &Path| {
        spawn(
            &[
                "keys",
                "retire",
                &first,
                "--keys",
                &k,
                "--source",
                &dsn,
                "--catch-up-timeout",
                timeout,
                "--yes",
            ],
            stderr,
        )
    };
    let err_path = dir.path().join("retire1.err");
    let (code, err) = wait_child(&mut retire("1s", &err_path), &err_path);
    assert_eq!(code, 1, "retired with unpublished events in the log: {err}");
    assert!(err.contains(&format!("relay {name:?} has stored")), "{err}");
    assert!(err.contains("outboxd teardown --name NAME --yes"), "{err}");
    let (live, _) = live_keys(&keys);
    assert!(live.contains(&first), "{live:?}");

    // With the relay running it waits for it, and retires once the log is published.
    let mut relay = Relay::start(&["run", "--source", &dsn, "--name", &name, "--commit-offsets"]);
    let err_path = dir.path().join("retire2.err");
    let mut child = retire("60s", &err_path);
    let started = Instant::now();
    loop {
        let text = std::fs::read_to_string(&err_path).unwrap();
        if text.contains("waiting up to") || child.try_wait().unwrap().is_some() {
            break;
        }
        assert!(started.elapsed() < T, "{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A commit after the head retire took: the relay's stored position passes it once the
    // event is published.
    write_events(&mut client, 1, 1, "t").await;
    let (code, err) = wait_child(&mut child, &err_path);
    assert_eq!(code, 0, "{err}");
    let (live, _) = live_keys(&keys);
    assert!(!live.contains(&first), "{live:?}");
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_forget_verifies_a_mysql_outbox_too() {
    use mysql_async::prelude::Queryable;
    let my = MyDb::create("shred_my").await;
    let pg = PgDb::create("shred_my_ks").await;
    let keyring = Keyring::generate(8).unwrap();
    let keystore = pg.dsn();
    let ring_only = outboxd::Outbox::new("outbox")
        .unwrap()
        .with_encryption(Encryptor::new(keyring.clone(), shred_schema()));
    let ks = crypto::shred::Keystore::connect(&keystore).await.unwrap();
    let with_ks = outboxd::Outbox::new("outbox")
        .unwrap()
        .with_encryption(Encryptor::new(keyring.clone(), shred_schema()).with_keystore(ks));
    let mut c = my.conn().await;
    let mut tx = c.start_transaction(Default::default()).await.unwrap();
    let old = ring_only
        .write(&mut tx, "t", "7", &shred_payload(0))
        .await
        .unwrap();
    let kept = with_ks
        .write(&mut tx, "t", "7", &shred_payload(1))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let forget = || {
        outboxd(
            &[
                "keys",
                "forget",
                "--aggregate",
                "7",
                "--keystore",
                &keystore,
                "--source",
                &my.dsn(),
                "--yes",
            ],
            "",
            &[],
        )
    };
    let o = forget();
    assert_eq!(o.code, 1, "{}", o.stderr);
    assert!(o.stderr.contains(&format!("row {old}")), "{}", o.stderr);
    assert!(!o.stderr.contains(&kept.to_string()), "{}", o.stderr);
    assert!(
        o.stderr.contains("Encryptor::with_keystore"),
        "{}",
        o.stderr
    );

    // Once the row outside the data key is gone, forgetting erases everything left.
    c.exec_drop(
        "DELETE FROM outbox WHERE id = ?",
        (old.as_bytes().to_vec(),),
    )
    .await
    .unwrap();
    let o = forget();
    assert_eq!(o.code, 0, "{}", o.stderr);
    let (id, text): (Vec<u8>, String) = c
        .query_first("SELECT id, CAST(payload AS CHAR) FROM outbox")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(Uuid::from_slice(&id).unwrap(), kept);
    let ks = crypto::shred::Keystore::connect(&keystore).await.unwrap();
    let enc = Encryptor::new(keyring, Schema::default()).with_keystore(ks);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(enc.decrypt_event(kept, &v).await.unwrap().erased.len(), 2);
}

// ---- keys forget: what the UPDATE leaves behind, and the rewrite that removes it ----

/// Whether any 16-character piece of a wrapped key's ciphertext is in a page of the key table
/// (its heap, and its TOAST table if it has one), read raw with pageinspect: what a copy of the
/// data files would give away, not what SQL shows.
async fn in_pages(client: &tokio_postgres::Client, wrapped: &str) -> bool {
    let sealed = wrapped.rsplit(':').next().unwrap();
    assert!(sealed.len() >= 32, "{wrapped}");
    let pieces: Vec<Vec<u8>> = sealed
        .as_bytes()
        .chunks_exact(16)
        .map(<[u8]>::to_vec)
        .collect();
    let rels: Vec<String> = client
        .query(
            "SELECT 'outboxd_data_keys' UNION ALL
             SELECT reltoastrelid::regclass::text FROM pg_class
              WHERE oid = 'outboxd_data_keys'::regclass AND reltoastrelid <> 0",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    for rel in rels {
        let found: bool = client
            .query_one(
                "SELECT coalesce(bool_or(position(p IN get_raw_page($1::text, b::int)) > 0), false)
                   FROM generate_series(0, pg_relation_size($1::text::regclass)
                                           / current_setting('block_size')::int8 - 1) b,
                        unnest($2::bytea[]) p",
                &[&rel, &pieces],
            )
            .await
            .unwrap()
            .get(0);
        if found {
            return true;
        }
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_forget_vacuum_removes_the_wrapped_key_from_the_tables_pages() {
    let db = PgDb::create("shred_pages").await;
    let admin = db.client().await;
    admin
        .batch_execute("CREATE EXTENSION IF NOT EXISTS pageinspect")
        .await
        .unwrap_or_else(|e| {
            panic!("pageinspect (PostgreSQL's contrib modules) is needed to read raw pages: {e}. Install postgresql-contrib (`sudo scripts/services.sh`)")
        });
    let keyring = Keyring::generate(8).unwrap();
    let dsn = db.dsn();
    let ks = crypto::shred::Keystore::connect(&dsn).await.unwrap();
    let producer = outboxd::Outbox::new("outbox")
        .unwrap()
        .with_encryption(Encryptor::new(keyring.clone(), shred_schema()).with_keystore(ks));
    // One event per aggregate, so each gets its data key, one after the other.
    let mut client = db.client().await;
    for i in 0..10 {
        let mut tx = client.transaction().await.unwrap();
        producer
            .write(&mut tx, "t", &format!("cust-{i}"), &shred_payload(i))
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    let wrapped = |agg: &'static str| {
        let admin = &admin;
        async move {
            admin
                .query_one(
                    "SELECT wrapped FROM outboxd_data_keys WHERE aggregate_id = $1",
                    &[&agg],
                )
                .await
                .unwrap()
                .get::<_, String>(0)
        }
    };
    let (middle, last, kept) = (
        wrapped("cust-3").await,
        wrapped("cust-9").await,
        wrapped("cust-5").await,
    );
    let forget = |agg: &str, vacuum: bool| {
        let mut args = vec![
            "keys",
            "forget",
            "--aggregate",
            agg,
            "--keystore",
            &dsn,
            "--source",
            &dsn,
            "--yes",
        ];
        if vacuum {
            args.push("--vacuum");
        }
        outboxd(&args, "", &[])
    };

    // The UPDATE alone: the key reads as forgotten, but its old row version is still in the
    // pages, and the command says what removes it.
    let o = forget("cust-3", false);
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(
        o.stderr.contains("VACUUM FULL outboxd_data_keys;") && o.stderr.contains("backups"),
        "{}",
        o.stderr
    );
    assert!(
        in_pages(&admin, &middle).await,
        "the forgotten key's old row version should still be in the pages"
    );

    // The documented step, here through --vacuum: gone from every page; a live key is still
    // found (the search works).
    let o = forget("cust-9", true);
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(
        o.stdout.contains("rewrote outboxd_data_keys"),
        "{}",
        o.stdout
    );
    assert!(
        !in_pages(&admin, &middle).await,
        "cust-3's wrapped key is still in the pages"
    );
    assert!(
        !in_pages(&admin, &last).await,
        "cust-9's wrapped key is still in the pages"
    );
    assert!(
        in_pages(&admin, &kept).await,
        "a live key must be found in the pages"
    );
}
