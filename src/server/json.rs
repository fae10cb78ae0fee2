//! `POST /json`, as envoyproxy/ratelimit serves it: a proto3-JSON `RateLimitRequest` in, a
//! proto3-JSON `RateLimitResponse` out. 200 when OK, 429 when over the limit, 400 with a
//! message for malformed input (503 or 500 when the backend could not decide).
//!
//! proto3 JSON is written by hand for the two messages (field names in lowerCamelCase or as
//! in the proto, 64-bit integers as numbers or strings, enums by name or number, wrappers as
//! their value, defaults left out), so no JSON runtime for protobuf is needed.

use std::sync::Arc;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, rate_limit};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
use envoy_types::pb::google::protobuf::{UInt64Value, value::Kind};
use serde_json::{Map, Value, json};

type Object = Map<String, Value>;

/// Why a body is not a `RateLimitRequest`.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct JsonError(String);

fn bad(m: impl Into<String>) -> JsonError {
    JsonError(m.into())
}

/// Looks up a field by its JSON name or its proto name, refusing unknown ones.
fn fields<'a>(
    v: &'a Value,
    at: &str,
    known: &[(&str, &str)],
) -> Result<Vec<Option<&'a Value>>, JsonError> {
    let Value::Object(o) = v else {
        return Err(bad(format!("{at}: expected an object")));
    };
    for k in o.keys() {
        if !known.iter().any(|(json, proto)| k == json || k == proto) {
            return Err(bad(format!("{at}: unknown field \"{k}\"")));
        }
    }
    Ok(known
        .iter()
        .map(|(json, proto)| {
            o.get(*json)
                .or_else(|| o.get(*proto))
                .filter(|v| !v.is_null())
        })
        .collect())
}

fn string(v: Option<&Value>, at: &str) -> Result<String, JsonError> {
    match v {
        None => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(bad(format!("{at}: expected a string"))),
    }
}

fn unsigned(v: Option<&Value>, at: &str, max: u64) -> Result<u64, JsonError> {
    let n = match v {
        None => return Ok(0),
        Some(Value::Number(n)) => n.as_u64(),
        Some(Value::String(s)) => s.parse().ok(),
        Some(_) => None,
    };
    n.filter(|n| *n <= max)
        .ok_or_else(|| bad(format!("{at}: expected an unsigned integer up to {max}")))
}

fn boolean(v: Option<&Value>, at: &str) -> Result<bool, JsonError> {
    match v {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(bad(format!("{at}: expected true or false"))),
    }
}

fn unit(v: Option<&Value>, at: &str) -> Result<i32, JsonError> {
    match v {
        None => Ok(0),
        Some(Value::Number(n)) => n
            .as_i64()
            .and_then(|n| i32::try_from(n).ok())
            .ok_or_else(|| bad(format!("{at}: not a unit"))),
        Some(Value::String(s)) => RateLimitUnit::from_str_name(s)
            .map(|u| u as i32)
            .ok_or_else(|| bad(format!("{at}: unknown unit \"{s}\""))),
        Some(_) => Err(bad(format!("{at}: expected a unit name"))),
    }
}

fn list<'a>(v: Option<&'a Value>, at: &str) -> Result<&'a [Value], JsonError> {
    match v {
        None => Ok(&[]),
        Some(Value::Array(a)) => Ok(a),
        Some(_) => Err(bad(format!("{at}: expected a list"))),
    }
}

/// Parses a proto3-JSON `RateLimitRequest`.
pub(crate) fn parse_request(body: &[u8]) -> Result<RateLimitRequest, JsonError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| bad(format!("not JSON: {e}")))?;
    let f = fields(
        &v,
        "request",
        &[
            ("domain", "domain"),
            ("descriptors", "descriptors"),
            ("hitsAddend", "hits_addend"),
        ],
    )?;
    let mut descriptors = Vec::new();
    for (i, d) in list(f[1], "descriptors")?.iter().enumerate() {
        let at = format!("descriptors[{i}]");
        let g = fields(
            d,
            &at,
            &[
                ("entries", "entries"),
                ("limit", "limit"),
                ("hitsAddend", "hits_addend"),
                ("isNegativeHits", "is_negative_hits"),
            ],
        )?;
        let mut entries = Vec::new();
        for (j, e) in list(g[0], &format!("{at}.entries"))?.iter().enumerate() {
            let at = format!("{at}.entries[{j}]");
            let h = fields(e, &at, &[("key", "key"), ("value", "value")])?;
            entries.push(Entry {
                key: string(h[0], &format!("{at}.key"))?,
                value: string(h[1], &format!("{at}.value"))?,
            });
        }
        let limit = match g[1] {
            None => None,
            Some(l) => {
                let at = format!("{at}.limit");
                let h = fields(
                    l,
                    &at,
                    &[("requestsPerUnit", "requests_per_unit"), ("unit", "unit")],
                )?;
                Some(RateLimitOverride {
                    requests_per_unit: unsigned(
                        h[0],
                        &format!("{at}.requestsPerUnit"),
                        u32::MAX as u64,
                    )? as u32,
                    unit: unit(h[1], &format!("{at}.unit"))?,
                })
            }
        };
        let hits_addend = match g[2] {
            None => None,
            // The wrapper in proto3 JSON is its value (an object form is refused).
            Some(h) => Some(UInt64Value {
                value: unsigned(Some(h), &format!("{at}.hitsAddend"), u64::MAX)?,
            }),
        };
        descriptors.push(RateLimitDescriptor {
            entries,
            limit,
            hits_addend,
            is_negative_hits: boolean(g[3], &format!("{at}.isNegativeHits"))?,
        });
    }
    Ok(RateLimitRequest {
        domain: string(f[0], "domain")?,
        descriptors,
        hits_addend: unsigned(f[2], "hitsAddend", u32::MAX as u64)? as u32,
    })
}

fn code_name(code: i32) -> Value {
    json!(Code::try_from(code).map_or("UNKNOWN", |c| c.as_str_name()))
}

/// A protobuf Duration in proto3 JSON: seconds with 0, 3, 6 or 9 fractional digits.
fn duration(seconds: i64, nanos: i32) -> String {
    match nanos {
        0 => format!("{seconds}s"),
        n if n % 1_000_000 == 0 => format!("{seconds}.{:03}s", n / 1_000_000),
        n if n % 1_000 == 0 => format!("{seconds}.{:06}s", n / 1_000),
        n => format!("{seconds}.{n:09}s"),
    }
}

fn struct_json(s: &envoy_types::pb::google::protobuf::Struct) -> Value {
    Value::Object(
        s.fields
            .iter()
            .map(|(k, v)| (k.clone(), value_json(v)))
            .collect(),
    )
}

fn value_json(v: &envoy_types::pb::google::protobuf::Value) -> Value {
    match &v.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::NumberValue(n)) => json!(n),
        Some(Kind::StringValue(s)) => json!(s),
        Some(Kind::BoolValue(b)) => json!(b),
        Some(Kind::StructValue(s)) => struct_json(s),
        Some(Kind::ListValue(l)) => Value::Array(l.values.iter().map(value_json).collect()),
    }
}

/// A `RateLimitResponse` in proto3 JSON (default values left out, as protojson does), each
/// refused status with the config path of the rule that refused it (`refused_by`, by status)
/// as `"rule"`: a field of this service's, unknown to the proto.
pub(crate) fn response_json(r: &RateLimitResponse, refused_by: &[Option<Arc<String>>]) -> Value {
    let mut o = Object::new();
    o.insert("overallCode".into(), code_name(r.overall_code));
    let statuses: Vec<Value> = r
        .statuses
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let mut st = Object::new();
            st.insert("code".into(), code_name(s.code));
            if let Some(Some(rule)) = refused_by.get(i) {
                st.insert("rule".into(), json!(rule.as_str()));
            }
            if let Some(l) = &s.current_limit {
                let mut cl = Object::new();
                if !l.name.is_empty() {
                    cl.insert("name".into(), json!(l.name));
                }
                if l.requests_per_unit != 0 {
                    cl.insert("requestsPerUnit".into(), json!(l.requests_per_unit));
                }
                let unit =
                    rate_limit::Unit::try_from(l.unit).map_or("UNKNOWN", |u| u.as_str_name());
                cl.insert("unit".into(), json!(unit));
                st.insert("currentLimit".into(), Value::Object(cl));
            }
            if s.limit_remaining != 0 {
                st.insert("limitRemaining".into(), json!(s.limit_remaining));
            }
            if let Some(d) = &s.duration_until_reset {
                st.insert(
                    "durationUntilReset".into(),
                    json!(duration(d.seconds, d.nanos)),
                );
            }
            Value::Object(st)
        })
        .collect();
    if !statuses.is_empty() {
        o.insert("statuses".into(), Value::Array(statuses));
    }
    for (name, headers) in [
        ("responseHeadersToAdd", &r.response_headers_to_add),
        ("requestHeadersToAdd", &r.request_headers_to_add),
    ] {
        if !headers.is_empty() {
            let headers = headers
                .iter()
                .map(|h| json!({"key": h.key, "value": h.value}))
                .collect();
            o.insert(name.into(), Value::Array(headers));
        }
    }
    if !r.raw_body.is_empty() {
        o.insert("rawBody".into(), json!(base64(&r.raw_body)));
    }
    if let Some(m) = &r.dynamic_metadata {
        o.insert("dynamicMetadata".into(), struct_json(m));
    }
    Value::Object(o)
}

/// Standard base64 with padding, as proto3 JSON writes `bytes`.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_in_either_field_naming_and_refusals() {
        let r = parse_request(
            br#"{"domain":"d","descriptors":[{"entries":[{"key":"k","value":"v"}],
                "limit":{"requests_per_unit":5,"unit":"MINUTE"},"hitsAddend":"3"}],"hits_addend":2}"#,
        )
        .unwrap();
        assert_eq!(r.domain, "d");
        assert_eq!(r.hits_addend, 2);
        let d = &r.descriptors[0];
        assert_eq!(
            (d.entries[0].key.as_str(), d.entries[0].value.as_str()),
            ("k", "v")
        );
        assert_eq!(d.limit.as_ref().unwrap().requests_per_unit, 5);
        assert_eq!(d.limit.as_ref().unwrap().unit, RateLimitUnit::Minute as i32);
        assert_eq!(d.hits_addend.as_ref().unwrap().value, 3);
        for (body, says) in [
            (&b"nope"[..], "not JSON"),
            (br#"{"domian":"d"}"#, "unknown field \"domian\""),
            (br#"{"descriptors":{}}"#, "descriptors: expected a list"),
            (br#"{"hitsAddend":-1}"#, "hitsAddend"),
            (
                br#"{"descriptors":[{"limit":{"unit":"FORTNIGHT"}}]}"#,
                "FORTNIGHT",
            ),
        ] {
            let e = parse_request(body).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
    }

    #[test]
    fn bytes_in_base64() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foob\xff"), "Zm9vYv8=");
        assert_eq!(base64(&[0xff, 0xfe]), "//4=");
    }

    #[test]
    fn durations_as_protojson_writes_them() {
        assert_eq!(duration(59, 0), "59s");
        assert_eq!(duration(1, 500_000_000), "1.500s");
        assert_eq!(duration(0, 1_000), "0.000001s");
        assert_eq!(duration(0, 7), "0.000000007s");
    }
}
