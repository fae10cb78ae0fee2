//! The config format, exactly as written: envoyproxy/ratelimit's schema plus our extensions.
//! Files are read into these types; a config received parsed (xDS) is converted into them, so
//! both meet the same checks.
//! Every field is optional here so that `compile` can say which one is missing, and where.
//! Unknown fields are refused by the deserializer.

use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_saphyr::{Location, Spanned};

/// A key envoyproxy/ratelimit knows but that means nothing where it stands (its key check
/// accepts any known key at any level; its parser then ignores it): accepted and ignored here
/// too, with a warning naming the file and line. Any other unknown key is an error.
pub(crate) type Misplaced = Option<Spanned<IgnoredAny>>;

/// The misplaced keys present, with where each stands.
fn present<const N: usize>(
    fields: [(&'static str, &Misplaced); N],
) -> Vec<(&'static str, Location)> {
    fields
        .into_iter()
        .filter_map(|(name, m)| m.as_ref().map(|m| (name, m.referenced)))
        .collect()
}

// A file is a mapping of `domain` (a string) and `descriptors` (a list of `RawDescriptor`),
// read field by field by `compile::FileSeed` so that descriptors are compiled as they arrive.

/// A node of the descriptor tree.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawDescriptor {
    pub key: Option<Spanned<String>>,
    pub value: Option<Spanned<String>>,
    pub rate_limit: Option<Spanned<RawLimit>>,
    /// Extension: several limits on one descriptor.
    pub rate_limits: Option<Spanned<Vec<Spanned<RawLimit>>>>,
    pub descriptors: Option<Vec<Spanned<RawDescriptor>>>,
    pub shadow_mode: Option<bool>,
    pub detailed_metric: Option<bool>,
    pub share_threshold: Option<bool>,
    pub value_to_metric: Option<bool>,
    pub quota_mode: Option<bool>,
    /// Accepted and kept for dynamic metadata; any YAML mapping.
    pub metadata: Option<serde_json::Value>,
    #[serde(rename = "domain", default)]
    pub(crate) misplaced_domain: Misplaced,
    #[serde(rename = "unit", default)]
    pub(crate) misplaced_unit: Misplaced,
    #[serde(rename = "requests_per_unit", default)]
    pub(crate) misplaced_requests_per_unit: Misplaced,
    #[serde(rename = "unlimited", default)]
    pub(crate) misplaced_unlimited: Misplaced,
    #[serde(rename = "name", default)]
    pub(crate) misplaced_name: Misplaced,
    #[serde(rename = "replaces", default)]
    pub(crate) misplaced_replaces: Misplaced,
}

impl RawDescriptor {
    /// Known keys that mean nothing on a descriptor.
    pub(crate) fn misplaced(&self) -> Vec<(&'static str, Location)> {
        present([
            ("domain", &self.misplaced_domain),
            ("unit", &self.misplaced_unit),
            ("requests_per_unit", &self.misplaced_requests_per_unit),
            ("unlimited", &self.misplaced_unlimited),
            ("name", &self.misplaced_name),
            ("replaces", &self.misplaced_replaces),
        ])
    }
}

/// A limit as written under `rate_limit` (or an item of `rate_limits`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawLimit {
    pub unit: Option<Spanned<String>>,
    pub requests_per_unit: Option<Spanned<u64>>,
    pub unlimited: Option<Spanned<bool>>,
    pub name: Option<Spanned<String>>,
    pub replaces: Option<Vec<Spanned<RawReplace>>>,
    /// Extension: fixed_window (default), sliding_window, sliding_log, token_bucket.
    pub algorithm: Option<Spanned<String>>,
    /// Extension: token bucket capacity.
    pub burst: Option<Spanned<u64>>,
    /// Extension: window = unit × unit_multiplier.
    pub unit_multiplier: Option<Spanned<u64>>,
    /// Extension: auto, admission or report (how the limit counts a descriptor's hits).
    pub accounting: Option<Spanned<String>>,
    #[serde(rename = "domain", default)]
    pub(crate) misplaced_domain: Misplaced,
    #[serde(rename = "key", default)]
    pub(crate) misplaced_key: Misplaced,
    #[serde(rename = "value", default)]
    pub(crate) misplaced_value: Misplaced,
    #[serde(rename = "descriptors", default)]
    pub(crate) misplaced_descriptors: Misplaced,
    #[serde(rename = "rate_limit", default)]
    pub(crate) misplaced_rate_limit: Misplaced,
    #[serde(rename = "shadow_mode", default)]
    pub(crate) misplaced_shadow_mode: Misplaced,
    #[serde(rename = "quota_mode", default)]
    pub(crate) misplaced_quota_mode: Misplaced,
    #[serde(rename = "detailed_metric", default)]
    pub(crate) misplaced_detailed_metric: Misplaced,
    #[serde(rename = "value_to_metric", default)]
    pub(crate) misplaced_value_to_metric: Misplaced,
    #[serde(rename = "share_threshold", default)]
    pub(crate) misplaced_share_threshold: Misplaced,
    #[serde(rename = "metadata", default)]
    pub(crate) misplaced_metadata: Misplaced,
}

impl RawLimit {
    /// Known keys that mean nothing on a limit.
    pub(crate) fn misplaced(&self) -> Vec<(&'static str, Location)> {
        present([
            ("domain", &self.misplaced_domain),
            ("key", &self.misplaced_key),
            ("value", &self.misplaced_value),
            ("descriptors", &self.misplaced_descriptors),
            ("rate_limit", &self.misplaced_rate_limit),
            ("shadow_mode", &self.misplaced_shadow_mode),
            ("quota_mode", &self.misplaced_quota_mode),
            ("detailed_metric", &self.misplaced_detailed_metric),
            ("value_to_metric", &self.misplaced_value_to_metric),
            ("share_threshold", &self.misplaced_share_threshold),
            ("metadata", &self.misplaced_metadata),
        ])
    }
}

/// An item of `replaces`: a `name`; any other key envoyproxy/ratelimit knows is misplaced
/// (ignored, with a warning), any other key an error.
#[derive(Debug, Default)]
pub(crate) struct RawReplace {
    pub name: Option<Spanned<String>>,
    pub(crate) misplaced: Vec<(&'static str, Location)>,
}

/// Every key envoyproxy/ratelimit's config check accepts, at any level.
const KNOWN_KEYS: [&str; 16] = [
    "domain",
    "key",
    "value",
    "descriptors",
    "rate_limit",
    "unit",
    "requests_per_unit",
    "unlimited",
    "shadow_mode",
    "quota_mode",
    "name",
    "replaces",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    "metadata",
];

impl<'de> Deserialize<'de> for RawReplace {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = RawReplace;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a mapping with a `name`")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<RawReplace, A::Error> {
                let mut out = RawReplace::default();
                while let Some(key) = map.next_key::<String>()? {
                    if key == "name" {
                        if out.name.is_some() {
                            return Err(serde::de::Error::duplicate_field("name"));
                        }
                        out.name = map.next_value()?;
                    } else if let Some(known) = KNOWN_KEYS.iter().find(|k| **k == key) {
                        let at: Spanned<IgnoredAny> = map.next_value()?;
                        out.misplaced.push((known, at.referenced));
                    } else {
                        return Err(serde::de::Error::unknown_field(&key, &["name"]));
                    }
                }
                Ok(out)
            }
        }
        d.deserialize_map(Visitor)
    }
}
