//! AFL++ harness for the `request` target (see tests/fuzz_targets).
#[path = "../../../tests/fuzz_targets/mod.rs"]
#[allow(dead_code)]
mod fuzz_targets;

fn main() {
    afl::fuzz!(|data: &[u8]| fuzz_targets::request(data));
}
