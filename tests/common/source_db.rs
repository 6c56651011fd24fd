//! One test scenario over either source database: what a scenario needs of a test database
//! (create it, its DSN, wait until a relay streams from it, write events now or in the
//! background) behind one trait, implemented for Postgres ([`PgDb`]) and MariaDB ([`MyDb`]),
//! so a test is written once and run as a `pg_…` and a `mariadb_…` test.

use super::*;
use std::sync::Arc;
use uuid::Uuid;

const T: Duration = Duration::from_secs(90);

/// A stored position or an event's place in the log, comparable within one source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Pos {
    /// Postgres: the stored end LSN, or an event's commit LSN.
    Lsn(u64),
    /// Binlog: (file sequence, end position of the transaction).
    Binlog(u64, u64),
}

impl Pos {
    /// Whether an event at `self` comes after the stored position `stored`: it is delivered
    /// again when the relay resumes from there.
    pub fn after(self, stored: Pos) -> bool {
        match (self, stored) {
            // A commit LSN is below its own end LSN, and at or above the previous one's.
            (Pos::Lsn(e), Pos::Lsn(s)) => e >= s,
            (a, b) => a > b,
        }
    }

    /// From an `x-source-position` header: `commit_lsn:index` or `file:end_pos:index`.
    pub fn of_event(s: &str) -> Option<Pos> {
        Pos::of_event_indexed(s).map(|(pos, _)| pos)
    }

    /// The same with the event's index in its transaction: the event's place in the log.
    pub fn of_event_indexed(s: &str) -> Option<(Pos, u64)> {
        let mut parts = s.rsplitn(3, ':');
        let index = parts.next()?.parse().ok()?;
        let b = parts.next()?;
        let pos = match parts.next() {
            None => outboxd::event::parse_lsn(b).map(Pos::Lsn)?,
            Some(file) => Pos::Binlog(outboxd::event::binlog_file_seq(file), b.parse().ok()?),
        };
        Some((pos, index))
    }
}

#[allow(async_fn_in_trait)]
pub trait SourceDb: Sized {
    /// What the tests call this database in their names and messages.
    const LABEL: &'static str;
    async fn create(prefix: &str) -> Self;
    fn dsn(&self) -> String;
    /// Waits until relay `name` streams from this database (a first start has taken its
    /// start position: what is committed from now on reaches it).
    async fn wait_streaming(&self, name: &str);
    /// Writes `n_tx` transactions of `per_tx` events on topic `topic`; the ids in commit order.
    async fn write(&self, n_tx: usize, per_tx: usize, topic: &str) -> Vec<Uuid>;
    /// The same from a task of its own, with `pause` between transactions, on a connection of
    /// its own.
    fn write_in_background(
        &self,
        n_tx: usize,
        per_tx: usize,
        pause: Duration,
        topic: &'static str,
    ) -> tokio::task::JoinHandle<Vec<Uuid>> {
        self.background_writer(per_tx, pause, topic, move |written| written < n_tx)
    }
    /// Transactions of `per_tx` events from a task of its own until `stop` is set, `pause`
    /// between them; the ids in commit order.
    fn write_until(
        &self,
        stop: Arc<std::sync::atomic::AtomicBool>,
        per_tx: usize,
        pause: Duration,
        topic: &'static str,
    ) -> tokio::task::JoinHandle<Vec<Uuid>> {
        self.background_writer(per_tx, pause, topic, move |_| {
            !stop.load(std::sync::atomic::Ordering::Relaxed)
        })
    }
    /// What both of the above run: one transaction of `per_tx` events at a time, on a
    /// connection of the task's own, while `more(transactions written so far)` holds.
    fn background_writer(
        &self,
        per_tx: usize,
        pause: Duration,
        topic: &'static str,
        more: impl FnMut(usize) -> bool + Send + 'static,
    ) -> tokio::task::JoinHandle<Vec<Uuid>>;
    /// A DSN for this database through a local port (the TCP fault proxy's).
    fn dsn_via(&self, port: u16) -> String;
    /// The server's address, for a proxy in front of it.
    fn server_addr() -> std::net::SocketAddr;
    /// The `lease_holder` of relay `name` in `outboxd_state` (`None`: no row or no holder).
    async fn lease_holder(&self, name: &str) -> Option<String>;
    /// The position relay `name` has stored (`None`: none yet).
    async fn stored_pos(&self, name: &str) -> Option<Pos>;
    /// The aggregate id the writers give the `n`-th event.
    fn aggregate(n: usize) -> String;
    /// Whether `pos` has the shape of this source's `x-source-position`.
    fn is_position(pos: &str) -> bool;
    /// Runs `sql` (one statement, or several separated by `;`) in this database.
    async fn exec(&self, sql: &str);
    /// Makes the outbox's `id` column text (Postgres `text`, MySQL `VARCHAR(64)`), so a row can
    /// hold an id that is no UUID.
    async fn id_as_text(&self);
}

impl SourceDb for PgDb {
    const LABEL: &'static str = "Postgres";

    async fn create(prefix: &str) -> Self {
        PgDb::create(prefix).await
    }

    fn dsn(&self) -> String {
        PgDb::dsn(self)
    }

    async fn wait_streaming(&self, name: &str) {
        let slot = format!("outboxd_{name}");
        wait_for("the relay's slot to be active", T, || {
            self.slot_active(&slot)
        })
        .await;
    }

    async fn write(&self, n_tx: usize, per_tx: usize, topic: &str) -> Vec<Uuid> {
        write_events(&mut self.client().await, n_tx, per_tx, topic).await
    }

    fn background_writer(
        &self,
        per_tx: usize,
        pause: Duration,
        topic: &'static str,
        mut more: impl FnMut(usize) -> bool + Send + 'static,
    ) -> tokio::task::JoinHandle<Vec<Uuid>> {
        let conninfo = self.conninfo();
        tokio::spawn(async move {
            let mut c = pg_connect(&conninfo).await;
            let mut ids = Vec::new();
            let mut written = 0;
            while more(written) {
                ids.extend(write_events(&mut c, 1, per_tx, topic).await);
                written += 1;
                tokio::time::sleep(pause).await;
            }
            ids
        })
    }

    fn dsn_via(&self, port: u16) -> String {
        PgDb::dsn_via(self, port)
    }

    fn server_addr() -> std::net::SocketAddr {
        "127.0.0.1:5432".parse().unwrap()
    }

    async fn lease_holder(&self, name: &str) -> Option<String> {
        self.client()
            .await
            .query_opt(
                "SELECT lease_holder FROM outboxd_state WHERE name = $1",
                &[&name],
            )
            .await
            .ok()??
            .get(0)
    }

    async fn stored_pos(&self, name: &str) -> Option<Pos> {
        let row = self
            .client()
            .await
            .query_opt(
                "SELECT position_lsn::text FROM outboxd_state WHERE name = $1",
                &[&name],
            )
            .await
            .ok()??;
        let lsn: Option<String> = row.get(0);
        lsn.and_then(|l| outboxd::event::parse_lsn(&l))
            .map(Pos::Lsn)
    }

    fn aggregate(n: usize) -> String {
        format!("agg-{}", n % 97)
    }

    fn is_position(pos: &str) -> bool {
        // commit_lsn:index, the LSN as X/X
        pos.split(':').next().is_some_and(|lsn| lsn.contains('/'))
    }

    async fn exec(&self, sql: &str) {
        self.client()
            .await
            .batch_execute(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    async fn id_as_text(&self) {
        self.exec("ALTER TABLE outbox ALTER COLUMN id TYPE text")
            .await
    }
}

impl SourceDb for MyDb {
    const LABEL: &'static str = "MariaDB";

    async fn create(prefix: &str) -> Self {
        MyDb::create(prefix).await
    }

    fn dsn(&self) -> String {
        MyDb::dsn(self)
    }

    async fn wait_streaming(&self, _name: &str) {
        wait_for("the relay's binlog dump thread", T, || self.streaming()).await;
    }

    async fn write(&self, n_tx: usize, per_tx: usize, topic: &str) -> Vec<Uuid> {
        my_write_events(&mut self.conn().await, n_tx, per_tx, topic).await
    }

    fn background_writer(
        &self,
        per_tx: usize,
        pause: Duration,
        topic: &'static str,
        mut more: impl FnMut(usize) -> bool + Send + 'static,
    ) -> tokio::task::JoinHandle<Vec<Uuid>> {
        let name = self.name.clone();
        tokio::spawn(async move {
            let mut c = my_connect(Some(&name)).await;
            let mut ids = Vec::new();
            let mut written = 0;
            while more(written) {
                ids.extend(my_write_events(&mut c, 1, per_tx, topic).await);
                written += 1;
                tokio::time::sleep(pause).await;
            }
            ids
        })
    }

    fn dsn_via(&self, port: u16) -> String {
        MyDb::dsn_via(self, port)
    }

    fn server_addr() -> std::net::SocketAddr {
        format!("{MY_HOST}:{MY_PORT}").parse().unwrap()
    }

    async fn lease_holder(&self, name: &str) -> Option<String> {
        let mut c = self.conn().await;
        my_value(
            &mut c,
            &format!("SELECT lease_holder FROM outboxd_state WHERE name = '{name}'"),
        )
        .await
    }

    async fn stored_pos(&self, name: &str) -> Option<Pos> {
        let (file, pos, _) = self.stored(name).await?;
        Some(Pos::Binlog(outboxd::event::binlog_file_seq(&file), pos))
    }

    fn aggregate(n: usize) -> String {
        (n % 97).to_string()
    }

    fn is_position(pos: &str) -> bool {
        // file:end_pos:index
        let parts: Vec<&str> = pos.split(':').collect();
        parts.len() == 3 && parts[1].parse::<u64>().is_ok() && parts[2].parse::<u64>().is_ok()
    }

    async fn exec(&self, sql: &str) {
        my_exec(&mut self.conn().await, sql).await
    }

    async fn id_as_text(&self) {
        self.exec("ALTER TABLE outbox MODIFY id VARCHAR(64) NOT NULL")
            .await
    }
}

/// Runs each named scenario `async fn name<D: SourceDb>()` as two tests, `name::postgres` and
/// `name::mariadb`.
#[allow(unused_macros)] // not every test binary has scenarios over both sources
macro_rules! on_both_sources {
    ($($scenario:ident),* $(,)?) => {$(
        mod $scenario {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                super::$scenario::<$crate::common::PgDb>().await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn mariadb() {
                super::$scenario::<$crate::common::MyDb>().await
            }
        }
    )*};
}
#[allow(unused_imports)] // the same
pub(crate) use on_both_sources;
