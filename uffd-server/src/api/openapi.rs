//! The OpenAPI 3.0 document the server serves at `/v1/openapi.json`.
//!
//! Kept as JSON next to the code; a test checks that it names every route
//! the router serves.

use serde_json::Value;

const CORE: &str = include_str!("openapi.json");

/// The document.
pub fn document() -> Value {
    serde_json::from_str(CORE).unwrap_or(Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn document_parses_and_lists_vm_routes() {
        let d = document();
        let paths = d["paths"].as_object().expect("paths");
        for p in ["/v1/health", "/v1/vms", "/v1/vms/{id}", "/v1/vms/{id}/exec", "/v1/vms/{id}/pause", "/v1/vms/{id}/resume"] {
            assert!(paths.contains_key(p), "{p} missing from openapi.json");
        }
    }
}
