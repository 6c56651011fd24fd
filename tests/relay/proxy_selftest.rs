//! Self-tests of the TCP fault proxy in `tests/common/proxy.rs`, run against an in-process echo
//! server on 127.0.0.1:0, so they need no database or broker. Every wait is bounded: either a
//! `timeout` around one operation or a poll of the proxy's counters against a deadline.

use crate::common;

use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::proxy::FaultProxy;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Upper bound for anything that is supposed to happen promptly.
const DEADLINE: Duration = Duration::from_secs(5);
/// Window in which a stalled round trip must not complete.
const STALL_WINDOW: Duration = Duration::from_millis(300);
/// Interval between two looks at a condition being polled.
const POLL: Duration = Duration::from_millis(5);

/// An echo server on 127.0.0.1:0 that answers each connection until it half-closes.
async fn echo_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let _ = stream.set_nodelay(true);
                let (mut rd, mut wr) = stream.split();
                let _ = tokio::io::copy(&mut rd, &mut wr).await;
                let _ = wr.shutdown().await;
            });
        }
    });
    addr
}

async fn start() -> FaultProxy {
    FaultProxy::start(echo_server().await).await.unwrap()
}

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(DEADLINE, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: not done within {DEADLINE:?}"),
    }
}

async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "{what}: not true within {DEADLINE:?}"
        );
        tokio::time::sleep(POLL).await;
    }
}

async fn connect(proxy: &FaultProxy) -> TcpStream {
    let stream = within("connect", TcpStream::connect(proxy.addr()))
        .await
        .unwrap();
    stream.set_nodelay(true).unwrap();
    stream
}

fn payload(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 % 251) as u8).collect()
}

/// Writes `data` and reads the same number of bytes back, concurrently so large payloads cannot
/// deadlock on full buffers.
async fn round_trip(stream: &mut TcpStream, data: &[u8]) -> Vec<u8> {
    let (mut rd, mut wr) = stream.split();
    let mut back = vec![0u8; data.len()];
    within("round trip", async {
        tokio::try_join!(wr.write_all(data), rd.read_exact(&mut back)).unwrap();
    })
    .await;
    back
}

async fn assert_echoes(stream: &mut TcpStream, data: &[u8]) {
    assert_eq!(round_trip(stream, data).await, data, "echo differs");
}

/// The peer closed the connection (EOF or reset) within the deadline.
async fn assert_closed(stream: &mut TcpStream) {
    let mut buf = [0u8; 1024];
    within("connection closed", async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
}

/// The peer reset the connection (RST, not FIN) within the deadline.
async fn assert_reset(stream: &mut TcpStream) {
    let mut buf = [0u8; 1024];
    let r = within("connection reset", stream.read(&mut buf)).await;
    match r {
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("expected a reset, got {other:?}"),
    }
}

/// Nothing arrives on `stream` for the whole stall window. `read` is cancel safe, so nothing
/// is lost when the timeout fires.
async fn assert_silent(stream: &mut TcpStream) {
    let mut buf = [0u8; 1024];
    match tokio::time::timeout(STALL_WINDOW, stream.read(&mut buf)).await {
        Err(_) => {}
        Ok(r) => panic!("read completed while stalled: {r:?}"),
    }
}

#[tokio::test]
async fn bytes_pass_through_and_counters_move() {
    let proxy = start().await;
    assert_eq!(proxy.addr().ip(), std::net::Ipv4Addr::LOCALHOST);
    assert_eq!(proxy.port(), proxy.addr().port());
    assert_eq!(
        (proxy.accepted(), proxy.open_connections(), proxy.bytes()),
        (0, 0, (0, 0))
    );

    let mut a = connect(&proxy).await;
    assert_echoes(&mut a, b"hello").await;
    let big = payload(1 << 20);
    assert_echoes(&mut a, &big).await;
    let n = (5 + big.len()) as u64;
    eventually("bytes counted", || proxy.bytes() == (n, n)).await;
    assert_eq!((proxy.accepted(), proxy.open_connections()), (1, 1));

    let mut b = connect(&proxy).await;
    assert_echoes(&mut b, b"second").await;
    eventually("second connection open", || proxy.open_connections() == 2).await;
    assert_eq!(proxy.accepted(), 2);
    eventually("bytes counted", || proxy.bytes() == (n + 6, n + 6)).await;

    // A half-close travels through: the echo server sees EOF and closes its side.
    a.shutdown().await.unwrap();
    let mut rest = Vec::new();
    within("EOF after half-close", a.read_to_end(&mut rest))
        .await
        .unwrap();
    assert!(rest.is_empty());
    eventually("closed connection counted", || {
        proxy.open_connections() == 1
    })
    .await;
    drop(b);
    eventually("all connections closed", || proxy.open_connections() == 0).await;
    assert_eq!(proxy.accepted(), 2);
}

#[tokio::test]
async fn cut_closes_every_connection_and_new_ones_work() {
    let proxy = start().await;
    let mut a = connect(&proxy).await;
    let mut b = connect(&proxy).await;
    assert_echoes(&mut a, b"a").await;
    assert_echoes(&mut b, b"b").await;
    assert_eq!(proxy.open_connections(), 2);

    proxy.cut();
    assert_reset(&mut a).await;
    assert_reset(&mut b).await;
    eventually("cut connections gone", || proxy.open_connections() == 0).await;

    let mut c = connect(&proxy).await;
    assert_echoes(&mut c, b"after the cut").await;
    assert_eq!((proxy.accepted(), proxy.open_connections()), (3, 1));
}

#[tokio::test]
async fn cut_interrupts_a_stall_and_a_delay() {
    let proxy = start().await;

    proxy.stall();
    let mut a = connect(&proxy).await;
    a.write_all(b"held").await.unwrap();
    eventually("stalled connection open", || proxy.open_connections() == 1).await;
    proxy.cut();
    assert_closed(&mut a).await;
    proxy.resume();

    proxy.set_delay(Duration::from_secs(3600));
    let mut b = connect(&proxy).await;
    b.write_all(b"delayed").await.unwrap();
    eventually("delayed connection open", || proxy.open_connections() == 1).await;
    proxy.cut();
    assert_closed(&mut b).await;
    eventually("cut connections gone", || proxy.open_connections() == 0).await;
    assert_eq!(proxy.bytes(), (0, 0));
}

#[tokio::test]
async fn block_refuses_new_connections_until_unblock() {
    let proxy = start().await;
    let mut old = connect(&proxy).await;
    assert_echoes(&mut old, b"before").await;

    proxy.block();
    // The kernel may complete the handshake, but the proxy resets the connection at once.
    if let Ok(mut refused) = within("connect", TcpStream::connect(proxy.addr())).await {
        assert_closed(&mut refused).await;
    }
    eventually("refusal counted", || proxy.refused() == 1).await;
    assert_eq!(proxy.accepted(), 1);
    // Connections that were already open are untouched by block().
    assert_echoes(&mut old, b"during").await;

    proxy.unblock();
    let mut new = connect(&proxy).await;
    assert_echoes(&mut new, b"after").await;
    assert_eq!((proxy.accepted(), proxy.refused()), (2, 1));

    // block() + cut(): the server is away, then comes back.
    proxy.block();
    proxy.cut();
    assert_closed(&mut old).await;
    assert_closed(&mut new).await;
    if let Ok(mut refused) = within("connect", TcpStream::connect(proxy.addr())).await {
        assert_closed(&mut refused).await;
    }
    eventually("refusal counted", || proxy.refused() == 2).await;
    eventually("cut connections gone", || proxy.open_connections() == 0).await;
    proxy.unblock();
    let mut back = connect(&proxy).await;
    assert_echoes(&mut back, b"back").await;
    assert_eq!((proxy.accepted(), proxy.refused()), (3, 2));
}

#[tokio::test]
async fn stall_holds_data_until_resume() {
    let proxy = start().await;
    let mut a = connect(&proxy).await;
    assert_echoes(&mut a, b"warm").await;
    let big_conn = connect(&proxy).await;
    eventually("bytes counted", || proxy.bytes() == (4, 4)).await;

    proxy.stall();
    let small = payload(1000);
    a.write_all(&small).await.unwrap();
    // A connection opened during the stall is stalled too.
    let mut b = connect(&proxy).await;
    b.write_all(b"new while stalled").await.unwrap();
    // 16 MiB is far more than the socket buffers hold while nobody reads them, so the writer is
    // held back by TCP backpressure; after resume it must still deliver every byte.
    let big = payload(16 << 20);
    let (mut big_rd, mut big_wr) = big_conn.into_split();
    let writer = tokio::spawn({
        let big = big.clone();
        async move { big_wr.write_all(&big).await.map(|()| big_wr) }
    });

    tokio::join!(assert_silent(&mut a), assert_silent(&mut b), async {
        let mut buf = [0u8; 1024];
        let r = tokio::time::timeout(STALL_WINDOW, big_rd.read(&mut buf)).await;
        assert!(r.is_err(), "read completed while stalled: {r:?}");
    });
    assert_eq!(proxy.bytes(), (4, 4), "bytes moved while stalled");
    assert!(
        !writer.is_finished(),
        "the proxy read the stalled socket dry"
    );
    assert_eq!(
        proxy.open_connections(),
        3,
        "a stall must not close connections"
    );

    proxy.resume();
    let mut back = vec![0u8; small.len()];
    within("stalled echo", a.read_exact(&mut back))
        .await
        .unwrap();
    assert_eq!(back, small);
    let mut back = vec![0u8; 17];
    within("stalled echo", b.read_exact(&mut back))
        .await
        .unwrap();
    assert_eq!(back, b"new while stalled");
    let mut back = vec![0u8; big.len()];
    within("stalled big echo", big_rd.read_exact(&mut back))
        .await
        .unwrap();
    assert!(back == big, "big echo differs");
    within("writer", writer).await.unwrap().unwrap();

    let n = (4 + small.len() + 17 + big.len()) as u64;
    eventually("bytes counted", || proxy.bytes() == (n, n)).await;
}

#[tokio::test]
async fn set_delay_adds_latency_to_a_round_trip() {
    let proxy = start().await;
    let mut a = connect(&proxy).await;
    assert_echoes(&mut a, b"warm").await;

    let delay = Duration::from_millis(150);
    proxy.set_delay(delay);
    // The request and the echo are each one chunk, and each waits `delay`.
    let t = Instant::now();
    assert_echoes(&mut a, b"slow").await;
    let took = t.elapsed();
    assert!(
        took >= 2 * delay,
        "round trip took {took:?}, want >= {:?}",
        2 * delay
    );

    // New connections are delayed as well.
    let mut b = connect(&proxy).await;
    let t = Instant::now();
    assert_echoes(&mut b, b"slow too").await;
    let took = t.elapsed();
    assert!(
        took >= 2 * delay,
        "round trip took {took:?}, want >= {:?}",
        2 * delay
    );

    proxy.set_delay(Duration::ZERO);
    let t = Instant::now();
    assert_echoes(&mut a, b"fast").await;
    let took = t.elapsed();
    assert!(took < delay, "round trip took {took:?} without delay");
}

#[tokio::test]
async fn dropping_the_last_handle_stops_everything() {
    let proxy = start().await;
    let addr = proxy.addr();
    let mut a = connect(&proxy).await;
    assert_echoes(&mut a, b"one").await;

    // A clone going away changes nothing.
    drop(proxy.clone());
    assert_echoes(&mut a, b"still").await;
    let mut b = connect(&proxy).await;
    assert_echoes(&mut b, b"two").await;

    drop(proxy);
    assert_closed(&mut a).await;
    assert_closed(&mut b).await;
    // The listener goes too: connecting is refused (poll, the accept task stops asynchronously).
    let deadline = Instant::now() + DEADLINE;
    loop {
        match tokio::time::timeout(DEADLINE, TcpStream::connect(addr)).await {
            Ok(Err(_)) => break,
            Ok(Ok(mut s)) => assert_closed(&mut s).await,
            Err(_) => panic!("connect hung after the proxy was dropped"),
        }
        assert!(Instant::now() < deadline, "listener still open after drop");
        tokio::time::sleep(POLL).await;
    }
}

#[tokio::test]
async fn unreachable_upstream_closes_the_client() {
    let gone = {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap()
    };
    let proxy = FaultProxy::start(gone).await.unwrap();
    let mut a = connect(&proxy).await;
    assert_closed(&mut a).await;
    eventually("connection gone", || proxy.open_connections() == 0).await;
    assert_eq!(proxy.accepted(), 1);
}
