//! `uffdctl`: pagefork's control CLI and memory-source debugging tool.
//!
//! A client of the REST API and nothing more: it builds request bodies
//! from the `proto::api` types the server parses, and never links the
//! daemon. [`client`] is the blocking HTTP client over the API socket,
//! also used by the end-to-end tests; [`cli`] holds the commands.

pub mod cli;
pub mod client;
pub mod error;

pub use error::{CliError, Result};
