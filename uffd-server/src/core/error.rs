//! Errors the core returns to API clients: an HTTP status and a message
//! that says what to fix.

use std::fmt;

/// An error for an API client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status code.
    pub status: u16,
    /// What went wrong and what to do about it.
    pub message: String,
}

impl ApiError {
    /// 400: the request itself is wrong.
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: 400,
            message: message.into(),
        }
    }
    /// 404: no such object.
    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError {
            status: 404,
            message: message.into(),
        }
    }
    /// 409: the object is in the wrong state.
    pub fn conflict(message: impl Into<String>) -> Self {
        ApiError {
            status: 409,
            message: message.into(),
        }
    }
    /// 500: the server failed.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: 500,
            message: message.into(),
        }
    }
    /// 502: the VMM failed or answered with an error.
    pub fn vmm(message: impl Into<String>) -> Self {
        ApiError {
            status: 502,
            message: message.into(),
        }
    }
    /// 504: the VMM did not answer in time.
    pub fn timeout(message: impl Into<String>) -> Self {
        ApiError {
            status: 504,
            message: message.into(),
        }
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.message, self.status)
    }
}

impl std::error::Error for ApiError {}

/// Result alias for core operations.
pub type ApiResult<T> = std::result::Result<T, ApiError>;
