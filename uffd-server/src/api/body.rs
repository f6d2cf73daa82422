//! What a handler takes and answers, as types that both axum and the
//! OpenAPI document read: a handler's signature is its operation's entry.
//!
//! - [`Json<T>`] as an argument parses the request body into `T`
//!   (`#[utoipa::path]` documents `T` as the request body; an
//!   `Option<Json<T>>` makes it optional). As the answer it is `200` with `T`;
//!   [`Created<T>`] is `201`, [`Accepted<T>`] `202`, [`JsonList<T>`] `200`
//!   with `[T]`.
//! - [`Path<T>`] and [`Query<T>`] take parameters; the `T` documents them
//!   (`IntoParams`).
//! - Whatever these refuse is an [`ErrorBody`] with a 4xx status, as every
//!   other error of the API.
//!
//! The answers implement utoipa's `IntoResponses`, which `#[utoipa::path]`
//! reads off a handler's return type (`Result<Created<VmInfo>, Error>`),
//! and [`Answer`], which names the schemas their responses refer to (see
//! `openapi.rs`'s `routes!`). The compiler thus checks that a
//! route answers what its document says.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, OptionalFromRequest, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use proto::api::ErrorBody;
use serde::de::DeserializeOwned;
use serde::Serialize;
use utoipa::openapi::{ContentBuilder, RefOr, ResponseBuilder, ResponsesBuilder, Schema};
use utoipa::{IntoResponses, ToSchema};

use crate::core::Error;

/// Largest request body accepted: every body of this API is a small JSON
/// object.
pub const MAX_BODY: usize = 64 << 10;

/// Schemas by name, as utoipa collects them for a document's components.
pub type Schemas = Vec<(String, RefOr<Schema>)>;

/// What a handler answers, for the document: its responses (the
/// `IntoResponses` that `#[utoipa::path]` reads off the return type) and
/// the schemas those refer to.
pub trait Answer: IntoResponses {
    /// Push the schemas this answer's responses refer to, and theirs.
    fn schemas(out: &mut Schemas);
}

impl<T: Answer, E: Answer> Answer for Result<T, E> {
    fn schemas(out: &mut Schemas) {
        T::schemas(out);
        E::schemas(out);
    }
}

/// Push `T`'s schema under its name, and the schemas it refers to.
pub fn push_schema<T: ToSchema>(out: &mut Schemas) {
    out.push((T::name().into_owned(), T::schema()));
    T::schemas(out);
}

/// One response with a JSON body of `schema`.
fn json_response(
    status: &str,
    description: &str,
    schema: impl Into<RefOr<Schema>>,
) -> std::collections::BTreeMap<String, RefOr<utoipa::openapi::Response>> {
    ResponsesBuilder::new()
        .response(
            status,
            ResponseBuilder::new().description(description).content(
                "application/json",
                ContentBuilder::new().schema(Some(schema)).build(),
            ),
        )
        .build()
        .into()
}

/// A reference to `T`'s schema in the document's components.
fn schema_ref<T: ToSchema>() -> RefOr<Schema> {
    RefOr::Ref(utoipa::openapi::Ref::from_schema_name(T::name()))
}

/// A JSON body: the request's (parsed with messages that say what is
/// wrong) or the answer's (`200`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Json<T>(pub T);

/// An answer `201 Created` with a JSON body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Created<T>(pub T);

/// An answer `202 Accepted` with a JSON body: the work goes on after the
/// answer (its progress is in another route's answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accepted<T>(pub T);

/// An answer `200` with a JSON array.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonList<T>(pub Vec<T>);

/// Parse a JSON body with a message that says what is wrong.
fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, Error> {
    if body.is_empty() {
        return Err(Error::BadRequest(
            "request body is empty; send a JSON object".into(),
        ));
    }
    // serde's derived structs also accept a JSON array (their fields in
    // order), so `[]` would pass as a body whose every field has a
    // default; every body of this API is an object, so anything else is
    // refused before it is parsed.
    if body.trim_ascii_start().first() != Some(&b'{') {
        return Err(Error::BadRequest(
            "invalid request body: expected a JSON object".into(),
        ));
    }
    serde_json::from_slice(body)
        .map_err(|e| Error::BadRequest(format!("invalid request body: {e}")))
}

/// The whole body, at most [`MAX_BODY`] bytes (the router's limit).
async fn read<S: Send + Sync>(req: Request, state: &S) -> Result<Bytes, Response> {
    Bytes::from_request(req, state).await.map_err(|e| {
        let status = e.status();
        let error = if status == StatusCode::PAYLOAD_TOO_LARGE {
            format!("request body is larger than {MAX_BODY} bytes; every body of this API is a small JSON object")
        } else {
            format!("cannot read the request body: {}", e.body_text())
        };
        (status, axum::Json(ErrorBody { error })).into_response()
    })
}

impl<T, S> FromRequest<S> for Json<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let body = read(req, state).await?;
        parse(&body).map(Json).map_err(IntoResponse::into_response)
    }
}

/// An optional body: none at all is `None`.
impl<T, S> OptionalFromRequest<S> for Json<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Option<Self>, Self::Rejection> {
        let body = read(req, state).await?;
        if body.is_empty() {
            return Ok(None);
        }
        parse(&body)
            .map(|v| Some(Json(v)))
            .map_err(IntoResponse::into_response)
    }
}

impl<T: Serialize> IntoResponse for Json<T> {
    fn into_response(self) -> Response {
        axum::Json(self.0).into_response()
    }
}

impl<T: ToSchema> IntoResponses for Json<T> {
    fn responses() -> std::collections::BTreeMap<String, RefOr<utoipa::openapi::Response>> {
        json_response("200", "OK", schema_ref::<T>())
    }
}

impl<T: ToSchema> Answer for Json<T> {
    fn schemas(out: &mut Schemas) {
        push_schema::<T>(out);
    }
}

impl<T: Serialize> IntoResponse for Created<T> {
    fn into_response(self) -> Response {
        (StatusCode::CREATED, axum::Json(self.0)).into_response()
    }
}

impl<T: ToSchema> IntoResponses for Created<T> {
    fn responses() -> std::collections::BTreeMap<String, RefOr<utoipa::openapi::Response>> {
        json_response("201", "Created", schema_ref::<T>())
    }
}

impl<T: ToSchema> Answer for Created<T> {
    fn schemas(out: &mut Schemas) {
        push_schema::<T>(out);
    }
}

impl<T: Serialize> IntoResponse for Accepted<T> {
    fn into_response(self) -> Response {
        (StatusCode::ACCEPTED, axum::Json(self.0)).into_response()
    }
}

impl<T: ToSchema> IntoResponses for Accepted<T> {
    fn responses() -> std::collections::BTreeMap<String, RefOr<utoipa::openapi::Response>> {
        json_response("202", "Accepted", schema_ref::<T>())
    }
}

impl<T: ToSchema> Answer for Accepted<T> {
    fn schemas(out: &mut Schemas) {
        push_schema::<T>(out);
    }
}

impl<T: Serialize> IntoResponse for JsonList<T> {
    fn into_response(self) -> Response {
        axum::Json(self.0).into_response()
    }
}

impl<T: ToSchema> IntoResponses for JsonList<T> {
    fn responses() -> std::collections::BTreeMap<String, RefOr<utoipa::openapi::Response>> {
        let list = utoipa::openapi::schema::ArrayBuilder::new().items(schema_ref::<T>());
        json_response("200", "OK", list)
    }
}

impl<T: ToSchema> Answer for JsonList<T> {
    fn schemas(out: &mut Schemas) {
        push_schema::<T>(out);
    }
}

/// Parameters in the path, named by `T`'s fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Path<T>(pub T);

impl<T, S> FromRequestParts<S> for Path<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = Error;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|p| Path(p.0))
            .map_err(|e| Error::BadRequest(format!("invalid path: {}", e.body_text())))
    }
}

/// A query string, named by `T`'s fields.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Query<T>(pub T);

impl<T, S> FromRequestParts<S> for Query<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = Error;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|q| Query(q.0))
            .map_err(|e| Error::BadRequest(format!("invalid query: {}", e.body_text())))
    }
}
