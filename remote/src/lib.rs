//! pagefork snapshots in an S3-compatible object store (AWS S3, Ceph RGW,
//! MinIO, ...), through the `object_store` crate: push a local snapshot
//! directory, list, read a manifest, fetch one chunk, pull a whole
//! snapshot, delete, collect garbage, and a bounded local cache of chunks
//! for worker threads that serve faults from a remote snapshot.
//!
//! # Layout in the store
//!
//! ```text
//! s3://BUCKET/PREFIX/
//!   chunks/<xxh3-128 hex>   one MiB of memory.img or of a volume snapshot,
//!                           one zstd frame, named by the XXH3-128 of its
//!                           uncompressed bytes: the digest state.json
//!                           already records for that chunk
//!   manifests/<name>        a snapshot (proto::manifest): state, geometry,
//!                           each chunk's digest and stored length, the
//!                           volume snapshot's chunks, the working set
//!   locks/<push|gc>-<id>    a running push or gc
//! ```
//!
//! **Content-addressed chunks.** A chunk's key is its digest, so the store
//! holds each distinct MiB once, whichever snapshots, hosts or volumes it
//! comes from: a push uploads only the chunks the store lacks (a HEAD per
//! chunk tells), so an incremental or dirty snapshot, or a second template
//! booted from the same image, costs the chunks it changed. Holes (chunks
//! whose digest is that of zeroes) are not stored at all, and a pull
//! leaves them holes, as well as every run of 64 KiB or more of zero pages
//! in the chunks it writes.
//!
//! **One frame per chunk.** A chunk is a single zstd frame of its 1 MiB
//! (level 1), fetched with one range GET of exactly its stored length (the
//! manifest gives it, so a damaged or foreign object cannot make a reader
//! allocate more) and checked, once decoded, against its digest: the
//! snapshot's own checksum. Nothing reaches a cache or a file before it
//! matched. Frames of a few hundred KiB inside a chunk object would need a
//! frame index and a checksum per frame in the manifest (the snapshot's
//! checksums are per MiB) for little gain. Measured with RGW on the same
//! 2-core host and a 512 MiB snapshot of program bytes (3.3:1):
//!
//! | | 1 MiB frame (this layout) | 256 KiB frame |
//! |---|---|---|
//! | GET, p50 | 1.5-2.0 ms (~310 KiB) | 1.4-1.5 ms (~80 KiB) |
//! | decode (and check) | 0.7-0.8 ms | 0.17 ms |
//! | a cold fault | ~2.5 ms, 1 MiB around it | ~1.6 ms, 256 KiB around it |
//! | one MiB read in order | ~2.5 ms | ~6.4 ms (4 GETs) |
//!
//! A request costs its latency, not its bytes, so the bigger frame loses
//! ~1 ms on an isolated fault and wins whenever the guest reads on, as a
//! restore's working set does. Level 1 compresses this memory 3.31:1 at
//! ~700 MB/s a core, level 3 3.50:1 at ~400 MB/s, which made pushes
//! CPU-bound (`examples/measure.rs` measures all of this on any store).
//!
//! **The manifest is the commit point.** A push writes every chunk first
//! and the manifest last, with `If-None-Match: *` so two pushes of one
//! name cannot both commit. A snapshot is listed exactly when its manifest
//! exists; a push stopped half-way leaves chunks no manifest names, which
//! [`Remote::gc`] deletes.
//!
//! # Pushes and gc
//!
//! A gc deletes chunks no manifest names; a push relies, between its HEAD
//! of a chunk and the write of its manifest, on chunks no manifest names
//! yet. The rule: **a gc never runs while a push runs.** Both write a lock
//! object (`locks/push-…`, `locks/gc-…`) and then LIST the locks; a push
//! that sees a fresh gc lock withdraws its own and waits, a gc that sees a
//! fresh push lock withdraws its own and fails as busy. Listing is
//! consistent with writes in S3 and RGW, so of a push and a gc that
//! overlap at least one sees the other's lock: whichever wrote second
//! lists after the other's write. A lock is fresh while its last write is
//! less than [`Tuning::lock_ttl`] older than the lock being taken (both
//! times from the store's own clock, in one listing); holders rewrite
//! their lock every TTL/4, and a holder that went more than TTL/2 without
//! a successful rewrite (a stopped process, a store that did not answer)
//! stops with [`Error::LockLost`] before it commits a manifest or deletes a
//! chunk, as it may have been taken for dead. A push killed outright
//! leaves its lock, which goes stale after the TTL: until then a gc is
//! refused, after it the gc deletes the lock and the push's chunks.
//!
//! Deleting a manifest is not locked: a host still pulling or restoring
//! that snapshot loses its chunks at the next gc and fails with
//! [`Error::ChunkMissing`].
//!
//! # Trust
//!
//! Chunk digests are XXH3-128: they detect damage and mix-ups (a wrong,
//! truncated or bit-flipped object), not forgery by someone who can write
//! to the bucket; such a party is as trusted as the state directory.
//! Manifests are parsed as bytes from a peer (bounded, validated, fuzzed).
//! Credentials never reach a message: [`Secret`] prints as `<redacted>`
//! and every error text from the client is scrubbed of them.

mod cache;
mod chunk;
mod config;
mod error;
mod gc;
mod local;
mod lock;
mod pull;
mod push;
mod store;

pub use cache::{CacheStats, ChunkCache, Loaded};
pub use chunk::{digest, zero_digest, ChunkRef, Damage, CHUNK_BYTES};
pub use config::{Credentials, RemoteConfig, RemoteUrl, Secret, Tuning, DEFAULT_REGION};
pub use error::{Error, Result};
pub use gc::GcReport;
pub use local::{data_ranges, STATE_FILE};
pub use proto::manifest::{Manifest, PageRun};
pub use pull::{PullReport, PullTarget};
pub use push::{Progress, PushReport, PushSource};
pub use store::{Remote, RemoteSnapshot};
