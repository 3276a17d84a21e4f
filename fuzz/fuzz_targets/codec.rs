//! The codec never panics and never reads or writes out of bounds: any bytes are parsed and
//! checked in place alike (a refused encoding is fine), an accepted one decodes within its
//! destination (an error is fine), and any bf16 input encodes and decodes back bit for bit.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let parsed = ddo_codec::EncodedBf16::parse(data);
    assert_eq!(parsed.is_ok(), ddo_codec::EncodedBf16::check(data).is_ok(), "parse and check agree");
    if let Ok(enc) = parsed
        && enc.decoded_len() <= 1 << 24
    {
        let mut out = vec![0u8; enc.decoded_len() as usize];
        let _ = ddo_codec::decode_bf16(&enc, &mut out, 2);
    }
    let even = &data[..data.len() / 2 * 2];
    let enc = ddo_codec::encode_bf16(even, 1 + data.len() % 3).expect("any bf16 bytes encode");
    let bytes = enc.to_bytes();
    let back = ddo_codec::EncodedBf16::parse(&bytes).expect("an encoding parses");
    let mut out = vec![0u8; even.len()];
    ddo_codec::decode_bf16(&back, &mut out, 2).expect("an encoding decodes");
    assert_eq!(out, even, "bit for bit");
});
