//! Cross-crate tests of ddo live in `tests/tests/`.
