//! The crate's floors: every module of `src/` sits on one floor and imports only from the
//! floors below it, so the structure has no circle and no import that runs back up. Reads the
//! `crate::` and `super::` paths of every source file (comments left out) and fails on an
//! import from a floor to the same floor or one above, naming file and line. Run by `make lint`
//! and `make test`; docs/architecture.md draws the same floors.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The floors, from the ground up: a module may import from the floors below its own.
/// "root" is `lib.rs` and what it defines; `main.rs` uses the crate as any user does.
const FLOORS: &[&[&str]] = &[
    &["logs", "runtime"],
    &["cli", "metrics", "shutdown", "trace"],
    &["limiter", "statsd", "telemetry", "top"],
    &["config"],
    &["engine", "rlqs", "xds"],
    &["server", "source"],
    &["settings"],
    &["root"],
    &["testing"],
];

fn floor(module: &str) -> Option<usize> {
    FLOORS.iter().position(|f| f.contains(&module))
}

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file belongs to (`src/limiter/redis/mod.rs`: limiter), and the one
/// its `super::` names (the root for `src/x.rs` and `src/x/mod.rs`).
fn owner(rel: &Path) -> (String, String) {
    let parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_owned())
        .collect();
    match parts.as_slice() {
        [file] => (file.clone(), "root".to_owned()),
        [dir, file] if file == "mod" => (dir.clone(), "root".to_owned()),
        [dir, ..] => (dir.clone(), dir.clone()),
        [] => unreachable!(),
    }
}

/// The top-level modules a line of code names through `crate::` (also in `crate::{a, b::c}`)
/// or `super::`.
fn named(code: &str, modules: &BTreeSet<String>, up: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut at = 0;
    while let Some(i) = code[at..].find("crate::") {
        let rest = &code[at + i + "crate::".len()..];
        at += i + "crate::".len();
        // Not part of a longer identifier such as `ratelimitd_crate::`.
        let before = code[..at - "crate::".len()].chars().last();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let names: Vec<&str> = match rest.strip_prefix('{') {
            Some(group) => {
                let group = &group[..group.find('}').unwrap_or(group.len())];
                group.split(',').map(str::trim).collect()
            }
            None => vec![rest],
        };
        for name in names {
            let first: String = name
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if first.is_empty() {
                continue;
            }
            found.push(if modules.contains(&first) {
                first
            } else {
                "root".to_owned()
            });
        }
    }
    if code.contains("super::") && !code.contains("use super::*") {
        found.push(up.to_owned());
    }
    found
}

#[test]
fn every_import_runs_down_a_floor() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    files.sort();
    let modules: BTreeSet<String> = files
        .iter()
        .map(|f| owner(f.strip_prefix(&src).unwrap()).0)
        .filter(|m| m != "lib" && m != "main")
        .collect();
    let mut wrong = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(&src).unwrap();
        let (mut module, up) = owner(rel);
        if module == "main" {
            continue;
        }
        if module == "lib" {
            module = "root".to_owned();
        }
        let Some(own) = floor(&module) else {
            wrong.push(format!(
                "src/{}: module `{module}` is on no floor of tests/layers.rs",
                rel.display()
            ));
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap();
        let mut in_tests = false;
        for (n, line) in text.lines().enumerate() {
            let code = line.trim_start();
            // A file's unit tests may reach anywhere; they are not part of the structure.
            if code.starts_with("#[cfg(test)]") {
                in_tests = true;
            }
            if in_tests || code.starts_with("//") {
                continue;
            }
            let code = code.split(" //").next().unwrap_or(code);
            for target in named(code, &modules, &up) {
                if target == module {
                    continue;
                }
                let Some(theirs) = floor(&target) else {
                    continue;
                };
                if theirs >= own {
                    wrong.push(format!(
                        "src/{}:{}: `{module}` (floor {own}) imports `{target}` (floor {theirs})",
                        rel.display(),
                        n + 1
                    ));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports that do not run down a floor:\n{}",
        wrong.join("\n")
    );
}

/// The check itself: an import back up, a sibling import and a grouped import are all seen.
#[test]
fn the_check_sees_imports_up_across_and_in_groups() {
    let modules: BTreeSet<String> = ["limiter", "telemetry", "settings", "metrics"]
        .map(String::from)
        .into();
    assert_eq!(
        named("use crate::telemetry::enabled;", &modules, "root"),
        ["telemetry"]
    );
    assert_eq!(
        named(
            "use crate::{settings::Flags, metrics::Metrics};",
            &modules,
            "root"
        ),
        ["settings", "metrics"]
    );
    assert_eq!(named("crate::run(x)", &modules, "root"), ["root"]);
    assert_eq!(named("use super::Thing;", &modules, "limiter"), ["limiter"]);
    assert!(named("use ratelimitd_crate::x;", &modules, "root").is_empty());
    assert!(floor("telemetry") >= floor("trace"));
    assert!(floor("limiter") < floor("settings"));
}
