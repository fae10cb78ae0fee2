//! From YAML text to a validated [`Domain`]: every rule envoyproxy/ratelimit enforces, plus
//! checks for our extensions. Each error names the file, line and field.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_saphyr::{Location, Spanned};

use super::answer::{self, Answer, RawAnswer};
use super::schema::{RawDescriptor, RawLimit, RawReplace};
use super::{
    ConfigError, Counted, Domain, Extra, Index, KeyNodes, Level, LimitRule, Node, NodeLimits, Unit,
    Wildcard, is_wildcard,
};
use crate::limiter::hold::MAX_HOLDS;
use crate::limiter::key::{LimitIdentity, escaped_if_needed};
use crate::limiter::{Accounting, Algorithm, Calendar, Zone, calendar};
use crate::top::Values;

/// `rate_limits`: the list, and each limit, where the file has them.
type RawLimitList = Spanned<Vec<Spanned<RawLimit>>>;

/// Sets `slot` to `value` (placed at `at`) unless the config set it already.
fn fill<T>(slot: &mut Option<Spanned<T>>, value: Option<T>, at: Location) {
    if slot.is_none() {
        *slot = value.map(|v| Spanned::new(v, at, at));
    }
}

/// The key under a descriptor's `metadata` that sets our limit extensions (`algorithm`,
/// `burst`, `unit_multiplier`, `accounting`, `calendar`) where a control plane can set metadata
/// but not those fields.
pub(crate) const METADATA_KEY: &str = "ratelimitd";

/// What a descriptor's `metadata.ratelimitd` sets for its limits, as written.
struct MetadataExtensions {
    algorithm: Option<String>,
    burst: Option<u64>,
    unit_multiplier: Option<u64>,
    accounting: Option<String>,
    calendar: Option<String>,
    top_values: Option<String>,
    /// The descriptor's `hold_key` (a node's, not its limits').
    hold_key: Option<String>,
}

impl MetadataExtensions {
    /// Whether it sets a field of the descriptor's limits.
    fn sets_a_limit(&self) -> bool {
        self.algorithm.is_some()
            || self.burst.is_some()
            || self.unit_multiplier.is_some()
            || self.accounting.is_some()
            || self.calendar.is_some()
            || self.top_values.is_some()
    }
}

/// Largest `unit_multiplier`: keeps every window (up to 10 000 years) within u64 microseconds.
pub(super) const MAX_UNIT_MULTIPLIER: u64 = 10_000;

/// The parser's budget for `text`: nodes and events grow with the file (an honest config has a
/// node for every few bytes, so a 100,000-descriptor file of tens of MB loads), while what
/// aliases can add without bytes of their own stays within that same allowance: parsing work is
/// linear in the file's size, however its anchors are nested.
fn budget(text: &str) -> serde_saphyr::Budget {
    let mut b = serde_saphyr::Budget::default();
    // At most one node per 2 bytes and one event per byte, never less than the defaults.
    b.max_nodes = b.max_nodes.max(text.len() / 2);
    b.max_events = b.max_events.max(text.len());
    b.max_recorded_anchor_events = b.max_recorded_anchor_events.min(b.max_events);
    b
}

/// What compiling a config takes from the service's settings.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct CompileOptions {
    /// The algorithm of every limit that names none (`--default-algorithm`).
    pub(crate) default_algorithm: Algorithm,
    /// Several files (or xDS configs) may carry one domain: their descriptors are merged, as
    /// envoyproxy/ratelimit's `MERGE_DOMAIN_CONFIG` merges them (`--merge-domain-config`).
    pub(crate) merge_domains: bool,
    /// The calendar of every limit that names none and can take one (`--calendar-timezone`):
    /// fixed_window, an hour or longer, a multiplier that tiles the next unit. Others are left
    /// as they are (logged once), so the flag never makes a config invalid.
    pub(crate) calendar: Option<&'static Zone>,
}

/// Logs `message` the first time `flag` is raised, and never again in this process.
fn log_once(flag: &std::sync::atomic::AtomicBool, message: impl FnOnce() -> String) {
    if !flag.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!("{}", message());
    }
}

/// Parses and validates one config file, with the default compile options.
pub fn compile_file(file: &Path, text: &str) -> Result<Domain, ConfigError> {
    compile_file_with(file, text, CompileOptions::default())
}

/// Parses and validates one config file.
///
/// The file's top-level descriptors are compiled one by one as the parser reaches them, so the
/// parsed form of only one of them (with what is nested under it) is held at a time: a
/// 100,000-descriptor file costs its compiled rules, not also a copy of itself as parsed YAML.
pub(crate) fn compile_file_with(
    file: &Path,
    text: &str,
    compile: CompileOptions,
) -> Result<Domain, ConfigError> {
    let mut options = serde_saphyr::Options::default();
    options.budget = Some(budget(text));
    let c = Compiler {
        file,
        options: compile,
    };
    // A descriptor's own error, kept here while the parser is told to stop.
    let mut invalid = None;
    let parsed = serde_saphyr::with_deserializer_from_str_with_options(text, options, |de| {
        FileSeed {
            c: &c,
            invalid: &mut invalid,
        }
        .deserialize(de)
    });
    let (domain, root) = match parsed {
        Ok(parsed) => parsed,
        Err(e) => return Err(invalid.unwrap_or_else(|| ConfigError::from_yaml(file, &e))),
    };
    let (name, line) = match domain {
        Some(d) if !d.value.is_empty() => (d.value, d.referenced.line()),
        other => {
            return Err(c.err(
                other.as_ref().map(|d| &d.referenced),
                "domain",
                "config file cannot have an empty domain",
            ));
        }
    };
    Ok(Domain::new(name, root, line))
}

/// Validates one domain that arrives already parsed (a `RateLimitConfig` over xDS), by the
/// same rules as a file: errors name `source` and the field, without a line.
pub(crate) fn compile_parsed(
    source: &Path,
    domain: String,
    descriptors: Vec<RawDescriptor>,
    options: CompileOptions,
) -> Result<Domain, ConfigError> {
    let c = Compiler {
        file: source,
        options,
    };
    if domain.is_empty() {
        return Err(c.err(None, "domain", "a config cannot have an empty domain"));
    }
    let descriptors = descriptors.into_iter().map(unlocated).collect();
    let root = c.level(descriptors, "descriptors", "", None)?;
    Ok(Domain::new(domain, root, 0))
}

/// `value` without a place in a text: what a parsed source gives (its errors have no line).
pub(crate) fn unlocated<T>(value: T) -> Spanned<T> {
    Spanned::new(value, Location::UNKNOWN, Location::UNKNOWN)
}

/// The fields of a config file (any other is refused, naming these), and the keys
/// envoyproxy/ratelimit accepts at any level, ignored here with a warning (Envoy Gateway's
/// rendered configs carry a top-level `name`).
#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum FileField {
    Domain,
    Descriptors,
    Key,
    Value,
    RateLimit,
    Unit,
    RequestsPerUnit,
    Unlimited,
    ShadowMode,
    QuotaMode,
    Name,
    Replaces,
    DetailedMetric,
    ValueToMetric,
    ShareThreshold,
    Metadata,
}

impl FileField {
    /// The key as written.
    fn name(&self) -> &'static str {
        match self {
            FileField::Domain => "domain",
            FileField::Descriptors => "descriptors",
            FileField::Key => "key",
            FileField::Value => "value",
            FileField::RateLimit => "rate_limit",
            FileField::Unit => "unit",
            FileField::RequestsPerUnit => "requests_per_unit",
            FileField::Unlimited => "unlimited",
            FileField::ShadowMode => "shadow_mode",
            FileField::QuotaMode => "quota_mode",
            FileField::Name => "name",
            FileField::Replaces => "replaces",
            FileField::DetailedMetric => "detailed_metric",
            FileField::ValueToMetric => "value_to_metric",
            FileField::ShareThreshold => "share_threshold",
            FileField::Metadata => "metadata",
        }
    }
}

/// Deserializes a config file, compiling its top-level descriptors as they arrive.
struct FileSeed<'c, 'p> {
    c: &'c Compiler<'p>,
    invalid: &'c mut Option<ConfigError>,
}

impl<'de> DeserializeSeed<'de> for FileSeed<'_, '_> {
    type Value = (Option<Spanned<String>>, Level);

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Self::Value, D::Error> {
        de.deserialize_struct("RawFile", &["domain", "descriptors"], self)
    }
}

impl<'de> Visitor<'de> for FileSeed<'_, '_> {
    type Value = (Option<Spanned<String>>, Level);

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a mapping with `domain` and `descriptors`")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let (mut domain, mut root) = (None, None);
        while let Some(field) = map.next_key::<FileField>()? {
            match field {
                FileField::Domain if domain.is_some() => {
                    return Err(de::Error::duplicate_field("domain"));
                }
                FileField::Domain => domain = Some(map.next_value::<Option<Spanned<String>>>()?),
                FileField::Descriptors if root.is_some() => {
                    return Err(de::Error::duplicate_field("descriptors"));
                }
                FileField::Descriptors => {
                    root = Some(map.next_value_seed(TopLevel {
                        c: self.c,
                        invalid: &mut *self.invalid,
                    })?);
                }
                misplaced => {
                    let at = map.next_value::<Spanned<de::IgnoredAny>>()?.referenced;
                    self.c.ignored(&at, misplaced.name());
                }
            }
        }
        Ok((domain.flatten(), root.unwrap_or_default()))
    }
}

/// Deserializes the top-level `descriptors` (a list, or null), compiling each as it arrives.
struct TopLevel<'c, 'p> {
    c: &'c Compiler<'p>,
    invalid: &'c mut Option<ConfigError>,
}

impl<'de> DeserializeSeed<'de> for TopLevel<'_, '_> {
    type Value = Level;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Level, D::Error> {
        de.deserialize_option(self)
    }
}

impl<'de> Visitor<'de> for TopLevel<'_, '_> {
    type Value = Level;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of descriptors")
    }

    fn visit_none<E: de::Error>(self) -> Result<Level, E> {
        Ok(Level::default())
    }

    fn visit_unit<E: de::Error>(self) -> Result<Level, E> {
        Ok(Level::default())
    }

    fn visit_some<D: Deserializer<'de>>(self, de: D) -> Result<Level, D::Error> {
        de.deserialize_seq(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Level, A::Error> {
        let mut level = LevelBuilder::default();
        while let Some(raw) = seq.next_element::<Spanned<RawDescriptor>>()? {
            if let Err(e) = self.c.add(&mut level, raw, "descriptors", "", None) {
                *self.invalid = Some(e);
                return Err(de::Error::custom("invalid descriptor"));
            }
        }
        Ok(level.build())
    }
}

/// A level being compiled: its nodes by key and value, and where each was first defined.
#[derive(Default)]
struct LevelBuilder {
    keys: HashMap<Box<str>, KeyNodesBuilder>,
    /// (key, value) → line of first definition, to name both places on a duplicate.
    seen: HashMap<(Box<str>, Option<Box<str>>), u64>,
    count: usize,
}

#[derive(Default)]
struct KeyNodesBuilder {
    /// How many distinct keys the level had before this one: file order.
    first: u32,
    exact: HashMap<Box<str>, Node>,
    wildcards: Vec<(Wildcard, Node)>,
    any: Option<Box<Node>>,
}

impl LevelBuilder {
    fn build(self) -> Level {
        let keys = self
            .keys
            .into_iter()
            .map(|(key, nodes)| {
                let mut wildcards = nodes.wildcards;
                wildcards.shrink_to_fit();
                let nodes = KeyNodes {
                    first: nodes.first,
                    exact: Index::new(nodes.exact),
                    wildcards,
                    any: nodes.any,
                };
                (key, nodes)
            })
            .collect();
        Level {
            keys: Index::new(keys),
        }
    }
}

struct Compiler<'a> {
    file: &'a Path,
    options: CompileOptions,
}

fn loc(l: &Location) -> Option<(u64, u64)> {
    (l.line() > 0).then(|| (l.line(), l.column()))
}

impl Compiler<'_> {
    fn err(&self, at: Option<&Location>, field: &str, message: impl Into<String>) -> ConfigError {
        ConfigError::at(self.file, at.and_then(loc), field, message)
    }

    /// Compiles the `answer` of `field` (a descriptor or a limit).
    fn answer(&self, raw: Spanned<RawAnswer>, field: &str) -> Result<Answer, ConfigError> {
        let at = raw.referenced;
        answer::compile(raw.value).map_err(|e| {
            let here = if e.line > 0 {
                Some((e.line, e.column))
            } else {
                loc(&at)
            };
            ConfigError::at(
                self.file,
                here,
                format!("{field}.answer.{}", e.field),
                e.message,
            )
        })
    }

    /// The extensions a descriptor's `metadata.ratelimitd` sets for its limits (for control
    /// planes that can set metadata but have no field for them): algorithm, burst,
    /// unit_multiplier and accounting, each checked as if written in the limit, which wins when
    /// it sets one.
    fn metadata_extensions(
        &self,
        extensions: &serde_json::Value,
        at: Location,
        field: &str,
    ) -> Result<MetadataExtensions, ConfigError> {
        let Some(map) = extensions.as_object() else {
            return Err(self.err(Some(&at), field, "must be a mapping"));
        };
        let number = |name: &str| -> Result<Option<u64>, ConfigError> {
            match map.get(name) {
                None => Ok(None),
                // Over xDS a Struct's numbers are floats: a whole one is fine.
                Some(v) => v
                    .as_u64()
                    .or_else(|| {
                        v.as_f64()
                            .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f < 1e15)
                            .map(|f| f as u64)
                    })
                    .map(Some)
                    .ok_or_else(|| {
                        self.err(
                            Some(&at),
                            &format!("{field}.{name}"),
                            "must be a whole number",
                        )
                    }),
            }
        };
        let text = |name: &str| -> Result<Option<String>, ConfigError> {
            match map.get(name) {
                None => Ok(None),
                Some(serde_json::Value::String(a)) => Ok(Some(a.clone())),
                Some(_) => Err(self.err(Some(&at), &format!("{field}.{name}"), "must be a string")),
            }
        };
        if let Some(other) = map.keys().find(|k| {
            ![
                "algorithm",
                "burst",
                "unit_multiplier",
                "accounting",
                "calendar",
                "top_values",
                "hold_key",
            ]
            .contains(&k.as_str())
        }) {
            return Err(self.err(
                Some(&at),
                &format!("{field}.{other}"),
                "unknown key (expected algorithm, burst, unit_multiplier, accounting, calendar, top_values or hold_key)",
            ));
        }
        let calendar = text("calendar")?;
        if let Some(zone) = &calendar
            && calendar::zone(zone).is_none()
        {
            return Err(self.err(
                Some(&at),
                &format!("{field}.calendar"),
                calendar::unknown_zone(zone),
            ));
        }
        Ok(MetadataExtensions {
            algorithm: text("algorithm")?,
            burst: number("burst")?,
            unit_multiplier: number("unit_multiplier")?,
            accounting: text("accounting")?,
            calendar,
            top_values: text("top_values")?,
            hold_key: text("hold_key")?,
        })
    }

    /// Warns of `field` at `at`: a key envoyproxy/ratelimit accepts there and ignores.
    fn ignored(&self, at: &Location, field: &str) {
        let shown = ConfigError::at(
            self.file,
            loc(at),
            field,
            "ignored: this key means nothing here (envoyproxy/ratelimit ignores it too)",
        );
        tracing::warn!("{shown}");
    }

    fn level(
        &self,
        descriptors: Vec<Spanned<RawDescriptor>>,
        field: &str,
        parent_path: &str,
        answer: Option<&Arc<Answer>>,
    ) -> Result<Level, ConfigError> {
        let mut level = LevelBuilder::default();
        for raw in descriptors {
            self.add(&mut level, raw, field, parent_path, answer)?;
        }
        Ok(level.build())
    }

    /// Compiles `raw`, the next descriptor of the list `field`, into `level`; `answer` is the
    /// one it inherits.
    fn add(
        &self,
        level: &mut LevelBuilder,
        raw: Spanned<RawDescriptor>,
        field: &str,
        parent_path: &str,
        answer: Option<&Arc<Answer>>,
    ) -> Result<(), ConfigError> {
        let field = format!("{field}[{}]", level.count);
        level.count += 1;
        let at = raw.referenced;
        let (key, node) = self.node(raw.value, &field, at, parent_path, answer)?;
        match level.seen.entry((key.clone(), node.value.clone())) {
            Entry::Occupied(first) => {
                let shown = match &node.value {
                    Some(v) => format!("key '{key}' value '{v}'"),
                    None => format!("key '{key}'"),
                };
                return Err(self.err(
                    Some(&at),
                    &field,
                    format!(
                        "duplicate descriptor {shown} (first defined at line {})",
                        first.get()
                    ),
                ));
            }
            Entry::Vacant(slot) => {
                slot.insert(at.line());
            }
        }
        let distinct = level.keys.len() as u32;
        let nodes = level.keys.entry(key).or_insert_with(|| KeyNodesBuilder {
            first: distinct,
            ..KeyNodesBuilder::default()
        });
        match node.value.clone() {
            None => nodes.any = Some(Box::new(node)),
            Some(v) => match Wildcard::new(&v) {
                Some(pattern) => nodes.wildcards.push((pattern, node)),
                None => {
                    nodes.exact.insert(v, node);
                }
            },
        }
        Ok(())
    }

    fn node(
        &self,
        raw: RawDescriptor,
        field: &str,
        at: Location,
        parent_path: &str,
        inherited: Option<&Arc<Answer>>,
    ) -> Result<(Box<str>, Node), ConfigError> {
        for (name, at) in raw.misplaced() {
            self.ignored(&at, &format!("{field}.{name}"));
        }
        let key = match raw.key {
            Some(k) if !k.value.is_empty() => k.value,
            other => {
                let at = other.as_ref().map_or(at, |k| k.referenced);
                return Err(self.err(
                    Some(&at),
                    &format!("{field}.key"),
                    "descriptor has an empty key",
                ));
            }
        };
        // `value: ""` is no value, as envoyproxy/ratelimit reads it: the value-less key.
        let value = raw.value.map(|v| v.value).filter(|v| !v.is_empty());
        let segment = match &value {
            Some(v) => format!("{key}_{v}"),
            None => key.clone(),
        };
        let path = if parent_path.is_empty() {
            segment
        } else {
            format!("{parent_path}.{segment}")
        };

        let share_threshold = raw.share_threshold.unwrap_or(false);
        if share_threshold && !is_wildcard(value.as_deref()) {
            return Err(self.err(
                Some(&at),
                &format!("{field}.share_threshold"),
                "share_threshold needs a wildcard value (one containing '*')",
            ));
        }
        if let Some(m) = &raw.metadata
            && !m.is_object()
        {
            return Err(self.err(
                Some(&at),
                &format!("{field}.metadata"),
                "metadata must be a mapping",
            ));
        }

        let (mut rate_limit, mut rate_limits) = (raw.rate_limit, raw.rate_limits);
        let mut hold_key = raw.hold_key;
        if let Some(extensions) = raw.metadata.as_ref().and_then(|m| m.get(METADATA_KEY)) {
            let meta_field = format!("{field}.metadata.{METADATA_KEY}");
            let mut ext = self.metadata_extensions(extensions, at, &meta_field)?;
            let ext_hold_key = ext.hold_key.take();
            let only_a_hold_key = ext_hold_key.is_some() && !ext.sets_a_limit();
            fill(&mut hold_key, ext_hold_key, at);
            if !only_a_hold_key {
                self.extend_limits(ext, (&mut rate_limit, &mut rate_limits), &meta_field, at)?;
            }
        }
        let hold_key = self.hold_key(hold_key, field, at, &rate_limit, &rate_limits)?;
        let answer = match raw.answer {
            Some(a) => Some(Arc::new(self.answer(a, field)?)),
            None => inherited.cloned(),
        };
        let mut limits = self.limits(
            rate_limit,
            rate_limits,
            field,
            hold_key.is_some(),
            answer.as_ref(),
        )?;
        if let Some(soft) = &raw.soft
            && soft.value
        {
            match &mut limits {
                Some(NodeLimits::Limits(rules)) => rules.iter_mut().for_each(|r| r.soft = true),
                _ => {
                    return Err(self.err(
                        Some(&soft.referenced),
                        &format!("{field}.soft"),
                        "soft applies to a descriptor's limits, and this descriptor has none",
                    ));
                }
            }
        }
        let quota_mode = raw.quota_mode.unwrap_or(false);
        if let (true, Some(NodeLimits::Limits(rules))) = (quota_mode, &limits)
            && rules.iter().any(|r| r.soft)
        {
            return Err(self.err(
                Some(&at),
                &format!("{field}.quota_mode"),
                "a soft limit never refuses, and quota_mode refuses when all of a request's quota descriptors are over: choose one",
            ));
        }

        let children = self.level(
            raw.descriptors.unwrap_or_default(),
            &format!("{field}.descriptors"),
            &path,
            answer.as_ref(),
        )?;
        if let Some((k, k_at)) = &hold_key
            && children.key(k.as_bytes()).is_some()
        {
            return Err(self.err(
                Some(k_at),
                &format!("{field}.hold_key"),
                format!("'{k}' is also the key of a nested descriptor: the entry that names a hold is never matched as one"),
            ));
        }
        let counted = match value.as_deref() {
            Some(v) if share_threshold || !is_wildcard(Some(v)) => match escaped_if_needed(v) {
                None => Counted::Fixed,
                Some(e) => Counted::FixedEscaped(e),
            },
            _ => Counted::AsSent,
        };
        let node = Node {
            escaped_key: escaped_if_needed(&key),
            counted,
            value: value.map(String::into_boxed_str),
            limits,
            shadow_mode: raw.shadow_mode.unwrap_or(false),
            detailed_metric: raw.detailed_metric.unwrap_or(false),
            share_threshold,
            value_to_metric: raw.value_to_metric.unwrap_or(false),
            soft: quota_mode,
            extra: (raw.metadata.is_some() || hold_key.is_some()).then(|| {
                Box::new(Extra {
                    metadata: raw.metadata,
                    hold_key: hold_key.map(|(k, _)| k),
                })
            }),
            children,
            path: Arc::new(path),
            line: at.line(),
            counters: Default::default(),
        };
        Ok((key.into_boxed_str(), node))
    }

    /// Fills each limit's unset fields from the descriptor's `metadata.ratelimitd`
    /// (`extensions`, at `field`): the extensions for a control plane that sends only
    /// envoyproxy/ratelimit's fields.
    fn extend_limits(
        &self,
        ext: MetadataExtensions,
        (rate_limit, rate_limits): (&mut Option<Spanned<RawLimit>>, &mut Option<RawLimitList>),
        field: &str,
        at: Location,
    ) -> Result<(), ConfigError> {
        let limits: Vec<&mut RawLimit> = match (rate_limit, rate_limits) {
            (Some(one), _) => vec![&mut one.value],
            (None, Some(list)) => list.value.iter_mut().map(|l| &mut l.value).collect(),
            (None, None) => {
                return Err(self.err(
                    Some(&at),
                    field,
                    "applies to a rate_limit, and this descriptor has none",
                ));
            }
        };
        for limit in limits {
            fill(&mut limit.algorithm, ext.algorithm.clone(), at);
            fill(&mut limit.burst, ext.burst, at);
            fill(&mut limit.unit_multiplier, ext.unit_multiplier, at);
            fill(&mut limit.accounting, ext.accounting.clone(), at);
            fill(&mut limit.calendar, ext.calendar.clone(), at);
            fill(&mut limit.top_values, ext.top_values.clone(), at);
        }
        Ok(())
    }

    /// A descriptor's limits: its `rate_limit`, or its `rate_limits` (never both), each limit
    /// given its counter's ordinal among the limits alike.
    fn limits(
        &self,
        rate_limit: Option<Spanned<RawLimit>>,
        rate_limits: Option<RawLimitList>,
        field: &str,
        held: bool,
        answer: Option<&Arc<Answer>>,
    ) -> Result<Option<NodeLimits>, ConfigError> {
        Ok(match (rate_limit, rate_limits) {
            (Some(_), Some(list)) => {
                return Err(self.err(
                    Some(&list.referenced),
                    &format!("{field}.rate_limits"),
                    "use either rate_limit or rate_limits, not both",
                ));
            }
            (Some(one), None) => Some(self.node_limits(
                one.value,
                one.referenced,
                &format!("{field}.rate_limit"),
                false,
                held,
                answer,
            )?),
            (None, Some(list)) => {
                let list_field = format!("{field}.rate_limits");
                if list.value.is_empty() {
                    return Err(self.err(
                        Some(&list.referenced),
                        &list_field,
                        "rate_limits is empty",
                    ));
                }
                let mut limits = Vec::with_capacity(list.value.len());
                for (j, item) in list.value.into_iter().enumerate() {
                    match self.node_limits(
                        item.value,
                        item.referenced,
                        &format!("{list_field}[{j}]"),
                        true,
                        held,
                        answer,
                    )? {
                        NodeLimits::Limits(mut l) => limits.append(&mut l),
                        NodeLimits::Unlimited => unreachable!("refused inside rate_limits"),
                    }
                }
                // A limit's counter is (algorithm, window, ordinal among those alike); a
                // concurrency limit's window is not in it (`Limit::counter_window_us`).
                for j in 0..limits.len() {
                    let names = |l: &LimitRule| {
                        let limit = l.limit();
                        (limit.algorithm, limit.counter_window_us())
                    };
                    let alike = limits[..j]
                        .iter()
                        .filter(|l| names(l) == names(&limits[j]))
                        .count();
                    limits[j].set_ordinal(u16::try_from(alike).unwrap_or(u16::MAX));
                }
                Some(NodeLimits::Limits(limits))
            }
            (None, None) => None,
        })
    }

    /// `unlimited: true` stands alone: not inside `rate_limits`, with no unit and none of the
    /// extensions' fields, which would mean nothing.
    fn check_unlimited(
        &self,
        raw: &RawLimit,
        field: &str,
        in_list: bool,
    ) -> Result<(), ConfigError> {
        let sub = |name: &str| format!("{field}.{name}");
        if in_list {
            return Err(self.err(
                raw.unlimited.as_ref().map(|u| &u.referenced),
                &sub("unlimited"),
                "unlimited is not allowed inside rate_limits; use rate_limit: {unlimited: true}",
            ));
        }
        if let Some(unit) = &raw.unit {
            return Err(self.err(
                Some(&unit.referenced),
                &sub("unit"),
                "should not specify a rate limit unit when unlimited",
            ));
        }
        let extension = [
            ("algorithm", raw.algorithm.as_ref().map(|s| s.referenced)),
            ("burst", raw.burst.as_ref().map(|s| s.referenced)),
            (
                "unit_multiplier",
                raw.unit_multiplier.as_ref().map(|s| s.referenced),
            ),
            ("accounting", raw.accounting.as_ref().map(|s| s.referenced)),
            ("calendar", raw.calendar.as_ref().map(|s| s.referenced)),
            ("top_values", raw.top_values.as_ref().map(|s| s.referenced)),
            ("answer", raw.answer.as_ref().map(|s| s.referenced)),
            ("soft", raw.soft.as_ref().map(|s| s.referenced)),
        ];
        if let Some((name, Some(at))) = extension.into_iter().find(|(_, at)| at.is_some()) {
            return Err(self.err(Some(&at), &sub(name), "has no meaning when unlimited"));
        }
        Ok(())
    }

    /// The names of the limits a limit replaces (`replaces`), each non-empty and not its own
    /// `name`.
    fn replaces(
        &self,
        raw: Vec<Spanned<RawReplace>>,
        name: Option<&str>,
        field: &str,
    ) -> Result<Vec<Arc<str>>, ConfigError> {
        let mut replaces = Vec::new();
        for (k, r) in raw.into_iter().enumerate() {
            let item = format!("{field}.replaces[{k}]");
            for (name, at) in &r.value.misplaced {
                self.ignored(at, &format!("{item}.{name}"));
            }
            let field = format!("{item}.name");
            let replaced = match r.value.name {
                Some(n) if !n.value.is_empty() => n.value,
                _ => {
                    return Err(self.err(
                        Some(&r.referenced),
                        &field,
                        "replaces needs a non-empty name",
                    ));
                }
            };
            if name == Some(replaced.as_str()) {
                return Err(self.err(
                    Some(&r.referenced),
                    &field,
                    format!("limit '{replaced}' replaces itself"),
                ));
            }
            replaces.push(Arc::from(replaced));
        }
        Ok(replaces)
    }

    /// The calendar of the limit `raw` at `field`: its own `calendar` (refused where it means
    /// nothing), else `--calendar-timezone`'s where the limit can take one.
    fn calendar(
        &self,
        raw: &RawLimit,
        at: Location,
        field: &str,
        unit: Unit,
        algorithm: Algorithm,
        multiplier: u64,
    ) -> Result<Option<Calendar>, ConfigError> {
        use std::sync::atomic::AtomicBool;
        let sub = |name: &str| format!("{field}.{name}");
        let Some(named) = &raw.calendar else {
            let Some(zone) = self.options.calendar else {
                return Ok(None);
            };
            static SHORT: AtomicBool = AtomicBool::new(false);
            static ALGORITHM: AtomicBool = AtomicBool::new(false);
            static MULTIPLIER: AtomicBool = AtomicBool::new(false);
            let Some(calendar_unit) = unit.calendar_unit() else {
                // Expected in most configs: said once, not warned.
                if !SHORT.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    tracing::info!(
                        "--calendar-timezone leaves limits of a second or a minute as they are (the same length in every zone)"
                    );
                }
                return Ok(None);
            };
            // Left as it is, said once per reason (the first limit it concerns named).
            let left = |flag: &AtomicBool, why: String| {
                log_once(flag, || {
                    let why = format!("left as it is by --calendar-timezone: {why} (logged once)");
                    ConfigError::at(self.file, loc(&at), field, why).to_string()
                });
                None
            };
            if algorithm != Algorithm::FixedWindow {
                return Ok(left(&ALGORITHM, format!("{algorithm} takes no calendar")));
            }
            return Ok(match Calendar::new(zone, calendar_unit, multiplier) {
                Ok(c) => Some(c),
                Err(why) => left(&MULTIPLIER, why.0),
            });
        };
        let here = Some(&named.referenced);
        let Some(zone) = calendar::zone(&named.value) else {
            return Err(self.err(here, &sub("calendar"), calendar::unknown_zone(&named.value)));
        };
        let Some(calendar_unit) = unit.calendar_unit() else {
            return Err(self.err(
                here,
                &sub("calendar"),
                format!(
                    "calendar '{}' means nothing for unit {}: it is the same length in every zone (a calendar takes hour, day, week, month or year)",
                    named.value,
                    unit.as_str().to_lowercase()
                ),
            ));
        };
        if algorithm != Algorithm::FixedWindow {
            let why = match algorithm {
                Algorithm::TokenBucket => "refills continuously, with no boundary to align to",
                Algorithm::Concurrency => "keeps a place for a lifetime from when it is taken",
                _ => "measures its window back from each hit, not from a boundary of the calendar",
            };
            return Err(self.err(
                here,
                &sub("calendar"),
                format!(
                    "calendar '{}' applies only to algorithm: fixed_window ({algorithm} {why})",
                    named.value
                ),
            ));
        }
        Calendar::new(zone, calendar_unit, multiplier)
            .map(Some)
            .map_err(|why| {
                let at = raw.unit_multiplier.as_ref().map(|m| &m.referenced).or(here);
                self.err(at, &sub("unit_multiplier"), why.0)
            })
    }

    /// A descriptor's `hold_key` (written, or from `metadata.ratelimitd`): a non-empty entry
    /// key, on a descriptor with limits.
    fn hold_key(
        &self,
        hold_key: Option<Spanned<String>>,
        field: &str,
        at: Location,
        rate_limit: &Option<Spanned<RawLimit>>,
        rate_limits: &Option<RawLimitList>,
    ) -> Result<Option<(Box<str>, Location)>, ConfigError> {
        let Some(k) = hold_key else { return Ok(None) };
        let here = Some(&k.referenced).filter(|l| l.line() > 0).or(Some(&at));
        let found_at = *here.expect("set");
        let sub = format!("{field}.hold_key");
        if k.value.is_empty() {
            return Err(self.err(here, &sub, "hold_key must name an entry key"));
        }
        let unlimited = rate_limit
            .as_ref()
            .is_some_and(|l| l.value.unlimited.as_ref().is_some_and(|u| u.value));
        if unlimited || (rate_limit.is_none() && rate_limits.is_none()) {
            return Err(self.err(
                here,
                &sub,
                "hold_key needs a rate_limit (or rate_limits) on this descriptor: a hold keeps what its limits took",
            ));
        }
        Ok(Some((k.value.into_boxed_str(), found_at)))
    }

    fn node_limits(
        &self,
        raw: RawLimit,
        at: Location,
        field: &str,
        in_list: bool,
        held: bool,
        answer: Option<&Arc<Answer>>,
    ) -> Result<NodeLimits, ConfigError> {
        let sub = |name: &str| format!("{field}.{name}");
        for (name, at) in raw.misplaced() {
            self.ignored(&at, &sub(name));
        }
        if raw.unlimited.as_ref().is_some_and(|u| u.value) {
            self.check_unlimited(&raw, field, in_list)?;
            return Ok(NodeLimits::Unlimited);
        }

        let unit = match &raw.unit {
            None => return Err(self.err(Some(&at), &sub("unit"), "a rate limit needs a unit (second, minute, hour, day, week, month or year)")),
            Some(u) => Unit::parse(&u.value).ok_or_else(|| {
                self.err(
                    Some(&u.referenced),
                    &sub("unit"),
                    format!("invalid rate limit unit '{}' (expected second, minute, hour, day, week, month or year)", u.value),
                )
            })?,
        };
        // A missing requests_per_unit is 0 (blocks everything), as in envoyproxy/ratelimit.
        let requests_per_unit = raw.requests_per_unit.as_ref().map_or(0, |r| r.value);
        if requests_per_unit > u32::MAX as u64 {
            let at = raw.requests_per_unit.as_ref().map(|r| r.referenced);
            return Err(self.err(
                at.as_ref(),
                &sub("requests_per_unit"),
                format!("{requests_per_unit} is larger than {}", u32::MAX),
            ));
        }
        let algorithm = match &raw.algorithm {
            None => self.options.default_algorithm,
            Some(a) => Algorithm::parse(&a.value).ok_or_else(|| {
                self.err(
                    Some(&a.referenced),
                    &sub("algorithm"),
                    format!("unknown algorithm '{}' (expected fixed_window, sliding_window, sliding_log, token_bucket or concurrency)", a.value),
                )
            })?,
        };
        if algorithm == Algorithm::Concurrency {
            let here = raw.algorithm.as_ref().map(|a| &a.referenced).or(Some(&at));
            if !held {
                return Err(self.err(
                    here,
                    &sub("algorithm"),
                    "algorithm: concurrency needs the descriptor's hold_key (the entry that names each request's place, so that its release frees that place and no other)",
                ));
            }
            if requests_per_unit > MAX_HOLDS as u64 {
                let at = raw.requests_per_unit.as_ref().map(|r| r.referenced);
                return Err(self.err(
                    at.as_ref(),
                    &sub("requests_per_unit"),
                    format!("a concurrency limit has at most {MAX_HOLDS} places"),
                ));
            }
            if let Some(a) = &raw.accounting {
                return Err(self.err(
                    Some(&a.referenced),
                    &sub("accounting"),
                    "has no meaning for algorithm: concurrency (an admission takes a place, a cost report takes none, a refund naming its hold releases it)",
                ));
            }
        }
        let burst = match &raw.burst {
            None => requests_per_unit,
            Some(b) if algorithm != Algorithm::TokenBucket => {
                return Err(self.err(
                    Some(&b.referenced),
                    &sub("burst"),
                    "burst applies only to algorithm: token_bucket",
                ));
            }
            Some(b) if b.value == 0 || b.value > u32::MAX as u64 => {
                return Err(self.err(
                    Some(&b.referenced),
                    &sub("burst"),
                    format!("burst must be between 1 and {}", u32::MAX),
                ));
            }
            Some(b) => b.value,
        };
        let unit_multiplier = match &raw.unit_multiplier {
            None => 1,
            Some(m) if m.value == 0 || m.value > MAX_UNIT_MULTIPLIER => {
                return Err(self.err(
                    Some(&m.referenced),
                    &sub("unit_multiplier"),
                    format!("unit_multiplier must be between 1 and {MAX_UNIT_MULTIPLIER}"),
                ));
            }
            Some(m) => m.value,
        };
        let accounting = match &raw.accounting {
            None => None,
            Some(a) => Some(Accounting::parse(&a.value).ok_or_else(|| {
                self.err(
                    Some(&a.referenced),
                    &sub("accounting"),
                    format!(
                        "unknown accounting '{}' (expected auto, admission or report)",
                        a.value
                    ),
                )
            })?),
        };
        let calendar = self.calendar(&raw, at, field, unit, algorithm, unit_multiplier)?;
        let top_values = match &raw.top_values {
            None => Values::Show,
            Some(v) => Values::parse(&v.value).ok_or_else(|| {
                self.err(
                    Some(&v.referenced),
                    &sub("top_values"),
                    format!(
                        "unknown top_values '{}' (expected show, hash or hide)",
                        v.value
                    ),
                )
            })?,
        };
        let answer = match raw.answer {
            Some(a) => Some(Arc::new(self.answer(a, field)?)),
            None => answer.cloned(),
        };
        let name = raw.name.map(|n| Arc::<str>::from(n.value));
        let replaces = self.replaces(raw.replaces.unwrap_or_default(), name.as_deref(), field)?;
        let mut rule = LimitRule {
            name,
            replaces,
            unit,
            unit_multiplier,
            requests_per_unit,
            algorithm,
            burst,
            accounting,
            calendar,
            top_values,
            ordinal: 0,
            identity: LimitIdentity::default(),
            answer,
            soft: raw.soft.is_some_and(|s| s.value),
        };
        rule.set_ordinal(0);
        Ok(NodeLimits::Limits(vec![rule]))
    }
}
