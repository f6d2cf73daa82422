//! Reflink volume engine (placeholder).
