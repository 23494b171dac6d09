//! Replays every committed fuzz seed and regression input (`fuzz/corpus/<target>/`)
//! through the fuzz target bodies: CI covers them without cargo-fuzz.

use std::path::Path;

#[test]
fn every_corpus_input_runs_through_its_target_without_panicking() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    for (name, target) in kvfleet_fuzz_targets::TARGETS {
        let dir = root.join(name);
        let mut n = 0;
        let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let path = entry.expect("corpus entry").path();
            let data = std::fs::read(&path).expect("read corpus input");
            target(&data);
            n += 1;
        }
        assert!(
            n >= 3,
            "target {name} has only {n} seeds in {}",
            dir.display()
        );
        eprintln!("{name}: {n} inputs replayed");
    }
}
