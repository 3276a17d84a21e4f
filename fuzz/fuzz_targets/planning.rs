//! Laying out and planning units never panics or wraps (see `planning_input.rs`).
#![no_main]

use libfuzzer_sys::fuzz_target;

mod planning_input;

fuzz_target!(|data: &[u8]| planning_input::plan(data));
