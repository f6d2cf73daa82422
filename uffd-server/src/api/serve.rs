//! Serving the API socket with limits, so idle or slow clients cannot lock
//! everyone else out (they would otherwise hold fds for as long as they
//! like):
//!
//! - at most `max_connections` connections at once; one more gets an
//!   immediate `503` with an [`ErrorBody`] and is closed;
//! - a connection must send a request's headers within `header_timeout`
//!   (hyper's header-read timeout, which also bounds a half-sent request);
//! - a connection that moves no bytes for `idle_timeout` is shut down
//!   gracefully (a request in progress still gets its answer).
//!
//! Built on hyper's HTTP/1 server connection with axum's router as the
//! service, as `axum::serve` is, plus the limits it lacks.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use proto::api::ErrorBody;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;
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
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut refused: u64 = 0;
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
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            refused += 1;
            if refused.is_power_of_two() {
                warn!(
                    "api socket: {refused} connection(s) refused so far: {} are open already",
                    limits.max_connections
                );
            }
            tokio::spawn(refuse(stream, limits.max_connections));
            continue;
        };
        let app = app.clone();
        tokio::spawn(async move {
            serve_connection(stream, app, limits).await;
            drop(permit);
        });
    }
}

/// Answer 503 on a connection over the cap and close it.
async fn refuse(mut stream: UnixStream, cap: usize) {
    let body = ErrorBody {
        error: format!(
            "the server already has {cap} API connections open; close idle ones or retry later"
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

async fn serve_connection(stream: UnixStream, app: Router, limits: Limits) {
    let io = Activity::new(stream);
    let last = io.last.clone();
    let born = Instant::now();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    let conn = builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(app));
    tokio::pin!(conn);
    let tick = (limits.idle_timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(5));
    let mut shutting_down = false;
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    debug!("api connection closed: {e}");
                }
                return;
            }
            () = tokio::time::sleep(tick), if !shutting_down => {
                let idle_ms = elapsed_ms(born).saturating_sub(last.load(Ordering::Relaxed));
                if idle_ms >= u64::try_from(limits.idle_timeout.as_millis()).unwrap_or(u64::MAX) {
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

/// A stream that records when it last moved bytes (milliseconds since the
/// connection began).
#[derive(Debug)]
struct Activity {
    inner: UnixStream,
    born: Instant,
    last: Arc<AtomicU64>,
}

impl Activity {
    fn new(inner: UnixStream) -> Self {
        Activity {
            inner,
            born: Instant::now(),
            last: Arc::new(AtomicU64::new(0)),
        }
    }

    fn touch(&self) {
        self.last.store(elapsed_ms(self.born), Ordering::Relaxed);
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
