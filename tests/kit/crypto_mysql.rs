//! Field-level encryption on MariaDB/MySQL: `Outbox::write` on a `mysql_async` transaction
//! seals the marked fields for the row's own id before the INSERT (no plaintext in the table or
//! the binlog-fed stream), the relay moves the payload byte for byte, and a consumer decrypts
//! it.

use crate::common;

use common::*;
use outboxd::crypto::{self, Encryptor, Keyring, Schema};
use serde_json::{json, Value};
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(60);

fn payload(i: usize) -> Value {
    json!({"invoice_id": i, "customer_name": format!("Ayşe Yılmaz {i}"),
           "tax_id": format!("TAX{i:07}"), "total": "12.50"})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_write_seals_before_insert_and_the_consumer_reads_through_the_relay() {
    use mysql_async::prelude::Queryable;
    let db = MyDb::create("my_crypt").await;
    let keyring = Keyring::generate(8).unwrap();
    let schema = Schema::from_value(&json!({
        "invoice_id": {"x-gdpr-sensitive": false},
        "customer_name": {"x-gdpr-sensitive": true},
        "tax_id": {"x-gdpr-sensitive": true},
        "total": {"x-gdpr-sensitive": false},
    }))
    .unwrap();
    let outbox = outboxd::Outbox::new("outbox")
        .unwrap()
        .with_encryption(Encryptor::new(keyring.clone(), schema));

    let name = unique("r");
    let dsn = db.dsn();
    let relay = Relay::start(&["run", "--source", &dsn, "--name", &name, "--commit-offsets"]);
    wait_for("the relay's binlog dump to be connected", T, || {
        db.streaming()
    })
    .await;

    let mut c = db.conn().await;
    let mut ids = Vec::new();
    let mut tx = c.start_transaction(Default::default()).await.unwrap();
    for i in 0..10 {
        ids.push(
            outbox
                .write(&mut tx, "invoice.issued", &(i + 1).to_string(), &payload(i))
                .await
                .unwrap(),
        );
    }
    tx.commit().await.unwrap();

    let rows: Vec<(Vec<u8>, String)> = c
        .query("SELECT id, CAST(payload AS CHAR) FROM outbox")
        .await
        .unwrap();
    assert_eq!(rows.len(), 10);
    for (id, text) in &rows {
        let id = Uuid::from_slice(id).unwrap();
        let i = ids.iter().position(|x| *x == id).unwrap();
        assert!(
            !text.contains("Ayşe") && !text.contains(&format!("TAX{i:07}")),
            "{text}"
        );
        assert!(text.contains("enc:v1:") && text.contains("12.50"), "{text}");
    }

    wait_for("10 events on stdout", T, || {
        let n = relay.line_count();
        async move { n >= 10 }
    })
    .await;
    for line in parse_lines(&relay.lines()) {
        let id = Uuid::parse_str(line["id"].as_str().unwrap()).unwrap();
        let i = ids.iter().position(|x| *x == id).unwrap();
        assert!(!line.to_string().contains("Ayşe"));
        assert_eq!(
            crypto::decrypt_payload(&keyring, id, &line["payload"]).unwrap(),
            payload(i)
        );
    }
}
