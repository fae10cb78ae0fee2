//! Config parsing, validation and matching through the library's public API, against
//! envoyproxy/ratelimit's own files where they exist.

mod common;

use std::path::Path;

use common::fixtures;
use ratelimitd::ConfigError;
use ratelimitd::testing::*;
use ratelimitd::testing::{Algorithm, CounterKey, KeyFormat};

fn fixture(rel: &str) -> Option<Domain> {
    let path = fixtures()?.join(rel);
    let text = std::fs::read_to_string(&path).unwrap();
    Some(compile_file(&path, &text).unwrap_or_else(|e| panic!("{e}")))
}

fn yaml(text: &str) -> Result<Domain, ConfigError> {
    compile_file(Path::new("t.yaml"), text)
}

/// The counter key (default format) a descriptor resolves to; it must resolve.
fn counter_key(domain: &Domain, entries: &[(&str, &str)]) -> CounterKey {
    domain
        .lookup(entries, &KeyFormat::default())
        .expect("the descriptor resolves")
        .key
}

/// (rule label, first limit's rpu, unit) for a descriptor, or None when no limit applies.
fn limit_of(domain: &Domain, entries: &[(&str, &str)]) -> Option<(String, u64, Unit)> {
    let m = domain.lookup(entries, &KeyFormat::default())?;
    match m.node.limits.as_ref()? {
        NodeLimits::Unlimited => Some((m.rule.to_string(), u64::MAX, Unit::Second)),
        NodeLimits::Limits(l) => Some((m.rule.to_string(), l[0].requests_per_unit, l[0].unit)),
    }
}

fn rpu(domain: &Domain, entries: &[(&str, &str)]) -> Option<u64> {
    limit_of(domain, entries).map(|l| l.1)
}

#[test]
fn every_good_fixture_loads() {
    let Some(dir) = fixtures() else { return };
    let mut n = 0;
    for entry in std::fs::read_dir(dir.join("good")).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        compile_file(&path, &text).unwrap_or_else(|e| panic!("{e}"));
        n += 1;
    }
    assert!(n >= 9, "only {n} good fixtures");
}

#[test]
fn basic_config_behaves_as_its_comments_say() {
    let Some(d) = fixture("good/basic_config.yaml") else {
        return;
    };
    // 2nd level key only with default rate limit, and the specific override.
    assert_eq!(rpu(&d, &[("key1", "value1"), ("subkey1", "any")]), Some(5));
    assert_eq!(
        rpu(&d, &[("key1", "value1"), ("subkey1", "subvalue1")]),
        Some(10)
    );
    // A node without a limit, fewer or more entries than the tree, unknown keys: no limit.
    assert_eq!(rpu(&d, &[("key1", "value1")]), None);
    assert_eq!(rpu(&d, &[("key1", "other"), ("subkey1", "x")]), None);
    assert_eq!(
        rpu(&d, &[("key1", "value1"), ("subkey1", "x"), ("deeper", "x")]),
        None
    );
    assert_eq!(rpu(&d, &[("nope", "x")]), None);
    // Top-level default, a specific override, and a whitelisted value.
    assert_eq!(rpu(&d, &[("key2", "anything")]), Some(20));
    assert_eq!(rpu(&d, &[("key2", "value2")]), Some(30));
    assert_eq!(rpu(&d, &[("key2", "value3")]), None);
    assert_eq!(
        limit_of(&d, &[("key3", "x")]).map(|l| l.2),
        Some(Unit::Hour)
    );
    let m = d.lookup(&[("key4", "x")], &KeyFormat::default()).unwrap();
    let Some(NodeLimits::Limits(l)) = &m.node.limits else {
        panic!()
    };
    assert_eq!(l[0].name.as_deref(), Some("key4_rate_limit"));
    assert_eq!(rpu(&d, &[("key5", "value5")]), Some(15));
    assert_eq!(
        rpu(&d, &[("key5", "value5"), ("subkey5", "subvalue5")]),
        Some(25)
    );
    assert_eq!(rpu(&d, &[("key6", "x")]), Some(u64::MAX), "unlimited");
    // Metric labels: config path, values only with detailed_metric.
    assert_eq!(limit_of(&d, &[("key2", "secret")]).unwrap().0, "key2");
    assert_eq!(limit_of(&d, &[("key7", "v7")]).unwrap().0, "key7_v7");
    assert_eq!(
        limit_of(&d, &[("key1", "value1"), ("subkey1", "zzz")])
            .unwrap()
            .0,
        "key1_value1.subkey1"
    );
}

#[test]
fn value_less_keys_count_each_value_apart() {
    let Some(d) = fixture("good/basic_config.yaml") else {
        return;
    };
    let a = counter_key(&d, &[("key2", "a")]);
    let b = counter_key(&d, &[("key2", "b")]);
    assert_ne!(a, b);
}

/// As envoyproxy/ratelimit reads it, `value: ""` is no value: the value-less key, one counter
/// per distinct value (Envoy Gateway renders its "distinct" rules so).
#[test]
fn an_empty_value_is_no_value() {
    let d = yaml(
        "domain: d\ndescriptors:\n  - key: user\n    value: \"\"\n    rate_limit: {unit: second, requests_per_unit: 5}\n",
    )
    .unwrap();
    assert_eq!(rpu(&d, &[("user", "alice")]), Some(5));
    assert_ne!(
        counter_key(&d, &[("user", "alice")]),
        counter_key(&d, &[("user", "bob")])
    );
    // And it is the same node as a missing value: both at once are duplicates.
    let dup = "domain: d\ndescriptors:\n  - key: user\n  - key: user\n    value: \"\"\n";
    assert!(yaml(dup).unwrap_err().message.contains("duplicate"));
}

/// envoyproxy/ratelimit accepts any key it knows at any level and ignores it where it means
/// nothing (Envoy Gateway's rendered configs carry a top-level `name`): so does ratelimitd, with
/// a warning. A key it does not know anywhere is still an error.
#[test]
fn known_keys_out_of_place_are_ignored_and_unknown_keys_refused() {
    let text = "name: my-policy
domain: d
descriptors:
  - key: k
    unit: hour
    name: n
    rate_limit:
      unit: minute
      requests_per_unit: 3
      key: x
      descriptors: []
      shadow_mode: true
";
    let d = yaml(text).unwrap();
    assert_eq!(rpu(&d, &[("k", "v")]), Some(3));
    let err = yaml("domain: d\nfoo: 1\ndescriptors: []\n").unwrap_err();
    assert_eq!((err.field.as_str(), err.line), ("foo", Some(2)), "{err}");
    let err = yaml("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, bogus: 1}\n")
        .unwrap_err();
    assert_eq!(err.field, "bogus", "{err}");
    let replaces = |item: &str| {
        yaml(&format!(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: 1, replaces: [{item}]}}\n"
        ))
    };
    assert!(replaces("{name: a, unit: hour, key: x}").is_ok());
    let err = replaces("{name: a, colour: red}").unwrap_err();
    assert_eq!((err.field.as_str(), err.line), ("colour", Some(4)), "{err}");
}

/// `metadata.ratelimitd` sets a descriptor's limit extensions, which the limit itself
/// overrides; anything else there is an error naming the field.
#[test]
fn metadata_extensions_set_the_algorithm_where_the_limit_does_not() {
    let d = yaml(
        "domain: d
descriptors:
  - key: a
    metadata: {ratelimitd: {algorithm: token_bucket, burst: 9, unit_multiplier: 2}}
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: b
    metadata: {ratelimitd: {algorithm: token_bucket}}
    rate_limit: {unit: second, requests_per_unit: 3, algorithm: sliding_log}
  - key: c
    metadata: {ratelimitd: {accounting: report}}
    rate_limits:
      - {unit: second, requests_per_unit: 3}
      - {unit: hour, requests_per_unit: 30, accounting: admission}
",
    )
    .unwrap();
    let dump = Snapshot::new(vec![d]).dump();
    assert!(
        dump.contains(
            "d.a: unit=SECOND requests_per_unit=3 unit_multiplier=2, algorithm=token_bucket burst=9"
        ),
        "{dump}"
    );
    assert!(
        dump.contains("d.b: unit=SECOND requests_per_unit=3, algorithm=sliding_log"),
        "{dump}"
    );
    for line in [
        "d.c: unit=SECOND requests_per_unit=3, algorithm=fixed_window accounting=report",
        "d.c: unit=HOUR requests_per_unit=30, algorithm=fixed_window accounting=admission",
    ] {
        assert!(dump.contains(line), "{line} in {dump}");
    }
    for (bad, field) in [
        (
            "{ratelimitd: {accounting: later}}",
            "descriptors[0].rate_limit.accounting",
        ),
        (
            "{ratelimitd: {accounting: 1}}",
            "descriptors[0].metadata.ratelimitd.accounting",
        ),
        (
            "{ratelimitd: {algorithm: fast}}",
            "descriptors[0].rate_limit.algorithm",
        ),
        (
            "{ratelimitd: {burst: -1}}",
            "descriptors[0].metadata.ratelimitd.burst",
        ),
        (
            "{ratelimitd: {colour: red}}",
            "descriptors[0].metadata.ratelimitd.colour",
        ),
        ("{ratelimitd: 3}", "descriptors[0].metadata.ratelimitd"),
    ] {
        let text = format!(
            "domain: d\ndescriptors:\n  - key: a\n    metadata: {bad}\n    rate_limit: {{unit: second, requests_per_unit: 3}}\n"
        );
        let err = yaml(&text).unwrap_err();
        assert_eq!(err.field, field, "{err}");
    }
}

/// Several YAML documents in one file: refused in the user's terms.
#[test]
fn a_file_of_several_documents_is_refused_saying_so() {
    let err = yaml("domain: a\ndescriptors: []\n---\ndomain: b\ndescriptors: []\n").unwrap_err();
    assert!(err.message.contains("one YAML document"), "{err}");
    assert!(!err.message.contains("from_str"), "{err}");
}

/// Envoy Gateway's rendered configs load as files too, each single-document one.
#[test]
fn envoy_gateway_rendered_configs_load_as_files() {
    let Some(corpus) = common::envoy_gateway_corpus() else {
        return;
    };
    let mut loaded = 0;
    for entry in std::fs::read_dir(corpus).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        if path.to_str().unwrap().ends_with(".routes.yaml") || text.contains("\n---") {
            continue;
        }
        compile_file(&path, &text).unwrap_or_else(|e| panic!("{e}"));
        loaded += 1;
    }
    assert!(loaded >= 20, "{loaded}");
}

#[test]
fn wildcards_match_in_file_order_after_exact_values() {
    let Some(d) = fixture("good/wildcard.yaml") else {
        return;
    };
    assert_eq!(rpu(&d, &[("wild", "foo")]), Some(20));
    assert_eq!(rpu(&d, &[("wild", "foo-bar")]), Some(20));
    assert_eq!(rpu(&d, &[("wild", "bar")]), None);
    assert_eq!(rpu(&d, &[("noWild", "foo")]), Some(20));
    assert_eq!(rpu(&d, &[("noWild", "foo1")]), None);
    assert_eq!(rpu(&d, &[("noVal", "whatever")]), Some(20));
    assert_eq!(rpu(&d, &[("midWild", "barxyzb")]), Some(20));
    assert_eq!(rpu(&d, &[("midWild", "barxyzc")]), None);
    assert_eq!(rpu(&d, &[("multiWild", "foo1bar2baz")]), Some(10));
    assert_eq!(rpu(&d, &[("multiWild", "foo1baz")]), None);
    assert_eq!(
        rpu(&d, &[("nestedWild", "val1"), ("wild", "goo-1")]),
        Some(20)
    );
    // Without share_threshold, each value matching a wildcard has its own counter.
    let a = counter_key(&d, &[("wild", "foo1")]);
    let b = counter_key(&d, &[("wild", "foo2")]);
    assert_ne!(a, b);
}

#[test]
fn share_threshold_counts_every_matching_value_together() {
    let Some(d) = fixture("good/share_threshold.yaml") else {
        return;
    };
    let key = |e: &[(&str, &str)]| counter_key(&d, e);
    assert_eq!(key(&[("files", "files/a")]), key(&[("files", "files/b")]));
    assert_eq!(
        key(&[("nested", "parent"), ("files", "nested/a")]),
        key(&[("nested", "parent"), ("files", "nested/b")])
    );
    assert_eq!(
        key(&[("files", "top/1"), ("files", "nested/1")]),
        key(&[("files", "top/2"), ("files", "nested/2")])
    );
    assert_eq!(
        rpu(&d, &[("files", "top/1"), ("files", "nested/1")]),
        Some(300)
    );
    // share_threshold: false on the middle level keeps values apart there.
    assert_ne!(
        key(&[("path", "path/1"), ("file", "file/a"), ("type", "t")]),
        key(&[("path", "path/2"), ("file", "file/b"), ("type", "t")])
    );
    assert_eq!(
        key(&[("path", "path/1"), ("file", "file/a"), ("type", "t")]),
        key(&[("path", "path/2"), ("file", "file/a"), ("type", "t")])
    );
    // An explicit value wins over a wildcard.
    assert_eq!(rpu(&d, &[("file", "test1")]), Some(50));
    assert_eq!(rpu(&d, &[("file", "test2")]), Some(100));
    assert_eq!(rpu(&d, &[("midpath", "/api/x/v1")]), Some(100));
    assert_eq!(rpu(&d, &[("multiroute", "svc-a-ep-b-rpc")]), Some(50));
    assert_eq!(
        rpu(&d, &[("tenant", "t1prod"), ("resource", "res1v2")]),
        Some(60)
    );
    // Labels: share_threshold keeps the pattern even where values are asked for.
    assert_eq!(
        limit_of(&d, &[("route", "api/v1"), ("method", "GET")])
            .unwrap()
            .0,
        "route_api/*.method"
    );
    assert_eq!(
        limit_of(&d, &[("service", "svc/a"), ("endpoint", "e1")])
            .unwrap()
            .0,
        "service_svc/*.endpoint_e1"
    );
    assert_eq!(
        limit_of(&d, &[("midroute", "/api/x/v2")]).unwrap().0,
        "midroute_/api*v2"
    );
}

#[test]
fn shadow_quota_and_replaces_are_read() {
    let Some(d) = fixture("good/shadowmode_config.yaml") else {
        return;
    };
    assert!(
        d.lookup(&[("key2", "x")], &KeyFormat::default())
            .unwrap()
            .node
            .shadow_mode
    );
    assert!(
        !d.lookup(&[("key2", "value2")], &KeyFormat::default())
            .unwrap()
            .node
            .shadow_mode
    );
    let Some(d) = fixture("good/example.yaml") else {
        return;
    };
    let m = d
        .lookup(&[("service", "service_1")], &KeyFormat::default())
        .unwrap();
    assert!(m.node.soft);
    assert!(m.node.metadata().is_some());
    let m = d
        .lookup(&[("category", "account")], &KeyFormat::default())
        .unwrap();
    let Some(NodeLimits::Limits(l)) = &m.node.limits else {
        panic!()
    };
    assert_eq!(&*l[0].replaces[1], "fake_name");
    assert_eq!(rpu(&d, &[("foo", "x"), ("bar", "banned")]), Some(0));
}

/// Every bad fixture is refused, naming the file, a line and the field at fault.
#[test]
fn every_bad_fixture_is_refused_with_file_line_and_field() {
    let Some(dir) = fixtures() else { return };
    let expected: &[(&str, u64, &str)] = &[
        ("bad_limit_unit.yaml", 6, "descriptors[0].rate_limit.unit"),
        ("bad_yaml.yaml", 1, "yaml"),
        ("duplicate_key.yaml", 6, "descriptors[1]"),
        ("empty_domain.yaml", 0, "domain"),
        ("empty_key.yaml", 3, "descriptors[0].key"),
        ("misspelled_key.yaml", 5, "ratelimit"),
        ("misspelled_key2.yaml", 7, "requestsperunit"),
        ("non_map_list.yaml", 3, "yaml"),
        ("non_string_key.yaml", 1, "0.25"),
        (
            "replaces_empty.yaml",
            10,
            "descriptors[0].descriptors[0].rate_limit.replaces[0].name",
        ),
        (
            "replaces_self.yaml",
            10,
            "descriptors[0].descriptors[0].rate_limit.replaces[0].name",
        ),
        (
            "unlimited_with_unit.yaml",
            6,
            "descriptors[0].rate_limit.unit",
        ),
    ];
    let mut seen = 0;
    for entry in std::fs::read_dir(dir.join("bad")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_owned();
        let text = std::fs::read_to_string(&path).unwrap();
        let err = compile_file(&path, &text).expect_err(&name);
        let shown = err.to_string();
        assert!(shown.starts_with(&path.display().to_string()), "{shown}");
        let &(_, line, field) = expected
            .iter()
            .find(|(n, _, _)| *n == name)
            .unwrap_or_else(|| panic!("no expectation for {name}: {shown}"));
        assert_eq!(err.field, field, "{shown}");
        if line > 0 {
            assert_eq!(err.line, Some(line), "{shown}");
        }
        seen += 1;
    }
    assert_eq!(seen, expected.len());
}

#[test]
fn a_duplicate_domain_beside_another_file_is_refused() {
    let Some(dir) = fixtures() else { return };
    let pair = [
        dir.join("good/basic_config.yaml"),
        dir.join("pairs/duplicate_domain.yaml"),
    ];
    let err = load_paths(&pair).unwrap_err();
    assert_eq!(err.file, pair[1]);
    assert_eq!(err.field, "domain");
    assert!(err.message.contains("basic_config.yaml"), "{err}");
    // Each alone is fine.
    assert!(load_paths(&pair[1..]).is_ok());
}

#[test]
fn directories_skip_dot_entries_and_other_extensions() {
    let dir = tempfile::tempdir().unwrap();
    let write = |rel: &str, text: &str| {
        let p = dir.path().join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    };
    write("a.yaml", "domain: a\n");
    write("sub/b.yml", "domain: b\n");
    write(".hidden.yaml", "domain: a\n"); // would be a duplicate if read
    write(".dir/c.yaml", "not: [valid");
    write("notes.txt", "not yaml");
    let loaded = load_paths(&[dir.path().to_owned()]).unwrap();
    assert_eq!(loaded.files.len(), 2);
    assert!(loaded.snapshot.domain("a").is_some() && loaded.snapshot.domain("b").is_some());
    assert!(
        load_paths(&[dir.path().join("missing")])
            .unwrap_err()
            .to_string()
            .contains("missing")
    );
}

#[test]
fn extensions_parse_and_dump() {
    let d = yaml(
        "domain: ext\ndescriptors:\n  - key: api\n    rate_limits:\n      - {unit: second, requests_per_unit: 10, algorithm: token_bucket, burst: 20}\n      - {unit: Day, requests_per_unit: 1000, name: daily}\n  - key: slow\n    rate_limit: {unit: second, unit_multiplier: 30, requests_per_unit: 5, algorithm: SLIDING_LOG}\n",
    )
    .unwrap();
    let m = d.lookup(&[("api", "k")], &KeyFormat::default()).unwrap();
    let Some(NodeLimits::Limits(l)) = &m.node.limits else {
        panic!()
    };
    assert_eq!(l.len(), 2);
    assert_eq!((l[0].algorithm, l[0].burst), (Algorithm::TokenBucket, 20));
    assert_eq!((l[1].unit, l[1].burst), (Unit::Day, 1000));
    let m = d.lookup(&[("slow", "k")], &KeyFormat::default()).unwrap();
    let Some(NodeLimits::Limits(l)) = &m.node.limits else {
        panic!()
    };
    assert_eq!(l[0].window_seconds(), 30);
    assert_eq!(l[0].limit().window_us, 30_000_000);
    assert_eq!(l[0].algorithm, Algorithm::SlidingLog);
    let dump = Snapshot::new(vec![d]).dump();
    assert!(dump.contains("ext.api: unit=SECOND requests_per_unit=10, algorithm=token_bucket burst=20, shadow_mode: false"), "{dump}");
    assert!(
        dump.contains(
            "ext.api: unit=DAY requests_per_unit=1000, algorithm=fixed_window, name=daily"
        ),
        "{dump}"
    );
    assert!(
        dump.contains(
            "ext.slow: unit=SECOND requests_per_unit=5 unit_multiplier=30, algorithm=sliding_log"
        ),
        "{dump}"
    );
}

#[test]
fn each_validation_error_names_its_field_and_line() {
    let cases: &[(&str, &str, u64, &str)] = &[
        ("domain: ''\n", "domain", 1, "empty domain"),
        (
            "domain: d\ndescriptors:\n  - key: ''\n",
            "descriptors[0].key",
            3,
            "empty key",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {requests_per_unit: 1}\n",
            "descriptors[0].rate_limit.unit",
            4,
            "needs a unit",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: fortnight\n",
            "descriptors[0].rate_limit.unit",
            5,
            "fortnight",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      requests_per_unit: 5000000000\n",
            "descriptors[0].rate_limit.requests_per_unit",
            6,
            "larger than",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      algorithm: leaky\n",
            "descriptors[0].rate_limit.algorithm",
            6,
            "leaky",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      burst: 3\n",
            "descriptors[0].rate_limit.burst",
            6,
            "token_bucket",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      algorithm: token_bucket\n      burst: 0\n",
            "descriptors[0].rate_limit.burst",
            7,
            "between 1",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      unit_multiplier: 0\n",
            "descriptors[0].rate_limit.unit_multiplier",
            6,
            "between 1",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unlimited: true\n      algorithm: token_bucket\n",
            "descriptors[0].rate_limit.algorithm",
            6,
            "unlimited",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limits: []\n",
            "descriptors[0].rate_limits",
            4,
            "empty",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limits:\n      - unlimited: true\n",
            "descriptors[0].rate_limits[0].unlimited",
            5,
            "not allowed",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second}\n    rate_limits:\n      - {unit: second}\n",
            "descriptors[0].rate_limits",
            6,
            "not both",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    value: plain\n    share_threshold: true\n",
            "descriptors[0].share_threshold",
            3,
            "wildcard",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    metadata: [1, 2]\n",
            "descriptors[0].metadata",
            3,
            "mapping",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    descriptors:\n      - key: a\n        value: '*'\n      - key: a\n        value: '*'\n",
            "descriptors[0].descriptors[1]",
            7,
            "first defined at line 5",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      requests_per_unit: -1\n",
            "yaml",
            6,
            "invalid",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    algorithm: token_bucket\n",
            "algorithm",
            4,
            "unknown field",
        ),
    ];
    for &(text, field, line, needle) in cases {
        let err = yaml(text).expect_err(text);
        let shown = err.to_string();
        assert_eq!(err.field, field, "{shown}");
        assert_eq!(err.line, Some(line), "{shown}");
        assert!(shown.contains(needle), "{shown} lacks {needle}");
        assert!(shown.starts_with("t.yaml:"), "{shown}");
    }
}

#[test]
fn keys_are_injective_over_hostile_values() {
    let d = yaml("domain: d\ndescriptors:\n  - key: a\n    descriptors:\n      - key: b\n        rate_limit: {unit: second, requests_per_unit: 1}\n  - key: a_b\n    descriptors:\n      - key: b\n        rate_limit: {unit: second, requests_per_unit: 1}\n").unwrap();
    let k1 = counter_key(&d, &[("a", "x_b"), ("b", "y")]);
    let k2 = counter_key(&d, &[("a", "x"), ("b", "b_y")]);
    let k3 = counter_key(&d, &[("a_b", "x"), ("b", "y")]);
    let k4 = counter_key(&d, &[("a", "x\0\0\0\x01b"), ("b", "")]);
    let keys = [k1, k2, k3, k4];
    for i in 0..keys.len() {
        for j in i + 1..keys.len() {
            assert_ne!(keys[i], keys[j]);
        }
    }
}

#[test]
fn wildcards_match_any_run_anywhere() {
    let cases = [
        ("foo*", "foo", true),
        ("foo*", "foobar", true),
        ("foo*", "fo", false),
        ("bar*b", "barb", true),
        ("bar*b", "bar-xyz-b", true),
        ("bar*b", "bar-xyz-c", false),
        ("foo*bar*baz", "foo1bar2baz", true),
        ("foo*bar*baz", "foobarbaz", true),
        ("foo*bar*baz", "foobaz", false),
        ("*", "", true),
        ("a*a", "a", false),
        ("/api*v1", "/api/users/v1", true),
        ("*end", "the end", true),
    ];
    // A value without `*` is not a pattern (it was one that panicked when matched).
    assert_eq!(Wildcard::new("abc"), None);
    for (pattern, value, expected) in cases {
        assert_eq!(
            Wildcard::new(pattern).unwrap().matches(value.as_bytes()),
            expected,
            "{pattern} ~ {value}"
        );
    }
}

#[test]
fn units_parse_case_insensitively() {
    assert_eq!(Unit::parse("second"), Some(Unit::Second));
    assert_eq!(Unit::parse("MiNuTe"), Some(Unit::Minute));
    assert_eq!(Unit::parse("month").map(Unit::seconds), Some(2_592_000));
    assert_eq!(Unit::parse("year").map(Unit::seconds), Some(31_536_000));
    assert_eq!(Unit::parse("foo"), None);
}

/// A per-customer file of 30,000 descriptors (3 MB) was refused ("budget breached: Nodes"),
/// though a domain cannot be split across files. Honest configs load by size; what aliases
/// can expand stays within the same allowance, so nested anchors are still refused.
#[test]
fn a_large_per_customer_config_loads_and_alias_bombs_do_not() {
    let dir = tempfile::tempdir().unwrap();
    let mut yaml = String::from("domain: customers\ndescriptors:\n");
    for i in 0..30_000 {
        yaml += &format!(
            "  - key: customer\n    value: c{i}\n    rate_limit: {{unit: minute, requests_per_unit: {}}}\n",
            100 + i % 7
        );
    }
    std::fs::write(dir.path().join("customers.yaml"), &yaml).unwrap();
    let loaded = ratelimitd::testing::load_paths(&[dir.path().to_owned()]).unwrap();
    assert_eq!(loaded.snapshot.rule_count(), 30_000);

    // Nine levels of ten aliases each in a descriptor's free-form `metadata`: a billion nodes
    // from a few hundred bytes.
    let mut bomb = String::from(
        "domain: bomb\ndescriptors:\n  - key: k\n    metadata:\n      a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n",
    );
    for l in 1..9 {
        let p = l - 1;
        bomb += &format!(
            "      a{l}: &a{l} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n"
        );
    }
    let file = dir.path().join("bomb.yaml");
    std::fs::write(&file, bomb).unwrap();
    let err = ratelimitd::testing::load_paths(&[file]).unwrap_err();
    assert!(err.to_string().contains("bomb.yaml"), "{err}");
    assert!(err.to_string().contains("budget"), "{err}");
}

/// Symlinked directories are read once: a `loop -> .` does not read every file twice (and
/// fail with "duplicate domain"), and self-links do not multiply the walk.
#[test]
fn symlink_loops_are_read_once() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("l.yaml"), "domain: l\ndescriptors: []\n").unwrap();
    std::os::unix::fs::symlink(".", dir.path().join("loop")).unwrap();
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    std::fs::write(sub.join("other.yaml"), "domain: other\ndescriptors: []\n").unwrap();
    for i in 0..7 {
        std::os::unix::fs::symlink(".", sub.join(format!("self{i}"))).unwrap();
    }
    std::os::unix::fs::symlink("l.yaml", dir.path().join("alias.yaml")).unwrap();
    let loaded = load_paths(&[dir.path().to_owned()]).unwrap();
    assert_eq!(loaded.snapshot.len(), 2);
    assert_eq!(loaded.files.len(), 2, "{:?}", loaded.files);
    // The same directory named twice is read once too.
    let twice = [dir.path().to_owned(), dir.path().join("loop")];
    assert_eq!(load_paths(&twice).unwrap().files.len(), 2);
}

/// `hold_key` names the entry after a node's that carries a request's hold: never matched,
/// never in the counter's key; `algorithm: concurrency` needs it. Both may come from
/// `metadata.ratelimitd` (xDS). Misuse is an error naming the field and line.
#[test]
fn hold_keys_name_a_hold_and_concurrency_needs_one() {
    let d = yaml(
        "domain: llm
descriptors:
  - key: tenant
    hold_key: request_id
    rate_limits:
      - {algorithm: concurrency, requests_per_unit: 5, unit: minute, unit_multiplier: 10}
      - {unit: month, requests_per_unit: 1000000, calendar: Europe/Berlin}
  - key: plan
    metadata: {ratelimitd: {hold_key: rid}}
    rate_limit: {unit: second, requests_per_unit: 3}
",
    )
    .unwrap();
    let held = d
        .lookup(
            &[("tenant", "acme"), ("request_id", "7f3a")],
            &KeyFormat::default(),
        )
        .expect("the hold entry is not matched as a child");
    assert_eq!(
        held.key,
        counter_key(&d, &[("tenant", "acme")]),
        "not in the key"
    );
    assert!(
        d.lookup(&[("plan", "p"), ("rid", "1")], &KeyFormat::default())
            .is_some()
    );
    // Only as the last entry; another key after the node matches nothing.
    assert!(
        d.lookup(&[("tenant", "acme"), ("other", "x")], &KeyFormat::default())
            .is_none()
    );
    let dump = Snapshot::new(vec![d]).dump();
    assert!(
        dump.contains(
            "llm.tenant: unit=MINUTE requests_per_unit=5 unit_multiplier=10, algorithm=concurrency, hold_key=request_id"
        ),
        "{dump}"
    );

    for (bad, field, line, says) in [
        (
            "  - key: t\n    rate_limit: {algorithm: concurrency, unit: minute, requests_per_unit: 2}\n",
            "descriptors[0].rate_limit.algorithm",
            Some(4),
            "hold_key",
        ),
        (
            "  - key: t\n    hold_key: rid\n    rate_limit: {algorithm: concurrency, unit: minute, requests_per_unit: 10001}\n",
            "descriptors[0].rate_limit.requests_per_unit",
            Some(5),
            "10000 places",
        ),
        (
            "  - key: t\n    hold_key: rid\n    rate_limit: {algorithm: concurrency, unit: hour, requests_per_unit: 2, calendar: UTC}\n",
            "descriptors[0].rate_limit.calendar",
            Some(5),
            "lifetime",
        ),
        (
            "  - key: t\n    hold_key: rid\n    rate_limit: {algorithm: concurrency, unit: hour, requests_per_unit: 2, accounting: report}\n",
            "descriptors[0].rate_limit.accounting",
            Some(5),
            "no meaning",
        ),
        (
            "  - key: t\n    hold_key: rid\n",
            "descriptors[0].hold_key",
            Some(4),
            "needs a rate_limit",
        ),
        (
            "  - key: t\n    hold_key: rid\n    rate_limit: {unlimited: true}\n",
            "descriptors[0].hold_key",
            Some(4),
            "needs a rate_limit",
        ),
        (
            "  - key: t\n    hold_key: \"\"\n    rate_limit: {unit: hour, requests_per_unit: 2}\n",
            "descriptors[0].hold_key",
            Some(4),
            "name an entry key",
        ),
        (
            "  - key: t\n    hold_key: rid\n    rate_limit: {unit: hour, requests_per_unit: 2}\n    descriptors:\n      - key: rid\n        rate_limit: {unit: hour, requests_per_unit: 1}\n",
            "descriptors[0].hold_key",
            Some(4),
            "nested descriptor",
        ),
        (
            "  - key: t\n    metadata: {ratelimitd: {hold_key: 3}}\n    rate_limit: {unit: hour, requests_per_unit: 2}\n",
            "descriptors[0].metadata.ratelimitd.hold_key",
            Some(3),
            "string",
        ),
    ] {
        let err = yaml(&format!("domain: d\ndescriptors:\n{bad}")).unwrap_err();
        assert_eq!((err.field.as_str(), err.line), (field, line), "{err}");
        assert!(err.message.contains(says), "{err}");
    }
}

/// An `answer` that does not compile is refused with its line and field, and why.
#[test]
fn answers_that_do_not_compile_are_refused_with_line_and_field() {
    let head = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n    answer:\n";
    let many_values = format!("'\"{}\"'", "{{value}}".repeat(20));
    let cases: Vec<(String, u64, &str, &str)> = vec![
        (
            "      headers:\n        x-a: \"{{remainder}}\"\n".into(),
            7,
            "descriptors[0].answer.headers.x-a",
            "unknown variable '{{remainder}}'",
        ),
        (
            "      headers:\n        x-a: \"{{value\"\n".into(),
            7,
            "descriptors[0].answer.headers.x-a",
            "never closed",
        ),
        (
            "      headers:\n        \"x a\": \"1\"\n".into(),
            7,
            "descriptors[0].answer.headers.x a",
            "not a header name",
        ),
        (
            "      headers:\n        Content-Type: text/html\n".into(),
            7,
            "descriptors[0].answer.headers.Content-Type",
            "over_limit.content_type",
        ),
        (
            "      headers:\n        x-a: \"a\\r\\nx-b: 1\"\n".into(),
            7,
            "descriptors[0].answer.headers.x-a",
            "printable ASCII",
        ),
        (
            "      over_limit:\n        body: '{\"key\": {{value}}}'\n".into(),
            7,
            "descriptors[0].answer.over_limit.body",
            "inside a JSON string",
        ),
        (
            "      over_limit:\n        content_type: application/json\n".into(),
            7,
            "descriptors[0].answer.over_limit.content_type",
            "without a body",
        ),
        (
            format!(
                "      over_limit:\n        content_type: text/plain\n        body: \"{}\"\n",
                "{{value}}".repeat(50)
            ),
            8,
            "descriptors[0].answer.over_limit.body",
            "more than 16384",
        ),
        (
            format!("      headers:\n        x-a: {many_values}\n        x-b: {many_values}\n"),
            0,
            "descriptors[0].answer.headers",
            "more than 8192",
        ),
        (
            "      over_limt: {}\n".into(),
            6,
            "over_limt",
            "unknown field",
        ),
    ];
    for (answer, line, field, says) in cases {
        let text = format!("{head}{answer}");
        let err = yaml(&text).expect_err(&text);
        assert_eq!(err.field, field, "{err}\n{text}");
        if line > 0 {
            assert_eq!(err.line, Some(line), "{err}\n{text}");
        }
        assert!(err.message.contains(says), "{err}\n{text}");
    }
    // Not on an unlimited limit, where it would mean nothing.
    let err = yaml("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unlimited: true\n      answer: {headers: {x-a: b}}\n").unwrap_err();
    assert_eq!(err.field, "descriptors[0].rate_limit.answer", "{err}");
    // A good one loads.
    yaml(&format!("{head}      headers:\n        X-Left: \"{{{{remaining}}}} of {{{{requests_per_unit}}}}\"\n      over_limit:\n        body: '{{\"k\": \"{{{{value}}}}\", \"n\": {{{{reset_ms}}}}}}'\n")).unwrap();
}

/// `soft` goes on limits: not with `quota_mode`, not on a descriptor without limits, not on
/// an unlimited one.
#[test]
fn soft_limits_are_refused_where_they_mean_nothing() {
    for (text, field) in [
        (
            "domain: d\ndescriptors:\n  - key: k\n    quota_mode: true\n    soft: true\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
            "descriptors[0].quota_mode",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    quota_mode: true\n    rate_limits:\n      - {unit: second, requests_per_unit: 1, soft: true}\n",
            "descriptors[0].quota_mode",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    soft: true\n",
            "descriptors[0].soft",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unlimited: true, soft: true}\n",
            "descriptors[0].rate_limit.soft",
        ),
    ] {
        let err = yaml(text).expect_err(text);
        assert_eq!(err.field, field, "{err}");
    }
    yaml("domain: d\ndescriptors:\n  - key: k\n    soft: true\n    shadow_mode: true\n    rate_limit: {unit: second, requests_per_unit: 1}\n").unwrap();
}
