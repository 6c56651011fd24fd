//! The RabbitMQ stream sink's own flags (`run` and `check`, docs/rabbitmq-stream.md); the
//! stream's name is the shared `--stream`.

use super::registry::Options;
use crate::consumer::cli::parse_duration;
use crate::values::parse_bytes;
use std::time::Duration;

#[derive(Debug, Clone, clap::Args)]
pub struct RabbitStreamFlags {
    /// RabbitMQ stream sink: retention in bytes of a stream --declare auto creates (e.g. 20GB).
    #[arg(long, env = "OUTBOXD_STREAM_MAX_BYTES", value_parser = parse_bytes)]
    pub stream_max_bytes: Option<usize>,
    /// RabbitMQ stream sink: retention in time of a stream --declare auto creates (e.g. 7d).
    #[arg(long, env = "OUTBOXD_STREAM_MAX_AGE", value_parser = parse_duration)]
    pub stream_max_age: Option<Duration>,
}

impl RabbitStreamFlags {
    pub fn options(&self) -> Result<Options, crate::Error> {
        Ok(Options {
            max_bytes: self.stream_max_bytes.map(|b| b as u64),
            max_age: self.stream_max_age,
            management_url: None,
        })
    }
}
