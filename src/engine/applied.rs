//! What resolution finds and the report reads: the limits that apply to a request's
//! descriptors, and what each reports. Its own module so that the two steps depend on it and
//! not on each other.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use crate::config::Node;
use crate::config::Unit;
use crate::limiter::Enforcement;

/// The limit reported for a descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReportedLimit {
    /// `rate_limit.name`, if configured.
    pub name: Option<Arc<str>>,
    /// Hits per unit.
    pub requests_per_unit: u64,
    /// The configured unit (not multiplied).
    pub unit: Unit,
    /// The window: unit × `unit_multiplier` (a calendar window's nominal length: a month is
    /// 30 days here, whatever the month).
    pub window: Duration,
    /// Windows follow a calendar: the reset is the verdict's, never the epoch's arithmetic.
    pub calendar: bool,
    /// What the client is told about it (`answer`); `None`: the server's default.
    pub answer: Option<Arc<crate::config::answer::Answer>>,
    /// A soft limit: over it, the request goes on and the upstream is told.
    pub soft: bool,
}

/// One limit that applies to one descriptor.
pub(crate) struct Applicable<'s> {
    /// The descriptor's index in the request.
    pub(crate) descriptor: usize,
    /// The limit as reported in the status.
    pub(crate) reported: ReportedLimit,
    /// What an over verdict does to the request.
    pub(crate) enforcement: Enforcement,
    /// The metric `rule` label: the config node's, borrowed, unless it carries request values.
    pub(crate) rule: Cow<'s, Arc<String>>,
    /// The rule label carries request values (`detailed_metric`, `value_to_metric`).
    pub(crate) rule_has_values: bool,
    /// The config node whose rule this is (its metric counters, its path); `None` for a limit
    /// override no node matches.
    pub(crate) node: Option<&'s Node>,
    /// The config node's `metadata`, if any.
    pub(crate) metadata: Option<&'s serde_json::Value>,
    /// Which limit this is for the heavy-hitter sketches: the config node's path (never
    /// request values) or [`OVERRIDE_RULE`](super::resolve::OVERRIDE_RULE), and the limit's
    /// place on the node ([`OVERRIDE`](crate::top::OVERRIDE) for a request's own).
    pub(crate) path: &'s str,
    /// See `path`.
    pub(crate) index: u16,
    /// How `/top` shows the limit's values.
    pub(crate) top_values: crate::top::Values,
    /// The descriptor's last entry names a hold (it is not counted as part of who asked).
    pub(crate) named_hold: bool,
    /// The id of the operator's override whose limit this is, in place of the rule's.
    pub(crate) operator: Option<&'s Arc<str>>,
}

/// An applicable limit and the hit its counter is decided in, once hits on the same counter
/// are merged.
pub(crate) struct Applied<'s> {
    /// The limit.
    pub(crate) limit: Applicable<'s>,
    /// Its merged hit: an index into [`Resolved::hits`](super::resolve::Resolved::hits).
    pub(crate) hit: usize,
}

impl<'s> Applied<'s> {
    /// `limit`, its hit not merged yet (`merge` in resolution sets it).
    pub(crate) fn unmerged(limit: Applicable<'s>) -> Self {
        Applied {
            limit,
            hit: usize::MAX,
        }
    }
}
