//! `cargo +nightly fuzz run header` from crates/ddo-source: header parsing never panics, and
//! whatever the safetensors crate (the format's reference reader) refuses, ddo refuses; when both
//! accept, they list the same tensors at the same offsets. ddo alone refuses repeated tensor
//! names, dtypes it cannot stream and entries written as arrays (`tests/differential.rs` runs
//! this corpus and names those cases).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::path::Path::new("fuzz.safetensors");
    let ddo = ddo_source::parse_header(data, data.len() as u64, path);
    match (ddo, safetensors::SafeTensors::read_metadata(data)) {
        (Ok(header), Ok((n, metadata))) => {
            assert_eq!(header.data_start, 8 + n as u64);
            assert_eq!(header.entries.len(), metadata.tensors().len());
            for e in &header.entries {
                assert!(e.offset + e.len <= data.len() as u64);
                let info = metadata.info(&e.name).expect("both list the same names");
                assert_eq!(info.dtype.to_string(), e.dtype.as_str());
                assert!(info.shape.iter().map(|&d| d as u64).eq(e.shape.iter().copied()));
                let (start, end) = info.data_offsets;
                assert_eq!(header.data_start + start as u64, e.offset);
                assert_eq!(end as u64 - start as u64, e.len);
            }
        }
        (Ok(header), Err(e)) => panic!("ddo accepts {header:?}; the safetensors crate refuses: {e}"),
        (Err(_), _) => {}
    }
});
