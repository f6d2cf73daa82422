//! A VM's link to its VMM process.

pub mod state;
