//! An answer as the server sent it, which every client here returns.

use serde_json::Value;

/// An answer as the server sent it: its status and JSON body (`Null` when
/// empty).
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    pub status: u16,
    pub body: Value,
}

impl Reply {
    /// The `error` message of an error body ("" if there is none).
    pub fn error(&self) -> &str {
        self.body["error"].as_str().unwrap_or_default()
    }
}

impl Reply {
    /// Assert this is a refusal with status `want` whose `error` message
    /// mentions `needle` (case-insensitively); `what` names the request in
    /// the panic. Returns the message.
    pub fn assert_error(&self, want: u16, needle: &str, what: &str) -> String {
        assert_eq!(
            self.status, want,
            "{what}: expected {want}, got {}: {}",
            self.status, self.body
        );
        let msg = self.body["error"]
            .as_str()
            .unwrap_or_else(|| panic!("{what}: error body without \"error\": {}", self.body))
            .to_owned();
        assert!(
            msg.to_lowercase().contains(&needle.to_lowercase()),
            "{what}: error message {msg:?} does not mention {needle:?}"
        );
        msg
    }
}

impl std::fmt::Display for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status, self.body)
    }
}
