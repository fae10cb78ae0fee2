//! The newcomer's path, as written: the README's first steps run, and the tables of README.md and
//! docs/ say what the code does. Every flag a table documents is a flag `--help` prints and the
//! reverse; every variable of envoyproxy/ratelimit the drop-in reads is named in
//! docs/migrating.md and the reverse; every metric the docs name is one the service registers
//! (with the labels its samples carry) and every family it registers is documented; the image
//! tag the docs build is the one the chart pulls.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::daemon::{BIN, Daemon, ratelimitd};
use common::redis::free_port;
use common::*;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The words of `text` that start with `prefix` at a word boundary and go on with `part`
/// characters, each with the character after it.
fn words<'t>(text: &'t str, prefix: &str, part: fn(char) -> bool) -> Vec<(&'t str, Option<char>)> {
    let mut found = Vec::new();
    let mut at = 0;
    while let Some(i) = text[at..].find(prefix) {
        let start = at + i;
        at = start + prefix.len();
        let before = text[..start].chars().last();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '-') {
            continue;
        }
        let len = text[at..]
            .find(|c: char| !part(c))
            .unwrap_or(text.len() - at);
        let word = &text[start..at + len];
        found.push((word, text[at + len..].chars().next()));
        at += len;
    }
    found
}

/// The first cell of every table row of `markdown`.
fn first_cells(markdown: &str) -> Vec<&str> {
    markdown
        .lines()
        .filter_map(|l| l.strip_prefix('|'))
        .filter_map(|l| l.split('|').next())
        .collect()
}

fn flag_char(c: char) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'
}

/// The long flags (`--name`) in `text`.
fn flags_in(text: &str) -> Vec<String> {
    words(text, "--", flag_char)
        .into_iter()
        .map(|(w, _)| w.to_owned())
        .filter(|w| w[2..].starts_with(|c: char| c.is_ascii_lowercase()))
        .collect()
}

/// The long flags of a `--help` text: the ones its option lines declare, not the ones its
/// descriptions mention.
fn declared_flags(help: &str) -> BTreeSet<String> {
    help.lines()
        .filter(|l| l.trim_start().starts_with('-'))
        .flat_map(|l| flags_in(l.trim_start().split("  ").next().unwrap_or("")))
        .filter(|f| f != "--help" && f != "--version")
        .collect()
}

/// Every flag in the first column of the flag tables (docs/configuration.md, and RLQS's in
/// docs/rlqs.md) is one `ratelimitd --help` declares, and every flag it declares is in a table.
#[test]
fn the_flag_tables_are_the_flags_help_prints() {
    let help = Command::new(BIN).arg("--help").output().unwrap();
    assert!(help.status.success());
    let help = declared_flags(&String::from_utf8(help.stdout).unwrap());
    assert!(help.len() > 100, "{help:?}");
    let mut documented = BTreeSet::new();
    for doc in ["docs/configuration.md", "docs/rlqs.md"] {
        let text = read(doc);
        for cell in first_cells(&text) {
            documented.extend(flags_in(cell));
        }
    }
    let undocumented: Vec<_> = help.difference(&documented).collect();
    let unknown: Vec<_> = documented.difference(&help).collect();
    assert!(
        undocumented.is_empty() && unknown.is_empty(),
        "flags --help declares that no table documents: {undocumented:?}\n\
         flags a table documents that --help does not declare: {unknown:?}"
    );
}

/// The check itself: an option line's flags count, a description's mention does not.
#[test]
fn the_flag_check_reads_declarations_only() {
    let help = "Options:\n      --grpc-addr <GRPC_ADDR>\n          gRPC; see --http-addr\n  -c, --config <PATH>  files\n";
    assert_eq!(
        declared_flags(help),
        ["--config", "--grpc-addr"].map(String::from).into()
    );
}

fn variable_char(c: char) -> bool {
    c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'
}

/// The string literals of a source file's code before its unit tests (its first
/// `#[cfg(test)]`): the odd pieces between quotes.
fn literals(source: &str) -> impl Iterator<Item = &str> {
    let code = &source[..source.find("#[cfg(test)]").unwrap_or(source.len())];
    code.split('"').skip(1).step_by(2)
}

/// Names of environment variables (upper case with an underscore) in string literals of
/// `source`.
fn variables_in_literals(source: &str) -> BTreeSet<String> {
    literals(source)
        .filter(|literal| {
            literal.contains('_')
                && literal.chars().all(variable_char)
                && literal.starts_with(|c: char| c.is_ascii_uppercase())
        })
        .map(str::to_owned)
        .collect()
}

/// docs/migrating.md's "Every variable, by name" is exactly the variables
/// src/settings/envoyproxy.rs reads, and every variable the rest of that page names is one it
/// reads.
#[test]
fn every_drop_in_variable_is_named_in_migrating_md() {
    let mut read_by_code = variables_in_literals(&read("src/settings/envoyproxy.rs"));
    // A value of CONFIG_TYPE, not a variable.
    read_by_code.remove("GRPC_XDS_SOTW");
    assert!(read_by_code.len() > 80, "{read_by_code:?}");
    let page = read("docs/migrating.md");
    let section = page
        .split("## Every variable, by name")
        .nth(1)
        .expect("docs/migrating.md has its section 'Every variable, by name'");
    let section = section.split("\n## ").next().unwrap();
    let listed: BTreeSet<String> = words(section, "`", |c| variable_char(c) || c == '`')
        .into_iter()
        .map(|(w, _)| w.trim_matches('`').to_owned())
        .filter(|w| w.contains('_'))
        .collect();
    let unlisted: Vec<_> = read_by_code.difference(&listed).collect();
    let unknown: Vec<_> = listed.difference(&read_by_code).collect();
    assert!(
        unlisted.is_empty() && unknown.is_empty(),
        "read by the code, not listed: {unlisted:?}\nlisted, not read by the code: {unknown:?}"
    );
    // The page's tables name no variable the code does not read.
    let mut named = BTreeSet::new();
    for cell in first_cells(&page) {
        for (w, _) in words(cell, "`", |c| variable_char(c) || c == '`') {
            let w = w.trim_matches('`');
            // `MEMCACHE_*`-style groups and `_TYPE`-style suffixes are shorthand; `GRPC_XDS_SOTW`
            // is a value.
            if w.contains('_')
                && w.chars().all(variable_char)
                && !w.starts_with('_')
                && !w.ends_with('_')
                && w != "GRPC_XDS_SOTW"
            {
                named.insert(w.to_owned());
            }
        }
    }
    let stray: Vec<_> = named.difference(&read_by_code).collect();
    assert!(
        stray.is_empty(),
        "the tables name variables the code does not read: {stray:?}"
    );
}

fn metric_char(c: char) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'
}

/// The metric families the source names in string literals (tests left out), and those it
/// builds from a prefix (`format!("ratelimit_service_rate_limit_{name}")`).
fn registered() -> (BTreeSet<String>, BTreeSet<String>) {
    let mut files = Vec::new();
    let mut dirs = vec![root().join("src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    let (mut names, mut prefixes) = (BTreeSet::new(), BTreeSet::new());
    for file in files {
        let text = std::fs::read_to_string(file).unwrap();
        for literal in literals(&text) {
            for (w, next) in words(literal, "ratelimit_", metric_char) {
                match next {
                    // A statsd stat's name (`ratelimit_server.ShouldRateLimit…`).
                    Some('.') => {}
                    Some('{') if w.ends_with('_') => {
                        prefixes.insert(w.to_owned());
                    }
                    _ => {
                        names.insert(w.trim_end_matches('_').to_owned());
                    }
                }
            }
        }
    }
    (names, prefixes)
}

const SUFFIXES: [&str; 4] = ["_total", "_bucket", "_sum", "_count"];

/// The family a name of a sample or a query belongs to, if the service registers it.
fn family_of(name: &str, names: &BTreeSet<String>, prefixes: &BTreeSet<String>) -> Option<String> {
    for suffix in SUFFIXES {
        if let Some(base) = name.strip_suffix(suffix)
            && names.contains(base)
        {
            return Some(base.to_owned());
        }
    }
    if names.contains(name) {
        return Some(name.to_owned());
    }
    prefixes
        .iter()
        .find(|p| name.starts_with(p.as_str()))
        .map(|_| name.to_owned())
}

/// What the docs write of metrics: each name (with the character after it) and, for
/// `name{a,b="x"}`, the label names.
fn documented_metrics() -> Vec<(String, Option<char>, Vec<String>, String)> {
    let mut docs = vec![
        "README.md".to_owned(),
        "charts/ratelimitd/README.md".to_owned(),
    ];
    for entry in std::fs::read_dir(root().join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            docs.push(format!(
                "docs/{}",
                path.file_name().unwrap().to_string_lossy()
            ));
        }
    }
    let mut found = Vec::new();
    for doc in docs {
        let text = read(&doc);
        for (w, next) in words(&text, "ratelimit_", metric_char) {
            // Where the word ends in `text` (it is a slice of it).
            let at = w.as_ptr() as usize - text.as_ptr() as usize + w.len();
            let mut labels = Vec::new();
            if next == Some('{') && !w.ends_with('_') {
                let inside = &text[at + 1..];
                let inside = &inside[..inside.find('}').unwrap_or(0)];
                for part in inside.split(',') {
                    let name = part.split('=').next().unwrap().trim();
                    if !name.is_empty() && name.chars().all(metric_char) {
                        labels.push(name.to_owned());
                    }
                }
            }
            found.push((w.to_owned(), next, labels, doc.clone()));
        }
    }
    found
}

/// Every metric README.md, the chart's README and docs/ name is a family the service
/// registers, and every family it registers is named there; labels written in braces are the
/// labels the family's samples carry (from scrapes of a server that decided, refused, reported,
/// refunded and reloaded).
#[tokio::test]
async fn every_metric_the_docs_name_is_registered_and_the_reverse() {
    let (names, prefixes) = registered();
    assert!(names.len() > 25, "{names:?}");
    let documented = documented_metrics();
    let mut unknown = Vec::new();
    let mut seen = BTreeSet::new();
    for (name, next, _, doc) in &documented {
        // A statsd stat's name, and Envoy's `x_ratelimit_*` settings, are no families here.
        if *next == Some('.') {
            continue;
        }
        match family_of(name.trim_end_matches('_'), &names, &prefixes) {
            Some(family) => {
                seen.insert(family);
            }
            // A family's prefix (`ratelimit_top_*`).
            None if name.ends_with('_')
                && prefixes
                    .iter()
                    .chain(&names)
                    .any(|p| p.starts_with(name.as_str())) => {}
            None => unknown.push(format!("{name} ({doc})")),
        }
    }
    let unseen: Vec<_> = names
        .iter()
        .filter(|n| !seen.contains(*n) && !SUFFIXES.iter().any(|s| n.ends_with(s)))
        .collect();
    assert!(
        unknown.is_empty() && unseen.is_empty(),
        "named in the docs, not registered: {unknown:?}\nregistered, named nowhere in the docs: {unseen:?}"
    );

    // Labels: what samples carry, from a server that has done each thing once.
    let limits = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n";
    let mut s = start(
        Kind::Memory,
        &[("d.yaml", limits)],
        &["--reference-metrics", "--top-metrics", "3"],
    )
    .await;
    let mut c = s.client().await;
    call(&mut c, request("d", &[&[("k", "v")]])).await;
    call(&mut c, request("d", &[&[("k", "v")]])).await;
    call(&mut c, with_hits(request("d", &[&[("k", "v")]]), 0, 5)).await;
    s.write("d.yaml", "domain: [");
    poll(Duration::from_secs(30), || async {
        let (_, m) = s.http_get("/metrics").await;
        m.contains("result=\"error\"").then_some(())
    })
    .await;
    let scrape = s.http_get("/metrics").await.1;
    s.shutdown().await.unwrap();
    let mut labels: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in scrape.lines().filter(|l| !l.starts_with('#')) {
        let Some(brace) = line.find('{') else {
            continue;
        };
        let Some(family) = family_of(&line[..brace], &names, &prefixes) else {
            continue;
        };
        let set = &line[brace + 1..line.rfind('}').unwrap()];
        for pair in set.split("\",") {
            if let Some((name, _)) = pair.split_once('=') {
                labels
                    .entry(family.clone())
                    .or_default()
                    .insert(name.trim_start_matches(',').to_owned());
            }
        }
    }
    assert!(labels.len() >= 5, "{labels:?}");
    let mut wrong = Vec::new();
    for (name, _, written, doc) in &documented {
        let Some(family) = family_of(name, &names, &prefixes) else {
            continue;
        };
        let Some(has) = labels.get(&family) else {
            continue;
        };
        for label in written {
            if !has.contains(label) {
                wrong.push(format!("{name}{{{label}}} ({doc}): samples carry {has:?}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "labels the samples do not carry: {wrong:#?}"
    );
}

/// The image the docs build is the one the chart pulls: `ratelimitd:<appVersion>`, the crate's
/// version.
#[test]
fn the_image_the_docs_build_is_the_one_the_chart_pulls() {
    let cargo = read("Cargo.toml");
    let version = cargo
        .lines()
        .find_map(|l| l.strip_prefix("version = "))
        .unwrap()
        .trim_matches('"');
    let chart = read("charts/ratelimitd/Chart.yaml");
    assert!(
        chart.contains(&format!("appVersion: \"{version}\"")),
        "Chart.yaml's appVersion is not {version}"
    );
    let values = read("charts/ratelimitd/values.yaml");
    assert!(values.contains("repository: ratelimitd"), "values.yaml");
    assert!(
        values.contains("tag: \"\""),
        "values.yaml: the tag defaults to the appVersion"
    );
    let tag = format!("ratelimitd:{version}");
    let mut builds = 0;
    for doc in [
        "README.md",
        "charts/ratelimitd/README.md",
        "docs/deploying.md",
        "docs/envoy-gateway.md",
    ] {
        let text = read(doc);
        for (i, _) in text.match_indices("docker build") {
            let line = text[i..].lines().next().unwrap();
            assert!(
                line.contains(&format!("-t {tag} ")),
                "{doc}: `{line}` does not tag {tag}"
            );
            builds += 1;
        }
        for (i, _) in text.match_indices("ratelimitd:") {
            let rest = &text[i + "ratelimitd:".len()..];
            if rest.starts_with(|c: char| c.is_ascii_digit()) {
                assert!(
                    rest.starts_with(version),
                    "{doc}: ratelimitd:{}",
                    &rest[..10]
                );
            }
        }
    }
    assert!(builds >= 3, "{builds} docker build commands");

    // docs/envoy-gateway.md's EnvoyGateway object: whole, with the rate-limit backend Envoy
    // Gateway needs, and this image.
    let page = read("docs/envoy-gateway.md");
    let block = page
        .split("```text\napiVersion: v1\nkind: ConfigMap\n")
        .nth(1)
        .expect("the envoy-gateway-config ConfigMap");
    let block = format!(
        "apiVersion: v1\nkind: ConfigMap\n{}",
        block.split("```").next().unwrap()
    );
    let map: serde_json::Value = serde_saphyr::from_str(&block).unwrap();
    assert_eq!(map["metadata"]["name"], "envoy-gateway-config");
    let eg: serde_json::Value =
        serde_saphyr::from_str(map["data"]["envoy-gateway.yaml"].as_str().unwrap()).unwrap();
    assert_eq!(eg["kind"], "EnvoyGateway");
    assert_eq!(
        eg["gateway"]["controllerName"],
        "gateway.envoyproxy.io/gatewayclass-controller"
    );
    assert_eq!(eg["rateLimit"]["backend"]["type"], "Redis");
    assert!(eg["rateLimit"]["backend"]["redis"]["url"].is_string());
    let image = eg["provider"]["kubernetes"]["rateLimitDeployment"]["container"]["image"]
        .as_str()
        .unwrap();
    assert!(image.ends_with(&format!("/{tag}")), "{image}");
    assert!(page.contains("kubectl rollout restart deployment envoy-gateway"));
}

/// README.md's first decision without Envoy: `make run`'s binary and flags, the `serving` line
/// the README shows as "ready", and its `curl` on `/json`, as written, until OVER_LIMIT.
#[tokio::test]
async fn the_readmes_first_decision_runs_as_written() {
    let readme = read("README.md");
    let makefile = read("Makefile");
    assert!(makefile.contains("--config $(EXAMPLE_LIMITS) --log-level info"));
    assert!(makefile.contains("EXAMPLE_LIMITS ?= examples/envoy/limits"));
    assert!(
        readme.contains(
            "INFO ratelimitd::server::serve: serving grpc=0.0.0.0:8081 http=0.0.0.0:8080"
        )
    );
    let curl = readme
        .lines()
        .find(|l| l.starts_with("curl -s localhost:8080/json -d '"))
        .expect("the README's curl on /json");
    let body = curl.split('\'').nth(1).unwrap();
    let example = root().join("examples/envoy/limits");
    let d = Daemon::start(ratelimitd(&example, &["--log-level", "info"])).await;
    let (status, answer) = post_json(d.http, body).await;
    assert_eq!(status, 200, "{answer}");
    let answer: serde_json::Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(answer["overallCode"], "OK");
    assert_eq!(answer["statuses"][0]["limitRemaining"], 9);
    assert_eq!(answer["statuses"][0]["currentLimit"]["requestsPerUnit"], 10);
    // Fifty at once: however slow the machine, more than ten land within one second's window.
    let http = d.http;
    let calls: Vec<_> = (0..50)
        .map(|_| {
            let body = body.to_owned();
            tokio::spawn(async move { post_json(http, &body).await.1 })
        })
        .collect();
    let mut over = 0;
    for call in calls {
        if call
            .await
            .unwrap()
            .starts_with("{\"overallCode\":\"OVER_LIMIT\"")
        {
            over += 1;
        }
    }
    assert!(over > 0, "no OVER_LIMIT in 50 requests at once");
    let (_, log) = d.terminate().await;
    let serving = log
        .lines()
        .find(|l| l.contains("ratelimitd::server::serve: serving "))
        .unwrap_or_else(|| panic!("no serving line in:\n{log}"));
    assert!(
        serving.contains(" grpc=127.0.0.1:") && serving.contains(" http=127.0.0.1:"),
        "{serving}"
    );
}

/// The example upstream answers, saying in `x-tokens-used` what the request asked it to (4000
/// by default), as the token-budget and reservation examples need.
#[tokio::test]
async fn the_example_upstream_reports_tokens_used() {
    let Some(python) = ["python3", "python"].into_iter().find(|p| {
        Command::new(p)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    }) else {
        panic!("python3 is needed for examples/envoy/upstream.py");
    };
    let port = free_port();
    let mut child = Command::new(python)
        .arg(root().join("examples/envoy/upstream.py"))
        .arg(port.to_string())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    redis::watchdog(child.id());
    let get = |extra: &'static str| async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        let req = format!("GET /v1/chat HTTP/1.1\r\nHost: t\r\n{extra}Connection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await.ok()?;
        Some(String::from_utf8(raw).unwrap().to_ascii_lowercase())
    };
    let plain = poll(Duration::from_secs(20), || get("")).await;
    let asked = get("x-fake-tokens: 600\r\n").await.unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(plain.starts_with("http/1.1 200"), "{plain}");
    assert!(plain.contains("x-tokens-used: 4000\r\n"), "{plain}");
    assert!(asked.contains("x-tokens-used: 600\r\n"), "{asked}");
    // The port the examples send to.
    for example in ["envoy.yaml", "token-budget.yaml", "reservations.yaml"] {
        let text = read(&format!("examples/envoy/{example}"));
        assert!(text.contains("port_value: 9000"), "{example}");
    }
    assert!(read("examples/envoy/upstream.py").contains("else 9000"));
}
