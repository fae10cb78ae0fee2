//! The config format, exactly as written: envoyproxy/ratelimit's schema plus our extensions.
//! Files are read into these types; a config received parsed (xDS) is converted into them, so
//! both meet the same checks.
//! Every field is optional here so that `compile` can say which one is missing, and where.
//! Unknown fields are refused by the deserializer.

use serde::Deserialize;
use serde_saphyr::Spanned;

// A file is a mapping of `domain` (a string) and `descriptors` (a list of `RawDescriptor`),
// read field by field by `compile::FileSeed` so that descriptors are compiled as they arrive.

/// A node of the descriptor tree.
#[derive(Debug, Deserialize)]
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
}

/// A limit as written under `rate_limit` (or an item of `rate_limits`).
#[derive(Debug, Deserialize)]
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
}

/// An item of `replaces`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawReplace {
    pub name: Option<Spanned<String>>,
}
