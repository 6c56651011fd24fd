//! The NATS sink's own flag (`run` and `check`); `--stream` and the others it shares with the
//! other sinks are the command line's `SinkArgs`.

use super::registry::Options;
use crate::sink::template::Template;
use crate::Error;

#[derive(Debug, Clone, clap::Args)]
pub struct NatsFlags {
    /// NATS sink: subject template over the event ({topic}, {aggregate_id}, {id}, {table});
    /// its first token is the prefix (<prefix>.dead for poison records, <prefix>.> in the stream).
    #[arg(long, env = "OUTBOXD_SUBJECT", default_value = super::config::DEFAULT_SUBJECT)]
    pub subject: String,
}

impl NatsFlags {
    pub fn options(&self) -> Result<Options, Error> {
        let subject = Template::parse(&self.subject).map_err(|e| {
            Error::config(format!("--subject: {e}"), "e.g. --subject outbox.{topic}")
        })?;
        Ok(Options { subject })
    }
}
