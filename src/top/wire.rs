//! A replica's view as other replicas read it: JSON (values stay strings, whatever they hold),
//! bounded in size, each limit cut to the sketches' capacity so the merge keeps its bound.

use serde::{Deserialize, Serialize};

use super::sketch::{Counter, View, decode};
use super::{LimitInfo, LimitTop, Values};

/// The largest view a replica publishes, or reads of another's: past it, the limits with the
/// fewest hits are left out (and a larger one read is ignored).
pub(crate) const MAX_VIEW_BYTES: usize = 1 << 20;

#[derive(Serialize, Deserialize)]
struct WireLimit {
    limit: LimitInfo,
    values: Values,
    total: u64,
    floor: u64,
    counters: Vec<WireCounter>,
    /// The refused hits' view (absent from a replica of a release before it: read as empty).
    #[serde(default)]
    refused: WireView,
}

/// A view of refused hits: as a limit's own, without its limit.
#[derive(Default, Serialize, Deserialize)]
struct WireView {
    total: u64,
    floor: u64,
    counters: Vec<WireCounter>,
}

#[derive(Serialize, Deserialize)]
struct WireCounter {
    entries: Vec<(WireBytes, WireBytes)>,
    hits: u64,
    over: u64,
    error: u64,
}

/// A key or value: a JSON string when it is UTF-8 (nearly always), else its bytes as an array.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum WireBytes {
    Text(String),
    Bytes(Vec<u8>),
}

impl WireBytes {
    fn of(bytes: &[u8]) -> WireBytes {
        match std::str::from_utf8(bytes) {
            Ok(s) => WireBytes::Text(s.to_owned()),
            Err(_) => WireBytes::Bytes(bytes.to_vec()),
        }
    }

    fn as_bytes(&self) -> &[u8] {
        match self {
            WireBytes::Text(s) => s.as_bytes(),
            WireBytes::Bytes(b) => b,
        }
    }
}

/// `limits` as published: each cut to `capacity` descriptors; those the heaviest limits leave
/// no room for under [`MAX_VIEW_BYTES`] left out. Descriptors kept without their entries are
/// left out too (another replica could not tell them apart).
pub(crate) fn encode(limits: Vec<LimitTop>, capacity: usize) -> Vec<u8> {
    let mut limits = super::merge_limits(limits, capacity);
    limits.sort_by_key(|l| std::cmp::Reverse(l.view.total));
    let mut out = b"[".to_vec();
    for l in limits {
        let view = WireView::of(&l.view);
        let wire = WireLimit {
            counters: view.counters,
            limit: l.info,
            values: l.values,
            total: view.total,
            floor: view.floor,
            refused: WireView::of(&l.refused),
        };
        let one = serde_json::to_vec(&wire).expect("plain data serializes");
        if out.len() + one.len() + 2 > MAX_VIEW_BYTES {
            continue;
        }
        if out.len() > 1 {
            out.push(b',');
        }
        out.extend_from_slice(&one);
    }
    out.push(b']');
    out
}

/// A view another replica published; `None` if it is not one (or too large).
pub(crate) fn decode_view(bytes: &[u8]) -> Option<Vec<LimitTop>> {
    if bytes.len() > MAX_VIEW_BYTES {
        return None;
    }
    let limits: Vec<WireLimit> = serde_json::from_slice(bytes).ok()?;
    Some(
        limits
            .into_iter()
            .map(|l| LimitTop {
                info: l.limit,
                values: l.values,
                view: WireView {
                    total: l.total,
                    floor: l.floor,
                    counters: l.counters,
                }
                .view(),
                refused: l.refused.view(),
            })
            .collect(),
    )
}

impl WireView {
    /// `view` as published: descriptors kept without their entries are left out (another
    /// replica could not tell them apart).
    fn of(view: &View) -> WireView {
        WireView {
            total: view.total,
            floor: view.floor,
            counters: view
                .counters
                .iter()
                .filter_map(|c| {
                    let entries = decode(c.item.as_deref()?)?;
                    Some(WireCounter {
                        entries: entries
                            .into_iter()
                            .map(|(k, v)| (WireBytes::of(k), WireBytes::of(v)))
                            .collect(),
                        hits: c.hits,
                        over: c.over,
                        error: c.error,
                    })
                })
                .collect(),
        }
    }

    /// The view as read.
    fn view(self) -> View {
        View {
            counters: self
                .counters
                .into_iter()
                .map(|c| {
                    let entries: Vec<(&[u8], &[u8])> = c
                        .entries
                        .iter()
                        .map(|(k, v)| (k.as_bytes(), v.as_bytes()))
                        .collect();
                    Counter {
                        hash: 0,
                        item: Some(super::sketch::encode(&entries)),
                        hits: c.hits,
                        over: c.over,
                        error: c.error,
                    }
                })
                .collect(),
            floor: self.floor,
            total: self.total,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::top::sketch::Summary;

    #[test]
    fn a_view_round_trips_with_its_values_verbatim() {
        let (mut s, mut refused) = (Summary::new(4), Summary::new(4));
        let mut room = usize::MAX;
        let odd = "\"}, {\"k\": [1]} \u{1F600}\n\0".repeat(200);
        for (v, n) in [(odd.as_str(), 5), ("plain", 2)] {
            let e = [("key", v), ("k2", "x")];
            s.record(v.len() as u64, &e, n, n == 5, &mut room);
            if n == 5 {
                refused.record(v.len() as u64, &e, n, true, &mut room);
            }
        }
        let info = LimitInfo {
            domain: "d".into(),
            rule: "key".into(),
            index: 0,
            name: Some("n".into()),
            algorithm: "fixed_window".into(),
            unit: "MINUTE".into(),
            window_seconds: 60,
            requests_per_unit: 3,
        };
        let top = LimitTop {
            info: info.clone(),
            values: Values::Hash,
            view: s.view(),
            refused: refused.view(),
        };
        let back = decode_view(&encode(vec![top], 4)).unwrap();
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].info, info);
        assert_eq!(back[0].values, Values::Hash);
        let mut view = back[0].view.clone();
        view.sort();
        let first = decode(view.counters[0].item.as_deref().unwrap()).unwrap();
        assert_eq!(
            first,
            [(&b"key"[..], odd.as_bytes()), (&b"k2"[..], &b"x"[..])]
        );
        assert_eq!((view.counters[0].hits, view.counters[0].over), (5, 5));
        assert_eq!(view.total, 7);
        let refused = &back[0].refused;
        assert_eq!((refused.total, refused.counters.len()), (5, 1));
        assert_eq!(refused.counters[0].item, view.counters[0].item);
        assert!(decode_view(b"{not a view").is_none());
    }

    /// A replica of the release before the sketch of refused hits publishes no `refused`:
    /// its view is read, with none refused, so that replicas of both releases merge.
    #[test]
    fn a_view_without_refused_hits_is_read() {
        let old = br#"[{"limit": {"domain": "d", "rule": "k", "index": 0, "name": null,
            "algorithm": "fixed_window", "unit": "MINUTE", "window_seconds": 60,
            "requests_per_unit": 3}, "values": "show", "total": 4, "floor": 0,
            "counters": [{"entries": [["k", "v"]], "hits": 4, "over": 1, "error": 0}]}]"#;
        let back = decode_view(old).expect("read");
        assert_eq!(back[0].view.counters[0].hits, 4);
        assert_eq!(back[0].refused, View::default());
    }
}
