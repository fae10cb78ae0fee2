//! Replays every input kept for the fuzz targets (`fuzz/seeds/<target>/` and the crashes found
//! by `make fuzz`, kept in `fuzz/regressions/<target>/`): none may panic.

mod fuzz_targets;

use std::path::Path;

#[test]
fn every_kept_fuzz_input_passes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut replayed = 0;
    for (name, target) in fuzz_targets::TARGETS {
        for kind in ["seeds", "regressions"] {
            let dir = root.join(kind).join(name);
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries {
                let path = entry.unwrap().path();
                let data = std::fs::read(&path).unwrap();
                let result = std::panic::catch_unwind(|| target(&data));
                assert!(result.is_ok(), "{name}: {} panics", path.display());
                replayed += 1;
            }
        }
    }
    assert!(replayed >= fuzz_targets::TARGETS.len(), "seeds are missing");
}
