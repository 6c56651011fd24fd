//! The log subscriber every binary installs, and the one filter no `--log-level` can lift.

/// Whether a log event may be written, whatever `--log-level` enables. The AMQP client's TRACE
/// events print whole frames, and the connection's `Connection.StartOk` frame holds the broker
/// password (the SASL PLAIN response), so they never reach the log; its DEBUG and higher
/// events carry no frames and pass.
pub fn loggable(meta: &tracing::Metadata<'_>) -> bool {
    let amqp = ["lapin", "amq_protocol"]
        .iter()
        .any(|c| meta.target().starts_with(c));
    !(amqp && *meta.level() == tracing::Level::TRACE)
}

/// Installs the stderr log subscriber: `level` is a `tracing` filter (`info`, `debug`,
/// `outboxd=trace,…`; an invalid one falls back to `info`), text or JSON lines, and
/// [`loggable`] on top of it.
pub fn init_logging(level: &str, json: bool) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let secrets = tracing_subscriber::filter::filter_fn(loggable);
    let fmt = tracing_subscriber::fmt::layer().with_writer(|| Stderr);
    let registry = tracing_subscriber::registry().with(filter);
    if json {
        registry.with(fmt.json().with_filter(secrets)).init();
    } else {
        registry.with(fmt.with_filter(secrets)).init();
    }
}

/// stderr, with a one-shot command's progress bar hidden while a line is written.
struct Stderr;

impl std::io::Write for Stderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        crate::progress::while_hidden(|| std::io::stderr().write(buf))
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}
