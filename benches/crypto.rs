//! Field-encryption benchmark: `cargo bench --bench crypto`.
//!
//! 1. Single fields: encrypt and decrypt of a 10-byte tax id and a 200-byte note (fields/s,
//!    one core).
//! 2. Payloads: a typical invoice (6 fields, 2 sensitive) and a nested order (20 fields, 6
//!    sensitive across an array): encrypt_payload / decrypt_payload against the parse+serialise
//!    a producer or consumer does anyway (the overhead a consumer sees per message).
//! 3. Producer: `Outbox::write` into Postgres, transactions of 100, with and without the
//!    encryption hook (skipped when Postgres is not reachable).
//!
//! `OUTBOXD_BENCH_SECONDS` (default 2) is the time per in-memory measurement,
//! `OUTBOXD_BENCH_WRITES` (default 20,000) the rows per producer run. Under `cargo test
//! --all-targets` (no `--bench` argument) it runs as a quick smoke test of a few hundred
//! milliseconds whose figures mean nothing.

/// Whether cargo bench (not cargo test) runs us.
fn benching() -> bool {
    std::env::args().any(|a| a == "--bench")
}

use outboxd::crypto::{self, Encryptor, Keyring, Schema};
use serde_json::{json, Value};
use std::hint::black_box;
use std::time::{Duration, Instant};
use uuid::Uuid;

fn measure(what: &str, unit_per_iter: f64, unit: &str, mut f: impl FnMut()) -> f64 {
    let secs: f64 = std::env::var("OUTBOXD_BENCH_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if benching() { 2.0 } else { 0.02 });
    for _ in 0..1000 {
        f();
    }
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < Duration::from_secs_f64(secs) {
        for _ in 0..100 {
            f();
        }
        n += 100;
    }
    let el = start.elapsed().as_secs_f64();
    let rate = n as f64 * unit_per_iter / el;
    println!(
        "{what:<58} {:>12.0} {unit}/s  ({:.2} µs per call)",
        rate,
        el * 1e6 / n as f64
    );
    rate
}

fn invoice() -> (Value, Schema) {
    (
        json!({"invoice_id": 1042, "customer_name": "Ayşe Yılmaz", "tax_id": "1234567890",
               "total": "1250.00", "currency": "TRY", "issued_at": "2025-01-31T10:00:00Z"}),
        Schema::from_value(&json!({
            "invoice_id": {"x-gdpr-sensitive": false},
            "customer_name": {"x-gdpr-sensitive": true},
            "tax_id": {"x-gdpr-sensitive": true},
            "total": {"x-gdpr-sensitive": false},
        }))
        .unwrap(),
    )
}

fn order() -> (Value, Schema) {
    (
        json!({
            "order_id": 77, "status": "placed", "currency": "EUR", "total": 129.9,
            "customer": {"id": 5, "name": "Jane Roe", "email": "jane@example.com",
                         "phone": "+49 30 1234567", "segment": "retail"},
            "shipping": {"street": "Hauptstr. 1", "city": "Berlin", "zip": "10115", "country": "DE"},
            "lines": [
                {"sku": "A-1", "qty": 1, "gift_note": "Happy birthday, Max!"},
                {"sku": "B-2", "qty": 2, "gift_note": null},
                {"sku": "C-3", "qty": 1, "gift_note": "For the office"}
            ]
        }),
        Schema::from_value(&json!({"properties": {
            "customer": {"properties": {
                "name": {"x-gdpr-sensitive": true},
                "email": {"x-gdpr-sensitive": true},
                "phone": {"x-gdpr-sensitive": true}}},
            "shipping": {"properties": {"street": {"x-gdpr-sensitive": true}}},
            "lines": {"items": {"properties": {"gift_note": {"x-gdpr-sensitive": true}}}}
        }}))
        .unwrap(),
    )
}

async fn producer(keyring: &Keyring) {
    let admin = "host=127.0.0.1 port=5432 user=postgres dbname=test";
    let Ok((c, conn)) = tokio_postgres::connect(admin, tokio_postgres::NoTls).await else {
        println!("producer: Postgres not reachable at 127.0.0.1:5432, skipped");
        return;
    };
    tokio::spawn(conn);
    let writes: usize = std::env::var("OUTBOXD_BENCH_WRITES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if benching() { 20_000 } else { 800 });
    let db = format!("bench_crypto_{}", std::process::id());
    c.batch_execute(&format!("CREATE DATABASE {db}"))
        .await
        .unwrap();
    let (mut client, conn) = tokio_postgres::connect(
        &format!("host=127.0.0.1 port=5432 user=postgres dbname={db}"),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    client
        .batch_execute(include_str!("../migrations/postgres/001_outbox.sql"))
        .await
        .unwrap();
    let (p, schema) = invoice();
    let plain = outboxd::Outbox::new("outbox").unwrap();
    let sealed = plain
        .clone()
        .with_encryption(Encryptor::new(keyring.clone(), schema));
    // Alternate the two so that table growth and caches hit both alike.
    let mut rates = [0f64; 2];
    for round in 0..4 {
        for (k, ob) in [(0, &plain), (1, &sealed)] {
            let start = Instant::now();
            for _ in 0..writes / 4 / 100 {
                let mut tx = client.transaction().await.unwrap();
                for _ in 0..100 {
                    ob.write(&mut tx, "invoice.issued", "inv", &p)
                        .await
                        .unwrap();
                }
                tx.commit().await.unwrap();
            }
            let r = (writes / 4 / 100 * 100) as f64 / start.elapsed().as_secs_f64();
            if round > 0 {
                rates[k] += r / 3.0;
            }
        }
    }
    println!(
        "{:<58} {:>12.0} rows/s",
        "producer: Outbox::write, tx of 100, no encryption", rates[0]
    );
    println!(
        "{:<58} {:>12.0} rows/s  ({:+.1}%)",
        "producer: Outbox::write, tx of 100, invoice encrypted",
        rates[1],
        (rates[1] / rates[0] - 1.0) * 100.0
    );
    drop(client);
    let _ = c
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await;
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    if !benching() {
        println!("crypto bench: smoke run (use `cargo bench --bench crypto` for figures)");
    }
    let keyring = Keyring::generate(8).unwrap();
    let ev = Uuid::now_v7();
    println!("== single fields (one core)");
    let tax = json!("1234567890");
    let note = json!("x".repeat(200));
    let s_tax = crypto::encrypt_value(&keyring, ev, "/tax_id", &tax).unwrap();
    let s_note = crypto::encrypt_value(&keyring, ev, "/note", &note).unwrap();
    measure("encrypt 10-byte string field", 1.0, "fields", || {
        black_box(crypto::encrypt_value(&keyring, ev, "/tax_id", black_box(&tax)).unwrap());
    });
    measure("decrypt 10-byte string field", 1.0, "fields", || {
        black_box(crypto::decrypt_value(&keyring, ev, "/tax_id", black_box(&s_tax)).unwrap());
    });
    measure("encrypt 200-byte string field", 1.0, "fields", || {
        black_box(crypto::encrypt_value(&keyring, ev, "/note", black_box(&note)).unwrap());
    });
    measure("decrypt 200-byte string field", 1.0, "fields", || {
        black_box(crypto::decrypt_value(&keyring, ev, "/note", black_box(&s_note)).unwrap());
    });

    for (name, (p, schema), sensitive) in [("invoice", invoice(), 2.0), ("order", order(), 7.0)] {
        println!("== {name} payload ({sensitive} sensitive fields)");
        let text = p.to_string();
        let sealed = crypto::encrypt_payload(&keyring, &schema, ev, &p).unwrap();
        let sealed_text = sealed.to_string();
        println!(
            "   size: {} bytes clear, {} bytes encrypted",
            text.len(),
            sealed_text.len()
        );
        let base_p = measure(
            &format!("{name}: producer baseline (serialise)"),
            1.0,
            "payloads",
            || {
                black_box(serde_json::to_string(black_box(&p)).unwrap());
            },
        );
        let enc_p = measure(
            &format!("{name}: producer encrypt_payload + serialise"),
            1.0,
            "payloads",
            || {
                let e = crypto::encrypt_payload(&keyring, &schema, ev, black_box(&p)).unwrap();
                black_box(serde_json::to_string(&e).unwrap());
            },
        );
        let base_c = measure(
            &format!("{name}: consumer baseline (parse)"),
            1.0,
            "payloads",
            || {
                black_box(serde_json::from_str::<Value>(black_box(&text)).unwrap());
            },
        );
        let dec_c = measure(
            &format!("{name}: consumer parse + decrypt_payload"),
            1.0,
            "payloads",
            || {
                let v: Value = serde_json::from_str(black_box(&sealed_text)).unwrap();
                black_box(crypto::decrypt_payload(&keyring, ev, &v).unwrap());
            },
        );
        println!(
            "   => {:.0} fields/s encrypted, {:.0} fields/s decrypted; producer CPU per payload ×{:.1}, consumer ×{:.1}",
            enc_p * sensitive,
            dec_c * sensitive,
            base_p / enc_p,
            base_c / dec_c
        );
    }
    println!("== producer into Postgres");
    producer(&keyring).await;
}
