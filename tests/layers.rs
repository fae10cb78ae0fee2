//! The crate's floors and edges, read from the source with Rust's own grammar (`syn`).
//!
//! Every module of `src/` sits on one floor and imports only from the floors below it, so the
//! structure has no circle and no import that runs back up. Every path of non-test code counts:
//! `use` trees however rustfmt wraps and groups them, paths in expressions, types and attributes,
//! and paths inside macro calls; only items marked `#[cfg(test)]` are left out, wherever they sit
//! in a file. Two more rules keep the protocol at the edge, as docs/architecture.md states:
//! envoy-types (Envoy's protos) only in `server` and `xds`, and `config` and `limiter` know
//! nothing of gRPC. And one name, one thing: no two types of the crate share a name. A failure
//! names file and line. Run by `make lint` and `make test`;
//! docs/architecture.md draws the same floors.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use proc_macro2::{Span, TokenStream, TokenTree};
use syn::spanned::Spanned;
use syn::visit::{self, Visit};

/// The floors, from the ground up: a module may import from the floors below its own.
/// "root" is `lib.rs` and what it defines; `main.rs` uses the crate as any user does.
const FLOORS: &[&[&str]] = &[
    &["logs", "runtime", "value"],
    &["cli", "metrics", "shutdown", "trace"],
    &["limiter", "statsd", "telemetry", "top"],
    &["config"],
    &["engine", "overrides", "rlqs", "xds"],
    &["server", "source"],
    &["settings"],
    &["run"],
    &["root"],
    &["testing"],
];

/// Envoy's protos: only the modules that speak Envoy's protocols use them.
const ENVOY_TYPES: &str = "envoy_types";
const SPEAK_ENVOY: &[&str] = &["server", "xds"];

/// The crates of gRPC and protobuf, and the modules that must not know them.
const GRPC_CRATES: &[&str] = &[
    "envoy_types",
    "tonic",
    "tonic_health",
    "prost",
    "h2",
    "hyper",
];
const NO_GRPC: &[&str] = &["config", "limiter"];

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

/// The module path a file defines: `limiter/redis/mod.rs` is `[limiter, redis]`,
/// `limiter/key.rs` is `[limiter, key]`, `lib.rs` is `[]`.
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_owned())
        .collect();
    if parts.last().is_some_and(|l| l == "mod" || l == "lib") {
        parts.pop();
    }
    parts
}

/// What a path names: a top-level module of the crate ("root" for what `lib.rs` defines), or
/// another crate.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    Module(String),
    Crate(String),
}

/// One path of the source and the line it starts on.
#[derive(Debug)]
struct Named {
    line: usize,
    target: Target,
}

/// Walks a file's syntax tree and collects what every path outside `#[cfg(test)]` names.
struct Walk<'m> {
    modules: &'m BTreeSet<String>,
    /// The module the walk is in: the file's, then each inline `mod` entered.
    here: Vec<String>,
    found: Vec<Named>,
    /// The types the file defines (structs, enums, unions, traits, aliases), with their lines.
    types: Vec<(String, usize)>,
}

/// `#[cfg(test)]` and `#[cfg(all(test, ...))]`: the item exists only in unit tests.
fn test_only(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        if !a.path().is_ident("cfg") {
            return false;
        }
        let Ok(list) = a.meta.require_list() else {
            return false;
        };
        let tokens = list.tokens.to_string().replace(' ', "");
        tokens == "test" || tokens.starts_with("all(test,")
    })
}

impl Walk<'_> {
    /// Records what a path of these segments names, if it leaves the module it is written in.
    fn name(&mut self, segments: &[String], span: Span) {
        let line = span.start().line;
        let Some(first) = segments.first() else {
            return;
        };
        let target = match first.as_str() {
            "crate" => self.top(&[], &segments[1..]),
            "self" | "super" => {
                let ups = segments.iter().take_while(|s| *s == "super").count();
                let skip = segments
                    .iter()
                    .take_while(|s| *s == "super" || *s == "self");
                let rest = &segments[skip.count()..];
                let Some(keep) = self.here.len().checked_sub(ups) else {
                    return;
                };
                self.top(&self.here[..keep], rest)
            }
            // A single segment is a local name, not a crate; so is `Self::`.
            other if segments.len() > 1 && other != "Self" => Target::Crate(other.to_owned()),
            _ => return,
        };
        self.found.push(Named { line, target });
    }

    /// The top-level module `base` then `rest` lands in.
    fn top(&self, base: &[String], rest: &[String]) -> Target {
        let first = base.first().or(rest.first());
        match first {
            Some(m) if self.modules.contains(m) => Target::Module(m.clone()),
            _ => Target::Module("root".to_owned()),
        }
    }

    /// Every leaf of a `use` tree, with the segments that lead to it.
    fn use_tree(&mut self, tree: &syn::UseTree, prefix: &mut Vec<String>) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(&p.tree, prefix);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                prefix.push(n.ident.to_string());
                self.name(&prefix.clone(), n.ident.span());
                prefix.pop();
            }
            syn::UseTree::Rename(r) => {
                prefix.push(r.ident.to_string());
                self.name(&prefix.clone(), r.ident.span());
                prefix.pop();
            }
            syn::UseTree::Glob(g) => {
                // `use super::*` brings the parent's names in; it names the parent itself.
                prefix.push("*".to_owned());
                self.name(&prefix.clone(), g.star_token.span());
                prefix.pop();
            }
            syn::UseTree::Group(g) => {
                for item in &g.items {
                    self.use_tree(item, prefix);
                }
            }
        }
    }

    /// Paths in a macro's tokens (`ident :: ident ...`), which syn leaves unparsed.
    fn tokens(&mut self, tokens: TokenStream) {
        let trees: Vec<TokenTree> = tokens.into_iter().collect();
        let mut i = 0;
        while i < trees.len() {
            match &trees[i] {
                TokenTree::Group(g) => {
                    self.tokens(g.stream());
                    i += 1;
                }
                TokenTree::Ident(first) => {
                    let mut segments = vec![first.to_string()];
                    let mut j = i + 1;
                    while let (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b))) =
                        (trees.get(j), trees.get(j + 1))
                    {
                        if a.as_char() != ':' || b.as_char() != ':' {
                            break;
                        }
                        match trees.get(j + 2) {
                            Some(TokenTree::Ident(next)) => segments.push(next.to_string()),
                            _ => break,
                        }
                        j += 3;
                    }
                    // `$crate` is a macro's own crate, not a path of this one.
                    let after_dollar =
                        i > 0 && matches!(&trees[i - 1], TokenTree::Punct(p) if p.as_char() == '$');
                    if segments.len() > 1 && !after_dollar {
                        self.name(&segments, first.span());
                    }
                    i = j.max(i + 1);
                }
                _ => i += 1,
            }
        }
    }
}

impl<'ast> Visit<'ast> for Walk<'_> {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let attrs = match item {
            syn::Item::Const(i) => &i.attrs,
            syn::Item::Enum(i) => &i.attrs,
            syn::Item::ExternCrate(i) => &i.attrs,
            syn::Item::Fn(i) => &i.attrs,
            syn::Item::ForeignMod(i) => &i.attrs,
            syn::Item::Impl(i) => &i.attrs,
            syn::Item::Macro(i) => &i.attrs,
            syn::Item::Mod(i) => &i.attrs,
            syn::Item::Static(i) => &i.attrs,
            syn::Item::Struct(i) => &i.attrs,
            syn::Item::Trait(i) => &i.attrs,
            syn::Item::TraitAlias(i) => &i.attrs,
            syn::Item::Type(i) => &i.attrs,
            syn::Item::Union(i) => &i.attrs,
            syn::Item::Use(i) => &i.attrs,
            _ => return visit::visit_item(self, item),
        };
        if test_only(attrs) {
            return;
        }
        let defined = match item {
            syn::Item::Enum(i) => Some(&i.ident),
            syn::Item::Struct(i) => Some(&i.ident),
            syn::Item::Trait(i) => Some(&i.ident),
            syn::Item::TraitAlias(i) => Some(&i.ident),
            syn::Item::Type(i) => Some(&i.ident),
            syn::Item::Union(i) => Some(&i.ident),
            _ => None,
        };
        if let Some(ident) = defined {
            self.types
                .push((ident.to_string(), ident.span().start().line));
        }
        visit::visit_item(self, item);
    }

    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        self.here.push(item.ident.to_string());
        visit::visit_item_mod(self, item);
        self.here.pop();
    }

    fn visit_impl_item(&mut self, item: &'ast syn::ImplItem) {
        let attrs = match item {
            syn::ImplItem::Const(i) => &i.attrs,
            syn::ImplItem::Fn(i) => &i.attrs,
            syn::ImplItem::Type(i) => &i.attrs,
            syn::ImplItem::Macro(i) => &i.attrs,
            _ => return visit::visit_impl_item(self, item),
        };
        if !test_only(attrs) {
            visit::visit_impl_item(self, item);
        }
    }

    fn visit_trait_item(&mut self, item: &'ast syn::TraitItem) {
        let attrs = match item {
            syn::TraitItem::Const(i) => &i.attrs,
            syn::TraitItem::Fn(i) => &i.attrs,
            syn::TraitItem::Type(i) => &i.attrs,
            syn::TraitItem::Macro(i) => &i.attrs,
            _ => return visit::visit_trait_item(self, item),
        };
        if !test_only(attrs) {
            visit::visit_trait_item(self, item);
        }
    }

    fn visit_field(&mut self, field: &'ast syn::Field) {
        if !test_only(&field.attrs) {
            visit::visit_field(self, field);
        }
    }

    fn visit_variant(&mut self, variant: &'ast syn::Variant) {
        if !test_only(&variant.attrs) {
            visit::visit_variant(self, variant);
        }
    }

    fn visit_stmt(&mut self, stmt: &'ast syn::Stmt) {
        if let syn::Stmt::Local(l) = stmt
            && test_only(&l.attrs)
        {
            return;
        }
        visit::visit_stmt(self, stmt);
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        if item.leading_colon.is_some() {
            // `use ::name::...`: always another crate.
            if let syn::UseTree::Path(p) = &item.tree {
                self.found.push(Named {
                    line: p.ident.span().start().line,
                    target: Target::Crate(p.ident.to_string()),
                });
            }
            return;
        }
        self.use_tree(&item.tree, &mut Vec::new());
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        if path.leading_colon.is_some() {
            if let Some(first) = segments.first() {
                self.found.push(Named {
                    line: path.span().start().line,
                    target: Target::Crate(first.clone()),
                });
            }
        } else {
            self.name(&segments, path.span());
        }
        visit::visit_path(self, path);
    }

    /// `pub(crate)` and `pub(super)` say who may see an item; they import nothing.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.visit_path(&mac.path);
        self.tokens(mac.tokens.clone());
    }
}

/// The file at `rel` (relative to `src/`) walked: what its paths name and the types it defines.
fn walk<'m>(rel: &Path, text: &str, modules: &'m BTreeSet<String>) -> Result<Walk<'m>, String> {
    let syntax = syn::parse_file(text).map_err(|e| {
        let at = e.span().start();
        format!("src/{}:{}: does not parse: {e}", rel.display(), at.line)
    })?;
    let mut walk = Walk {
        modules,
        here: module_path(rel),
        found: Vec::new(),
        types: Vec::new(),
    };
    walk.visit_file(&syntax);
    Ok(walk)
}

/// Every rule the file at `rel` (relative to `src/`) breaks, as "src/file:line: what".
fn check(rel: &Path, text: &str, modules: &BTreeSet<String>) -> Vec<String> {
    let here = module_path(rel);
    let module = here.first().cloned().unwrap_or_else(|| "root".to_owned());
    let file = format!("src/{}", rel.display());
    let Some(own) = floor(&module) else {
        return vec![format!(
            "{file}: module `{module}` is on no floor of tests/layers.rs"
        )];
    };
    let walk = match walk(rel, text, modules) {
        Ok(walk) => walk,
        Err(e) => return vec![e],
    };
    let mut wrong = Vec::new();
    for Named { line, target } in walk.found {
        match target {
            Target::Module(target) if target != module => {
                if let Some(theirs) = floor(&target)
                    && theirs >= own
                {
                    wrong.push(format!(
                        "{file}:{line}: `{module}` (floor {own}) imports `{target}` (floor {theirs})"
                    ));
                }
            }
            Target::Module(_) => {}
            Target::Crate(name) => {
                if name == ENVOY_TYPES && !SPEAK_ENVOY.contains(&module.as_str()) {
                    wrong.push(format!(
                        "{file}:{line}: `{module}` uses envoy-types, which only {} may",
                        SPEAK_ENVOY.join(" and ")
                    ));
                }
                if GRPC_CRATES.contains(&name.as_str()) && NO_GRPC.contains(&module.as_str()) {
                    wrong.push(format!(
                        "{file}:{line}: `{module}` names `{name}`: {} know nothing of gRPC",
                        NO_GRPC.join(" and ")
                    ));
                }
            }
        }
    }
    wrong.sort();
    wrong.dedup();
    wrong
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The crate's files (relative to `src/`, `main.rs` left out: it uses the crate as any user
/// does) and its top-level modules.
fn crate_files() -> (Vec<PathBuf>, BTreeSet<String>) {
    let src = src();
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut files: Vec<PathBuf> = files
        .into_iter()
        .map(|f| f.strip_prefix(&src).unwrap().to_owned())
        .filter(|f| f != Path::new("main.rs"))
        .collect();
    files.sort();
    let modules = files
        .iter()
        .filter_map(|f| module_path(f).first().cloned())
        .collect();
    (files, modules)
}

/// The text of the file at `rel` (relative to `src/`).
fn read(rel: impl AsRef<Path>) -> String {
    std::fs::read_to_string(src().join(rel)).unwrap()
}

#[test]
fn every_import_runs_down_a_floor_and_the_protocol_stays_at_the_edge() {
    let (files, modules) = crate_files();
    let mut wrong = Vec::new();
    for rel in &files {
        wrong.extend(check(rel, &read(rel), &modules));
    }
    assert!(
        wrong.is_empty(),
        "rules of tests/layers.rs broken:\n{}",
        wrong.join("\n")
    );
}

/// Plants `code` in a real file of the tree (at its end, after its unit tests) and returns
/// what the check says of it.
fn planted(rel: &str, code: &str) -> Vec<String> {
    let (_, modules) = crate_files();
    let text = format!("{}\n{code}\n", read(rel));
    check(Path::new(rel), &text, &modules)
}

#[test]
fn a_wrapped_group_import_up_is_seen() {
    let wrong = planted(
        "config/load.rs",
        "use crate::{\n    engine::Engine,\n    settings::Options,\n};",
    );
    assert!(
        wrong.iter().any(|w| w.contains("imports `engine`")),
        "{wrong:?}"
    );
    assert!(
        wrong.iter().any(|w| w.contains("imports `settings`")),
        "{wrong:?}"
    );
}

#[test]
fn code_after_a_files_first_cfg_test_counts() {
    let text = read("limiter/memory.rs");
    let first = text.find("#[cfg(test)]").expect("memory.rs has unit tests");
    assert!(first < text.rfind("#[cfg(test)]").unwrap());
    let wrong = planted(
        "limiter/memory.rs",
        "fn planted() -> usize { crate::server::MAX_FRAME }",
    );
    assert!(
        wrong.iter().any(|w| w.contains("imports `server`")),
        "{wrong:?}"
    );
    // And the same path inside a test-only item does not.
    let wrong = planted(
        "limiter/memory.rs",
        "#[cfg(test)]\nfn planted() -> usize { crate::server::MAX_FRAME }",
    );
    assert!(wrong.is_empty(), "{wrong:?}");
}

#[test]
fn a_sibling_import_through_super_and_a_path_in_a_macro_are_seen() {
    // `super::` from a top-level file is the root; `super::engine` is the engine.
    let wrong = planted("rlqs/fair_share.rs", "use super::super::engine::Engine;");
    assert!(
        wrong
            .iter()
            .any(|w| w.contains("`rlqs` (floor 4) imports `engine`")),
        "{wrong:?}"
    );
    let wrong = planted(
        "limiter/key.rs",
        "fn planted() { tracing::info!(\"{}\", crate::config::MAX); }",
    );
    assert!(
        wrong.iter().any(|w| w.contains("imports `config`")),
        "{wrong:?}"
    );
}

#[test]
fn envoy_types_outside_server_and_xds_is_seen() {
    let wrong = planted(
        "engine/request.rs",
        "use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;",
    );
    assert!(
        wrong
            .iter()
            .any(|w| w.contains("`engine` uses envoy-types")),
        "{wrong:?}"
    );
    assert!(
        planted(
            "server/grpc.rs",
            "use envoy_types::pb::google::rpc::Status;"
        )
        .is_empty()
    );
}

#[test]
fn grpc_in_config_or_limiter_is_seen() {
    let wrong = planted(
        "limiter/failure_mode.rs",
        "fn planted(s: tonic::Status) -> tonic::Code { s.code() }",
    );
    assert!(
        wrong.iter().any(|w| w.contains("`limiter` names `tonic`")),
        "{wrong:?}"
    );
    let wrong = planted(
        "config/matcher.rs",
        "fn planted() { let _ = format!(\"{:?}\", prost::bytes::Bytes::new()); }",
    );
    assert!(
        wrong.iter().any(|w| w.contains("`config` names `prost`")),
        "{wrong:?}"
    );
    // The same names are the server's to use.
    assert!(planted("server/conn.rs", "fn planted(s: tonic::Status) {}").is_empty());
}

/// Type names defined twice in `files` (path relative to `src/`, text): "Name: src/a.rs:1,
/// src/b.rs:2" for each.
fn twice_named(files: &[(PathBuf, String)], modules: &BTreeSet<String>) -> Vec<String> {
    let mut places: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for (rel, text) in files {
        let walk = walk(rel, text, modules).unwrap_or_else(|e| panic!("{e}"));
        for (name, line) in walk.types {
            places
                .entry(name)
                .or_default()
                .push(format!("src/{}:{line}", rel.display()));
        }
    }
    places
        .into_iter()
        .filter(|(_, at)| at.len() > 1)
        .map(|(name, at)| format!("{name}: {}", at.join(", ")))
        .collect()
}

fn tree() -> (Vec<(PathBuf, String)>, BTreeSet<String>) {
    let (files, modules) = crate_files();
    let mut texts: Vec<(PathBuf, String)> = files
        .into_iter()
        .map(|rel| {
            let text = read(&rel);
            (rel, text)
        })
        .collect();
    let main = read("main.rs");
    texts.push(("main.rs".into(), main));
    (texts, modules)
}

/// One name, one thing (docs/architecture.md, "Words"): no two types of the crate share a name,
/// wherever they sit (unit tests left out).
#[test]
fn no_two_types_share_a_name() {
    let (files, modules) = tree();
    let twice = twice_named(&files, &modules);
    assert!(
        twice.is_empty(),
        "type names defined more than once:\n{}",
        twice.join("\n")
    );
}

#[test]
fn a_second_type_of_one_name_is_seen() {
    let (mut files, modules) = tree();
    let (_, statsd) = files
        .iter_mut()
        .find(|(rel, _)| rel == Path::new("statsd.rs"))
        .unwrap();
    statsd.push_str("\nenum Conn { Udp }\n#[cfg(test)]\nstruct Store;\n");
    let twice = twice_named(&files, &modules);
    assert_eq!(twice.len(), 1, "{twice:?}");
    assert!(
        twice[0].starts_with("Conn: ") && twice[0].contains("src/statsd.rs:"),
        "{twice:?}"
    );
}
