//! cargo-fuzz target `gguf_header`: see `kvfleet_fuzz_targets::gguf_header`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvfleet_fuzz_targets::gguf_header(data));
