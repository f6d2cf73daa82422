//! The live fault trace of one VM: `GET /v1/vms/{id}/faults?follow=true`.
//!
//! Each VM has a [`Tap`]. Nobody listening costs the fault path one relaxed
//! atomic load per event ([`Tap::active`]): no clock read, no allocation,
//! no lock. A listener gets its own receiver of a bounded broadcast
//! channel (created at the first subscription); the core sends a small
//! `Copy` [`RawEvent`] (no allocation: sources travel as arena ids, named
//! once in the tap's name table) with `broadcast::Sender::send`, which
//! never waits: a reader that falls more than [`CAPACITY`] events behind
//! loses the oldest ones and is told how many (`{"dropped": n}`). A fault
//! is never slowed by a reader; the JSON is made by the listener's stream.
//!
//! ```text
//!   core thread (serve_faults)             API task (one per listener)
//!   ───────────────────────────            ───────────────────────────
//!   tap.active()? ── no ─▶ handle event    subscribe (through the core)
//!        │ yes                              rx.recv() ─▶ NDJSON line
//!   handle event, time it                   Lagged(n) ─▶ {"dropped": n}
//!   tap.send(FaultEvent) ─── broadcast ──▶  Closed   ─▶ end of stream
//! ```
//!
//! The stream ends when the VM's VMM goes ([`Tap::close`]), after `limit`
//! events, or when the client hangs up (its receiver and its count go).

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use proto::api::{FaultEvent, FaultKind};
use tokio::sync::broadcast;

use crate::pages::SourceId;

/// One traced event as the fault path records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawEvent {
    pub time_us: u64,
    pub kind: FaultKind,
    pub page: u64,
    pub write: bool,
    /// The source, named in the tap's [`Names`].
    pub source: Option<SourceId>,
    pub pages: u64,
    pub service_us: u64,
}

/// Names of the sources a tap's events mention (a handful per VM).
pub type Names = Arc<Mutex<HashMap<SourceId, String>>>;

/// Events a listener may fall behind before it loses the oldest.
pub const CAPACITY: usize = 4096;

/// One VM's trace point. Lives on the core thread (in the VM and in its
/// fault-serving task); only the listener count is shared with API tasks.
#[derive(Debug, Default)]
pub struct Tap {
    listeners: Arc<AtomicUsize>,
    tx: RefCell<Option<broadcast::Sender<RawEvent>>>,
    closed: std::cell::Cell<bool>,
    names: Names,
}

/// A listener: its receiver, the names of sources, and its place in the
/// listener count (given back when dropped, on whatever thread the stream
/// ends).
#[derive(Debug)]
pub struct Subscription {
    pub rx: broadcast::Receiver<RawEvent>,
    /// The VM (`vm-N`).
    pub vm: String,
    names: Names,
    count: Arc<AtomicUsize>,
}

impl Subscription {
    /// The event as the API shows it.
    pub fn event(&self, raw: &RawEvent) -> FaultEvent {
        let source = raw.source.map(|id| {
            self.names
                .lock()
                .ok()
                .and_then(|n| n.get(&id).cloned())
                .unwrap_or_else(|| format!("source-{id}"))
        });
        FaultEvent {
            time_us: raw.time_us,
            vm: self.vm.clone(),
            kind: raw.kind,
            page: raw.page,
            write: raw.write,
            source,
            pages: raw.pages,
            service_us: raw.service_us,
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Tap {
    /// Whether anyone listens: the one check on the fault path.
    #[inline]
    pub fn active(&self) -> bool {
        self.listeners.load(Ordering::Relaxed) > 0
    }

    /// Listeners now.
    pub fn listeners(&self) -> u64 {
        self.listeners.load(Ordering::Relaxed) as u64
    }

    /// Make sure `id` has a name in the table (`name` is called only the
    /// first time).
    pub fn name(&self, id: SourceId, name: impl FnOnce() -> String) {
        if let Ok(mut names) = self.names.lock() {
            names.entry(id).or_insert_with(name);
        }
    }

    /// A new listener of VM `vm`, or `None` once the VM's VMM is gone.
    pub fn subscribe(&self, vm: String) -> Option<Subscription> {
        if self.closed.get() {
            return None;
        }
        let mut tx = self.tx.borrow_mut();
        let rx = tx
            .get_or_insert_with(|| broadcast::channel(CAPACITY).0)
            .subscribe();
        self.listeners.fetch_add(1, Ordering::Relaxed);
        Some(Subscription {
            rx,
            vm,
            names: self.names.clone(),
            count: self.listeners.clone(),
        })
    }

    /// Hand `event` to the listeners; never waits.
    pub fn send(&self, event: RawEvent) {
        if let Some(tx) = self.tx.borrow().as_ref() {
            let _ = tx.send(event);
        }
    }

    /// The VM's VMM is gone: every listener's stream ends after the
    /// events already sent.
    pub fn close(&self) {
        self.closed.set(true);
        self.tx.borrow_mut().take();
    }
}

/// Microseconds since the Unix epoch.
pub fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(page: u64) -> RawEvent {
        RawEvent {
            time_us: 0,
            kind: FaultKind::Missing,
            page,
            write: false,
            source: Some(3),
            pages: 1,
            service_us: 0,
        }
    }

    #[test]
    fn events_name_their_source_from_the_table() {
        let tap = Tap::default();
        let mut sub = tap.subscribe("vm-1".into()).expect("open");
        tap.name(3, || "snapshot:a".into());
        tap.name(3, || unreachable!("named once"));
        tap.send(event(7));
        let raw = sub.rx.try_recv().expect("an event");
        let ev = sub.event(&raw);
        assert_eq!(
            (ev.vm.as_str(), ev.source.as_deref()),
            ("vm-1", Some("snapshot:a"))
        );
    }

    #[test]
    fn inactive_until_subscribed_and_after_the_listener_goes() {
        let tap = Tap::default();
        assert!(!tap.active());
        let sub = tap.subscribe("vm-1".into()).expect("open");
        assert!(tap.active());
        drop(sub);
        assert!(!tap.active());
    }

    #[test]
    fn a_slow_listener_is_told_how_many_it_lost() {
        let tap = Tap::default();
        let mut sub = tap.subscribe("vm-1".into()).expect("open");
        for p in 0..(CAPACITY as u64 + 10) {
            tap.send(event(p));
        }
        match sub.rx.try_recv() {
            Err(broadcast::error::TryRecvError::Lagged(n)) => assert_eq!(n, 10),
            other => panic!("expected a lag, got {other:?}"),
        }
        assert_eq!(sub.rx.try_recv().map(|e| e.page).ok(), Some(10));
    }

    #[test]
    fn close_ends_every_stream_and_refuses_new_listeners() {
        let tap = Tap::default();
        let mut sub = tap.subscribe("vm-1".into()).expect("open");
        tap.send(event(7));
        tap.close();
        assert_eq!(sub.rx.try_recv().map(|e| e.page).ok(), Some(7));
        assert!(matches!(
            sub.rx.try_recv(),
            Err(broadcast::error::TryRecvError::Closed)
        ));
        assert!(tap.subscribe("vm-1".into()).is_none());
    }
}
