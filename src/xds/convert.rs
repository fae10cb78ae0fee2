//! A `RateLimitConfig` into the config's own parsed form, field for field as
//! envoyproxy/ratelimit reads it, then compiled by the checks a file meets. Proto3 has no
//! "unset" for scalars, so its defaults mean what that service makes of them: an empty `value`
//! is no value, an empty `name` no name, unit `UNKNOWN` no unit (valid only when unlimited).

use std::path::PathBuf;

use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};

use super::pb;
use crate::config::schema::{RawDescriptor, RawLimit, RawReplace};
use crate::config::{CompileOptions, ConfigError, Domain, compile_parsed, unlocated};

/// Compiles one config; its errors name it as `xds:<name>` (its domain when it has no name).
pub(super) fn domain(
    config: pb::RateLimitConfig,
    options: CompileOptions,
) -> Result<Domain, ConfigError> {
    let name = if config.name.is_empty() {
        &config.domain
    } else {
        &config.name
    };
    let source = PathBuf::from(format!("xds:{name}"));
    let descriptors = config.descriptors.into_iter().map(descriptor).collect();
    compile_parsed(&source, config.domain, descriptors, options)
}

fn non_empty(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

fn descriptor(d: pb::RateLimitDescriptor) -> RawDescriptor {
    RawDescriptor {
        // An empty key stays, for the compiler to refuse by name.
        key: Some(unlocated(d.key)),
        value: non_empty(d.value).map(unlocated),
        rate_limit: d.rate_limit.map(|l| unlocated(limit(l))),
        rate_limits: None,
        descriptors: Some(
            d.descriptors
                .into_iter()
                .map(|c| unlocated(descriptor(c)))
                .collect(),
        ),
        shadow_mode: Some(d.shadow_mode),
        detailed_metric: Some(d.detailed_metric),
        share_threshold: None,
        value_to_metric: None,
        quota_mode: Some(d.quota_mode),
        metadata: d.metadata.map(|m| json_of_struct(&m)),
        ..RawDescriptor::default()
    }
}

fn limit(p: pb::RateLimitPolicy) -> RawLimit {
    let unit = match pb::RateLimitUnit::try_from(p.unit) {
        Ok(pb::RateLimitUnit::Unknown) => None,
        Ok(unit) => Some(unit.as_str_name().to_owned()),
        // A number the enum does not know: kept, so the compiler refuses it as a unit.
        Err(_) => Some(p.unit.to_string()),
    };
    RawLimit {
        unit: unit.map(unlocated),
        requests_per_unit: Some(unlocated(u64::from(p.requests_per_unit))),
        unlimited: Some(unlocated(p.unlimited)),
        name: non_empty(p.name).map(unlocated),
        replaces: Some(
            p.replaces
                .into_iter()
                .map(|r| {
                    unlocated(RawReplace {
                        name: Some(unlocated(r.name)),
                        ..RawReplace::default()
                    })
                })
                .collect(),
        ),
        ..RawLimit::default()
    }
}

/// A protobuf `Struct` as the JSON mapping the config keeps for `metadata`.
fn json_of_struct(s: &Struct) -> serde_json::Value {
    serde_json::Value::Object(
        s.fields
            .iter()
            .map(|(k, v)| (k.clone(), json_of_value(v)))
            .collect(),
    )
}

fn json_of_value(v: &Value) -> serde_json::Value {
    match &v.kind {
        None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
        Some(Kind::NumberValue(n)) => serde_json::Number::from_f64(*n)
            .map_or(serde_json::Value::Null, serde_json::Value::Number),
        Some(Kind::StringValue(s)) => serde_json::Value::String(s.clone()),
        Some(Kind::BoolValue(b)) => serde_json::Value::Bool(*b),
        Some(Kind::StructValue(s)) => json_of_struct(s),
        Some(Kind::ListValue(ListValue { values })) => {
            serde_json::Value::Array(values.iter().map(json_of_value).collect())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::NodeLimits;

    fn policy(unit: pb::RateLimitUnit, rpu: u32) -> pb::RateLimitPolicy {
        pb::RateLimitPolicy {
            unit: unit as i32,
            requests_per_unit: rpu,
            ..Default::default()
        }
    }

    fn config(descriptors: Vec<pb::RateLimitDescriptor>) -> pb::RateLimitConfig {
        pb::RateLimitConfig {
            name: "c".into(),
            domain: "d".into(),
            descriptors,
        }
    }

    #[test]
    fn defaults_mean_what_the_reference_makes_of_them() {
        let d = domain(
            config(vec![
                pb::RateLimitDescriptor {
                    key: "k".into(),
                    value: String::new(),
                    rate_limit: Some(policy(pb::RateLimitUnit::Minute, 5)),
                    ..Default::default()
                },
                pb::RateLimitDescriptor {
                    key: "free".into(),
                    rate_limit: Some(pb::RateLimitPolicy {
                        unlimited: true,
                        ..Default::default()
                    }),
                    ..Default::default()
                },
            ]),
            CompileOptions::default(),
        )
        .unwrap();
        let snapshot = crate::config::Snapshot::new(vec![d]);
        let domain = snapshot.domain("d").unwrap();
        let keys = crate::limiter::KeyFormat::default();
        // An empty value is the value-less key: any value matches it.
        let m = domain.lookup(&[("k", "anything")], &keys).unwrap();
        assert!(
            matches!(&m.node.limits, Some(NodeLimits::Limits(l)) if l[0].requests_per_unit == 5)
        );
        let m = domain.lookup(&[("free", "x")], &keys).unwrap();
        assert!(matches!(m.node.limits, Some(NodeLimits::Unlimited)));
    }

    #[test]
    fn what_the_reference_refuses_is_refused_naming_the_config() {
        let refused = [
            (
                config(vec![pb::RateLimitDescriptor::default()]),
                "empty key",
            ),
            (
                config(vec![pb::RateLimitDescriptor {
                    key: "k".into(),
                    rate_limit: Some(policy(pb::RateLimitUnit::Unknown, 5)),
                    ..Default::default()
                }]),
                "unit",
            ),
            (
                config(vec![pb::RateLimitDescriptor {
                    key: "k".into(),
                    rate_limit: Some(pb::RateLimitPolicy {
                        unlimited: true,
                        ..policy(pb::RateLimitUnit::Second, 0)
                    }),
                    ..Default::default()
                }]),
                "unlimited",
            ),
            (
                config(vec![
                    pb::RateLimitDescriptor {
                        key: "k".into(),
                        value: "v".into(),
                        ..Default::default()
                    },
                    pb::RateLimitDescriptor {
                        key: "k".into(),
                        value: "v".into(),
                        ..Default::default()
                    },
                ]),
                "duplicate",
            ),
            (
                config(vec![pb::RateLimitDescriptor {
                    key: "k".into(),
                    rate_limit: Some(pb::RateLimitPolicy {
                        name: "a".into(),
                        replaces: vec![pb::RateLimitReplace { name: "a".into() }],
                        ..policy(pb::RateLimitUnit::Second, 1)
                    }),
                    ..Default::default()
                }]),
                "replaces itself",
            ),
            (
                config(vec![pb::RateLimitDescriptor {
                    key: "k".into(),
                    rate_limit: Some(pb::RateLimitPolicy {
                        replaces: vec![pb::RateLimitReplace::default()],
                        ..policy(pb::RateLimitUnit::Second, 1)
                    }),
                    ..Default::default()
                }]),
                "non-empty name",
            ),
            (
                pb::RateLimitConfig {
                    name: "c".into(),
                    ..Default::default()
                },
                "empty domain",
            ),
        ];
        for (config, why) in refused {
            let err = domain(config, CompileOptions::default())
                .unwrap_err()
                .to_string();
            assert!(err.starts_with("xds:c"), "{err}");
            assert!(err.contains(why), "{err} should say {why}");
        }
    }

    #[test]
    fn metadata_becomes_json() {
        let mut fields = std::collections::HashMap::new();
        fields.insert(
            "n".to_owned(),
            Value {
                kind: Some(Kind::NumberValue(2.5)),
            },
        );
        fields.insert(
            "l".to_owned(),
            Value {
                kind: Some(Kind::ListValue(ListValue {
                    values: vec![Value {
                        kind: Some(Kind::BoolValue(true)),
                    }],
                })),
            },
        );
        let json = json_of_struct(&Struct { fields });
        assert_eq!(json, serde_json::json!({"n": 2.5, "l": [true]}));
    }
}
