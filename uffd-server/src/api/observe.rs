//! REST handlers for seeing a VM's memory at work.
//!
//! ```text
//! GET /v1/vms/{id}/faults?follow=true[&kind=wp][&limit=N]   NDJSON, live
//! GET /v1/vms/{id}/access[?within_ms=N]                      JSON extents
//! POST /v1/vms/{id}/access/reset                             begin it again
//! GET /v1/vms/{id}/access.png[?cells=N]                      heat map
//! GET /v1/vms/{id}/map[?cells=N]                             JSON cells
//! GET /v1/vms/{id}/map.png[?cells=N]                         page-source map
//! GET /metrics                                               Prometheus metrics
//! ```
//!
//! The trace is a stream (`application/x-ndjson`): one [`FaultEvent`]
//! per line, or a [`TraceDropped`] line where a slow reader lost events.
//! It ends after `limit` events, when the VM's VMM goes, or when the client
//! hangs up. Each listener has a thread that makes its JSON, in batches:
//! the events that arrive within 2 ms of one another go out as one chunk,
//! so the core thread only forwards chunks.
//!
//! [`FaultEvent`]: proto::api::FaultEvent
//! [`TraceDropped`]: proto::api::TraceDropped

use std::collections::BTreeMap;

use axum::body::Body;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use proto::api::{
    AccessMap, AccessQuery, FaultEvent, FaultKind, MapQuery, PageMap, TraceDropped, TraceQuery,
};
use tokio::sync::broadcast::error::{RecvError, TryRecvError};
use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, OneOfBuilder, SchemaFormat, Type};
use utoipa::openapi::{ContentBuilder, RefOr, ResponseBuilder, ResponsesBuilder};
use utoipa::IntoResponses;
use utoipa_axum::router::OpenApiRouter;

use super::body::{push_schema, Answer, Json, Path, Query, Schemas};
use super::openapi::routes;
use super::params::VmPath;
use crate::core::{CoreHandle, Error};
use crate::observe::trace::{RawEvent, Subscription};

/// Content type of the fault trace.
pub const NDJSON: &str = "application/x-ndjson";

/// The observation routes.
pub fn routes() -> OpenApiRouter<CoreHandle> {
    OpenApiRouter::default()
        .routes(routes!(faults))
        .routes(routes!(access))
        .routes(routes!(reset_access))
        .routes(routes!(access_png))
        .routes(routes!(map))
        .routes(routes!(map_png))
        .routes(routes!(metrics))
}

/// One `200` response of `content_type` with `schema`.
fn responses(
    description: &str,
    content_type: &str,
    schema: impl Into<RefOr<utoipa::openapi::Schema>>,
) -> BTreeMap<String, RefOr<utoipa::openapi::Response>> {
    ResponsesBuilder::new()
        .response(
            "200",
            ResponseBuilder::new().description(description).content(
                content_type,
                ContentBuilder::new().schema(Some(schema)).build(),
            ),
        )
        .build()
        .into()
}

/// The live fault trace: NDJSON lines, each a [`FaultEvent`] or a
/// [`TraceDropped`].
#[derive(Debug)]
pub struct FaultStream(Body);

impl IntoResponse for FaultStream {
    fn into_response(self) -> Response {
        ([(header::CONTENT_TYPE, NDJSON)], self.0).into_response()
    }
}

impl IntoResponses for FaultStream {
    fn responses() -> BTreeMap<String, RefOr<utoipa::openapi::Response>> {
        let line = OneOfBuilder::new()
            .item(utoipa::openapi::Ref::from_schema_name("FaultEvent"))
            .item(utoipa::openapi::Ref::from_schema_name("TraceDropped"));
        responses(
            "the VM's faults as they happen: one JSON object per line, a FaultEvent or a \
             TraceDropped",
            NDJSON,
            line,
        )
    }
}

impl Answer for FaultStream {
    fn schemas(out: &mut Schemas) {
        push_schema::<FaultEvent>(out);
        push_schema::<TraceDropped>(out);
    }
}

/// A picture the core drew; its layout as JSON in the PNG's iTXt chunk
/// `pagefork-layout`.
#[derive(Debug)]
pub struct Png(Vec<u8>);

impl IntoResponse for Png {
    fn into_response(self) -> Response {
        ([(header::CONTENT_TYPE, "image/png")], self.0).into_response()
    }
}

impl IntoResponses for Png {
    fn responses() -> BTreeMap<String, RefOr<utoipa::openapi::Response>> {
        let bytes = ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Binary)));
        responses(
            "a PNG; its layout as JSON in its iTXt chunk pagefork-layout",
            "image/png",
            bytes,
        )
    }
}

impl Answer for Png {
    fn schemas(_: &mut Schemas) {}
}

/// The server's metrics as OpenMetrics text.
#[derive(Debug)]
pub struct Metrics(String);

impl IntoResponse for Metrics {
    fn into_response(self) -> Response {
        (
            [(header::CONTENT_TYPE, crate::observe::metrics::CONTENT_TYPE)],
            self.0,
        )
            .into_response()
    }
}

impl IntoResponses for Metrics {
    fn responses() -> BTreeMap<String, RefOr<utoipa::openapi::Response>> {
        responses(
            "Prometheus metrics (OpenMetrics text)",
            "application/openmetrics-text",
            ObjectBuilder::new().schema_type(Type::String),
        )
    }
}

impl Answer for Metrics {
    fn schemas(_: &mut Schemas) {}
}

/// The server's counters for Prometheus: VMs, faults and their times, the
/// pool, snapshots.
#[utoipa::path(get, path = "/metrics")]
pub(super) async fn metrics(State(core): State<CoreHandle>) -> Result<Metrics, Error> {
    let sample = core.run(|c| async move { Ok(c.metrics_sample()) }).await?;
    Ok(Metrics(crate::observe::metrics::render(&sample)))
}

/// The VM's faults as they happen (`?follow=true`), until `limit` events,
/// its VMM going, or the client hanging up.
#[utoipa::path(get, path = "/v1/vms/{id}/faults")]
async fn faults(
    State(core): State<CoreHandle>,
    Path(p): Path<VmPath>,
    Query(q): Query<TraceQuery>,
) -> Result<FaultStream, Error> {
    let id = p.vm()?;
    if !q.follow {
        return Err(Error::BadRequest(format!(
            "the fault trace is live: add ?follow=true (what {id} touched so far: \
             GET /v1/vms/{id}/access)"
        )));
    }
    let sub = core
        .run(move |c| async move { c.subscribe_faults(id) })
        .await?;
    // The JSON is made on a thread of the listener's own: the core thread
    // (which also runs this stream) only forwards finished chunks.
    let (tx, rx) = tokio::sync::mpsc::channel::<String>(CHUNKS);
    let (kind, limit) = (q.kind, q.limit);
    std::thread::Builder::new()
        .name(format!("trace-{id}"))
        .spawn(move || write_lines(sub, kind, limit, &tx))
        .map_err(|source| Error::SpawnThread {
            what: "write a fault trace",
            source,
        })?;
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|chunk| (Ok::<_, std::convert::Infallible>(chunk), rx))
    });
    Ok(FaultStream(Body::from_stream(stream)))
}

/// How long a listener lets events gather after the first one before it
/// hands them on: one chunk (one wake-up and one write on the core thread)
/// per batch rather than per event, for at most this much delay.
const BATCH_WAIT: std::time::Duration = std::time::Duration::from_millis(2);

/// Chunks written but not yet sent a listener may hold; beyond, its thread
/// waits, its receiver falls behind and the events it loses are counted.
const CHUNKS: usize = 16;

/// A listener's thread: turn its events into NDJSON chunks for `tx`
/// until the stream ends (the VMM went, `limit` events, the client left).
fn write_lines(
    mut sub: Subscription,
    kind: Option<FaultKind>,
    mut limit: Option<u64>,
    tx: &tokio::sync::mpsc::Sender<String>,
) {
    let push = |sub: &Subscription,
                out: &mut String,
                item: Result<RawEvent, u64>,
                limit: &mut Option<u64>| {
        let line = match item {
            Ok(ev) if kind.is_some_and(|k| k != ev.kind) => return,
            Ok(ev) => {
                *limit = limit.map(|n| n.saturating_sub(1));
                serde_json::to_string(&sub.event(&ev))
            }
            Err(dropped) => serde_json::to_string(&TraceDropped { dropped }),
        };
        if let Ok(line) = line {
            out.push_str(&line);
            out.push('\n');
        }
    };
    while limit != Some(0) {
        let mut out = String::new();
        while out.is_empty() {
            match sub.rx.blocking_recv() {
                Ok(ev) => push(&sub, &mut out, Ok(ev), &mut limit),
                Err(RecvError::Lagged(n)) => push(&sub, &mut out, Err(n), &mut limit),
                Err(RecvError::Closed) => return,
            }
        }
        std::thread::sleep(BATCH_WAIT);
        while limit != Some(0) {
            match sub.rx.try_recv() {
                Ok(ev) => push(&sub, &mut out, Ok(ev), &mut limit),
                Err(TryRecvError::Lagged(n)) => push(&sub, &mut out, Err(n), &mut limit),
                Err(TryRecvError::Empty | TryRecvError::Closed) => break,
            }
        }
        if tx.blocking_send(out).is_err() {
            return; // The client hung up.
        }
    }
}

/// The pages the VM faulted on since its access record began, as extents.
#[utoipa::path(get, path = "/v1/vms/{id}/access")]
async fn access(
    State(core): State<CoreHandle>,
    Path(p): Path<VmPath>,
    Query(q): Query<AccessQuery>,
) -> Result<Json<AccessMap>, Error> {
    let id = p.vm()?;
    core.run(move |c| async move { c.access(id, &q) })
        .await
        .map(Json)
}

/// The page-source table as cells (what `map.png` draws), with its legend.
#[utoipa::path(get, path = "/v1/vms/{id}/map")]
async fn map(
    State(core): State<CoreHandle>,
    Path(p): Path<VmPath>,
    Query(q): Query<MapQuery>,
) -> Result<Json<PageMap>, Error> {
    let id = p.vm()?;
    core.run(move |c| async move { c.page_map(id, &q) })
        .await
        .map(Json)
}

/// The page-source map: one cell per page or group of pages, coloured by
/// source, faded where not present, with a legend.
#[utoipa::path(get, path = "/v1/vms/{id}/map.png")]
async fn map_png(
    State(core): State<CoreHandle>,
    Path(p): Path<VmPath>,
    Query(q): Query<MapQuery>,
) -> Result<Png, Error> {
    let id = p.vm()?;
    let map = core.run(move |c| async move { c.page_map(id, &q) }).await?;
    Ok(Png(crate::observe::map::source_png(&map)))
}

/// Faults per page since the access record began, as a heat map.
#[utoipa::path(get, path = "/v1/vms/{id}/access.png")]
async fn access_png(
    State(core): State<CoreHandle>,
    Path(p): Path<VmPath>,
    Query(q): Query<MapQuery>,
) -> Result<Png, Error> {
    let id = p.vm()?;
    core.run(move |c| async move { c.access_png(id, &q) })
        .await
        .map(Png)
}

/// Begin the access record again now (install records stay); answers the
/// record, empty. A `POST`, not a `DELETE` of the record: the record is
/// still there after it, only emptied.
#[utoipa::path(post, path = "/v1/vms/{id}/access/reset")]
async fn reset_access(
    State(core): State<CoreHandle>,
    Path(p): Path<VmPath>,
) -> Result<Json<AccessMap>, Error> {
    let id = p.vm()?;
    core.run(move |c| async move { c.reset_access(id) })
        .await
        .map(Json)
}
