//! `cargo +nightly fuzz run header` from crates/ddo-source: header parsing never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::path::Path::new("fuzz.safetensors");
    if let Ok(header) = ddo_source::parse_header(data, data.len() as u64, path) {
        for e in header.entries {
            assert!(e.offset + e.len <= data.len() as u64);
        }
    }
});
