//! A VM's life: made, the one way every VM is ([`make`]), created
//! (fresh, from an image, or restored from a snapshot) and started
//! ([`create`]), deleted or forgotten ([`delete`]).
//! Its VMM process itself is `link::process`.

pub mod create;
pub mod delete;
pub mod make;
