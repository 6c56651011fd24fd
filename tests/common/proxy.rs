//! A TCP fault-injection proxy for the integration tests.
//!
//! [`FaultProxy`] owns a listener on `127.0.0.1:0` and every connection accepted on it: each
//! one is forwarded byte for byte to a single upstream (Postgres, MariaDB or RabbitMQ on
//! 127.0.0.1), and the test holding the handle can cut, refuse, stall or delay that traffic
//! whenever it likes. It exists so that the relay's reconnect, timeout and redelivery paths can
//! be driven deterministically without stopping or restarting the real servers. The control
//! calls are synchronous and take effect promptly: every connection task selects on one shared
//! `tokio::sync::watch` state channel, so a cut or a stall interrupts a pending read, write or
//! delay instead of waiting for the next chunk. A stall stops reading the sockets, so TCP
//! backpressure holds the data and nothing is lost. The proxy never sleeps in place of a
//! condition; tests poll its counters against a deadline. When the last handle is dropped the
//! listener closes and every forwarded connection is reset.
#![allow(dead_code)]

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Size of the per-direction copy buffer.
const BUF_SIZE: usize = 32 * 1024;
/// Upper bound on connecting to the upstream for one accepted connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause after a failed `accept` (e.g. out of file descriptors) so the loop cannot spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);

/// The control state every task watches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct State {
    /// New connections are accepted and reset at once.
    blocked: bool,
    /// No bytes are read or written in either direction.
    stalled: bool,
    /// Added before each forwarded chunk.
    delay: Duration,
    /// Bumped by every `cut`; a connection dies once this differs from the value it was
    /// accepted under.
    cut_gen: u64,
    /// The last handle is gone: the listener and every connection stop.
    shutdown: bool,
}

impl State {
    fn kills(&self, gen: u64) -> bool {
        self.shutdown || self.cut_gen != gen
    }
}

#[derive(Debug, Default)]
struct Counters {
    accepted: AtomicU64,
    refused: AtomicU64,
    open: AtomicUsize,
    up: AtomicU64,
    down: AtomicU64,
    /// Chunks forwarded after an added delay (proof that a slowdown hit traffic).
    delayed: AtomicU64,
}

/// Handle to a running proxy. Cheap to clone; the proxy stops when the last clone is dropped.
#[derive(Clone)]
pub struct FaultProxy {
    inner: Arc<Inner>,
}

struct Inner {
    addr: SocketAddr,
    upstream: SocketAddr,
    state: watch::Sender<State>,
    counters: Arc<Counters>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The tasks hold only receivers and the counters, never `Inner`, so this runs when
        // the last `FaultProxy` goes away.
        self.state.send_modify(|s| s.shutdown = true);
    }
}

impl fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.inner.addr)
            .field("upstream", &self.inner.upstream)
            .field("state", &*self.inner.state.borrow())
            .field("counters", &self.inner.counters)
            .finish()
    }
}

impl FaultProxy {
    /// Listen on 127.0.0.1:0 and forward every accepted connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> io::Result<FaultProxy> {
        Self::start_on(std::net::Ipv4Addr::LOCALHOST, upstream).await
    }

    /// Like [`start`](Self::start), listening on another loopback address (any of
    /// 127.0.0.0/8), e.g. to reach a server under an address its certificate does not list.
    pub async fn start_on(
        bind: std::net::Ipv4Addr,
        upstream: SocketAddr,
    ) -> io::Result<FaultProxy> {
        let listener = TcpListener::bind((bind, 0)).await?;
        let addr = listener.local_addr()?;
        let (state, rx) = watch::channel(State::default());
        let counters = Arc::new(Counters::default());
        tokio::spawn(accept_loop(listener, upstream, rx, counters.clone()));
        Ok(FaultProxy {
            inner: Arc::new(Inner {
                addr,
                upstream,
                state,
                counters,
            }),
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// The port of [`addr`](Self::addr).
    pub fn port(&self) -> u16 {
        self.inner.addr.port()
    }

    /// Close every open connection at once, both sides reset (`SO_LINGER` 0, so RST). New
    /// connections are still accepted. Connections still waiting in the kernel's accept
    /// backlog are not yet the proxy's and survive; call [`block`](Self::block) first to
    /// refuse those too.
    pub fn cut(&self) {
        self.inner.state.send_modify(|s| s.cut_gen += 1);
    }

    /// Refuse new connections (accept and reset at once) until [`unblock`](Self::unblock).
    /// Connections already open are untouched; `block()` then `cut()` simulates a server
    /// that is away.
    pub fn block(&self) {
        self.inner
            .state
            .send_if_modified(|s| !std::mem::replace(&mut s.blocked, true));
    }

    /// Accept and forward new connections again.
    pub fn unblock(&self) {
        self.inner
            .state
            .send_if_modified(|s| std::mem::replace(&mut s.blocked, false));
    }

    /// Stop forwarding bytes in both directions, on existing and new connections, until
    /// [`resume`](Self::resume). Connections stay open; the sockets are not read, so the data
    /// waits in the kernel buffers (TCP backpressure) and nothing is lost.
    pub fn stall(&self) {
        self.inner
            .state
            .send_if_modified(|s| !std::mem::replace(&mut s.stalled, true));
    }

    /// Forward bytes again after [`stall`](Self::stall).
    pub fn resume(&self) {
        self.inner
            .state
            .send_if_modified(|s| std::mem::replace(&mut s.stalled, false));
    }

    /// Add `d` before each forwarded chunk, in each direction (zero = none). An echo round
    /// trip therefore takes at least `2 * d`.
    pub fn set_delay(&self, d: Duration) {
        self.inner
            .state
            .send_if_modified(|s| std::mem::replace(&mut s.delay, d) != d);
    }

    /// Connections accepted and forwarded so far (refused ones are not counted).
    pub fn accepted(&self) -> u64 {
        self.inner.counters.accepted.load(Ordering::SeqCst)
    }

    /// Connections accepted and reset at once because the proxy was blocked.
    pub fn refused(&self) -> u64 {
        self.inner.counters.refused.load(Ordering::SeqCst)
    }

    /// Forwarded connections currently open.
    pub fn open_connections(&self) -> usize {
        self.inner.counters.open.load(Ordering::SeqCst)
    }

    /// Chunks forwarded late because of [`set_delay`](Self::set_delay), so far.
    pub fn delayed_chunks(&self) -> u64 {
        self.inner.counters.delayed.load(Ordering::SeqCst)
    }

    /// Bytes forwarded (client -> upstream, upstream -> client) so far.
    pub fn bytes(&self) -> (u64, u64) {
        let c = &self.inner.counters;
        (c.up.load(Ordering::SeqCst), c.down.load(Ordering::SeqCst))
    }
}

/// Why a connection is torn down with a reset instead of closed in order.
struct Abort;

impl From<io::Error> for Abort {
    fn from(_: io::Error) -> Self {
        Abort
    }
}

/// Decrements the open-connection count however the connection task ends.
struct OpenGuard(Arc<Counters>);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Make the next close of `stream` send RST rather than FIN.
fn reset(stream: &TcpStream) {
    let _ = stream.set_zero_linger();
}

async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    mut rx: watch::Receiver<State>,
    counters: Arc<Counters>,
) {
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            r = rx.changed() => {
                if r.is_err() || rx.borrow_and_update().shutdown {
                    return;
                }
                continue;
            }
        };
        let client = match accepted {
            Ok((client, _)) => client,
            Err(_) => {
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let (blocked, gen) = {
            let s = rx.borrow();
            if s.shutdown {
                return;
            }
            (s.blocked, s.cut_gen)
        };
        if blocked {
            counters.refused.fetch_add(1, Ordering::SeqCst);
            reset(&client);
            continue;
        }
        counters.accepted.fetch_add(1, Ordering::SeqCst);
        counters.open.fetch_add(1, Ordering::SeqCst);
        let guard = OpenGuard(counters.clone());
        tokio::spawn(connection(
            client,
            upstream,
            rx.clone(),
            gen,
            counters.clone(),
            guard,
        ));
    }
}

async fn connection(
    mut client: TcpStream,
    upstream: SocketAddr,
    mut rx: watch::Receiver<State>,
    gen: u64,
    counters: Arc<Counters>,
    _guard: OpenGuard,
) {
    let _ = client.set_nodelay(true);
    let connect = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(upstream));
    let mut server = tokio::select! {
        r = connect => match r {
            Ok(Ok(server)) => server,
            _ => return reset(&client),
        },
        _ = killed(&mut rx, gen) => return reset(&client),
    };
    let _ = server.set_nodelay(true);
    let outcome = {
        let (client_rd, client_wr) = client.split();
        let (server_rd, server_wr) = server.split();
        tokio::try_join!(
            pump(
                client_rd,
                server_wr,
                rx.clone(),
                gen,
                &counters.up,
                &counters.delayed
            ),
            pump(
                server_rd,
                client_wr,
                rx,
                gen,
                &counters.down,
                &counters.delayed
            ),
        )
    };
    if outcome.is_err() {
        reset(&client);
        reset(&server);
    }
}

/// Resolves once connection `gen` has to die (cut or shutdown).
async fn killed(rx: &mut watch::Receiver<State>, gen: u64) {
    let _ = rx.wait_for(|s| s.kills(gen)).await;
}

/// Waits while stalled; fails once connection `gen` has to die.
async fn runnable(rx: &mut watch::Receiver<State>, gen: u64) -> Result<(), Abort> {
    let killed = rx
        .wait_for(|s| s.kills(gen) || !s.stalled)
        .await
        .map_or(true, |s| s.kills(gen));
    if killed {
        Err(Abort)
    } else {
        Ok(())
    }
}

/// Copies `rd` to `wr` chunk by chunk, honouring stall, delay and cut. Returns `Ok` after
/// passing an end of stream on as a write shutdown (half-close), `Err` when the whole
/// connection must be reset.
async fn pump<R, W>(
    mut rd: R,
    mut wr: W,
    mut rx: watch::Receiver<State>,
    gen: u64,
    counter: &AtomicU64,
    delayed: &AtomicU64,
) -> Result<(), Abort>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; BUF_SIZE];
    loop {
        runnable(&mut rx, gen).await?;
        // Any state change cancels the (cancel-safe) read and re-checks the state, so a stall
        // stops reading at once and a cut does not wait for traffic.
        let n = tokio::select! {
            r = rd.read(&mut buf) => r?,
            r = rx.changed() => {
                r.map_err(|_| Abort)?;
                continue;
            }
        };
        if n == 0 {
            runnable(&mut rx, gen).await?;
            wr.shutdown().await?;
            return Ok(());
        }
        let delay = rx.borrow().delay;
        if !delay.is_zero() {
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = killed(&mut rx, gen) => return Err(Abort),
            }
            delayed.fetch_add(1, Ordering::SeqCst);
        }
        let mut off = 0;
        while off < n {
            runnable(&mut rx, gen).await?;
            tokio::select! {
                r = wr.write(&buf[off..n]) => {
                    let k = r?;
                    if k == 0 {
                        return Err(Abort);
                    }
                    off += k;
                    counter.fetch_add(k as u64, Ordering::SeqCst);
                }
                r = rx.changed() => {
                    r.map_err(|_| Abort)?;
                }
            }
        }
    }
}
