//! A small blocking HTTP/1.1 client for the control API over its Unix
//! socket, used by `uffdctl`.
//!
//! Built on hyper's client connection API with a current-thread tokio
//! runtime, so the CLI stays a plain synchronous program.

use std::path::{Path, PathBuf};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::Value;

/// Errors of the API client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to {path}: is uffd-server running with this state directory?")]
    Connect {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start the client runtime")]
    Runtime(#[source] std::io::Error),
    #[error("HTTP exchange with the server failed")]
    Http(#[source] hyper::Error),
    #[error("cannot build the request")]
    Build(#[source] hyper::http::Error),
    #[error("the server's answer is not JSON: {0}")]
    NotJson(String),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, ClientError>;

/// A control API client bound to one socket path.
#[derive(Debug, Clone)]
pub struct Client {
    socket: PathBuf,
}

/// A response: HTTP status and JSON body (`Value::Null` if empty).
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub body: Value,
}

impl Response {
    /// Whether the status is 2xx.
    pub fn ok(&self) -> bool {
        (200..300).contains(&self.status)
    }

    /// The `error` field of an error body, or the whole body.
    pub fn error_text(&self) -> String {
        self.body
            .get("error")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .unwrap_or_else(|| self.body.to_string())
    }
}

impl Client {
    /// A client for the API socket at `socket`.
    pub fn new(socket: impl AsRef<Path>) -> Self {
        Client {
            socket: socket.as_ref().to_owned(),
        }
    }

    /// Send `method path` with an optional JSON body.
    pub fn request(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Response> {
        runtime()?.block_on(self.request_async(method, path, body))
    }

    /// `GET path` and return the status and the raw body (a picture).
    pub fn get_bytes(&self, path: &str) -> Result<(u16, Vec<u8>)> {
        let rt = runtime()?;
        rt.block_on(async {
            let resp = self.send(hyper::Method::GET, path, None).await?;
            let status = resp.status().as_u16();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(ClientError::Http)?
                .to_bytes();
            Ok((status, body.to_vec()))
        })
    }

    /// `GET path`, a stream of lines (NDJSON): `line` gets each line as it
    /// comes, until it returns `false` or the stream ends. A status other
    /// than 2xx is returned with the (JSON) body read whole instead.
    pub fn stream_lines(
        &self,
        path: &str,
        mut line: impl FnMut(&str) -> bool,
    ) -> Result<Option<Response>> {
        let rt = runtime()?;
        rt.block_on(async {
            let resp = self.send(hyper::Method::GET, path, None).await?;
            let status = resp.status().as_u16();
            let mut body = resp.into_body();
            if !(200..300).contains(&status) {
                let bytes = body.collect().await.map_err(ClientError::Http)?.to_bytes();
                let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                return Ok(Some(Response { status, body }));
            }
            let mut pending: Vec<u8> = Vec::new();
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(ClientError::Http)?;
                let Some(data) = frame.data_ref() else {
                    continue;
                };
                pending.extend_from_slice(data);
                let mut start = 0;
                while let Some(nl) = pending[start..].iter().position(|b| *b == b'\n') {
                    let text = String::from_utf8_lossy(&pending[start..start + nl]);
                    start += nl + 1;
                    if !line(&text) {
                        return Ok(None);
                    }
                }
                pending.drain(..start);
            }
            Ok(None)
        })
    }

    async fn send(
        &self,
        method: hyper::Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<hyper::Response<hyper::body::Incoming>> {
        let stream = tokio::net::UnixStream::connect(&self.socket)
            .await
            .map_err(|source| ClientError::Connect {
                path: self.socket.clone(),
                source,
            })?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(ClientError::Http)?;
        tokio::spawn(conn);
        let bytes = body.map(|b| b.to_string()).unwrap_or_default();
        let req = Request::builder()
            .method(method)
            .uri(format!("http://localhost{path}"))
            .header("host", "localhost")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(bytes)))
            .map_err(ClientError::Build)?;
        sender.send_request(req).await.map_err(ClientError::Http)
    }

    async fn request_async(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Response> {
        let method = hyper::Method::from_bytes(method.as_bytes())
            .map_err(|e| ClientError::Build(e.into()))?;
        let resp = self.send(method, path, body).await?;
        let status = resp.status().as_u16();
        let collected = resp
            .into_body()
            .collect()
            .await
            .map_err(ClientError::Http)?
            .to_bytes();
        let body = if collected.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&collected).map_err(|_| {
                ClientError::NotJson(String::from_utf8_lossy(&collected).into_owned())
            })?
        };
        Ok(Response { status, body })
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ClientError::Runtime)
}
