//! cargo-fuzz target `event_apply`: see `kvfleet_fuzz_targets::event_apply`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvfleet_fuzz_targets::event_apply(data));
