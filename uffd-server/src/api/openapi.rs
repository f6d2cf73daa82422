//! The OpenAPI 3.0 document the server serves at `/v1/openapi.json`.
//!
//! Kept as JSON next to the code; a test checks that it names every route
//! the router serves.

use serde_json::Value;

const CORE: &str = include_str!("openapi.json");
const VOLUMES: &str = include_str!("volumes_openapi.json");

/// The document: the core paths plus the volume paths.
pub fn document() -> Value {
    let mut doc: Value = serde_json::from_str(CORE).unwrap_or(Value::Null);
    let vols: Value = serde_json::from_str(VOLUMES).unwrap_or(Value::Null);
    let frag = vols.get("paths").unwrap_or(&vols);
    if let (Some(paths), Some(extra)) = (
        doc.get_mut("paths").and_then(Value::as_object_mut),
        frag.as_object(),
    ) {
        for (k, v) in extra {
            paths.insert(k.clone(), v.clone());
        }
    }
    doc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn document_parses_and_lists_vm_routes() {
        let d = document();
        let paths = d["paths"].as_object().expect("paths");
        for p in [
            "/v1/volumes",
            "/v1/vms/{id}/fork",
            "/v1/tree",
            "/v1/health",
            "/v1/vms",
            "/v1/vms/{id}",
            "/v1/vms/{id}/exec",
            "/v1/vms/{id}/pause",
            "/v1/vms/{id}/resume",
        ] {
            assert!(paths.contains_key(p), "{p} missing from openapi.json");
        }
    }
}
