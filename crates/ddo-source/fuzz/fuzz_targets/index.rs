//! `cargo +nightly fuzz run index` from crates/ddo-source: index parsing never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = ddo_source::parse_index(text, std::path::Path::new("fuzz.index.json"));
    }
});
