//! Field-level encryption against the real Postgres: the producer hook leaves no plaintext of a
//! sensitive field in the table, the relay moves the ciphertext unchanged and a consumer reads
//! the clear values; re-encryption moves every row to the current key, resumably; retiring a key
//! still in use is refused.

use crate::common;

use common::*;
use outboxd::crypto::{self, reencrypt, Encryptor, Keyring, Schema};
use outboxd::outbox::{ColumnMap, TableName};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const T: Duration = Duration::from_secs(60);

fn outboxd_cli(args: &[&str], stdin: &str) -> (i32, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env_remove("OUTBOXD_KEYRING")
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn schema() -> Schema {
    Schema::from_value(&json!({
        "type": "object",
        "properties": {
            "invoice_id": {"type": "integer"},
            "customer": {"type": "object", "properties": {
                "name": {"type": "string", "x-gdpr-sensitive": true},
                "tax_id": {"type": "string", "x-gdpr-sensitive": true},
                "country": {"type": "string"}
            }},
            "lines": {"type": "array", "items": {"properties": {
                "note": {"x-gdpr-sensitive": true}
            }}},
            "total": {"type": "string"}
        }
    }))
    .unwrap()
}

fn payload(i: usize) -> Value {
    json!({
        "invoice_id": i,
        "customer": {"name": format!("Ayşe Yılmaz {i}"), "tax_id": format!("TAX{i:07}"), "country": "TR"},
        "lines": [{"sku": "A-1", "note": format!("secret note {i}")}, {"sku": "B-2", "note": {"floor": i, "door": true}}],
        "total": "12.50"
    })
}

/// No sensitive plaintext of payload `i` in `text`, and the clear fields are there.
fn assert_sealed(text: &str, i: usize) {
    for secret in [
        format!("Ayşe Yılmaz {i}"),
        format!("TAX{i:07}"),
        format!("secret note {i}"),
        "\"floor\"".to_string(),
    ] {
        assert!(!text.contains(&secret), "{secret:?} in clear: {text}");
    }
    assert!(text.contains("\"country\":\"TR\"") || text.contains("\"country\": \"TR\""));
    assert!(text.contains("enc:v1:"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_hook_seals_before_insert_and_the_consumer_reads_through_the_relay() {
    let db = PgDb::create("crypt").await;
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.json");
    Keyring::generate(8).unwrap().save_new(&keys).unwrap();
    let keyring = Keyring::load(&keys).unwrap();
    let outbox = outboxd::Outbox::new("outbox")
        .unwrap()
        .with_encryption(Encryptor::new(keyring.clone(), schema()));

    // The relay first, so it streams what follows (stdout sink, no broker needed).
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let dsn = db.dsn();
    let relay = Relay::start(&["run", "--source", &dsn, "--name", &name, "--commit-offsets"]);
    wait_for("the relay's slot to be active", T, || db.slot_active(&slot)).await;

    let mut client = db.client().await;
    let mut ids = Vec::new();
    let mut tx = client.transaction().await.unwrap();
    for i in 0..20 {
        ids.push(
            outbox
                .write(&mut tx, "invoice.issued", &format!("inv-{i}"), &payload(i))
                .await
                .unwrap(),
        );
    }
    tx.commit().await.unwrap();

    // The whole row as Postgres stores it: no plaintext of a sensitive field.
    let rows = client
        .query(
            "SELECT id, payload::text, row_to_json(o)::text FROM outbox o ORDER BY id",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 20);
    let mut stored = BTreeMap::new();
    for (i, row) in rows.iter().enumerate() {
        let id: Uuid = row.get(0);
        assert_eq!(id, ids[i], "UUID v7 ids sort in write order");
        let text: String = row.get(1);
        assert_sealed(&row.get::<_, String>(2), i);
        stored.insert(id, text);
    }

    // `outboxd decrypt` restores it.
    let k = keys.to_str().unwrap();
    let id0 = ids[0].to_string();
    let (code, out, err) = outboxd_cli(
        &["decrypt", "--keys", k, "--event-id", &id0],
        &stored[&ids[0]],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(serde_json::from_str::<Value>(&out).unwrap(), payload(0));

    // Through the relay: the body is the stored text byte for byte, and decrypts.
    wait_for("20 events on stdout", T, || {
        let n = relay.line_count();
        async move { n >= 20 }
    })
    .await;
    let lines = parse_lines(&relay.lines());
    for line in &lines {
        let id = Uuid::parse_str(line["id"].as_str().unwrap()).unwrap();
        let i = ids.iter().position(|x| *x == id).unwrap();
        let body = &line["payload"];
        assert_eq!(
            body,
            &serde_json::from_str::<Value>(&stored[&id]).unwrap(),
            "unchanged by the relay"
        );
        assert_sealed(&body.to_string(), i);
        assert_eq!(
            crypto::decrypt_payload(&keyring, id, body).unwrap(),
            payload(i)
        );
    }
    // A body read as another event's does not decrypt.
    assert!(matches!(
        crypto::decrypt_payload(&keyring, ids[1], &lines[0]["payload"]),
        Err(crypto::CryptoError::WrongEvent { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reencrypt_moves_every_row_to_the_current_key_and_resumes() {
    let db = PgDb::create("reenc").await;
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.json");
    let schema_path = dir.path().join("schema.json");
    std::fs::write(
        &schema_path,
        serde_json::to_string(&json!({"properties": {
            "customer": {"properties": {
                "name": {"x-gdpr-sensitive": true},
                "tax_id": {"x-gdpr-sensitive": true}}},
            "lines": {"items": {"properties": {"note": {"x-gdpr-sensitive": true}}}}
        }}))
        .unwrap(),
    )
    .unwrap();
    let mut keyring = Keyring::generate(8).unwrap();
    keyring.save_new(&keys).unwrap();
    let old_id = keyring.current_id().to_string();
    let mut client = db.client().await;
    let mut originals = BTreeMap::new();

    // 30 rows under the first key, 10 written before encryption was switched on, then a
    // rotation and 10 rows under the new key.
    let enc_old = outboxd::Outbox::new("outbox")
        .unwrap()
        .with_encryption(Encryptor::new(keyring.clone(), schema()));
    let clear = outboxd::Outbox::new("outbox").unwrap();
    let mut tx = client.transaction().await.unwrap();
    for i in 0..40 {
        let ob = if i < 30 { &enc_old } else { &clear };
        let id = ob.write(&mut tx, "t", "a", &payload(i)).await.unwrap();
        originals.insert(id, i);
    }
    tx.commit().await.unwrap();
    let new_id = keyring.rotate();
    keyring.save_replace(&keys).unwrap();
    let enc_new = outboxd::Outbox::new("outbox")
        .unwrap()
        .with_encryption(Encryptor::new(keyring.clone(), schema()));
    let mut tx = client.transaction().await.unwrap();
    for i in 40..50 {
        let id = enc_new.write(&mut tx, "t", "a", &payload(i)).await.unwrap();
        originals.insert(id, i);
    }
    tx.commit().await.unwrap();

    let table = TableName::parse("outbox").unwrap();
    let cols = ColumnMap::default();
    let counts = reencrypt::count_by_key(&client, &table, &cols)
        .await
        .unwrap();
    assert_eq!(counts.get(&old_id), Some(&30));
    assert_eq!(counts.get(&new_id), Some(&10));

    // Retiring the old key is refused while rows use it.
    let k = keys.to_str().unwrap();
    let dsn = db.dsn();
    let (code, _, err) = outboxd_cli(
        &[
            "keys", "retire", &old_id, "--keys", k, "--source", &dsn, "--yes",
        ],
        "",
    );
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("30 rows") && err.contains("still use key"),
        "{err}"
    );
    assert!(err.contains("cannot see messages still queued"), "{err}");

    // A first, partial run (as if stopped) ...
    let enc = Encryptor::load(Some(&keys), &schema_path).unwrap();
    let opts = reencrypt::Options {
        batch: 7,
        after: None,
        limit: Some(14),
        // No poll relay reads this table: its rows stay `pending`, as under CDC mode.
        include_pending: true,
    };
    let mut reports = 0;
    let p = reencrypt::run(
        &mut client,
        &table,
        &cols,
        &enc,
        &opts,
        &CancellationToken::new(),
        |_| reports += 1,
    )
    .await
    .unwrap();
    assert_eq!((p.scanned, p.rewritten, reports), (14, 14, 2));
    let counts = reencrypt::count_by_key(&client, &table, &cols)
        .await
        .unwrap();
    assert_eq!(counts.get(&old_id), Some(&16));

    // ... resumed from where it stopped by the command.
    let last = p.last_id.unwrap().to_string();
    let s = schema_path.to_str().unwrap();
    let (code, out, err) = outboxd_cli(
        &[
            "reencrypt",
            "--source",
            &dsn,
            "--table",
            "outbox",
            "--keys",
            k,
            "--schema",
            s,
            "--batch",
            "7",
            "--after",
            &last,
            "--include-pending",
        ],
        "",
    );
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("resume with --after"), "{err}");
    assert!(
        out.lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == [old_id.as_str(), "old", "0"]),
        "{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == [new_id.as_str(), "current", "50"]),
        "{out}"
    );
    let counts = reencrypt::count_by_key(&client, &table, &cols)
        .await
        .unwrap();
    assert_eq!(counts.get(&old_id), None, "no row under the old key");
    assert_eq!(
        counts.get(&new_id),
        Some(&50),
        "the clear rows were sealed too"
    );

    // Every row still reads as it was written, with no plaintext left.
    let rows = client
        .query("SELECT id, payload::text FROM outbox", &[])
        .await
        .unwrap();
    for row in rows {
        let id: Uuid = row.get(0);
        let text: String = row.get(1);
        let i = originals[&id];
        assert_sealed(&text, i);
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            crypto::decrypt_payload(enc.keyring(), id, &v).unwrap(),
            payload(i)
        );
    }

    // A second run changes nothing.
    let (code, out, err) = outboxd_cli(
        &[
            "reencrypt",
            "--source",
            &dsn,
            "--keys",
            k,
            "--schema",
            s,
            "--include-pending",
        ],
        "",
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("scanned 50 rows, rewrote 0, failed 0, left 0 pending"),
        "{out}"
    );
    // Without --include-pending the (still pending) rows are left alone, and it says so.
    let (code, out, err) = outboxd_cli(
        &["reencrypt", "--source", &dsn, "--keys", k, "--schema", s],
        "",
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("scanned 50 rows, rewrote 0, failed 0, left 50 pending"),
        "{out}"
    );
    assert!(
        err.contains("50 rows still pending were left alone") && err.contains("--include-pending"),
        "{err}"
    );

    // Now the old key can go.
    let (code, out, err) = outboxd_cli(
        &["keys", "retire", &old_id, "--keys", k, "--source", &dsn],
        "",
    );
    assert_eq!(code, 2, "asks for --yes: {err}");
    assert!(err.contains("no row of"), "{err}");
    assert!(out.is_empty());
    let (code, out, err) = outboxd_cli(
        &[
            "keys", "retire", &old_id, "--keys", k, "--source", &dsn, "--yes",
        ],
        "",
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("retired key"));
    let (_, list, _) = outboxd_cli(&["keys", "list", "--keys", k], "");
    assert!(
        list.lines()
            .any(|l| l.starts_with(&old_id) && l.contains("retired")),
        "{list}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forgotten_aggregate_decrypts_as_erased_while_others_stay_readable() {
    let db = PgDb::create("shred").await;
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.json");
    let mut keyring = Keyring::generate(8).unwrap();
    keyring.save_new(&keys).unwrap();
    let dsn = db.dsn();
    let enc = Encryptor::new(keyring.clone(), schema())
        .with_keystore(crypto::shred::Keystore::connect(&dsn).await.unwrap());
    let outbox = outboxd::Outbox::new("outbox")
        .unwrap()
        .with_encryption(enc.clone());
    let mut client = db.client().await;
    let mut events = Vec::new(); // (id, aggregate, i)
    let mut tx = client.transaction().await.unwrap();
    for i in 0..6 {
        let agg = if i % 2 == 0 { "cust-A" } else { "cust-B" };
        let id = outbox.write(&mut tx, "t", agg, &payload(i)).await.unwrap();
        events.push((id, agg, i));
    }
    tx.commit().await.unwrap();
    let stored = |rows: Vec<tokio_postgres::Row>| -> BTreeMap<Uuid, Value> {
        rows.iter()
            .map(|r| {
                (
                    r.get(0),
                    serde_json::from_str(&r.get::<_, String>(1)).unwrap(),
                )
            })
            .collect()
    };
    let rows = stored(
        client
            .query("SELECT id, payload::text FROM outbox", &[])
            .await
            .unwrap(),
    );
    // One data key per aggregate, none of them a keyring key.
    let mut data_keys = BTreeMap::new();
    for (id, agg, i) in &events {
        assert_sealed(&rows[id].to_string(), *i);
        let ids = crypto::key_ids_in(&rows[id]);
        assert_eq!(ids.len(), 1);
        let kid = ids.keys().next().unwrap().clone();
        assert!(kid.starts_with("d-"), "{kid}");
        assert_eq!(*data_keys.entry(*agg).or_insert(kid.clone()), kid);
        let d = enc.decrypt_event(*id, &rows[id]).await.unwrap();
        assert_eq!((d.payload, d.erased.len()), (payload(*i), 0));
    }
    assert_ne!(data_keys["cust-A"], data_keys["cust-B"]);

    // Without the keystore: a clear error, not "unknown key".
    let k = keys.to_str().unwrap();
    let (id0, _, _) = events[0];
    let (code, _, err) = outboxd_cli(
        &["decrypt", "--keys", k, "--event-id", &id0.to_string()],
        &rows[&id0].to_string(),
    );
    assert_eq!(code, 1);
    assert!(err.contains("--keystore"), "{err}");

    // Forget A.
    let (code, _, err) = outboxd_cli(
        &[
            "keys",
            "forget",
            "--aggregate",
            "cust-A",
            "--keystore",
            &dsn,
            "--source",
            &dsn,
        ],
        "",
    );
    assert_eq!(code, 2, "asks for --yes: {err}");
    assert!(err.contains("--yes"), "{err}");
    let (code, out, err) = outboxd_cli(
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
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&data_keys["cust-A"]), "{out}");
    assert!(err.contains("rolled off"), "{err}");

    for (id, agg, i) in &events {
        let d = enc.decrypt_event(*id, &rows[id]).await.unwrap();
        if *agg == "cust-A" {
            let mut want = payload(*i);
            want["customer"]["name"] = Value::Null;
            want["customer"]["tax_id"] = Value::Null;
            want["lines"][0]["note"] = Value::Null;
            want["lines"][1]["note"] = Value::Null;
            assert_eq!(
                d.payload, want,
                "clear fields survive, sensitive ones are erased"
            );
            assert_eq!(
                d.erased,
                vec![
                    "/customer/name",
                    "/customer/tax_id",
                    "/lines/0/note",
                    "/lines/1/note"
                ]
            );
        } else {
            assert_eq!((d.payload, d.erased.len()), (payload(*i), 0));
        }
    }
    // The command: exit 0, null on stdout, the erased fields on stderr.
    let (code, out, err) = outboxd_cli(
        &[
            "decrypt",
            "--keys",
            k,
            "--keystore",
            &dsn,
            "--event-id",
            &id0.to_string(),
        ],
        &rows[&id0].to_string(),
    );
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["customer"]["name"], Value::Null);
    assert_eq!(v["customer"]["country"], "TR");
    assert!(err.contains("/customer/tax_id: erased"), "{err}");

    // A later event of A gets a new key and is readable.
    let mut tx = client.transaction().await.unwrap();
    let later = outbox
        .write(&mut tx, "t", "cust-A", &payload(9))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let row: String = client
        .query_one("SELECT payload::text FROM outbox WHERE id = $1", &[&later])
        .await
        .unwrap()
        .get(0);
    let row: Value = serde_json::from_str(&row).unwrap();
    assert_ne!(
        crypto::key_ids_in(&row).keys().next().unwrap(),
        &data_keys["cust-A"]
    );
    assert_eq!(
        enc.decrypt_event(later, &row).await.unwrap().payload,
        payload(9)
    );

    // Rotating the keyring: reencrypt re-wraps the data keys, then the old key can go.
    let old = keyring.current_id().to_string();
    keyring.rotate();
    keyring.save_replace(&keys).unwrap();
    let schema_path = dir.path().join("schema.json");
    std::fs::write(
        &schema_path,
        r#"{"customer": {"properties": {"name": {"x-gdpr-sensitive": true}}}}"#,
    )
    .unwrap();
    let (code, _, err) = outboxd_cli(
        &[
            "keys",
            "retire",
            &old,
            "--keys",
            k,
            "--keystore",
            &dsn,
            "--yes",
        ],
        "",
    );
    assert_eq!(code, 1, "data keys still wrapped by it: {err}");
    assert!(err.contains("still wrapped by key"), "{err}");
    let (code, out, err) = outboxd_cli(
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
    );
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("re-wrapped 2 data keys"), "{err}");
    assert!(out.contains("per-aggregate data keys"), "{out}");
    assert!(
        out.contains("rewrote 0"),
        "data-key values stay as they are: {out}"
    );
    let (code, _, err) = outboxd_cli(
        &[
            "keys",
            "retire",
            &old,
            "--keys",
            k,
            "--keystore",
            &dsn,
            "--source",
            &dsn,
            "--yes",
        ],
        "",
    );
    assert_eq!(code, 0, "{err}");
    let keyring = Keyring::load(&keys).unwrap();
    let enc = Encryptor::new(keyring, Schema::default())
        .with_keystore(crypto::shred::Keystore::connect(&dsn).await.unwrap());
    let (id1, _, i1) = events[1];
    assert_eq!(
        enc.decrypt_event(id1, &rows[&id1]).await.unwrap().payload,
        payload(i1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_rabbitmq_the_body_is_the_stored_ciphertext_and_the_consumer_reads_it() {
    use common::amqp::{self, message_id, Topology};
    let db = PgDb::create("crypt_rmq").await;
    let mut topo = Topology::new("xc").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let dsn = db.dsn();
    let sink = amqp::url();
    let _relay = Relay::start_with_env(
        &[
            "run",
            "--source",
            &dsn,
            "--name",
            &name,
            "--exchange",
            &topo.exchange,
            "--log-level",
            "info,lapin=warn",
        ],
        &[("OUTBOXD_SINK", &sink)],
    );
    wait_for("the relay's slot to be active", T, || db.slot_active(&slot)).await;
    topo.wait_declared(T).await;
    let queue = topo.bind_queue("all", "#").await;

    let keyring = Keyring::generate(8).unwrap();
    let outbox = outboxd::Outbox::new("outbox")
        .unwrap()
        .with_encryption(Encryptor::new(keyring.clone(), schema()));
    let mut client = db.client().await;
    let mut ids = Vec::new();
    let mut tx = client.transaction().await.unwrap();
    for i in 0..20 {
        ids.push(
            outbox
                .write(&mut tx, "invoice.issued", &format!("inv-{i}"), &payload(i))
                .await
                .unwrap(),
        );
    }
    tx.commit().await.unwrap();
    let stored: BTreeMap<Uuid, String> = client
        .query("SELECT id, payload::text FROM outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();

    let deliveries = topo.take(&queue, 20, T).await;
    for d in &deliveries {
        let id = message_id(d);
        let i = ids.iter().position(|x| *x == id).unwrap();
        let body = std::str::from_utf8(&d.data).unwrap();
        assert_eq!(
            body, stored[&id],
            "the body is the stored text byte for byte"
        );
        assert_sealed(body, i);
        let v: Value = serde_json::from_str(body).unwrap();
        assert_eq!(
            crypto::decrypt_payload(&keyring, id, &v).unwrap(),
            payload(i)
        );
    }
}

/// A poll relay claiming while `reencrypt` holds a batch: every aggregate's versions are first
/// delivered in order. The overlap is made certain by a trigger on the table that makes
/// reencrypt's first rewrite wait on an advisory lock the test holds — by then its batch is
/// locked — and the relay is started only once reencrypt waits there. The lock is released only
/// when every pending row that reencrypt does not hold has been published (the row's `xmax` is
/// the waiting transaction's id for the rows it holds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_relay_during_reencrypt_publishes_each_aggregate_in_order() {
    let db = PgDb::create("reencpoll").await;
    let mut client = db.client().await;
    let clear = outboxd::Outbox::new("outbox").unwrap();
    // Three rows already published by poll mode, then four versions of five aggregates, still
    // pending, in one transaction (so the relay's claim order is their insert order).
    let mut tx = client.transaction().await.unwrap();
    let mut published = Vec::new();
    for i in 0..3 {
        published.push(
            clear
                .write(&mut tx, "t", "done", &payload(i))
                .await
                .unwrap(),
        );
    }
    tx.commit().await.unwrap();
    client
        .execute(
            "UPDATE outbox SET status = 'published', published_at = now() WHERE id = ANY($1)",
            &[&published],
        )
        .await
        .unwrap();
    let mut version_of: HashMap<Uuid, (String, usize)> = HashMap::new();
    let mut tx = client.transaction().await.unwrap();
    for v in 1..=4 {
        for a in 0..5 {
            let agg = format!("agg{a}");
            let id = clear
                .write(&mut tx, "t", &agg, &payload(10 * v + a))
                .await
                .unwrap();
            version_of.insert(id, (agg, v));
        }
    }
    tx.commit().await.unwrap();
    client
        .batch_execute(
            "CREATE FUNCTION hold_rewrite() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN PERFORM pg_advisory_xact_lock(4242); RETURN NEW; END $$;
             CREATE TRIGGER hold_rewrite BEFORE UPDATE ON outbox FOR EACH ROW
               WHEN (OLD.payload::text IS DISTINCT FROM NEW.payload::text)
               EXECUTE FUNCTION hold_rewrite();
             SELECT pg_advisory_lock(4242);",
        )
        .await
        .unwrap();

    // The first batch covers the published rows and the first two versions of every aggregate.
    let keyring = Keyring::generate(8).unwrap();
    let enc = Encryptor::new(keyring, schema());
    let mut rclient = db.client().await;
    let reenc = tokio::spawn(async move {
        let table = TableName::parse("outbox").unwrap();
        let opts = reencrypt::Options {
            batch: 13,
            after: None,
            limit: None,
            include_pending: false,
        };
        reencrypt::run(
            &mut rclient,
            &table,
            &ColumnMap::default(),
            &enc,
            &opts,
            &CancellationToken::new(),
            |_| {},
        )
        .await
        .unwrap()
    });
    let admin = pg_connect(PG_ADMIN).await;
    let waiting = "SELECT 1 FROM pg_stat_activity WHERE datname = $1 AND wait_event_type = 'Lock' AND wait_event = 'advisory'";
    wait_for("reencrypt waits with its batch locked", T, || async {
        admin
            .query_opt(waiting, &[&db.name])
            .await
            .unwrap()
            .is_some()
    })
    .await;

    let dsn = db.dsn();
    let relay = Relay::start(&common::poll::stdout_args(&dsn, "rp", "20ms", "5"));
    let unheld = "SELECT count(*) FROM outbox o WHERE o.status = 'pending' AND NOT EXISTS (
                    SELECT 1 FROM pg_stat_activity a WHERE a.wait_event_type = 'Lock'
                       AND a.wait_event = 'advisory' AND a.backend_xid = o.xmax)";
    wait_for(
        "every pending row reencrypt does not hold is published",
        T,
        || async {
            client
                .query_one(unheld, &[])
                .await
                .unwrap()
                .get::<_, i64>(0)
                == 0
        },
    )
    .await;
    client
        .execute("SELECT pg_advisory_unlock(4242)", &[])
        .await
        .unwrap();
    let p = reenc.await.unwrap();
    wait_for("every row published", T, || async {
        client
            .query_one("SELECT count(*) FROM outbox WHERE status = 'pending'", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
            == 0
    })
    .await;

    let mut seen = std::collections::HashSet::new();
    let mut firsts: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for id in common::poll::ids(&relay) {
        if seen.insert(id) {
            let (agg, v) = &version_of[&id];
            firsts.entry(agg.clone()).or_default().push(*v);
        }
    }
    assert_eq!(seen.len(), 20, "every pending row published");
    for (agg, versions) in &firsts {
        assert_eq!(
            versions,
            &vec![1, 2, 3, 4],
            "{agg}: first deliveries out of version order"
        );
    }
    // The first batch's ten pending rows were left alone; by the second batch (after the
    // release) the relay had published every row, so its ten were re-sealed.
    assert_eq!(
        (p.scanned, p.rewritten, p.skipped_pending),
        (23, 13, 10),
        "published rows re-sealed, pending ones left: {p:?}"
    );
    let sealed = client
        .query_one(
            "SELECT count(*) FROM outbox WHERE payload::text LIKE '%enc:v1:%'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0);
    assert_eq!(sealed, 13, "the rows left pending stayed as they were");
    // With the poll relay still connected, --include-pending is refused with the fix.
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.json");
    Keyring::generate(8).unwrap().save_new(&keys).unwrap();
    let schema_path = dir.path().join("schema.json");
    std::fs::write(
        &schema_path,
        r#"{"properties": {"customer": {"properties": {"name": {"x-gdpr-sensitive": true}}}}}"#,
    )
    .unwrap();
    let (code, out, err) = outboxd_cli(
        &[
            "reencrypt",
            "--source",
            &dsn,
            "--keys",
            keys.to_str().unwrap(),
            "--schema",
            schema_path.to_str().unwrap(),
            "--include-pending",
        ],
        "",
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("a poll relay is connected to this database (outboxd_rp_poll)")
            && err.contains("without --include-pending"),
        "{err}"
    );
    assert!(out.is_empty(), "{out}");
}

/// A row whose (nullable) status is NULL is no row a poll relay claims: reencrypt rewrites it
/// like a published one, and still leaves the pending one alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reencrypt_rewrites_a_row_with_a_null_status_and_leaves_a_pending_one() {
    let db = PgDb::create("reencnull").await;
    let mut client = db.client().await;
    client
        .batch_execute("ALTER TABLE outbox ALTER COLUMN status DROP NOT NULL")
        .await
        .unwrap();
    let clear = outboxd::Outbox::new("outbox").unwrap();
    let mut tx = client.transaction().await.unwrap();
    let null_row = clear.write(&mut tx, "t", "a", &payload(1)).await.unwrap();
    let pending_row = clear.write(&mut tx, "t", "a", &payload(2)).await.unwrap();
    tx.commit().await.unwrap();
    client
        .execute(
            "UPDATE outbox SET status = NULL WHERE id = $1",
            &[&null_row],
        )
        .await
        .unwrap();
    let enc = Encryptor::new(Keyring::generate(8).unwrap(), schema());
    let p = reencrypt::run(
        &mut client,
        &TableName::parse("outbox").unwrap(),
        &ColumnMap::default(),
        &enc,
        &reencrypt::Options::default(),
        &CancellationToken::new(),
        |_| {},
    )
    .await
    .unwrap();
    assert_eq!(
        (p.scanned, p.rewritten, p.skipped_pending),
        (2, 1, 1),
        "{p:?}"
    );
    let text = |id: Uuid| {
        let client = &client;
        async move {
            client
                .query_one("SELECT payload::text FROM outbox WHERE id = $1", &[&id])
                .await
                .unwrap()
                .get::<_, String>(0)
        }
    };
    assert_sealed(&text(null_row).await, 1);
    assert!(
        text(pending_row).await.contains("TAX0000002"),
        "left in clear"
    );
}
