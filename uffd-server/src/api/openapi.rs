//! The OpenAPI 3 document the server serves at `/v1/openapi.json`, made by
//! the router itself: each route is registered with [`routes!`], which puts
//! the handler's `#[utoipa::path]` operation in the document beside the
//! route (its request body and parameters read off the handler's
//! arguments, its responses off its return type, see `body.rs`). There is
//! no list of paths to keep: a route the router serves is in the document,
//! and the document's routes are the ones served.

use std::future::Future;

use axum::extract::State;
use proto::api::ErrorBody;
use utoipa::openapi::path::{Operation, Parameter, ParameterIn, Paths};
use utoipa::openapi::HttpMethod;
use utoipa::{IntoParams, IntoResponses, OpenApi};

use super::body::{Answer, Json, Path, Query, Schemas};
use super::error::{ClientError, ErrorResponses, InsufficientStorage, ServerError};

/// What the document says besides its paths: who it is, and the error
/// responses every operation refers to.
#[derive(Debug, OpenApi)]
#[openapi(
    info(
        title = "pagefork uffd-server API",
        description = "Control API of the pagefork page server: VMs, live fork, memory-source \
                       debugging, Firecracker listeners, VM snapshots and reflink disk volumes. JSON over the \
                       server's Unix socket (STATE_DIR/api.sock). Errors are {\"error\": \"...\"}: \
                       4xx for the client's mistakes, 5xx for the server's own failures, 507 when \
                       the server has not the room for what was asked."
    ),
    components(
        schemas(ErrorBody),
        responses(ClientError, InsufficientStorage, ServerError)
    )
)]
pub struct ApiDoc;

/// What a handler's arguments and answer add to its operation beyond what
/// `#[utoipa::path]` reads off them: the parameters of its [`Path`] and
/// [`Query`] arguments (utoipa takes those only when they are listed in
/// the attribute as well) and the schemas its answer refers to (utoipa
/// collects those of request bodies, not those of answers). Implemented
/// for functions of up to six arguments, each an [`Arg`].
pub trait Handler<Args> {
    type Answer: Answer;
    /// The parameters of the arguments, in order.
    fn params() -> Vec<Parameter>;
}

macro_rules! handler {
    ($($arg:ident),*) => {
        impl<F, Fut, $($arg,)*> Handler<($($arg,)*)> for F
        where
            F: FnOnce($($arg),*) -> Fut,
            Fut: Future,
            Fut::Output: Answer,
            $($arg: Arg,)*
        {
            type Answer = Fut::Output;

            fn params() -> Vec<Parameter> {
                #[allow(unused_mut)]
                let mut params = Vec::new();
                $(params.extend($arg::params());)*
                params
            }
        }
    };
}

handler!();
handler!(A);
handler!(A, B);
handler!(A, B, C);
handler!(A, B, C, D);
handler!(A, B, C, D, E);
handler!(A, B, C, D, E, G);

/// A handler argument: what it adds to the operation's parameters (a
/// request body is documented by `#[utoipa::path]` itself).
pub trait Arg {
    fn params() -> Vec<Parameter> {
        Vec::new()
    }
}

impl<S> Arg for State<S> {}
impl<T> Arg for Json<T> {}
impl<T> Arg for Option<Json<T>> {}

impl<T: IntoParams> Arg for Path<T> {
    fn params() -> Vec<Parameter> {
        T::into_params(|| Some(ParameterIn::Path))
    }
}

impl<T: IntoParams> Arg for Query<T> {
    fn params() -> Vec<Parameter> {
        T::into_params(|| Some(ParameterIn::Query))
    }
}

/// Complete `handler`'s operation (`P`, its `#[utoipa::path]`) in `paths`
/// with what its signature says (see [`Handler`]).
pub fn describe<P, H, Args>(_handler: &H, paths: &mut Paths, schemas: &mut Schemas)
where
    P: utoipa::Path,
    H: Handler<Args>,
{
    <H::Answer as Answer>::schemas(schemas);
    let params = H::params();
    if params.is_empty() {
        return;
    }
    let Some(item) = paths.paths.get_mut(&P::path()) else {
        return;
    };
    for method in P::methods() {
        let op = match method {
            HttpMethod::Get => &mut item.get,
            HttpMethod::Put => &mut item.put,
            HttpMethod::Post => &mut item.post,
            HttpMethod::Delete => &mut item.delete,
            HttpMethod::Options => &mut item.options,
            HttpMethod::Head => &mut item.head,
            HttpMethod::Patch => &mut item.patch,
            HttpMethod::Trace => &mut item.trace,
        };
        if let Some(op) = op {
            op.parameters
                .get_or_insert_with(Vec::new)
                .extend(params.iter().cloned());
        }
    }
}

/// The handlers of one path, for `OpenApiRouter::routes`: utoipa-axum's
/// `routes!`, each operation completed by [`describe`].
macro_rules! routes {
    ($($handler:ident),+ $(,)?) => {{
        let (mut schemas, mut paths, router) = utoipa_axum::routes!($($handler),+);
        $(
            utoipa_axum::paste! {
                $crate::api::openapi::describe::<[<__path_ $handler>], _, _>(
                    &$handler,
                    &mut paths,
                    &mut schemas,
                );
            }
        )+
        (schemas, paths, router)
    }};
}
pub(crate) use routes;

/// Finish the document a router collected: every operation answers the
/// shared errors, also one whose handler cannot fail (the connection cap
/// and an oversized body are answered before any handler runs).
pub fn finish(mut doc: utoipa::openapi::OpenApi) -> serde_json::Value {
    let errors = ErrorResponses::responses();
    for op in doc.paths.paths.values_mut().flat_map(operations) {
        for (status, response) in &errors {
            op.responses
                .responses
                .entry(status.clone())
                .or_insert_with(|| response.clone());
        }
    }
    serde_json::to_value(doc).unwrap_or_default()
}

fn operations(item: &mut utoipa::openapi::PathItem) -> impl Iterator<Item = &mut Operation> {
    [
        &mut item.get,
        &mut item.put,
        &mut item.post,
        &mut item.delete,
        &mut item.options,
        &mut item.head,
        &mut item.patch,
        &mut item.trace,
    ]
    .into_iter()
    .flatten()
}

#[cfg(test)]
mod tests {
    /// The document of a server with a volume engine (every route).
    fn document() -> serde_json::Value {
        let mut doc = ApiDoc::openapi();
        doc.merge(crate::api::core_routes().into_openapi());
        doc.merge(crate::api::volumes::routes().into_openapi());
        finish(doc)
    }

    use std::sync::Arc;

    use axum::body::Body;
    use axum::http::{Method, Request, StatusCode};
    use tower::ServiceExt;

    use super::*;
    use crate::core::Core;
    use volume::VolumeEngine;

    /// The operations of a document: (method, path) with the operation.
    fn operations_of(doc: &serde_json::Value) -> Vec<(String, String, serde_json::Value)> {
        let mut ops = Vec::new();
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for (method, op) in item.as_object().expect("path item") {
                ops.push((method.clone(), path.clone(), op.clone()));
            }
        }
        ops
    }

    /// Every operation answers its own success and the shared errors, by
    /// reference to the one place they are written.
    #[test]
    fn every_operation_documents_its_answer_and_the_shared_errors() {
        let d = document();
        let ops = operations_of(&d);
        assert!(ops.len() > 40, "{}", ops.len());
        for (method, path, op) in &ops {
            let codes: Vec<&String> = op["responses"]
                .as_object()
                .expect("responses")
                .keys()
                .collect();
            assert!(
                codes.iter().any(|c| c.starts_with('2')),
                "{method} {path}: no success answer in {codes:?}"
            );
            for shared in ["4XX", "507", "5XX"] {
                assert!(
                    codes.iter().any(|c| *c == shared),
                    "{method} {path}: no {shared}"
                );
            }
        }
        let op = &d["paths"]["/v1/vms"]["post"];
        assert_eq!(
            op["responses"]["4XX"]["$ref"], "#/components/responses/ClientError",
            "{op}"
        );
        assert_eq!(
            op["responses"]["201"]["content"]["application/json"]["schema"]["$ref"],
            "#/components/schemas/VmInfo",
            "{op}"
        );
        assert_eq!(
            op["requestBody"]["content"]["application/json"]["schema"]["$ref"],
            "#/components/schemas/CreateVm",
            "{op}"
        );
        let responses = d["components"]["responses"].as_object().expect("responses");
        for r in ["ClientError", "InsufficientStorage", "ServerError"] {
            assert!(responses.contains_key(r), "response {r} missing");
        }
    }

    /// A handler's `Path` and `Query` arguments are its operation's
    /// parameters: every `{name}` of a path is documented, and so are the
    /// query strings the handlers take.
    #[test]
    fn parameters_come_from_the_handlers_arguments() {
        let d = document();
        for (method, path, op) in operations_of(&d) {
            let params: Vec<(String, String)> = op["parameters"]
                .as_array()
                .map(|ps| {
                    ps.iter()
                        .map(|p| {
                            let name = p["name"].as_str().unwrap_or_default().to_owned();
                            let place = p["in"].as_str().unwrap_or_default().to_owned();
                            (name, place)
                        })
                        .collect()
                })
                .unwrap_or_default();
            let in_path: Vec<&str> = path
                .split('/')
                .filter_map(|seg| seg.strip_prefix('{')?.strip_suffix('}'))
                .collect();
            for name in &in_path {
                assert!(
                    params.contains(&((*name).to_owned(), "path".to_owned())),
                    "{method} {path}: {{{name}}} undocumented in {params:?}"
                );
            }
            let path_params = params.iter().filter(|(_, place)| place == "path").count();
            assert_eq!(path_params, in_path.len(), "{method} {path}: {params:?}");
        }
        let query = |path: &str, method: &str| -> Vec<String> {
            d["paths"][path][method]["parameters"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["in"] == "query")
                .map(|p| p["name"].as_str().unwrap_or_default().to_owned())
                .collect()
        };
        assert_eq!(
            query("/v1/vms/{id}/faults", "get"),
            ["follow", "kind", "limit"]
        );
        assert_eq!(query("/v1/vms/{id}/pages/{page}", "get"), ["explain"]);
        assert_eq!(query("/v1/vms/{id}/map.png", "get"), ["cells"]);
        assert_eq!(query("/v1/vms/{id}/access", "get"), ["within_ms"]);
        assert!(query("/v1/vms/{id}/access", "delete").is_empty());
        let page = &d["paths"]["/v1/vms/{id}/pages/{page}"]["get"]["parameters"][1];
        assert_eq!(page["schema"]["type"], "integer", "{page}");
        let fork = &d["paths"]["/v1/vms/{id}/fork"]["post"]["requestBody"];
        // Optional: `required` absent or false.
        assert_ne!(fork["required"], true, "{fork}");
        assert!(fork["content"]["application/json"].is_object(), "{fork}");
    }

    /// Every `$ref` of the document names a schema or response it holds:
    /// the answers' schemas are collected with the routes.
    #[test]
    fn every_reference_resolves() {
        fn refs(v: &serde_json::Value, out: &mut Vec<String>) {
            match v {
                serde_json::Value::Object(m) => {
                    if let Some(r) = m.get("$ref").and_then(|r| r.as_str()) {
                        out.push(r.to_owned());
                    }
                    m.values().for_each(|v| refs(v, out));
                }
                serde_json::Value::Array(a) => a.iter().for_each(|v| refs(v, out)),
                _ => {}
            }
        }
        let d = document();
        let mut all = Vec::new();
        refs(&d, &mut all);
        assert!(all.len() > 100, "{}", all.len());
        for r in all {
            let pointer = r.trim_start_matches('#');
            assert!(d.pointer(pointer).is_some(), "{r} does not resolve");
        }
    }

    /// Each documented operation reaches a handler through the router the
    /// server serves (not the fallback's 404, not a 405): with a core that
    /// has stopped, the VM routes answer 503 and the volume routes their
    /// engine's answer, but none is unknown.
    #[tokio::test]
    async fn every_documented_operation_is_served() {
        let dir = tempfile::tempdir().unwrap();
        let engine = Arc::new(VolumeEngine::open(dir.path()).unwrap());
        let (core, commands) = Core::command_channel();
        drop(commands);
        let app = super::super::router(core, Some(engine));
        let d = document();
        for (method, path, _) in operations_of(&d) {
            let uri = path
                .replace("{id}", "vm-1")
                .replace("{name}", "x")
                .replace("{page}", "0");
            let req = Request::builder()
                .method(Method::from_bytes(method.to_uppercase().as_bytes()).unwrap())
                .uri(&uri)
                .body(Body::empty())
                .unwrap();
            let res = app.clone().oneshot(req).await.unwrap();
            let status = res.status();
            let body = axum::body::to_bytes(res.into_body(), 1 << 20)
                .await
                .unwrap();
            let text = String::from_utf8_lossy(&body);
            assert_ne!(status, StatusCode::METHOD_NOT_ALLOWED, "{method} {uri}");
            assert!(
                !text.contains("no such route"),
                "{method} {uri}: {status} {text}"
            );
        }
        // And what is not documented is not served.
        let req = Request::builder()
            .uri("/v1/nothing")
            .body(Body::empty())
            .unwrap();
        let res = app.clone().oneshot(req).await.unwrap();
        assert_eq!(res.status(), StatusCode::NOT_FOUND);
    }

    /// The document the server serves is the one its router made.
    #[tokio::test]
    async fn the_server_serves_its_routers_document() {
        let (core, _commands) = Core::command_channel();
        let dir = tempfile::tempdir().unwrap();
        let engine = Arc::new(VolumeEngine::open(dir.path()).unwrap());
        let app = super::super::router(core.clone(), Some(engine));
        let req = Request::builder()
            .uri("/v1/openapi.json")
            .body(Body::empty())
            .unwrap();
        let res = app.oneshot(req).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        let body = axum::body::to_bytes(res.into_body(), 1 << 24)
            .await
            .unwrap();
        let served: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(served, document());
        // Without a volume engine there are no volume routes to describe.
        let res = super::super::router(core, None)
            .oneshot(
                Request::builder()
                    .uri("/v1/openapi.json")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        let body = axum::body::to_bytes(res.into_body(), 1 << 24)
            .await
            .unwrap();
        let served: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let paths = served["paths"].as_object().unwrap();
        assert!(paths.contains_key("/v1/vms"));
        assert!(!paths.keys().any(|p| p.starts_with("/v1/volume")));
    }

    #[test]
    fn document_holds_the_bodies_schemas() {
        let d = document();
        let schemas = d["components"]["schemas"].as_object().expect("schemas");
        for t in [
            "CreateVm",
            "VmInfo",
            "ExecRequest",
            "ForkResponse",
            "ErrorBody",
            "VolumeInfo",
            "CreateSnapshot",
            "SnapshotCreated",
            "SnapshotInfo",
        ] {
            assert!(schemas.contains_key(t), "schema {t} missing");
        }
    }

    /// The limits the schema states are the ones the server enforces.
    #[test]
    fn count_limits_in_the_schema_are_the_servers() {
        let d = document();
        let schemas = &d["components"]["schemas"];
        for (schema, max) in [
            ("ForkRequest", proto::api::MAX_FORK_COUNT),
            ("CloneVm", proto::api::MAX_CLONE_COUNT),
        ] {
            let count = &schemas[schema]["properties"]["count"];
            assert_eq!(count["minimum"].as_f64(), Some(1.0), "{schema}: {count}");
            assert_eq!(
                count["maximum"].as_f64(),
                Some(f64::from(max)),
                "{schema}: {count}"
            );
        }
    }

    #[test]
    fn exec_schema_names_each_op_and_its_fields() {
        let d = document();
        let exec = d["components"]["schemas"]["ExecRequest"].to_string();
        for op in [
            "fill",
            "touch",
            "digest",
            "identity",
            "disk_fill",
            "disk_write_pages",
        ] {
            assert!(exec.contains(op), "{op} missing from {exec}");
        }
    }
}
