//! The metrics endpoint (`--metrics-addr`): `/metrics`, `/healthz` and `/readyz` served on a
//! bounded number of connections with deadlines (input from the network is bounded before it
//! is read), and `outboxd health`, the one-GET probe of it.

use super::events::{HttpConnectionRefused, InternalEvent};
use super::get;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `outboxd health`: one GET of `path` on the relay's metrics address; Ok on 200, otherwise an
/// error carrying the status line and body (the reason /readyz gives).
pub async fn probe(addr: &str, path: &str) -> Result<(), crate::Error> {
    let body = fetch(addr, path).await?;
    println!("ok   {path}: {}", body.trim());
    Ok(())
}

/// The most bytes of an answer [`fetch`] reads (a fleet's `/status` of thousands of sources
/// fits many times over).
const MAX_ANSWER_BYTES: u64 = 16 << 20;

/// One GET of `path` on `addr`: the body of a 200 answer, otherwise an error carrying the
/// status line and body.
pub async fn fetch(addr: &str, path: &str) -> Result<String, crate::Error> {
    let fail = |what: String| crate::Error::Other(format!("{addr}{path}: {what}"));
    let exchange = async {
        let mut sock = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| fail(format!("cannot connect: {e}")))?;
        sock.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .map_err(|e| fail(e.to_string()))?;
        let mut answer = Vec::new();
        (&mut sock)
            .take(MAX_ANSWER_BYTES)
            .read_to_end(&mut answer)
            .await
            .map_err(|e| fail(e.to_string()))?;
        Ok::<_, crate::Error>(String::from_utf8_lossy(&answer).into_owned())
    };
    let answer = tokio::time::timeout(std::time::Duration::from_secs(5), exchange)
        .await
        .map_err(|_| fail("no answer in 5 s".into()))??;
    let status = answer.lines().next().unwrap_or_default();
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    if status.split_whitespace().nth(1) == Some("200") {
        Ok(body.to_string())
    } else {
        Err(fail(format!("{status}: {}", body.trim())))
    }
}

/// Most connections served at once. Beyond it, room is made by closing the oldest connection
/// that has not sent its request yet (an idle or slow client; a prober sends at once, so it is
/// the newest); when every connection is being answered, the new one is closed at once (so it
/// does not wait in the backlog) and counted. Well below the usual 1024 file descriptors, well
/// above what Prometheus and a prober need.
pub const MAX_CONNECTIONS: usize = 512;
/// A client must send its request head within this time.
pub const HEADER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
/// A whole connection (request and answer, a slow reader of /metrics included) ends after this.
pub const REQUEST_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves `/metrics`, `/healthz` and `/readyz` until the process ends, with hyper (HTTP/1.1,
/// one request per connection): at most [`MAX_CONNECTIONS`] at once, each bounded by
/// [`HEADER_TIMEOUT`] and [`REQUEST_DEADLINE`], and accept errors (such as running out of
/// file descriptors) retried with a growing pause instead of a spinning loop.
pub async fn serve(addr: &str) -> Result<std::net::SocketAddr, crate::Error> {
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        crate::Error::config(
            format!("--metrics-addr {addr}: {e}"),
            "use a free HOST:PORT, e.g. --metrics-addr 127.0.0.1:9187",
        )
    })?;
    let local = listener
        .local_addr()
        .map_err(|e| crate::Error::Other(e.to_string()))?;
    tracing::info!(addr = %local, "serving /metrics, /healthz and /readyz");
    tokio::spawn(accept_loop(listener));
    Ok(local)
}

/// The connections that have not sent a request yet, oldest first, each with the sender that
/// closes it. Without this, a client holding [`MAX_CONNECTIONS`] idle connections (and
/// reopening each one the header timeout closes) would keep every probe out.
#[derive(Default)]
struct Waiting {
    next: u64,
    queue: std::collections::VecDeque<(u64, tokio::sync::oneshot::Sender<()>)>,
}

impl Waiting {
    fn push(&mut self) -> (u64, tokio::sync::oneshot::Receiver<()>) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let id = self.next;
        self.next += 1;
        self.queue.push_back((id, tx));
        (id, rx)
    }

    fn remove(&mut self, id: u64) {
        if let Some(i) = self.queue.iter().position(|(x, _)| *x == id) {
            self.queue.remove(i);
        }
    }

    /// Closes the oldest waiting connection; false when none is waiting.
    fn evict_oldest(&mut self) -> bool {
        while let Some((_, close)) = self.queue.pop_front() {
            if close.send(()).is_ok() {
                return true;
            }
        }
        false
    }
}

type Shared<T> = std::sync::Arc<std::sync::Mutex<T>>;

fn lock(w: &Shared<Waiting>) -> std::sync::MutexGuard<'_, Waiting> {
    // The queue holds no invariant a panic elsewhere could break half-way.
    w.lock().unwrap_or_else(|p| p.into_inner())
}

async fn accept_loop(listener: tokio::net::TcpListener) {
    use std::time::Duration;
    let permits = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let waiting: Shared<Waiting> = Shared::default();
    let mut pause = Duration::ZERO;
    loop {
        let sock = match listener.accept().await {
            Ok((sock, _)) => {
                pause = Duration::ZERO;
                sock
            }
            Err(e) => {
                if pause.is_zero() {
                    tracing::warn!(error = %e, "metrics endpoint: accept failed; retrying with backoff");
                }
                pause = (pause * 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
                tokio::time::sleep(pause).await;
                continue;
            }
        };
        let permit = match permits.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                let evicted = lock(&waiting).evict_oldest();
                // The evicted connection's task ends at once and returns its permit.
                let freed = if evicted {
                    HttpConnectionRefused.emit();
                    tokio::time::timeout(Duration::from_secs(1), permits.clone().acquire_owned())
                        .await
                        .ok()
                        .and_then(Result::ok)
                } else {
                    None
                };
                match freed {
                    Some(p) => p,
                    None => {
                        HttpConnectionRefused.emit();
                        drop(sock);
                        continue;
                    }
                }
            }
        };
        let (id, evicted) = lock(&waiting).push();
        let waiting = waiting.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let served = waiting.clone();
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .keep_alive(false)
                .max_buf_size(16 * 1024)
                .serve_connection(
                    hyper_util::rt::TokioIo::new(sock),
                    hyper::service::service_fn(move |req| {
                        // A request arrived: this connection is no longer idle.
                        lock(&served).remove(id);
                        answer(req)
                    }),
                );
            tokio::select! {
                _ = tokio::time::timeout(REQUEST_DEADLINE, conn) => {}
                _ = evicted => {}
            }
            lock(&waiting).remove(id);
        });
    }
}

type Body = http_body_util::Full<bytes::Bytes>;

async fn answer(
    req: hyper::Request<hyper::body::Incoming>,
) -> Result<hyper::Response<Body>, std::convert::Infallible> {
    use hyper::{Method, StatusCode};
    let t = get();
    let (status, ctype, body) = if req.method() != Method::GET && req.method() != Method::HEAD {
        (
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "use GET\n".to_string(),
        )
    } else {
        match req.uri().path() {
            "/metrics" => (
                StatusCode::OK,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                match super::fleet() {
                    None => t.render(),
                    Some(f) => {
                        // The fleet's families go before the exposition's closing `# EOF`.
                        let mut text = t.render();
                        let end = text.rfind("# EOF").unwrap_or(text.len());
                        text.insert_str(end, &f.metrics());
                        text
                    }
                },
            ),
            "/healthz" => (StatusCode::OK, "text/plain", "ok\n".to_string()),
            "/readyz" => match super::fleet()
                .map(|f| f.not_ready())
                .unwrap_or_else(|| t.not_ready().map(str::to_string))
            {
                None => (StatusCode::OK, "text/plain", "ready\n".to_string()),
                Some(why) => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    format!("not ready: {why}\n"),
                ),
            },
            "/status" => match super::fleet() {
                Some(f) => (StatusCode::OK, "application/json", f.status_json()),
                None => (
                    StatusCode::NOT_FOUND,
                    "text/plain",
                    "not a fleet: /status lists a fleet's sources (outboxd status reads one relay's state)\n".to_string(),
                ),
            },
            _ => (
                StatusCode::NOT_FOUND,
                "text/plain",
                "not found\n".to_string(),
            ),
        }
    };
    let mut resp = hyper::Response::new(Body::new(body.into()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(ctype),
    );
    Ok(resp)
}
