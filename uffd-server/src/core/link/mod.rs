//! A VM's link to its VMM process: starting the process
//! ([`process`]), its Welcome once it said hello ([`welcome`]), the
//! requests the features send it and their answers ([`requests`],
//! [`messages`]), and its end ([`exit`]).
//!
//! ```text
//!   launch_process ─▶ vmm-accept thread checks the hello's token ─▶ welcome
//!        (memfd, disk, config) ─▶ UffdReady (fault::serve) ─▶ Running
//!   send_request ─▶ ServerMsg::Request{seq} ─ ─ ─ VmmMsg::Reply{seq} ─▶ await_reply
//!   socket closed / process exited ─▶ ConnEvent::Closed ─▶ exit::mark_exited
//! ```

pub mod error;
pub mod exit;
pub mod messages;
pub mod process;
pub mod requests;
pub mod state;
pub mod welcome;
