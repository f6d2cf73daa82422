//! Serving the API socket with limits, so idle or slow clients cannot lock
//! everyone else out (they would otherwise hold fds for as long as they
//! like):
//!
//! - at most `max_connections` connections at once. One more closes the
//!   connection that has been idle longest (no request in flight, no byte
//!   moved for the longest time) to make room, so an operator's health
//!   check or delete always gets through however many clients sit silent;
//!   only when every connection has a request in flight does it get an
//!   immediate `503` with an [`ErrorBody`] and is closed;
//! - a connection must send a request's headers within `header_timeout`
//!   (hyper's header-read timeout, which also bounds a half-sent request);
//! - a connection that moves no bytes for `idle_timeout` is shut down
//!   gracefully (a request in progress still gets its answer).
//!
//! A request is in flight from when its headers are read until the last
//! byte of its answer is handed to the socket (a streamed fault trace is
//! in flight for as long as it streams), so a connection is never closed
//! under a request.
//!
//! Built on hyper's HTTP/1 server connection with axum's router as the
//! service, as `axum::serve` is, plus the limits it lacks.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::Router;
use http_body_util::BodyExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use proto::api::ErrorBody;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Notify;
use tower::ServiceExt;
use tracing::{debug, warn};

/// Limits on API connections.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub idle_timeout: Duration,
}

/// Serve `app` on `listener` until the listener fails.
pub async fn serve(listener: UnixListener, app: Router, limits: Limits) {
    let open = Arc::new(Open::new(limits.max_connections.max(1)));
    let mut refused: u64 = 0;
    let mut evicted: u64 = 0;
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                // EMFILE and the like: back off instead of spinning.
                warn!("api socket: accept failed: {e}{}", crate::fd_hint(&e));
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let conn = match open.admit() {
            Admitted::Room(conn) => conn,
            Admitted::Evicted(conn) => {
                evicted += 1;
                if evicted.is_power_of_two() {
                    debug!(
                        "api socket: {evicted} idle connection(s) closed so far to admit new ones \
                         at the cap of {}",
                        open.cap
                    );
                }
                conn
            }
            Admitted::Full => {
                refused += 1;
                if refused.is_power_of_two() {
                    warn!(
                        "api socket: {refused} connection(s) refused so far: {} are open, each \
                         with a request in flight",
                        open.cap
                    );
                }
                tokio::spawn(refuse(stream, open.cap));
                continue;
            }
        };
        let (app, open) = (app.clone(), open.clone());
        tokio::spawn(async move {
            serve_connection(stream, app, limits, &conn, open.epoch).await;
            open.close(conn.id);
        });
    }
}

/// The connections open, to find the one to close at the cap.
#[derive(Debug)]
struct Open {
    cap: usize,
    /// The clock of every connection's `last` (milliseconds since).
    epoch: Instant,
    conns: Mutex<Conns>,
}

#[derive(Debug, Default)]
struct Conns {
    next: u64,
    by_id: HashMap<u64, Arc<Conn>>,
}

/// One connection as the cap sees it.
#[derive(Debug)]
struct Conn {
    id: u64,
    /// When it last moved a byte, in ms since [`Open::epoch`].
    last: Arc<AtomicU64>,
    /// Requests in flight (0 or 1: HTTP/1 answers one at a time).
    busy: AtomicUsize,
    /// Told when it was chosen to make room.
    evict: Notify,
}

/// What [`Open::admit`] did.
enum Admitted {
    /// Below the cap.
    Room(Arc<Conn>),
    /// At the cap: the idlest connection was told to close.
    Evicted(Arc<Conn>),
    /// At the cap, every connection with a request in flight.
    Full,
}

impl Open {
    fn new(cap: usize) -> Self {
        Open {
            cap,
            epoch: Instant::now(),
            conns: Mutex::new(Conns::default()),
        }
    }

    /// Register a new connection, closing the one idle longest if the cap
    /// is reached.
    fn admit(&self) -> Admitted {
        let mut conns = self.conns.lock().unwrap_or_else(|p| p.into_inner());
        let mut evicted = false;
        if conns.by_id.len() >= self.cap {
            let victim = conns
                .by_id
                .values()
                .filter(|c| c.busy.load(Ordering::Acquire) == 0)
                // Quiet longest first; of those quiet since the same
                // millisecond, the older.
                .min_by_key(|c| (c.last.load(Ordering::Relaxed), c.id))
                .map(|c| c.id);
            let Some(victim) = victim.and_then(|id| conns.by_id.remove(&id)) else {
                return Admitted::Full;
            };
            victim.evict.notify_one();
            evicted = true;
        }
        conns.next += 1;
        let conn = Arc::new(Conn {
            id: conns.next,
            last: Arc::new(AtomicU64::new(elapsed_ms(self.epoch))),
            busy: AtomicUsize::new(0),
            evict: Notify::new(),
        });
        conns.by_id.insert(conn.id, conn.clone());
        if evicted {
            Admitted::Evicted(conn)
        } else {
            Admitted::Room(conn)
        }
    }

    /// Forget a connection that has closed.
    fn close(&self, id: u64) {
        let mut conns = self.conns.lock().unwrap_or_else(|p| p.into_inner());
        conns.by_id.remove(&id);
    }
}

/// Answer 503 on a connection over the cap and close it.
async fn refuse(mut stream: UnixStream, cap: usize) {
    let body = ErrorBody {
        error: format!(
            "the server already has {cap} API connections open, each with a request in flight; \
             retry when one finishes"
        ),
    };
    let body = serde_json::to_string(&body).unwrap_or_default();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let write = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
}

/// Marks a request of a connection in flight until it drops: with the
/// answer's body, once hyper has written its last byte or given up.
struct InFlight(Arc<Conn>);

impl InFlight {
    fn begin(conn: &Arc<Conn>) -> Self {
        conn.busy.fetch_add(1, Ordering::AcqRel);
        InFlight(conn.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

async fn serve_connection(
    stream: UnixStream,
    app: Router,
    limits: Limits,
    conn_state: &Arc<Conn>,
    epoch: Instant,
) {
    let io = Activity {
        inner: stream,
        epoch,
        last: conn_state.last.clone(),
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    let state = conn_state.clone();
    let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        let in_flight = InFlight::begin(&state);
        let app = app.clone();
        async move {
            let res = app.oneshot(req.map(Body::new)).await?;
            // The answer's body holds the mark: a streamed answer is in
            // flight until it ends.
            Ok::<_, std::convert::Infallible>(res.map(|body| {
                Body::new(body.map_frame(move |frame| {
                    let _held = &in_flight;
                    frame
                }))
            }))
        }
    });
    let conn = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    let tick = (limits.idle_timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(5));
    let idle_limit = u64::try_from(limits.idle_timeout.as_millis()).unwrap_or(u64::MAX);
    let mut shutting_down = false;
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    debug!("api connection closed: {e}");
                }
                return;
            }
            () = conn_state.evict.notified(), if !shutting_down => {
                if conn_state.busy.load(Ordering::Acquire) == 0 {
                    // Idle: close it now, its slot is taken already.
                    return;
                }
                // A request began meanwhile: it gets its answer first.
                conn.as_mut().graceful_shutdown();
                shutting_down = true;
            }
            () = tokio::time::sleep(tick), if !shutting_down => {
                let idle_ms = elapsed_ms(epoch).saturating_sub(conn_state.last.load(Ordering::Relaxed));
                if idle_ms >= idle_limit {
                    conn.as_mut().graceful_shutdown();
                    shutting_down = true;
                }
            }
        }
    }
}

fn elapsed_ms(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// A stream that records when it last moved bytes (milliseconds since
/// `epoch`).
#[derive(Debug)]
struct Activity {
    inner: UnixStream,
    epoch: Instant,
    last: Arc<AtomicU64>,
}

impl Activity {
    fn touch(&self) {
        self.last.store(elapsed_ms(self.epoch), Ordering::Relaxed);
    }
}

impl AsyncRead for Activity {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.touch();
        }
        r
    }
}

impl AsyncWrite for Activity {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(open: &Open) -> Vec<u64> {
        let conns = open.conns.lock().unwrap();
        let mut ids: Vec<u64> = conns.by_id.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    fn admitted(a: Admitted) -> (Arc<Conn>, bool) {
        match a {
            Admitted::Room(c) => (c, false),
            Admitted::Evicted(c) => (c, true),
            Admitted::Full => panic!("refused"),
        }
    }

    #[test]
    fn at_the_cap_the_connection_idle_longest_makes_room() {
        let open = Open::new(3);
        let conns: Vec<Arc<Conn>> = (0..3).map(|_| admitted(open.admit()).0).collect();
        // The first moved bytes last; the second has been quiet longest.
        conns[0].last.store(30, Ordering::Relaxed);
        conns[1].last.store(10, Ordering::Relaxed);
        conns[2].last.store(20, Ordering::Relaxed);
        let (new, evicted) = admitted(open.admit());
        assert!(evicted);
        assert_eq!(ids(&open), [1, 3, new.id]);
        // Its task is told (the permit waits for its next select).
        assert!(futures_util::FutureExt::now_or_never(conns[1].evict.notified()).is_some());
    }

    #[test]
    fn of_connections_quiet_since_the_same_moment_the_older_goes() {
        let open = Open::new(3);
        let conns: Vec<Arc<Conn>> = (0..3).map(|_| admitted(open.admit()).0).collect();
        // Quiet since the server began, as the new ones are at the
        // earliest.
        for c in &conns {
            c.last.store(0, Ordering::Relaxed);
        }
        admitted(open.admit());
        admitted(open.admit());
        assert_eq!(&ids(&open)[..1], [conns[2].id]);
    }

    #[test]
    fn a_connection_with_a_request_in_flight_is_never_chosen() {
        let open = Open::new(2);
        let a = admitted(open.admit()).0;
        let b = admitted(open.admit()).0;
        a.last.store(1, Ordering::Relaxed);
        b.last.store(2, Ordering::Relaxed);
        let busy_a = InFlight::begin(&a);
        let (c, evicted) = admitted(open.admit());
        assert!(evicted);
        assert_eq!(ids(&open), [a.id, c.id], "the busy one stays");
        let _busy_c = InFlight::begin(&c);
        // Every connection busy: refused.
        assert!(matches!(open.admit(), Admitted::Full));
        drop(busy_a);
        assert!(matches!(open.admit(), Admitted::Evicted(_)));
    }

    #[test]
    fn a_closed_connection_frees_its_slot() {
        let open = Open::new(1);
        let a = admitted(open.admit()).0;
        let _busy = InFlight::begin(&a);
        assert!(matches!(open.admit(), Admitted::Full));
        open.close(a.id);
        assert!(matches!(open.admit(), Admitted::Room(_)));
    }
}
