//! cargo-fuzz target `trace_line`: see `kvfleet_fuzz_targets::trace_line`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvfleet_fuzz_targets::trace_line(data));
