//! The OpenAPI 3 document the server serves at `/v1/openapi.json`,
//! derived from the handlers' annotations and the `proto::api` types: it
//! cannot drift from what the server parses and answers.

use utoipa::OpenApi;

/// The API: every route of the VM and the volume routers.
#[derive(Debug, OpenApi)]
#[openapi(
    info(
        title = "pagefork uffd-server API",
        description = "Control API of the pagefork page server: VMs, live fork, memory-source \
                       debugging, Firecracker listeners, VM snapshots and reflink disk volumes. JSON over the \
                       server's Unix socket (STATE_DIR/api.sock). Errors are {\"error\": \"...\"}: \
                       4xx for the client's mistakes, 5xx for the server's own failures."
    ),
    paths(
        super::health,
        super::create_vm,
        super::list_vms,
        super::get_vm,
        super::delete_vm,
        super::pause,
        super::resume,
        super::exec,
        super::fork,
        super::sources,
        super::page,
        super::tree,
        super::invariant,
        super::metrics,
        super::observe::faults,
        super::observe::access,
        super::observe::reset_access,
        super::observe::access_png,
        super::observe::map,
        super::observe::map_png,
        super::add_listener,
        super::list_listeners,
        super::delete_listener,
        super::snapshots::create_snapshot,
        super::snapshots::list_snapshots,
        super::snapshots::get_snapshot,
        super::snapshots::delete_snapshot,
        super::snapshots::rollback_vm,
        super::snapshots::clone_vm,
        super::volumes::list_volumes,
        super::volumes::create_volume,
        super::volumes::get_volume,
        super::volumes::delete_volume,
        super::volumes::grow_volume,
        super::volumes::snapshot_volume,
        super::volumes::list_volume_snapshots,
        super::volumes::rollback_volume,
        super::volumes::import_volume,
        super::volumes::export_volume,
        super::volumes::list_snapshots,
        super::volumes::get_snapshot,
        super::volumes::delete_snapshot,
        super::volumes::snapshot_snapshot,
    )
)]
pub struct ApiDoc;

/// The document as JSON.
pub fn document() -> serde_json::Value {
    serde_json::to_value(ApiDoc::openapi()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every route the routers serve, with its methods.
    const ROUTES: &[(&str, &[&str])] = &[
        ("/v1/health", &["get"]),
        ("/v1/vms", &["get", "post"]),
        ("/v1/vms/{id}", &["get", "delete"]),
        ("/v1/vms/{id}/pause", &["post"]),
        ("/v1/vms/{id}/resume", &["post"]),
        ("/v1/vms/{id}/exec", &["post"]),
        ("/v1/vms/{id}/fork", &["post"]),
        ("/v1/vms/{id}/sources", &["get"]),
        ("/v1/vms/{id}/pages/{page}", &["get"]),
        ("/v1/tree", &["get"]),
        ("/v1/debug/invariant", &["get"]),
        ("/metrics", &["get"]),
        ("/v1/vms/{id}/faults", &["get"]),
        ("/v1/vms/{id}/access", &["get", "delete"]),
        ("/v1/vms/{id}/access.png", &["get"]),
        ("/v1/vms/{id}/map", &["get"]),
        ("/v1/vms/{id}/map.png", &["get"]),
        ("/v1/firecracker/listeners", &["get", "post"]),
        ("/v1/firecracker/listeners/{id}", &["delete"]),
        ("/v1/vms/{id}/snapshots", &["post"]),
        ("/v1/vms/{id}/rollback", &["post"]),
        ("/v1/vms/{id}/clone", &["post"]),
        ("/v1/snapshots", &["get"]),
        ("/v1/snapshots/{name}", &["get", "delete"]),
        ("/v1/volumes", &["get", "post"]),
        ("/v1/volumes/{name}", &["get", "delete"]),
        ("/v1/volumes/{name}/grow", &["post"]),
        ("/v1/volumes/{name}/snapshots", &["get", "post"]),
        ("/v1/volumes/{name}/rollback", &["post"]),
        ("/v1/volumes/import", &["post"]),
        ("/v1/volumes/{name}/export", &["post"]),
        ("/v1/volume-snapshots", &["get"]),
        ("/v1/volume-snapshots/{name}", &["get", "delete"]),
        ("/v1/volume-snapshots/{name}/snapshots", &["post"]),
    ];

    #[test]
    fn document_describes_every_route_with_its_bodies() {
        let d = document();
        let paths = d["paths"].as_object().expect("paths");
        assert_eq!(paths.len(), ROUTES.len(), "{:?}", paths.keys());
        for (path, methods) in ROUTES {
            for m in *methods {
                let op = &d["paths"][path][m];
                assert!(op.is_object(), "{m} {path} missing");
                assert!(
                    op["responses"]["4XX"].is_object(),
                    "{m} {path}: no error body"
                );
            }
        }
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
