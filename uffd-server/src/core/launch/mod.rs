//! A VM's life: created (fresh, from an image, or restored from a
//! snapshot) and started ([`create`]), deleted or forgotten ([`delete`]).
//! Its VMM process itself is `link::process`.

pub mod create;
pub mod delete;
