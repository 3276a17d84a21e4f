//! `cargo +nightly fuzz run gguf` from crates/ddo-source: GGUF header parsing never panics, and
//! every header it accepts lists tensors inside the file, aligned, and not overlapping.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::path::Path::new("fuzz.gguf");
    if let Ok(h) = ddo_source::parse_gguf(data, data.len() as u64, path) {
        assert!(h.alignment.is_power_of_two());
        assert_eq!(h.entries.len(), h.types.len());
        let mut ranges: Vec<(u64, u64)> = h.entries.iter().map(|e| (e.offset, e.offset + e.len)).collect();
        for e in &h.entries {
            assert!(e.offset >= h.data_start && e.offset + e.len <= data.len() as u64);
            assert_eq!((e.offset - h.data_start) % h.alignment, 0);
            let elements: u64 = e.shape.iter().product();
            assert_eq!(elements * e.dtype.size_bytes(), e.len);
        }
        ranges.sort_unstable();
        assert!(ranges.windows(2).all(|w| w[0].1 <= w[1].0));
    }
});
