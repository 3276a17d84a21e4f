//! Inputs the fuzz targets found, kept as tests (through the fuzz targets' own steps).

#[path = "../../../fuzz/fuzz_targets/planning_input.rs"]
mod planning_input;

use ddo_arena::ArenaError;
use planning_input::plan;

/// Streamed units whose slot ranges would overflow the placed layout: the plan refuses them
/// (before the refusal, placing wrapped).
#[test]
fn slots_that_would_overflow_the_placed_layout_are_refused() {
    let planned = plan(&[
        0, 0, 0, 26, 0, 0, 0, 246, 32, 7, 7, 7, 0, 0, 0, 0, 0, 0, 0, 0, 95, 0, 0, 26, 0, 0, 0, 246,
        0, 0, 0, 0, 0, 0, 0, 0, 0, 95, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
        4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 255, 4, 4, 4, 4,
        4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 234,
        234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234,
        234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 4, 4, 4, 4, 4, 4, 255, 3,
        4, 4, 4, 4, 4, 58, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
        4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
        4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 36,
        4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 184, 184, 184, 4, 4,
        4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 8, 4, 4, 4, 4, 4, 4, 4, 4, 4, 0, 4, 4, 4, 4, 4, 4, 4,
        4, 4, 4, 4, 4, 4, 4, 255, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
        4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234,
        234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234, 234,
        234, 234, 4, 4, 4, 4, 4, 4, 255, 3, 4, 4, 4, 4, 4, 58, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
        4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 26, 0, 95, 0, 0, 0, 0, 0,
        0,
    ])
    .expect("the input describes units");
    match planned {
        Err(ArenaError::InvalidUnits(why)) => {
            assert!(why.contains("exceed what an arena can lay out"), "{why}");
        }
        other => panic!("the plan was not refused for its placed size: {other:?}"),
    }
}
