//! cargo-fuzz target `messages_request`: see `kvfleet_fuzz_targets::messages_request`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvfleet_fuzz_targets::messages_request(data));
