//! Laying out and planning units never panics or wraps (see `planning_input.rs`).
#![no_main]

use libfuzzer_sys::fuzz_target;

mod planning_input;

fuzz_target!(|data: &[u8]| {
    // A refusal is fine; a panic (or a wrapped size, asserted inside) is a finding.
    let _ = planning_input::plan(data);
});
