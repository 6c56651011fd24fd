//! What several benches share: process figures from /proc and the MariaDB side (connection, a
//! database with the outbox table, the backlog rows, the binlog head). Each bench is its own
//! crate and includes this file with `mod support;`; not every bench uses every item.
#![allow(dead_code)]

use mysql_async::prelude::Queryable;

/// Resident set size of a process, KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// User + system CPU seconds of a process (from /proc/PID/stat, in clock ticks of 1/100 s).
pub fn cpu_secs(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0)
}

/// The 1-, 5- and 15-minute load average, as /proc/loadavg says it.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

pub fn my_opts(db: Option<&str>) -> mysql_async::OptsBuilder {
    mysql_async::OptsBuilder::default()
        .ip_or_hostname("127.0.0.1")
        .tcp_port(3306)
        .user(Some("root"))
        .db_name(db)
        .prefer_socket(false)
}

pub async fn my_connect(db: Option<&str>) -> mysql_async::Conn {
    mysql_async::Conn::new(my_opts(db))
        .await
        .unwrap_or_else(|e| panic!("MariaDB at 127.0.0.1:3306: {e}; run scripts/services.sh"))
}

/// Creates database `db` with the contract's outbox table; returns a session in it.
pub async fn my_create_db(db: &str) -> mysql_async::Conn {
    let mut admin = my_connect(None).await;
    admin
        .query_drop(format!("CREATE DATABASE `{db}`"))
        .await
        .unwrap();
    let mut c = my_connect(Some(db)).await;
    c.query_drop(include_str!("../../migrations/mysql/001_outbox.sql"))
        .await
        .unwrap();
    c
}

pub async fn my_drop_db(db: &str) {
    let mut admin = my_connect(None).await;
    let _ = admin.query_drop(format!("DROP DATABASE `{db}`")).await;
}

/// `events` outbox rows of ~300-byte JSON in transactions of 100 (the rows of the Postgres
/// benches, as MariaDB's JSON_OBJECT renders them).
pub async fn my_write_backlog(c: &mut mysql_async::Conn, events: usize) {
    for i in 0..events / 100 {
        c.query_drop(format!(
            "INSERT INTO outbox (id, aggregate_id, topic, payload, created_at)
             SELECT UNHEX(REPLACE(UUID(), '-', '')), seq % 1000, 'invoice.issued',
                    JSON_OBJECT('invoice_id', seq, 'customer_name', 'Muhammet Şafak', 'tax_id', '1234567890',
                                'total', '1499.90', 'currency', 'TRY', 'lines', JSON_ARRAY(
                                JSON_OBJECT('sku', 'A-100', 'qty', 2, 'price', '499.95'),
                                JSON_OBJECT('sku', 'B-200', 'qty', 1, 'price', '500.00')),
                                'note', REPEAT('x', 60)),
                    NOW(6)
               FROM seq_{}_to_{}",
            i * 100,
            i * 100 + 99
        ))
        .await
        .unwrap();
    }
}

/// The server's binlog head, `FILE:POS`.
pub async fn my_head(c: &mut mysql_async::Conn) -> String {
    let row: mysql_async::Row = c.query_first("SHOW MASTER STATUS").await.unwrap().unwrap();
    let file: String = row.get(0).unwrap();
    let pos: u64 = row.get(1).unwrap();
    format!("{file}:{pos}")
}

/// Whether a binlog dump thread serves database `db` (the relay streams).
pub async fn my_streaming(c: &mut mysql_async::Conn, db: &str) -> bool {
    let n: Option<i64> = c
        .exec_first(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE COMMAND LIKE 'Binlog Dump%' AND DB = ?",
            (db,),
        )
        .await
        .unwrap();
    n.unwrap_or(0) > 0
}
