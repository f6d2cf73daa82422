//! One line for an error and the chain of its sources.

use std::fmt::Write;

/// `outer: inner: innermost` for `e` and its `source()` chain, skipping a
/// source whose text the outer message already ends with (errors that wrap
/// `#[error(transparent)]` or repeat their source).
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let text = c.to_string();
        if !out.ends_with(&text) {
            let _ = write!(out, ": {text}");
        }
        cur = c.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot open image")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn chain_joins_sources_once() {
        let e = Outer(std::io::Error::from_raw_os_error(libc_enoent()));
        let s = chain(&e);
        assert!(s.starts_with("cannot open image: "), "{s}");
        assert_eq!(s.matches("No such file").count(), 1, "{s}");
    }

    fn libc_enoent() -> i32 {
        2
    }
}
