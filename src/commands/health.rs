//! `outboxd health`: the flags of the probe of a running relay's /readyz or /healthz (a
//! container healthcheck); the probe itself is `telemetry::probe`.

use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct HealthArgs {
    /// The relay's --metrics-addr (HOST:PORT).
    #[arg(long, env = "OUTBOXD_METRICS_ADDR", default_value = "127.0.0.1:9187")]
    pub addr: String,
    /// Which endpoint: /readyz (streaming and broker connected) or /healthz (process serves).
    #[arg(long, default_value = "/readyz")]
    pub path: String,
}
