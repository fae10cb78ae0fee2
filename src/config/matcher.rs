//! Descriptor matching: walks a domain's tree one entry at a time and, when the last entry
//! lands on a node with limits (or `unlimited`), returns that node with the counter key and metric label.
//!
//! Per level: exact value first, then wildcard values in file order, then the value-less key.
//! More or fewer entries than the tree's depth at that point means no limit.

use std::borrow::Cow;
use std::sync::Arc;

use super::{Counted, Domain, KeyNodes, Node};
use smallvec::SmallVec;

use crate::limiter::key::{CounterKey, KeyFormat, KeyPart};
use crate::limiter::{Hold, HoldId};
use crate::value::{KeyValue, shown};

/// A descriptor that landed on a node with limits (or `unlimited`).
#[derive(Debug)]
pub struct Matched<'s> {
    /// The node (its `limits` are set).
    pub node: &'s Node,
    /// The domain and each entry's key and counted value, in `keys`' format; the caller
    /// appends each limit's identity. A wildcard with `share_threshold` counts under its pattern, every other node
    /// under the request's value.
    pub key: CounterKey,
    /// The metric `rule` label: the config path, with request values only where the config asks
    /// for them (`detailed_metric`, `value_to_metric`), so clients cannot explode cardinality.
    /// The node's own label is borrowed: no reference count shared by every request touched.
    pub rule: Cow<'s, Arc<String>>,
    /// Whether `rule` carries request values (the config asked for them), so that its
    /// cardinality is up to clients and must be capped by whoever records it.
    pub rule_has_values: bool,
    /// The hold the descriptor names, where the node keeps holds (`hold_key`).
    pub hold: Hold,
}

impl KeyNodes {
    /// The node `value` lands on: exact first, then wildcards in file order, then the
    /// value-less key.
    /// A value that is not UTF-8 equals no configured value (YAML is text), so it goes on to
    /// the wildcards (matched on bytes) and the value-less key.
    fn pick(&self, value: &[u8]) -> Option<&Node> {
        std::str::from_utf8(value)
            .ok()
            .and_then(|v| self.exact.get(v))
            .or_else(|| {
                self.wildcards
                    .iter()
                    .find(|(pattern, _)| pattern.matches(value))
                    .map(|(_, node)| node)
            })
            .or(self.any.as_deref())
    }
}

impl Domain {
    /// Orders an unordered set of entries (an RLQS bucket id) as a descriptor: level by level,
    /// the key among the unused entries that comes first in the file at that level, its node
    /// picked by value as for a descriptor. `None` unless every entry is used and the walk
    /// ends on a node with limits (or `unlimited`). One entry is exactly a one-entry descriptor.
    pub(crate) fn order_entries<'e>(
        &self,
        entries: &[KeyValue<'e>],
    ) -> Option<SmallVec<[KeyValue<'e>; 8]>> {
        let mut level = &self.root;
        let mut used = vec![false; entries.len()];
        let mut ordered = SmallVec::new();
        let mut last = None;
        for _ in 0..entries.len() {
            let (i, nodes) = entries
                .iter()
                .enumerate()
                .filter(|(i, _)| !used[*i])
                .filter_map(|(i, (k, _))| level.key(k).map(|n| (i, n)))
                .min_by_key(|(_, n)| n.first)?;
            let node = nodes.pick(entries[i].1)?;
            used[i] = true;
            ordered.push(entries[i]);
            level = &node.children;
            last = Some(node);
        }
        last?.limits.as_ref()?;
        Some(ordered)
    }

    /// Looks a descriptor's entries up: the node whose limits apply, if any.
    /// Keys and values are bytes as sent (`&str` or `&[u8]`). On a node with a `hold_key`, a
    /// last entry of that key names the hold; it is not matched, nor part of the key.
    pub fn lookup<'s, K: AsRef<[u8]>, V: AsRef<[u8]>>(
        &'s self,
        entries: &[(K, V)],
        keys: &KeyFormat,
    ) -> Option<Matched<'s>> {
        let mut level = &self.root;
        // Trees deeper than 8 are rare: no allocation for the walk itself.
        let mut path: SmallVec<[&'s Node; 8]> = SmallVec::new();
        let mut hold = Hold::Unheld;
        for (i, (key, value)) in entries.iter().enumerate() {
            if i + 1 == entries.len()
                && let Some(hold_key) = path.last().and_then(|n| n.hold_key())
                && hold_key.as_bytes() == key.as_ref()
            {
                hold = Hold::Named(HoldId::new(value.as_ref()));
                break;
            }
            let node = level.key(key.as_ref())?.pick(value.as_ref())?;
            path.push(node);
            level = &node.children;
        }
        let leaf = *path.last()?;
        leaf.limits.as_ref()?;
        if leaf.hold_key().is_some() && hold == Hold::Unheld {
            hold = Hold::Unnamed;
        }

        // The config's own names were escaped when it compiled; only the request's values that
        // are counted as sent are escaped here. (A value landing on an exact node is that
        // node's value; a shared wildcard counts its pattern.)
        let key = keys.key_of(
            KeyPart::Escaped(&self.escaped_name),
            path.iter().zip(entries).map(|(node, (k, v))| {
                let (k, v) = (k.as_ref(), v.as_ref());
                // A node's key is the request's key; a fixed value is the node's own.
                let key = match &node.escaped_key {
                    Some(escaped) => KeyPart::Escaped(escaped),
                    None => KeyPart::Escaped(k),
                };
                let counted = match &node.counted {
                    Counted::AsSent => KeyPart::Value(v),
                    Counted::Fixed => {
                        KeyPart::Escaped(node.value.as_deref().map_or(v, str::as_bytes))
                    }
                    Counted::FixedEscaped(escaped) => KeyPart::Escaped(escaped),
                };
                (key, counted)
            }),
        );

        let with_values = leaf.detailed_metric || path.iter().any(|n| n.value_to_metric);
        let rule = if !with_values {
            Cow::Borrowed(&leaf.path)
        } else {
            let mut label = String::new();
            for (node, (k, v)) in path.iter().zip(entries) {
                let (k, v) = (k.as_ref(), v.as_ref());
                if !label.is_empty() {
                    label.push('.');
                }
                let shown: Option<Cow<'_, str>> = if node.share_threshold {
                    node.value.as_deref().map(Cow::Borrowed)
                } else if leaf.detailed_metric || node.value_to_metric {
                    Some(shown(v, keys.longest_value()))
                } else {
                    node.value.as_deref().map(Cow::Borrowed)
                };
                // The key matched a configured one, so it is that UTF-8 text.
                label.push_str(&String::from_utf8_lossy(k));
                if let Some(shown) = shown {
                    label.push('_');
                    label.push_str(&shown);
                }
            }
            Cow::Owned(Arc::new(label))
        };
        Some(Matched {
            node: leaf,
            key,
            rule,
            rule_has_values: with_values,
            hold,
        })
    }
}
