//! Metrics and health scraped end to end: counters move as events flow, `/readyz` says why it
//! is not ready while the broker or the source database is unreachable, the reconnects are
//! counted by cause, and it recovers.

use crate::common;

use common::amqp::Topology;
use common::proxy::FaultProxy;
use common::source_db::{on_both_sources, SourceDb};
use common::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

async fn get(port: u16, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return (0, String::new());
    };
    let _ = s
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .await;
    let mut out = String::new();
    let _ = s.read_to_string(&mut out).await;
    let code = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
}

fn metric(body: &str, name: &str) -> f64 {
    body.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(-1.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_health_follow_the_pipeline() {
    let db = PgDb::create("metrics").await;
    let mut topo = Topology::new("metrics").await;
    let proxy = FaultProxy::start(
        format!("127.0.0.1:{}", common::amqp::HOST_PORT)
            .parse()
            .unwrap(),
    )
    .await
    .unwrap();
    let name = unique("r");
    let port = free_local_port();
    let addr = format!("127.0.0.1:{port}");
    let dsn = db.dsn();
    let sink = common::amqp::url_via(proxy.port());
    let _relay = Relay::start(&[
        "run",
        "--source",
        &dsn,
        "--name",
        &name,
        "--sink",
        &sink,
        "--exchange",
        &topo.exchange,
        "--metrics-addr",
        &addr,
        "--confirm-timeout",
        "2s",
    ]);
    wait_for("/healthz", T, || async {
        get(port, "/healthz").await.0 == 200
    })
    .await;
    wait_for("/readyz ready", T, || async {
        get(port, "/readyz").await.0 == 200
    })
    .await;
    topo.wait_declared(T).await;
    let q = topo.bind_queue("all", "#").await;
    let mut client = db.client().await;
    write_events(&mut client, 10, 20, "metrics").await;
    wait_for("200 confirmed in the metrics", T, || async {
        metric(
            &get(port, "/metrics").await.1,
            "outboxd_events_confirmed_total",
        ) >= 200.0
    })
    .await;
    let body = get(port, "/metrics").await.1;
    assert!(
        metric(&body, "outboxd_events_read_total") >= 200.0,
        "{body}"
    );
    assert!(metric(&body, "outboxd_events_published_total") >= 200.0);
    assert_eq!(metric(&body, "outboxd_leader"), 1.0);
    assert_eq!(metric(&body, "outboxd_source_streaming"), 1.0);
    assert!(
        metric(&body, "outboxd_slot_retained_wal_bytes") >= 0.0,
        "{body}"
    );
    assert!(
        body.contains("outboxd_commit_confirm_seconds_bucket"),
        "{body}"
    );
    assert!(
        metric(&body, "outboxd_publish_confirm_seconds_count") >= 200.0,
        "{body}"
    );
    topo.take(&q, 200, T).await;

    // The broker goes away: not ready, with the reason; back: ready again.
    proxy.block();
    proxy.cut();
    write_events(&mut client, 1, 5, "while.away").await;
    wait_for("/readyz 503 while the broker is away", T, || async {
        let (code, body) = get(port, "/readyz").await;
        code == 503 && body.contains("sink")
    })
    .await;
    assert_eq!(
        get(port, "/healthz").await.0,
        200,
        "the process still serves"
    );
    // While the broker stays unreachable, the relay keeps retrying and stays not ready.
    wait_for("a failed reconnect while blocked", T, || async {
        proxy.refused() >= 1
    })
    .await;
    let (code, body) = get(port, "/readyz").await;
    assert_eq!(code, 503, "{body}");
    proxy.unblock();
    wait_for("/readyz ready again", T, || async {
        let (code, _) = get(port, "/readyz").await;
        code == 200
    })
    .await;
    topo.take(&q, 5, T).await;
    let body = get(port, "/metrics").await.1;
    assert!(
        body.contains("outboxd_reconnects_total{cause=\"sink\"}"),
        "{body}"
    );
    assert_eq!(get(port, "/nope").await.0, 404);
}

/// 500 idle connections (open, nothing sent) do not stop `/healthz` answering; past the
/// endpoint's limit a new connection closes the oldest idle one at once, and an idle one is
/// closed by the header timeout anyway, not held for ever. In process: `serve` is the relay's
/// own server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_do_not_stop_healthz() {
    use tokio::io::AsyncReadExt;
    let addr = outboxd::telemetry::serve("127.0.0.1:0").await.unwrap();
    let mut idle = Vec::new();
    for _ in 0..500 {
        idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    let started = std::time::Instant::now();
    let (code, body) = get(addr.port(), "/healthz").await;
    assert_eq!((code, body.as_str()), (200, "ok\n"));
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    // Past the limit (500 + these): each new connection closes the oldest idle one.
    let over = outboxd::telemetry::MAX_CONNECTIONS - 500 + 5;
    let mut newer = Vec::new();
    for _ in 0..over {
        newer.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    let mut closed = 0;
    for s in idle.iter_mut().take(5) {
        let mut b = [0u8; 1];
        if let Ok(Ok(0) | Err(_)) =
            tokio::time::timeout(Duration::from_secs(2), s.read(&mut b)).await
        {
            closed += 1;
        }
    }
    assert_eq!(
        closed, 5,
        "the 5 oldest idle connections closed to make room"
    );
    // The newest idle one is closed by the header timeout, not held for ever.
    let mut b = [0u8; 1];
    let r = tokio::time::timeout(
        outboxd::telemetry::HEADER_TIMEOUT + Duration::from_secs(10),
        newer.last_mut().unwrap().read(&mut b),
    )
    .await;
    assert!(
        matches!(r, Ok(Ok(0)) | Ok(Err(_))),
        "idle connection still open: {r:?}"
    );
    drop(idle);
    drop(newer);
    wait_for("/healthz after the flood", T, || async {
        get(addr.port(), "/healthz").await.0 == 200
    })
    .await;
}

/// A client that keeps the endpoint full of idle connections (more than its limit, each
/// reopened as soon as it is closed, for longer than a header timeout) must not turn probes
/// away: a liveness probe refused that way restarts a healthy relay. Every probe is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_idle_connections_past_the_limit_does_not_refuse_probes() {
    use tokio::io::AsyncReadExt;
    let addr = outboxd::telemetry::serve("127.0.0.1:0").await.unwrap();
    let flood = outboxd::telemetry::MAX_CONNECTIONS + 100;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let opened = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut flooders = Vec::new();
    for _ in 0..flood {
        let (stop, opened) = (stop.clone(), opened.clone());
        flooders.push(tokio::spawn(async move {
            // Open, send nothing, wait until the server closes it, open again.
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                opened.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let mut b = [0u8; 1];
                let _ = tokio::time::timeout(Duration::from_secs(1), s.read(&mut b)).await;
            }
        }));
    }
    wait_for("the flood to fill the endpoint", T, || async {
        opened.load(std::sync::atomic::Ordering::Relaxed) > flood
    })
    .await;
    // Across a header timeout, so the flood's connections turn over while probes arrive.
    let until =
        std::time::Instant::now() + outboxd::telemetry::HEADER_TIMEOUT + Duration::from_secs(2);
    let (mut probes, mut refused) = (0, Vec::new());
    while std::time::Instant::now() < until {
        let (code, body) = get(addr.port(), "/healthz").await;
        probes += 1;
        if (code, body.as_str()) != (200, "ok\n") {
            refused.push(code);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let reopened = opened.load(std::sync::atomic::Ordering::Relaxed);
    for f in flooders {
        f.abort();
    }
    // The fault was there: more connections were opened than the endpoint serves at once.
    assert!(reopened > flood, "the flood opened {reopened} connections");
    assert!(
        refused.is_empty(),
        "{} of {probes} probes not answered with 200 (codes {refused:?}) under {flood} idle connections",
        refused.len()
    );
}

/// The source's connection is cut (and refused for a while): `/readyz` says the source is not
/// streaming, the reconnect is counted by cause, and once the database is reachable again the
/// relay is ready and delivers what was written meanwhile. On both sources: each logs and
/// counts its reconnects through the same internal event.
async fn a_source_reconnect_is_counted_and_readyz_follows_it<D: SourceDb>() {
    let db = D::create("metrics_src").await;
    let proxy = FaultProxy::start(D::server_addr()).await.unwrap();
    let name = unique("r");
    let port = free_local_port();
    let addr = format!("127.0.0.1:{port}");
    let via = db.dsn_via(proxy.port());
    let relay = Relay::start(&[
        "run",
        "--source",
        &via,
        "--name",
        &name,
        "--commit-offsets",
        "--metrics-addr",
        &addr,
    ]);
    db.wait_streaming(&name).await;
    wait_for("/readyz ready", T, || async {
        get(port, "/readyz").await.0 == 200
    })
    .await;
    let source_reconnects = |body: &str| metric(body, "outboxd_reconnects_total{cause=\"source\"}");
    let before = source_reconnects(&get(port, "/metrics").await.1).max(0.0);

    proxy.block();
    proxy.cut();
    wait_for("/readyz 503: source not streaming", T, || async {
        let (code, body) = get(port, "/readyz").await;
        code == 503 && body.contains("source not streaming")
    })
    .await;
    assert_eq!(
        get(port, "/healthz").await.0,
        200,
        "the process still serves"
    );
    let body = get(port, "/metrics").await.1;
    assert!(
        source_reconnects(&body) >= before + 1.0,
        "the reconnect is counted: {body}"
    );
    assert_eq!(metric(&body, "outboxd_source_streaming"), 0.0, "{body}");
    let written = db.write(2, 5, "while.cut").await;
    proxy.unblock();
    wait_for("/readyz ready again", T, || async {
        get(port, "/readyz").await.0 == 200
    })
    .await;
    wait_all_printed(&[&relay], &written, T).await;
    assert!(
        proxy.accepted() >= 2,
        "the relay connected again through the proxy"
    );
}

on_both_sources!(a_source_reconnect_is_counted_and_readyz_follows_it);
