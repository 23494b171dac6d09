//! cargo-fuzz target `proto_decode`: see `kvfleet_fuzz_targets::proto_decode`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvfleet_fuzz_targets::proto_decode(data));
