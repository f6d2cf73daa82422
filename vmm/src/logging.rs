//! The VMM's log: one line per `tracing` event on stderr (the server
//! points a VMM's stderr at `logs/<vm>.log`), filtered by target and level
//! from `RUST_LOG` (`info`, `vmm=debug,warn`; `info` when unset).
//!
//! Hand-written in place of tracing-subscriber's `fmt` subscriber, for
//! memory: that one sits on a span registry whose shard table
//! (sharded-slab, sized for 4,096 threads) is a 32 KiB zero-filled heap
//! block from the first event on, and its `EnvFilter` links a regex engine
//! whose relocated tables add ~20 KiB. Both are private memory in every
//! VMM, and a host runs a thousand VMMs. The VMM logs events only, never
//! spans, so a subscriber without a registry serves it; `Targets` still
//! parses the filter.

use std::fmt::Write as _;
use std::io::Write as _;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::filter::Targets;

/// Install the subscriber for the whole process.
pub fn init() {
    let log = Log {
        filter: filter_from_env(),
    };
    if tracing::subscriber::set_global_default(log).is_err() {
        eprintln!("vmm: a log subscriber was already installed");
    }
}

/// `RUST_LOG` as targets and levels; `info` when unset or unreadable.
fn filter_from_env() -> Targets {
    let info = || Targets::new().with_default(Level::INFO);
    match std::env::var("RUST_LOG") {
        Ok(s) => s.parse().unwrap_or_else(|e| {
            eprintln!(
                "vmm: RUST_LOG={s:?} is not a list of targets and levels ({e}); logging at info"
            );
            info()
        }),
        Err(_) => info(),
    }
}

struct Log {
    filter: Targets,
}

impl Subscriber for Log {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        self.filter
            .would_enable(metadata.target(), metadata.level())
    }

    // Spans are not logged (the VMM opens none); each gets the same id.
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let meta = event.metadata();
        let mut line = Line::default();
        let _ = write!(
            line.0,
            "{} {:>5} {}: ",
            humantime::format_rfc3339_micros(std::time::SystemTime::now()),
            meta.level(),
            meta.target()
        );
        event.record(&mut line);
        line.0.push('\n');
        // One write per line, so lines of different threads never mix.
        let _ = std::io::stderr().write_all(line.0.as_bytes());
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}

/// An event's text: the message, then `name=value` for each other field.
#[derive(Default)]
struct Line(String);

impl Visit for Line {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0.push_str(value);
        } else {
            let _ = write!(self.0, " {}={value}", field.name());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.0, "{value:?}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }
}
