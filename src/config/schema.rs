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

/// Declares a raw config type: its fields, then the keys envoyproxy/ratelimit knows that mean
/// nothing at this level, each written once. A misplaced key becomes a [`Misplaced`] field of
/// its own name, and `misplaced()` lists those present with where each stands.
macro_rules! raw {
    (
        $(#[$meta:meta])*
        pub(crate) struct $name:ident {
            $($(#[$fmeta:meta])* pub $field:ident: $ty:ty,)*
        }
        misplaced here: [$($key:ident),* $(,)?]
    ) => {
        $(#[$meta])*
        #[derive(Debug, Default, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub(crate) struct $name {
            $($(#[$fmeta])* pub $field: $ty,)*
            $(
                #[serde(default)]
                #[doc = concat!("`", stringify!($key), "`: known, but means nothing here.")]
                pub(crate) $key: Misplaced,
            )*
        }

        impl $name {
            /// The known keys present that mean nothing here, with where each stands.
            pub(crate) fn misplaced(&self) -> Vec<(&'static str, Location)> {
                [$((stringify!($key), &self.$key)),*]
                    .into_iter()
                    .filter_map(|(name, m)| m.as_ref().map(|m| (name, m.referenced)))
                    .collect()
            }
        }
    };
}

// A file is a mapping of `domain` (a string) and `descriptors` (a list of `RawDescriptor`),
// read field by field by `compile::FileSeed` so that descriptors are compiled as they arrive.

raw! {
    /// A node of the descriptor tree.
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
        /// Extension: the entry after this one that names a request's hold.
        pub hold_key: Option<Spanned<String>>,
        /// Extension: what a client is told, for this node's limits and those below.
        pub answer: Option<Spanned<super::answer::RawAnswer>>,
        /// Extension: this node's limits are soft (over, the request goes on, the upstream
        /// told).
        pub soft: Option<Spanned<bool>>,
    }
    misplaced here: [domain, unit, requests_per_unit, unlimited, name, replaces]
}

raw! {
    /// A limit as written under `rate_limit` (or an item of `rate_limits`).
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
        /// Extension: an IANA time zone whose calendar the windows follow (fixed_window, a
        /// unit of an hour or longer).
        pub calendar: Option<Spanned<String>>,
        /// Extension: how `/top` shows this limit's descriptor values: show, hash or hide.
        pub top_values: Option<Spanned<String>>,
        /// Extension: what a client is told about this limit (in place of the descriptor's).
        pub answer: Option<Spanned<super::answer::RawAnswer>>,
        /// Extension: a soft limit (over, the request goes on, the upstream told).
        pub soft: Option<Spanned<bool>>,
    }
    misplaced here: [
        domain,
        key,
        value,
        descriptors,
        rate_limit,
        shadow_mode,
        quota_mode,
        detailed_metric,
        value_to_metric,
        share_threshold,
        metadata,
    ]
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
