//! Errors as the API answers them: an [`ErrorBody`] with the status
//! [`Error::status`] decides, and the error responses every operation
//! documents, written once here as components that each operation refers
//! to.

use std::collections::BTreeMap;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use proto::api::ErrorBody;
use utoipa::openapi::RefOr;
use utoipa::{IntoResponses, ToResponse};

use super::body::{push_schema, Answer, Schemas};
use crate::core::Error;

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = ErrorBody {
            error: self.message(),
        };
        (status, axum::Json(body)).into_response()
    }
}

/// A 4xx: the request is wrong; the message says how.
#[derive(Debug, ToResponse)]
#[response(description = "the request is wrong: the message says how")]
pub struct ClientError(pub ErrorBody);

/// A 507: the server has not the room for what was asked (memory budget,
/// VM slots, disk space); the client can free some or ask for less.
#[derive(Debug, ToResponse)]
#[response(
    description = "not enough room for it (memory budget, VMs, disk space): delete VMs or \
                   snapshots, or ask for less"
)]
pub struct InsufficientStorage(pub ErrorBody);

/// A 5xx: the server or a VMM failed.
#[derive(Debug, ToResponse)]
#[response(description = "the server or a VMM failed")]
pub struct ServerError(pub ErrorBody);

/// The error answers any operation may give. Every operation refers to
/// them (`openapi.rs` adds them where a handler cannot fail: the
/// connection cap answers before any handler runs).
#[derive(Debug, IntoResponses)]
pub enum ErrorResponses {
    #[response(status = "4XX")]
    Client(#[ref_response] ClientError),
    #[response(status = 507)]
    InsufficientStorage(#[ref_response] InsufficientStorage),
    #[response(status = "5XX")]
    Server(#[ref_response] ServerError),
}

impl IntoResponses for Error {
    fn responses() -> BTreeMap<String, RefOr<utoipa::openapi::Response>> {
        ErrorResponses::responses()
    }
}

impl Answer for Error {
    fn schemas(out: &mut Schemas) {
        push_schema::<ErrorBody>(out);
    }
}
