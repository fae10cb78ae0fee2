//! What the engine is asked: a request's types, their bounds and validation.

use crate::config::Unit;
use crate::limiter::{BackendError, Hit};

/// Bounds on request size. What Envoy's configuration sets (descriptors, entries, keys) is
/// refused past them as `INVALID_ARGUMENT`; a value, which a client sets, never is: past
/// `max_value_bytes` it is counted and shown under its digest (`limiter::value`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestLimits {
    /// Descriptors per request.
    pub max_descriptors: usize,
    /// Entries per descriptor.
    pub max_entries: usize,
    /// Bytes per entry key.
    pub max_key_bytes: usize,
    /// Bytes of an entry value kept as it is; a longer one is kept as its SHA-256.
    pub max_value_bytes: usize,
    /// Counters one request touches, after merging.
    pub max_counters: usize,
    /// Bytes of all its counters' keys together.
    pub max_counter_key_bytes: usize,
}

impl Default for RequestLimits {
    fn default() -> Self {
        RequestLimits {
            max_descriptors: 64,
            max_entries: 32,
            max_key_bytes: 4096,
            max_value_bytes: crate::value::DEFAULT_LONGEST_KEPT,
            max_counters: 256,
            max_counter_key_bytes: 1 << 20,
        }
    }
}

/// A limit supplied by the request itself (Envoy's `limit` override on a descriptor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LimitOverride {
    /// Hits per unit.
    pub requests_per_unit: u64,
    /// The unit.
    pub unit: Unit,
}

/// One descriptor of a request.
#[derive(Clone, Debug, Default)]
pub struct Descriptor<'a> {
    /// (key, value) pairs, outermost first: bytes as sent, not necessarily UTF-8.
    pub entries: Vec<(&'a [u8], &'a [u8])>,
    /// Replaces the configured limit when present.
    pub limit_override: Option<LimitOverride>,
    /// Hits for this descriptor; `Some(0)` checks without consuming. Greater than 0, it marks a
    /// cost report where the limit's accounting is `auto`.
    pub hits_addend: Option<u64>,
    /// `is_negative_hits`: the hits are given back (a refund).
    pub refund: bool,
}

/// A request: a domain and its descriptors.
#[derive(Clone, Debug, Default)]
pub struct Request<'a> {
    /// The config domain.
    pub domain: &'a str,
    /// Descriptors, each decided and reported in order.
    pub descriptors: Vec<Descriptor<'a>>,
    /// Hits for descriptors without their own; 0 means 1.
    pub hits_addend: u64,
}

/// Why a request got no decision.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The request is malformed; retrying it will not help.
    #[error("{0}")]
    InvalidArgument(String),
    /// The backend could not decide.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// No config has been loaded yet (a service started without one).
    #[error("no rate limit configuration loaded")]
    NoConfig,
}

/// Checks a request against `bounds`: an `InvalidArgument` naming the first offending field.
pub(crate) fn validate(req: &Request<'_>, bounds: &RequestLimits) -> Result<(), EngineError> {
    let invalid = |m: String| Err(EngineError::InvalidArgument(m));
    if req.domain.is_empty() {
        return invalid("domain must not be empty".into());
    }
    if req.descriptors.is_empty() {
        return invalid("descriptors must not be empty".into());
    }
    if req.descriptors.len() > bounds.max_descriptors {
        return invalid(format!(
            "{} descriptors exceed the maximum of {}",
            req.descriptors.len(),
            bounds.max_descriptors
        ));
    }
    for (i, d) in req.descriptors.iter().enumerate() {
        if d.entries.len() > bounds.max_entries {
            return invalid(format!(
                "descriptors[{i}] has {} entries, more than the maximum of {}",
                d.entries.len(),
                bounds.max_entries
            ));
        }
        for (j, (k, _)) in d.entries.iter().enumerate() {
            if k.is_empty() {
                return invalid(format!(
                    "descriptors[{i}].entries[{j}].key must not be empty"
                ));
            }
            if k.len() > bounds.max_key_bytes {
                return invalid(format!(
                    "descriptors[{i}].entries[{j}].key is {} bytes, more than the maximum of {}",
                    k.len(),
                    bounds.max_key_bytes
                ));
            }
        }
    }
    Ok(())
}

/// Checks what a request resolved to against `bounds`: one request's counters, and so its CPU
/// and Redis time, stay bounded however many limits its descriptors match.
pub(crate) fn validate_counters(hits: &[Hit], bounds: &RequestLimits) -> Result<(), EngineError> {
    if hits.len() > bounds.max_counters {
        return Err(EngineError::InvalidArgument(format!(
            "the request touches {} counters, more than the maximum of {}",
            hits.len(),
            bounds.max_counters
        )));
    }
    let bytes: usize = hits.iter().map(|h| h.key.as_bytes().len()).sum();
    if bytes > bounds.max_counter_key_bytes {
        return Err(EngineError::InvalidArgument(format!(
            "the request's counter keys take {bytes} bytes, more than the maximum of {}",
            bounds.max_counter_key_bytes
        )));
    }
    Ok(())
}
