//! A run decided before it starts: the source, the mode and every setting `outboxd run` reads
//! from its flags, as one value that can run again (a fleet restarts a failed source from it).
//! [`RunPlan::run`] picks the pipeline for the source and mode; the command line builds the
//! plan (`commands::run`), and so does `outboxd fleet` from each source's file.

use super::{RelayStats, RunConfig};
use crate::dsn::{DbDsn, SourceDsn};
use crate::outbox::Mode;
use crate::source::mysql::hub::MysqlHub;
use crate::source::mysql::log::MySqlOptions;
use crate::source::poll::PollOptions;
use crate::source::postgres::log::PgOptions;
use crate::Error;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// One relay's run, validated.
#[derive(Debug, Clone)]
pub struct RunPlan {
    pub source: SourceDsn,
    pub mode: Mode,
    pub cfg: RunConfig,
    pub postgres: PgOptions,
    pub mysql: MySqlOptions,
    pub poll: PollOptions,
}

impl RunPlan {
    /// The database server the source reads (`host:port`, no credentials); `None` for binlog
    /// files. Sources of one server are the ones a shared log stream could serve together.
    pub fn server(&self) -> Option<String> {
        match &self.source {
            SourceDsn::Postgres(d) | SourceDsn::Mysql(d) => Some(format!("{}:{}", d.host, d.port)),
            SourceDsn::File(_) => None,
        }
    }

    /// Where this plan can read its binlog through its server's shared stream: a MySQL/MariaDB
    /// CDC source keeping its position in `outboxd_state` (an offset file, a binlog-file source,
    /// poll mode and Postgres read on their own). The DSN opens the shared stream.
    pub fn shared_binlog(&self) -> Option<&DbDsn> {
        match (&self.source, self.mode) {
            (SourceDsn::Mysql(dsn), Mode::Cdc) if self.mysql.offset_file.is_none() => Some(dsn),
            _ => None,
        }
    }

    /// [`RunPlan::run`], the binlog read through `hub` (its server's shared stream) where
    /// [`RunPlan::shared_binlog`] allows it.
    pub async fn run_shared(
        self,
        shutdown: CancellationToken,
        hub: MysqlHub,
    ) -> Result<Arc<RelayStats>, Error> {
        if self.shared_binlog().is_none() {
            return self.run(shutdown).await;
        }
        let RunPlan {
            source,
            mut cfg,
            mysql,
            ..
        } = self;
        let SourceDsn::Mysql(dsn) = source else {
            unreachable!("shared_binlog is a MySQL source's")
        };
        cfg.relay.stop = Some(shutdown.clone());
        super::run_mysql_shared(dsn, mysql, cfg, hub, shutdown).await
    }

    /// Runs the plan until `shutdown` is cancelled (then stops gracefully) or an error. The
    /// relay's stop is `shutdown` too, whatever the plan held.
    pub async fn run(self, shutdown: CancellationToken) -> Result<Arc<RelayStats>, Error> {
        let RunPlan {
            source,
            mode,
            mut cfg,
            postgres,
            mysql,
            poll,
        } = self;
        cfg.relay.stop = Some(shutdown.clone());
        match (source, mode) {
            (SourceDsn::Postgres(dsn), Mode::Cdc) => {
                super::run_postgres(dsn, postgres, cfg, shutdown).await
            }
            (SourceDsn::Postgres(dsn), Mode::Poll) => {
                super::run_poll_postgres(dsn, cfg, poll, shutdown).await
            }
            (SourceDsn::Mysql(dsn), Mode::Cdc) => super::run_mysql(dsn, mysql, cfg, shutdown).await,
            (SourceDsn::Mysql(dsn), Mode::Poll) => {
                super::run_poll_mysql(dsn, mysql, cfg, poll, shutdown).await
            }
            (SourceDsn::File(files), Mode::Cdc) => {
                super::run_file(files, mysql, cfg, shutdown).await
            }
            (SourceDsn::File(_), Mode::Poll) => Err(Error::config(
                "poll mode queries a database table; a binlog-file source has none",
                "drop --mode poll to replay the files, or poll the database: --source mysql://…",
            )),
        }
    }
}
