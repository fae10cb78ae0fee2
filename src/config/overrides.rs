//! Limits changed at runtime: an operator's override of the limits one descriptor resolves to
//! (`PUT /v1/overrides` on the admin listener). Here: what an override is, how its fields are
//! checked (the limits by the config's own rules, so an override takes exactly what a
//! `rate_limits` item takes) and the set in force, which the request path looks a descriptor
//! up in. Where overrides are kept and how replicas agree on them is `crate::overrides`'.
//!
//! An override replaces the limits of the rule a descriptor with exactly its entries resolves
//! to; other descriptors of that rule keep the config's. Its limits are compiled as that
//! rule's would be, each given its counter's ordinal among the limits alike, so a limit that
//! keeps its algorithm and window keeps its counter: raising 3 to 5 after 3 were used lets 2
//! more pass.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher, RandomState};
use std::path::Path;
use std::sync::Arc;

use hashbrown::HashTable;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::schema::{RawDescriptor, RawLimit};
use super::{CompileOptions, LimitRule, NodeLimits, compile_parsed, unlocated};

/// Most overrides in force unless `--max-overrides` says otherwise.
pub(crate) const DEFAULT_MAX_OVERRIDES: usize = 10_000;
/// Most bytes of one override as the admin API receives it (its JSON body).
pub(crate) const MAX_OVERRIDE_BYTES: usize = 16 << 10;
/// Most entries of an override's descriptor, and most limits.
const MAX_ENTRIES: usize = 64;
const MAX_LIMITS: usize = 64;

/// An entry of an override's descriptor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct OverrideEntry {
    /// The descriptor entry's key.
    pub(crate) key: String,
    /// Its value, exactly as Envoy sends it.
    pub(crate) value: String,
}

/// An override as it is kept (in Redis, or in `--overrides-file`) and listed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct OverrideRecord {
    /// Made when it was set; a `PUT` of the same entries makes a new one.
    pub(crate) id: String,
    /// The config domain.
    pub(crate) domain: String,
    /// The descriptor's entries, in order.
    pub(crate) entries: Vec<OverrideEntry>,
    /// The limits as given (the fields of a config limit), checked.
    pub(crate) limits: Vec<Value>,
    /// When it ends, in milliseconds since the Unix epoch; `None`: when deleted.
    pub(crate) expires_at_ms: Option<u64>,
    /// Why, as the operator wrote it.
    pub(crate) reason: String,
    /// The name of the token (or client certificate) that set it.
    pub(crate) created_by: String,
    /// When it was set, in milliseconds since the Unix epoch.
    pub(crate) created_at_ms: u64,
}

impl OverrideRecord {
    /// Whether it has ended at `now_ms`.
    pub(crate) fn expired(&self, now_ms: u64) -> bool {
        self.expires_at_ms.is_some_and(|at| at <= now_ms)
    }

    /// What makes two overrides one: the domain and the entries, in order.
    pub(crate) fn slot(&self) -> String {
        slot_of(&self.domain, &self.entries)
    }
}

/// The text naming a domain and entries, one per override in force (JSON: unambiguous).
pub(crate) fn slot_of(domain: &str, entries: &[OverrideEntry]) -> String {
    let pairs: Vec<(&str, &str)> = entries
        .iter()
        .map(|e| (e.key.as_str(), e.value.as_str()))
        .collect();
    serde_json::to_string(&(domain, pairs)).unwrap_or_default()
}

/// What `PUT /v1/overrides` asks for, checked.
#[derive(Debug)]
pub(crate) struct OverrideRequest {
    /// The config domain.
    pub(crate) domain: String,
    /// The descriptor's entries.
    pub(crate) entries: Vec<OverrideEntry>,
    /// The limits as given.
    pub(crate) limits: Vec<Value>,
    /// How long it lasts; `None`: until deleted.
    pub(crate) ttl: Option<std::time::Duration>,
    /// Why.
    pub(crate) reason: String,
}

/// A malformed override: the field at fault (`limits[0].unit`) and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub(crate) struct OverrideError {
    /// The field, as a path into the request.
    pub(crate) field: String,
    /// What is wrong.
    pub(crate) message: String,
}

/// `body` as JSON, refused when any object in it gives a key twice (serde_json keeps the last,
/// so `{"limits": [...], "limits": []}` would mean what a reader of the body does not see): the
/// error names the key.
fn strict_json(body: &[u8]) -> Result<Value, OverrideError> {
    use serde::de::{Deserializer, Error, MapAccess, SeqAccess, Visitor};
    struct Strict(Value);
    struct StrictVisitor;
    impl<'de> Deserialize<'de> for Strict {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(StrictVisitor).map(Strict)
        }
    }
    impl<'de> Visitor<'de> for StrictVisitor {
        type Value = Value;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("JSON")
        }
        fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
            Ok(Value::Bool(v))
        }
        fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
            Ok(v.into())
        }
        fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
            Ok(v.into())
        }
        fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
            Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
        }
        fn visit_str<E>(self, v: &str) -> Result<Value, E> {
            Ok(Value::String(v.to_owned()))
        }
        fn visit_string<E>(self, v: String) -> Result<Value, E> {
            Ok(Value::String(v))
        }
        fn visit_unit<E>(self) -> Result<Value, E> {
            Ok(Value::Null)
        }
        fn visit_none<E>(self) -> Result<Value, E> {
            Ok(Value::Null)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
            let mut items = Vec::new();
            while let Some(Strict(v)) = seq.next_element()? {
                items.push(v);
            }
            Ok(Value::Array(items))
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
            let mut object = serde_json::Map::new();
            while let Some(key) = map.next_key::<String>()? {
                if object.contains_key(&key) {
                    return Err(A::Error::custom(format!("duplicate key `{key}`")));
                }
                let Strict(v) = map.next_value()?;
                object.insert(key, v);
            }
            Ok(Value::Object(object))
        }
    }
    serde_json::from_slice::<Strict>(body)
        .map(|s| s.0)
        .map_err(|e| {
            let text = e.to_string();
            match text
                .strip_prefix("duplicate key `")
                .and_then(|r| r.split_once('`'))
            {
                Some((key, _)) => bad(key, format!("given twice: {text}")),
                None => bad("body", format!("not JSON: {text}")),
            }
        })
}

fn bad(field: impl Into<String>, message: impl Into<String>) -> OverrideError {
    OverrideError {
        field: field.into(),
        message: message.into(),
    }
}

/// The fields a limit of an override may set: a config limit's, less `unlimited` and
/// `replaces`, which mean nothing for one descriptor.
const LIMIT_FIELDS: [&str; 9] = [
    "unit",
    "requests_per_unit",
    "name",
    "algorithm",
    "burst",
    "unit_multiplier",
    "accounting",
    "calendar",
    "top_values",
];

/// Reads a `PUT /v1/overrides` body: every field checked, the limits compiled as a config
/// limit's are. Nothing is kept on an error.
pub(crate) fn parse_request(
    body: &[u8],
    options: CompileOptions,
) -> Result<OverrideRequest, OverrideError> {
    if body.len() > MAX_OVERRIDE_BYTES {
        return Err(bad(
            "body",
            format!(
                "{} bytes; an override is at most {MAX_OVERRIDE_BYTES}",
                body.len()
            ),
        ));
    }
    let value = strict_json(body)?;
    let Value::Object(mut map) = value else {
        return Err(bad("body", "must be a JSON object"));
    };
    const FIELDS: [&str; 5] = ["domain", "entries", "limits", "ttl", "reason"];
    if let Some(unknown) = map.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(bad(
            unknown.clone(),
            format!("unknown field; expected one of {}", FIELDS.join(", ")),
        ));
    }
    let domain = match map.remove("domain") {
        Some(Value::String(d)) if !d.is_empty() => d,
        Some(Value::String(_)) | None => return Err(bad("domain", "required")),
        Some(_) => return Err(bad("domain", "must be a string")),
    };
    let entries = match map.remove("entries") {
        Some(Value::Array(items)) if !items.is_empty() => items,
        Some(Value::Array(_)) | None => {
            return Err(bad("entries", "required: at least one {key, value}"));
        }
        Some(_) => return Err(bad("entries", "must be a list of {key, value}")),
    };
    if entries.len() > MAX_ENTRIES {
        return Err(bad("entries", format!("at most {MAX_ENTRIES}")));
    }
    let entries = entries
        .into_iter()
        .enumerate()
        .map(|(i, e)| entry(i, e))
        .collect::<Result<Vec<_>, _>>()?;
    let limits = match map.remove("limits") {
        Some(Value::Array(items)) if !items.is_empty() => items,
        Some(Value::Array(_)) | None => {
            return Err(bad("limits", "required: at least one limit"));
        }
        Some(_) => return Err(bad("limits", "must be a list of limits")),
    };
    if limits.len() > MAX_LIMITS {
        return Err(bad("limits", format!("at most {MAX_LIMITS}")));
    }
    compile_limits(&domain, &limits, options)?;
    let ttl = match map.remove("ttl") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(parse_ttl(&s).ok_or_else(|| {
            bad(
                "ttl",
                format!("'{s}' is no duration (a whole number and s, m, h or d, e.g. 24h)"),
            )
        })?),
        Some(_) => return Err(bad("ttl", "must be a duration such as \"24h\"")),
    };
    let reason = match map.remove("reason") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) if s.len() <= 1024 => s,
        Some(Value::String(_)) => return Err(bad("reason", "at most 1,024 bytes")),
        Some(_) => return Err(bad("reason", "must be a string")),
    };
    Ok(OverrideRequest {
        domain,
        entries,
        limits,
        ttl,
        reason,
    })
}

fn entry(i: usize, e: Value) -> Result<OverrideEntry, OverrideError> {
    let field = format!("entries[{i}]");
    let Value::Object(mut m) = e else {
        return Err(bad(field, "must be {\"key\": ..., \"value\": ...}"));
    };
    if let Some(unknown) = m.keys().find(|k| *k != "key" && *k != "value") {
        return Err(bad(
            format!("{field}.{unknown}"),
            "unknown field; expected key or value",
        ));
    }
    let mut text = |name: &str| match m.remove(name) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s),
        Some(Value::String(_)) | None => Err(bad(format!("{field}.{name}"), "required")),
        Some(_) => Err(bad(format!("{field}.{name}"), "must be a string")),
    };
    Ok(OverrideEntry {
        key: text("key")?,
        value: text("value")?,
    })
}

/// `30s`, `15m`, `24h`, `7d`: a whole, positive number of a unit.
fn parse_ttl(s: &str) -> Option<std::time::Duration> {
    let (digits, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit())?);
    let n: u64 = digits.parse().ok().filter(|n| *n > 0)?;
    let seconds = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3_600,
        "d" => 86_400,
        _ => return None,
    };
    // At most ten years: an expiry in milliseconds stays far from overflowing.
    n.checked_mul(seconds)
        .filter(|s| *s <= 10 * 365 * 86_400)
        .map(std::time::Duration::from_secs)
}

/// A limit as given, as the config's raw limit (each field checked for its JSON type here,
/// for its meaning by the config's compiler).
fn raw_limit(i: usize, limit: &Value) -> Result<RawLimit, OverrideError> {
    let field = format!("limits[{i}]");
    let Value::Object(m) = limit else {
        return Err(bad(
            field,
            "must be an object with the fields of a config limit",
        ));
    };
    if let Some(unknown) = m.keys().find(|k| !LIMIT_FIELDS.contains(&k.as_str())) {
        return Err(bad(
            format!("{field}.{unknown}"),
            format!("unknown field; expected one of {}", LIMIT_FIELDS.join(", ")),
        ));
    }
    let text = |name: &str| -> Result<Option<String>, OverrideError> {
        match m.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(bad(format!("{field}.{name}"), "must be a string")),
        }
    };
    let number = |name: &str| -> Result<Option<u64>, OverrideError> {
        match m.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => n.as_u64().map(Some).ok_or_else(|| {
                bad(
                    format!("{field}.{name}"),
                    format!("{n} is not a whole number of 0 or more"),
                )
            }),
            Some(_) => Err(bad(format!("{field}.{name}"), "must be a number")),
        }
    };
    let Some(requests_per_unit) = number("requests_per_unit")? else {
        return Err(bad(format!("{field}.requests_per_unit"), "required"));
    };
    Ok(RawLimit {
        unit: text("unit")?.map(unlocated),
        requests_per_unit: Some(unlocated(requests_per_unit)),
        name: text("name")?.map(unlocated),
        algorithm: text("algorithm")?.map(unlocated),
        burst: number("burst")?.map(unlocated),
        unit_multiplier: number("unit_multiplier")?.map(unlocated),
        accounting: text("accounting")?.map(unlocated),
        calendar: text("calendar")?.map(unlocated),
        top_values: text("top_values")?.map(unlocated),
        ..RawLimit::default()
    })
}

/// The limits of an override, compiled as a `rate_limits` list of the config is (each
/// limit's counter ordinal among the limits alike), or the first error, its field named as
/// the request names it.
pub(crate) fn compile_limits(
    domain: &str,
    limits: &[Value],
    options: CompileOptions,
) -> Result<Arc<[LimitRule]>, OverrideError> {
    let raw = limits
        .iter()
        .enumerate()
        .map(|(i, l)| raw_limit(i, l).map(unlocated))
        .collect::<Result<Vec<_>, _>>()?;
    // Compiled as on a node that keeps holds, so that a concurrency limit may be given: it
    // applies where the descriptor's node has a `hold_key` (its places), and nowhere else.
    let descriptor = RawDescriptor {
        key: Some(unlocated("override".to_owned())),
        rate_limits: Some(unlocated(raw)),
        hold_key: Some(unlocated("hold".to_owned())),
        ..RawDescriptor::default()
    };
    let compiled = compile_parsed(
        Path::new("override"),
        domain.to_owned(),
        vec![descriptor],
        options,
    )
    .map_err(|e| {
        let field = e
            .field
            .strip_prefix("descriptors[0].rate_limits")
            .map_or_else(|| e.field.clone(), |rest| format!("limits{rest}"));
        bad(field, e.message)
    })?;
    let node = compiled
        .root
        .keys
        .get("override")
        .and_then(|k| k.any.as_deref())
        .ok_or_else(|| bad("limits", "compiled to no rule"))?;
    match &node.limits {
        Some(NodeLimits::Limits(rules)) => Ok(rules.clone().into()),
        _ => Err(bad("limits", "compiled to no limit")),
    }
}

/// A descriptor's entries as an override holds them: each key and value, bytes.
type HeldEntries = Box<[(Box<[u8]>, Box<[u8]>)]>;

/// One override in force, as the request path finds it.
#[derive(Debug)]
pub(crate) struct InForce {
    /// Its id (for logs and `/json`).
    pub(crate) id: Arc<str>,
    /// Its limits, in place of the rule's.
    pub(crate) limits: Arc<[LimitRule]>,
    domain: Box<str>,
    entries: HeldEntries,
    hash: u64,
}

impl InForce {
    /// `r` as the set holds it: its limits compiled (an error when they no longer compile,
    /// after an upgrade that refuses what it took), its entries hashed.
    pub(crate) fn compile(
        r: &OverrideRecord,
        options: CompileOptions,
    ) -> Result<Arc<InForce>, OverrideError> {
        let limits = compile_limits(&r.domain, &r.limits, options)?;
        let entries: HeldEntries = r
            .entries
            .iter()
            .map(|e| {
                (
                    e.key.as_bytes().to_vec().into_boxed_slice(),
                    e.value.as_bytes().to_vec().into_boxed_slice(),
                )
            })
            .collect();
        let hash = hash_entries(entries.iter().map(|(k, v)| (&**k, &**v)));
        Ok(Arc::new(InForce {
            id: r.id.as_str().into(),
            limits,
            domain: r.domain.as_str().into(),
            entries,
            hash,
        }))
    }
}

/// Tables per domain: a change copies one (about 1/64 of the domain's overrides) while the
/// request path still reads the set before it, never the whole set.
const BUCKETS: usize = 64;

/// The table of `hash` among a domain's: bits the tables do not index by (they take the low
/// bits for the bucket and the top seven for the tag).
fn bucket_of(hash: u64) -> usize {
    (hash >> 32) as usize % BUCKETS
}

/// One domain's overrides, by their exact entries.
#[derive(Clone, Debug)]
struct DomainOverrides {
    tables: Box<[Arc<HashTable<Arc<InForce>>>]>,
    len: usize,
}

impl Default for DomainOverrides {
    fn default() -> Self {
        DomainOverrides {
            tables: (0..BUCKETS).map(|_| Arc::default()).collect(),
            len: 0,
        }
    }
}

/// The overrides in force: looked up by every descriptor of a domain that has one, by a hash
/// of its entries (one pass over the bytes, no allocation). A clone is cheap (an `Arc` per
/// domain), and [`OverrideSet::insert`] and [`OverrideSet::remove`] copy only what they
/// change, so a set is changed one override at a time while the request path reads the last.
#[derive(Clone, Debug, Default)]
pub(crate) struct OverrideSet {
    domains: HashMap<Box<str>, Arc<DomainOverrides>>,
    len: usize,
}

/// The hasher of every set's entries: keyed at random once per process (clients choose the
/// values a descriptor is looked up by).
fn hasher() -> &'static RandomState {
    static HASHER: std::sync::OnceLock<RandomState> = std::sync::OnceLock::new();
    HASHER.get_or_init(RandomState::new)
}

impl OverrideSet {
    /// The set of `records` that have not ended at `now_ms` and whose limits compile (one
    /// that no longer does is left out and logged); of two with the same entries, the later.
    #[cfg(test)]
    pub(crate) fn build<'a>(
        records: impl IntoIterator<Item = &'a OverrideRecord>,
        now_ms: u64,
        options: CompileOptions,
    ) -> OverrideSet {
        let mut set = OverrideSet::default();
        for r in records.into_iter().filter(|r| !r.expired(now_ms)) {
            match InForce::compile(r, options) {
                Ok(o) => {
                    set.insert(o);
                }
                Err(e) => {
                    tracing::warn!(id = %r.id, domain = %r.domain, error = %e, "override not applied: its limits do not compile")
                }
            }
        }
        set
    }

    /// Puts `o` in force, in place of the one with its entries (returned), if any.
    pub(crate) fn insert(&mut self, o: Arc<InForce>) -> Option<Arc<InForce>> {
        let domain = Arc::make_mut(self.domains.entry(o.domain.clone()).or_default());
        let table = Arc::make_mut(&mut domain.tables[bucket_of(o.hash)]);
        match table.find_entry(o.hash, |a| a.entries == o.entries) {
            Ok(mut found) => Some(std::mem::replace(found.get_mut(), o)),
            Err(_) => {
                table.insert_unique(o.hash, o, |a| a.hash);
                domain.len += 1;
                self.len += 1;
                None
            }
        }
    }

    /// Takes `o` out of force, if it is the one in force for its entries (the same id);
    /// whether it was.
    pub(crate) fn remove(&mut self, o: &InForce) -> bool {
        let Some(domain) = self.domains.get_mut(&o.domain) else {
            return false;
        };
        let found = domain.tables[bucket_of(o.hash)]
            .find(o.hash, |a| a.entries == o.entries)
            .is_some_and(|a| a.id == o.id);
        if !found {
            return false;
        }
        let d = Arc::make_mut(domain);
        let table = Arc::make_mut(&mut d.tables[bucket_of(o.hash)]);
        if let Ok(entry) = table.find_entry(o.hash, |a| a.entries == o.entries) {
            entry.remove();
        }
        d.len -= 1;
        self.len -= 1;
        if d.len == 0 {
            self.domains.remove(&o.domain);
        }
        true
    }

    /// How many are in force.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether none is.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `domain` has any: the request path looks no further for a domain without.
    pub(crate) fn domain(&self, domain: &str) -> Option<DomainLookup<'_>> {
        self.domains
            .get(domain)
            .map(|d| DomainLookup { overrides: d })
    }
}

/// A domain's overrides, to look descriptors up in.
#[derive(Clone, Copy)]
pub(crate) struct DomainLookup<'a> {
    overrides: &'a DomainOverrides,
}

impl<'a> DomainLookup<'a> {
    /// The override of exactly `entries`, if one is in force.
    pub(crate) fn get<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        &self,
        entries: &[(K, V)],
    ) -> Option<&'a InForce> {
        let hash = hash_entries(entries.iter().map(|(k, v)| (k.as_ref(), v.as_ref())));
        self.overrides.tables[bucket_of(hash)]
            .find(hash, |a| {
                a.entries.len() == entries.len()
                    && a.entries
                        .iter()
                        .zip(entries)
                        .all(|((k, v), (rk, rv))| **k == *rk.as_ref() && **v == *rv.as_ref())
            })
            .map(|a| &**a)
    }
}

/// A hash of entries, each key and value with its length (so no two lists hash as one by
/// moving bytes between fields).
fn hash_entries<'e>(entries: impl Iterator<Item = (&'e [u8], &'e [u8])>) -> u64 {
    let mut h = hasher().build_hasher();
    for (k, v) in entries {
        h.write_usize(k.len());
        h.write(k);
        h.write_usize(v.len());
        h.write(v);
    }
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(body: &str) -> Result<OverrideRequest, OverrideError> {
        parse_request(body.as_bytes(), CompileOptions::default())
    }

    #[test]
    fn a_well_formed_override_is_read() {
        let r = req(
            r#"{"domain": "d", "entries": [{"key": "tenant", "value": "acme"}],
            "limits": [{"requests_per_unit": 5000, "unit": "hour"}], "ttl": "24h",
            "reason": "plan upgrade"}"#,
        )
        .unwrap();
        assert_eq!(r.domain, "d");
        assert_eq!(r.ttl, Some(std::time::Duration::from_secs(86_400)));
        let limits = compile_limits(&r.domain, &r.limits, CompileOptions::default()).unwrap();
        assert_eq!(limits[0].requests_per_unit, 5000);
    }

    #[test]
    fn each_malformed_field_is_named() {
        let cases = [
            (
                r#"{"entries": [{"key": "k", "value": "v"}], "limits": [{"requests_per_unit": 1, "unit": "hour"}]}"#,
                "domain",
            ),
            (
                r#"{"domain": "d", "entries": [{"key": "k", "value": "v"}], "limits": [{"requests_per_unit": 1, "unit": "fortnight"}]}"#,
                "limits[0].unit",
            ),
            (
                r#"{"domain": "d", "entries": [{"key": "k", "value": "v"}], "limits": [{"requests_per_unit": -5, "unit": "hour"}]}"#,
                "limits[0].requests_per_unit",
            ),
            (
                r#"{"domain": "d", "entries": [{"key": "k", "value": "v"}], "limits": [{"requests_per_unit": 1, "unit": "hour", "colour": 1}]}"#,
                "limits[0].colour",
            ),
            (
                r#"{"domain": "d", "entries": [{"key": "k"}], "limits": [{"requests_per_unit": 1, "unit": "hour"}]}"#,
                "entries[0].value",
            ),
            (
                r#"{"domain": "d", "entries": [{"key": "k", "value": "v"}], "limits": [{"requests_per_unit": 1, "unit": "hour"}], "ttl": "soon"}"#,
                "ttl",
            ),
            (
                r#"{"domain": "d", "entries": [{"key": "k", "value": "v"}], "limits": []}"#,
                "limits",
            ),
            (r#"[1]"#, "body"),
        ];
        for (body, field) in cases {
            let e = req(body).expect_err(body);
            assert_eq!(e.field, field, "{body}: {e}");
        }
        let big = format!(r#"{{"domain": "{}"}}"#, "x".repeat(MAX_OVERRIDE_BYTES));
        assert_eq!(req(&big).unwrap_err().field, "body");
    }

    /// An override of domain `d` for `tenant=value`: 3 an hour.
    fn record(id: &str, value: &str, expires_at_ms: Option<u64>) -> OverrideRecord {
        OverrideRecord {
            id: id.into(),
            domain: "d".into(),
            entries: vec![OverrideEntry {
                key: "tenant".into(),
                value: value.into(),
            }],
            limits: vec![serde_json::json!({"requests_per_unit": 3, "unit": "hour"})],
            expires_at_ms,
            reason: String::new(),
            created_by: "ops".into(),
            created_at_ms: 0,
        }
    }

    #[test]
    fn a_change_leaves_the_set_read_before_it_as_it_was() {
        fn compiled(id: &str, value: &str) -> Arc<InForce> {
            InForce::compile(&record(id, value, None), CompileOptions::default()).unwrap()
        }
        let found = |set: &OverrideSet, value: &str| {
            set.domain("d")
                .and_then(|d| d.get(&[(b"tenant".as_slice(), value.as_bytes())]))
                .map(|o| o.id.to_string())
        };
        let mut set = OverrideSet::default();
        for i in 0..500 {
            assert!(
                set.insert(compiled(&format!("id-{i}"), &format!("t-{i}")))
                    .is_none()
            );
        }
        let read = set.clone();
        // In place of the one of its entries; the one read before keeps the old.
        let old = set.insert(compiled("new-7", "t-7")).unwrap();
        assert_eq!(&*old.id, "id-7");
        assert_eq!(found(&set, "t-7").as_deref(), Some("new-7"));
        assert_eq!(found(&read, "t-7").as_deref(), Some("id-7"));
        // Only the one in force for its entries is removed: not an older id of them.
        assert!(!set.remove(&old));
        assert!(set.remove(&compiled("id-8", "t-8")));
        assert_eq!((set.len(), read.len()), (499, 500));
        assert_eq!(found(&set, "t-8"), None);
        assert_eq!(found(&read, "t-8").as_deref(), Some("id-8"));
        for i in 0..500 {
            let id = if i == 7 {
                "new-7".to_owned()
            } else {
                format!("id-{i}")
            };
            set.remove(&compiled(&id, &format!("t-{i}")));
        }
        assert!(set.is_empty() && set.domain("d").is_none());
        assert_eq!(read.len(), 500);
    }

    #[test]
    fn the_set_finds_exact_entries_only_and_leaves_ended_ones_out() {
        let records = [record("a", "acme", None), record("b", "old", Some(1_000))];
        let set = OverrideSet::build(&records, 2_000, CompileOptions::default());
        assert_eq!(set.len(), 1);
        let d = set.domain("d").unwrap();
        let found = d
            .get(&[(b"tenant".as_slice(), b"acme".as_slice())])
            .unwrap();
        assert_eq!(&*found.id, "a");
        assert!(
            d.get(&[(b"tenant".as_slice(), b"old".as_slice())])
                .is_none()
        );
        assert!(
            d.get(&[(b"tenant".as_slice(), b"acm".as_slice())])
                .is_none()
        );
        assert!(
            d.get(&[
                (b"tenant".as_slice(), b"acme".as_slice()),
                (b"x".as_slice(), b"y".as_slice())
            ])
            .is_none()
        );
        assert!(set.domain("other").is_none());
    }
}
