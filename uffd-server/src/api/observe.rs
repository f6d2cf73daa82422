//! REST handlers for seeing a VM's memory at work.
//!
//! ```text
//! GET /v1/vms/{id}/faults?follow=true[&kind=wp][&limit=N]   NDJSON, live
//! GET /v1/vms/{id}/access[?within_ms=N]                      JSON extents
//! DELETE /v1/vms/{id}/access                                 begin it again
//! GET /v1/vms/{id}/access.png[?cells=N]                      heat map
//! GET /v1/vms/{id}/map[?cells=N]                             JSON cells
//! GET /v1/vms/{id}/map.png[?cells=N]                         page-source map
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

use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use proto::api::{AccessQuery, FaultKind, MapQuery, TraceDropped, TraceQuery};
use tokio::sync::broadcast::error::{RecvError, TryRecvError};

use super::{call, vm_id, ApiResult};
use crate::core::{Answer, CommandKind, CoreHandle, Error};
use crate::observe::trace::{RawEvent, Subscription};

/// Content type of the fault trace.
pub const NDJSON: &str = "application/x-ndjson";

/// The observation routes, to merge into the VM router.
pub fn routes() -> Router<CoreHandle> {
    Router::new()
        .route("/v1/vms/{id}/faults", get(faults))
        .route("/v1/vms/{id}/access", get(access).delete(reset_access))
        .route("/v1/vms/{id}/access.png", get(access_png))
        .route("/v1/vms/{id}/map", get(map))
        .route("/v1/vms/{id}/map.png", get(map_png))
}

/// A query string, or a 400 that says what is wrong with it.
pub(super) fn query<T>(q: Result<Query<T>, QueryRejection>) -> Result<T, Error> {
    q.map(|Query(q)| q)
        .map_err(|e| Error::BadRequest(format!("invalid query: {}", e.body_text())))
}

#[utoipa::path(
    get,
    path = "/v1/vms/{id}/faults",
    params(("id" = String, description = "a VM id (vm-N)"), TraceQuery),
    responses(
        (status = 200, description = "the VM's faults as they happen: one JSON object per line, \
         a FaultEvent or a TraceDropped", body = proto::api::FaultEvent,
         content_type = "application/x-ndjson"),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server is stopping", body = proto::api::ErrorBody)
    )
)]
pub(super) async fn faults(
    State(core): State<CoreHandle>,
    Path(id): Path<String>,
    q: Result<Query<TraceQuery>, QueryRejection>,
) -> Result<Response, Error> {
    let id = vm_id(&id)?;
    let q = query(q)?;
    if !q.follow {
        return Err(Error::BadRequest(format!(
            "the fault trace is live: add ?follow=true (what {id} touched so far: \
             GET /v1/vms/{id}/access)"
        )));
    }
    let Answer::Trace(sub) = core.call(CommandKind::Faults(id)).await? else {
        return Err(Error::ShuttingDown);
    };
    // The JSON is made on a thread of the listener's own: the core thread
    // (which also runs this stream) only forwards finished chunks.
    let (tx, rx) = tokio::sync::mpsc::channel::<String>(CHUNKS);
    let (kind, limit) = (q.kind, q.limit);
    std::thread::Builder::new()
        .name(format!("trace-{id}"))
        .spawn(move || write_lines(*sub, kind, limit, &tx))
        .map_err(|source| Error::SpawnThread {
            what: "write a fault trace",
            source,
        })?;
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|chunk| (Ok::<_, std::convert::Infallible>(chunk), rx))
    });
    Ok(([(header::CONTENT_TYPE, NDJSON)], Body::from_stream(stream)).into_response())
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

#[utoipa::path(
    get,
    path = "/v1/vms/{id}/access",
    params(("id" = String, description = "a VM id (vm-N)"), AccessQuery),
    responses(
        (status = 200, description = "the pages the VM faulted on since its record began", body = proto::api::AccessMap),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
pub(super) async fn access(
    State(core): State<CoreHandle>,
    Path(id): Path<String>,
    q: Result<Query<AccessQuery>, QueryRejection>,
) -> ApiResult {
    let id = vm_id(&id)?;
    let q = query(q)?;
    call(&core, CommandKind::Access(id, q), StatusCode::OK).await
}

#[utoipa::path(
    get,
    path = "/v1/vms/{id}/map",
    params(("id" = String, description = "a VM id (vm-N) or a listener id (fc-N)"), MapQuery),
    responses(
        (status = 200, description = "the page-source table as cells, with its legend", body = proto::api::PageMap),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
pub(super) async fn map(
    State(core): State<CoreHandle>,
    Path(id): Path<String>,
    q: Result<Query<MapQuery>, QueryRejection>,
) -> ApiResult {
    let id = vm_id(&id)?;
    let q = query(q)?;
    call(&core, CommandKind::Map(id, q), StatusCode::OK).await
}

/// A PNG the core drew.
async fn png(core: &CoreHandle, kind: CommandKind) -> Result<Response, Error> {
    let Answer::Png(bytes) = core.call(kind).await? else {
        return Err(Error::ShuttingDown);
    };
    Ok(([(header::CONTENT_TYPE, "image/png")], bytes).into_response())
}

#[utoipa::path(
    get,
    path = "/v1/vms/{id}/map.png",
    params(("id" = String, description = "a VM id (vm-N) or a listener id (fc-N)"), MapQuery),
    responses(
        (status = 200, description = "the page-source map: one cell per page or group of pages, \
         coloured by source, faded where not present, with a legend; its layout as JSON in the \
         iTXt chunk pagefork-layout", body = Vec<u8>, content_type = "image/png"),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
pub(super) async fn map_png(
    State(core): State<CoreHandle>,
    Path(id): Path<String>,
    q: Result<Query<MapQuery>, QueryRejection>,
) -> Result<Response, Error> {
    let id = vm_id(&id)?;
    let q = query(q)?;
    png(&core, CommandKind::MapPng(id, q)).await
}

#[utoipa::path(
    get,
    path = "/v1/vms/{id}/access.png",
    params(("id" = String, description = "a VM id (vm-N)"), MapQuery),
    responses(
        (status = 200, description = "faults per page since the access record began, as a heat \
         map; its layout as JSON in the iTXt chunk pagefork-layout", body = Vec<u8>,
         content_type = "image/png"),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
pub(super) async fn access_png(
    State(core): State<CoreHandle>,
    Path(id): Path<String>,
    q: Result<Query<MapQuery>, QueryRejection>,
) -> Result<Response, Error> {
    let id = vm_id(&id)?;
    let q = query(q)?;
    png(&core, CommandKind::AccessPng(id, q)).await
}

#[utoipa::path(
    delete,
    path = "/v1/vms/{id}/access",
    params(("id" = String, description = "a VM id (vm-N)")),
    responses(
        (status = 200, description = "the access record begins again now (install records stay)", body = proto::api::AccessMap),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
pub(super) async fn reset_access(
    State(core): State<CoreHandle>,
    Path(id): Path<String>,
) -> ApiResult {
    let id = vm_id(&id)?;
    call(&core, CommandKind::ResetAccess(id), StatusCode::OK).await
}
