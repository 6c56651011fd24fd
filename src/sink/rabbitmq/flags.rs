//! The RabbitMQ sink's own flag (`run` and `check`); the ones it shares with the other sinks
//! (`--exchange`, `--declare`, the TLS files, `--partitions`, …) are the command line's
//! `SinkArgs`.

use super::registry::Options;
use crate::sink::partition::QueueType;

#[derive(Debug, Clone, clap::Args)]
pub struct RabbitFlags {
    /// Queue type of <exchange>.unrouted and <exchange>.dead as --declare auto declares them
    /// (quorum: replicated across a cluster).
    #[arg(long, env = "OUTBOXD_DEAD_QUEUE_TYPE", value_enum, default_value_t = QueueType::Classic)]
    pub dead_queue_type: QueueType,
}

impl RabbitFlags {
    pub fn options(&self) -> Result<Options, crate::Error> {
        Ok(Options {
            dead_queue_type: self.dead_queue_type,
        })
    }
}
