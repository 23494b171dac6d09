//! cargo-fuzz target `chat_request`: see `kvfleet_fuzz_targets::chat_request`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvfleet_fuzz_targets::chat_request(data));
