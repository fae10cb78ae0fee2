//! Space-Saving (Metwally, Agrawal and El Abbadi, 2005), weighted, and its merge (Agarwal et
//! al., "Mergeable summaries", 2012): the heaviest descriptors of one limit in `capacity`
//! counters, whatever the number of distinct descriptors.
//!
//! The guarantee, for a summary that has seen `N` hits: every counted descriptor's `hits`
//! overestimates its true hits by at most its `error`, and `error <= N / capacity`; a
//! descriptor with more than `N / capacity` true hits is always counted (a flood of one-off
//! descriptors replaces only the smallest counters, never one above that share). `over` (the
//! hits refused) never overestimates and misses at most `error` hits: refusals before a
//! descriptor's counter was last taken over.

use std::hash::{BuildHasher, Hash, Hasher};

use hashbrown::HashTable;

/// Longest descriptor kept with its entries (its encoding, see [`encode`]): a longer one is
/// counted all the same, by its hash, and listed without its entries.
pub(crate) const MAX_ITEM_BYTES: usize = 16 << 10;

/// Memory a summary of `capacity` counters holds besides its descriptors' bytes.
pub(crate) fn overhead(capacity: usize) -> usize {
    std::mem::size_of::<Summary>()
        + capacity * (std::mem::size_of::<Counter>() + std::mem::size_of::<u32>() + 8)
}

/// One counted descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Counter {
    /// The descriptor's hash (this process's hasher; never compared across replicas).
    pub(crate) hash: u64,
    /// The descriptor's entries, encoded; `None` when kept without them (too long, or no room
    /// left in the memory budget when it was counted).
    pub(crate) item: Option<Box<[u8]>>,
    /// Hits asked for, an overestimate by at most `error`.
    pub(crate) hits: u64,
    /// Hits refused.
    pub(crate) over: u64,
    /// How much of `hits` may belong to descriptors this counter held before.
    pub(crate) error: u64,
}

/// The heaviest descriptors of one limit, in at most `capacity` counters.
#[derive(Debug)]
pub(crate) struct Summary {
    counters: Vec<Counter>,
    /// Positions in `counters` by hash (counters are replaced in place, never moved).
    index: HashTable<u32>,
    capacity: usize,
    /// Every hit recorded.
    total: u64,
}

/// `entries` encoded as one string of bytes: each key and value as a 4-byte little-endian
/// length and its bytes.
pub(crate) fn encode(entries: &[(impl AsRef<[u8]>, impl AsRef<[u8]>)]) -> Box<[u8]> {
    let mut out = Vec::with_capacity(encoded_len(entries));
    for (k, v) in entries {
        for s in [k.as_ref(), v.as_ref()] {
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
            out.extend_from_slice(s);
        }
    }
    out.into_boxed_slice()
}

/// The length of `encode(entries)`.
pub(crate) fn encoded_len(entries: &[(impl AsRef<[u8]>, impl AsRef<[u8]>)]) -> usize {
    entries
        .iter()
        .map(|(k, v)| 8 + k.as_ref().len() + v.as_ref().len())
        .sum()
}

/// The entries of an encoded descriptor (`None` if `item` is no encoding).
pub(crate) fn decode(item: &[u8]) -> Option<Vec<(&[u8], &[u8])>> {
    fn take<'a>(rest: &mut &'a [u8]) -> Option<&'a [u8]> {
        let (len, tail) = rest.split_first_chunk::<4>()?;
        let len = u32::from_le_bytes(*len) as usize;
        let (s, tail) = (tail.get(..len)?, tail.get(len..)?);
        *rest = tail;
        Some(s)
    }
    let mut rest = item;
    let mut entries = Vec::new();
    while !rest.is_empty() {
        let k = take(&mut rest)?;
        let v = take(&mut rest)?;
        entries.push((k, v));
    }
    Some(entries)
}

/// Whether `item` encodes `entries`, without encoding them.
fn same(item: &[u8], entries: &[(impl AsRef<[u8]>, impl AsRef<[u8]>)]) -> bool {
    let mut at = 0;
    for (k, v) in entries {
        for s in [k.as_ref(), v.as_ref()] {
            let Some(len) = item.get(at..at + 4) else {
                return false;
            };
            if len != (s.len() as u32).to_le_bytes() {
                return false;
            }
            at += 4;
            if item.get(at..at + s.len()) != Some(s) {
                return false;
            }
            at += s.len();
        }
    }
    at == item.len()
}

/// The hash of a descriptor's entries under `state`.
pub(crate) fn hash_entries(
    state: &impl BuildHasher,
    entries: &[(impl AsRef<[u8]>, impl AsRef<[u8]>)],
) -> u64 {
    let mut h = state.build_hasher();
    entries.len().hash(&mut h);
    for (k, v) in entries {
        k.as_ref().hash(&mut h);
        v.as_ref().hash(&mut h);
    }
    h.finish()
}

impl Summary {
    /// An empty summary of `capacity` counters (at least one).
    pub(crate) fn new(capacity: usize) -> Summary {
        let capacity = capacity.max(1);
        Summary {
            counters: Vec::with_capacity(capacity),
            index: HashTable::with_capacity(capacity),
            capacity,
            total: 0,
        }
    }

    /// Counts `hits` asked for by the descriptor `entries` (hash `hash`), refused if `over`.
    /// A descriptor newly kept takes its bytes out of `room` (kept without its entries when
    /// they do not fit), and one it replaces gives its bytes back.
    pub(crate) fn record(
        &mut self,
        hash: u64,
        entries: &[(impl AsRef<[u8]>, impl AsRef<[u8]>)],
        hits: u64,
        over: bool,
        room: &mut usize,
    ) {
        if hits == 0 {
            return;
        }
        self.total = self.total.saturating_add(hits);
        let refused = if over { hits } else { 0 };
        let counters = &mut self.counters;
        let found = self.index.find(hash, |&i| {
            let c = &counters[i as usize];
            c.hash == hash && c.item.as_deref().is_none_or(|item| same(item, entries))
        });
        if let Some(&i) = found {
            let c = &mut counters[i as usize];
            c.hits = c.hits.saturating_add(hits);
            c.over = c.over.saturating_add(refused);
            if c.item.is_none() {
                c.item = keep(entries, room);
            }
            return;
        }
        if counters.len() < self.capacity {
            let i = counters.len() as u32;
            counters.push(Counter {
                hash,
                item: keep(entries, room),
                hits,
                over: refused,
                error: 0,
            });
            self.index
                .insert_unique(hash, i, |&i| counters[i as usize].hash);
            return;
        }
        // Full: the smallest counter now counts this descriptor, keeping its hits as error.
        let i = (0..counters.len())
            .min_by_key(|&i| counters[i].hits)
            .expect("a full summary has counters");
        let old = counters[i].hash;
        if let Ok(e) = self.index.find_entry(old, |&j| j as usize == i) {
            e.remove();
        }
        let c = &mut counters[i];
        if let Some(item) = c.item.take() {
            *room = room.saturating_add(item.len());
        }
        *c = Counter {
            hash,
            item: keep(entries, room),
            hits: c.hits.saturating_add(hits),
            over: refused,
            error: c.hits,
        };
        self.index
            .insert_unique(hash, i as u32, |&i| counters[i as usize].hash);
    }

    /// Every hit recorded.
    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    /// The bytes of descriptors this summary keeps.
    pub(crate) fn item_bytes(&self) -> usize {
        self.counters
            .iter()
            .map(|c| c.item.as_ref().map_or(0, |i| i.len()))
            .sum()
    }

    /// What the summary holds, for merging.
    pub(crate) fn view(&self) -> View {
        View {
            counters: self.counters.clone(),
            floor: self.floor(),
            total: self.total,
        }
    }

    /// The most hits a descriptor not counted here may have had: the smallest counter once
    /// every counter is taken, else 0.
    fn floor(&self) -> u64 {
        if self.counters.len() < self.capacity {
            0
        } else {
            self.counters.iter().map(|c| c.hits).min().unwrap_or(0)
        }
    }
}

/// Bytes for `entries` out of `room`, if they fit there and under [`MAX_ITEM_BYTES`].
fn keep(entries: &[(impl AsRef<[u8]>, impl AsRef<[u8]>)], room: &mut usize) -> Option<Box<[u8]>> {
    let len = encoded_len(entries);
    if len > MAX_ITEM_BYTES || len > *room {
        return None;
    }
    *room -= len;
    Some(encode(entries))
}

/// A summary as read (or merged from several, or from other replicas): its counters, the most
/// hits a descriptor absent from them may have, and every hit it saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct View {
    /// Counted descriptors, in no order.
    pub(crate) counters: Vec<Counter>,
    /// The most hits a descriptor absent from `counters` may have had.
    pub(crate) floor: u64,
    /// Every hit seen.
    pub(crate) total: u64,
}

impl View {
    /// The merge of `views` (several summaries of one limit: shards, windows, replicas): a
    /// descriptor's hits and error add up, and where a view lacks it, that view's floor is
    /// added to both, as the most it may have counted there. The merged error stays within
    /// the sum of the views' bounds. Descriptors kept without entries merge only with the same
    /// hash from the same process (`local`); across replicas they stay apart.
    pub(crate) fn merge<'a>(views: impl IntoIterator<Item = &'a View>) -> View {
        let views: Vec<&View> = views.into_iter().collect();
        let mut merged: Vec<Counter> = Vec::new();
        let mut at: std::collections::HashMap<Key<'_>, usize> = std::collections::HashMap::new();
        // Per merged counter, the views that held it.
        let mut held: Vec<Vec<bool>> = Vec::new();
        for (v, view) in views.iter().enumerate() {
            for c in &view.counters {
                let key = match &c.item {
                    Some(item) => Key::Item(item),
                    None => Key::Hash(c.hash),
                };
                let i = *at.entry(key).or_insert_with(|| {
                    merged.push(Counter {
                        hits: 0,
                        over: 0,
                        error: 0,
                        ..c.clone()
                    });
                    held.push(vec![false; views.len()]);
                    merged.len() - 1
                });
                let m = &mut merged[i];
                m.hits = m.hits.saturating_add(c.hits);
                m.over = m.over.saturating_add(c.over);
                m.error = m.error.saturating_add(c.error);
                held[i][v] = true;
            }
        }
        for (m, held) in merged.iter_mut().zip(&held) {
            for (view, _) in views.iter().zip(held).filter(|(_, h)| !**h) {
                m.hits = m.hits.saturating_add(view.floor);
                m.error = m.error.saturating_add(view.floor);
            }
        }
        View {
            counters: merged,
            floor: views.iter().map(|v| v.floor).fold(0, u64::saturating_add),
            total: views.iter().map(|v| v.total).fold(0, u64::saturating_add),
        }
    }

    /// The heaviest first: most refused, then most hits, then the entries' order (so equal
    /// counts list the same way every time).
    pub(crate) fn sort(&mut self) {
        self.counters.sort_by(|a, b| {
            b.over
                .cmp(&a.over)
                .then(b.hits.cmp(&a.hits))
                .then_with(|| a.item.cmp(&b.item))
        });
    }

    /// Keeps the `n` counters with the most hits; the floor rises to the most hits of those
    /// dropped, so the guarantee holds for what is kept.
    pub(crate) fn truncate(&mut self, n: usize) {
        if self.counters.len() <= n {
            return;
        }
        self.counters.sort_by_key(|c| std::cmp::Reverse(c.hits));
        let dropped = self.counters[n].hits;
        self.counters.truncate(n);
        self.floor = self.floor.max(dropped);
    }
}

/// What merging tells descriptors apart by.
#[derive(Hash, PartialEq, Eq)]
enum Key<'a> {
    Item(&'a [u8]),
    Hash(u64),
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::hash::RandomState;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn encoding_round_trips_any_text() {
        let entries = [("k", "v"), ("", ""), ("a\0b", "{\"x\":[1]}"), ("é", "日本")];
        let item = encode(&entries);
        assert_eq!(item.len(), encoded_len(&entries));
        let back = decode(&item).unwrap();
        assert!(back.len() == entries.len());
        for ((k, v), (ek, ev)) in back.into_iter().zip(entries) {
            assert_eq!((k, v), (ek.as_bytes(), ev.as_bytes()));
        }
        assert!(same(&item, &entries));
        assert!(!same(&item, &entries[..3]));
        assert!(!same(&item, &[("k", "v"), ("", "x")]));
        assert!(decode(&item[..item.len() - 1]).is_none());
    }

    fn record(s: &mut Summary, state: &RandomState, v: &str, hits: u64, over: bool) {
        let entries = [("key", v)];
        let mut room = usize::MAX;
        s.record(
            hash_entries(state, &entries),
            &entries,
            hits,
            over,
            &mut room,
        );
    }

    fn value(c: &Counter) -> String {
        String::from_utf8(decode(c.item.as_deref().unwrap()).unwrap()[0].1.to_owned()).unwrap()
    }

    #[test]
    fn a_flood_of_one_off_values_never_pushes_out_a_heavy_one() {
        let state = RandomState::new();
        let mut s = Summary::new(8);
        for i in 0..10_000u64 {
            record(&mut s, &state, &format!("tail-{i}"), 1, false);
            if i % 4 == 0 {
                record(&mut s, &state, "heavy", 1, i % 8 == 0);
            }
        }
        let mut view = s.view();
        view.sort();
        let heavy = &view.counters[0];
        assert_eq!(value(heavy), "heavy");
        assert!(heavy.hits - heavy.error <= 2_500 && 2_500 <= heavy.hits);
        assert!(heavy.over <= 1_250 && 1_250 - heavy.over <= heavy.error);
        assert!(heavy.error <= view.total / 8, "{heavy:?}");
    }

    #[test]
    fn memory_left_decides_whether_entries_are_kept() {
        let state = RandomState::new();
        let mut s = Summary::new(2);
        let mut room = 30;
        let e = |v: &'static str| [("k", v)];
        let put = |s: &mut Summary, v: &'static str, room: &mut usize| {
            s.record(hash_entries(&state, &e(v)), &e(v), 1, false, room)
        };
        put(&mut s, "aaaa", &mut room); // 13 bytes
        put(&mut s, "bbbb", &mut room); // 13 bytes
        assert_eq!(room, 4);
        put(&mut s, "cccccccc", &mut room); // 17 bytes, in the 13 the one it replaces gives back
        assert_eq!(s.item_bytes() + room, 30);
        put(&mut s, "dddddddddddddddddddd", &mut room); // 29 bytes: no room, counted by hash
        assert!(s.counters.iter().any(|c| c.item.is_none()));
        assert_eq!(s.item_bytes() + room, 30);
    }

    proptest! {
        /// Against exact counts over any stream: every counter within its error, every error
        /// within N / capacity, every descriptor above that share counted, and merging two
        /// summaries keeps all of it for the two streams together.
        #[test]
        fn counts_stay_within_the_stated_error(
            a in proptest::collection::vec((0u8..40, 1u64..5, any::<bool>()), 0..400),
            b in proptest::collection::vec((0u8..40, 1u64..5, any::<bool>()), 0..400),
            capacity in 1usize..12,
        ) {
            let state = RandomState::new();
            let mut exact: HashMap<String, (u64, u64)> = HashMap::new();
            let mut views = Vec::new();
            for stream in [&a, &b] {
                let mut s = Summary::new(capacity);
                let mut own: HashMap<String, (u64, u64)> = HashMap::new();
                for &(v, hits, over) in stream {
                    let v = format!("v{v}");
                    record(&mut s, &state, &v, hits, over);
                    for e in [own.entry(v.clone()).or_default(), exact.entry(v).or_default()] {
                        e.0 += hits;
                        e.1 += if over { hits } else { 0 };
                    }
                }
                views.push((s.view(), own));
            }
            let summaries: Vec<View> = views.iter().map(|(v, _)| v.clone()).collect();
            let merged = View::merge(&summaries);
            let n: u64 = exact.values().map(|e| e.0).sum();
            prop_assert_eq!(merged.total, n);
            for (view, truth) in views.iter().map(|(v, t)| (v, t)).chain([(&merged, &exact)]) {
                for c in &view.counters {
                    let (hits, over) = truth.get(&value(c)).copied().unwrap_or_default();
                    prop_assert!(c.hits >= hits && c.hits - c.error <= hits, "{:?} {}", c, hits);
                    prop_assert!(c.over <= over && over - c.over <= c.error, "{:?} {}", c, over);
                }
            }
            for c in &merged.counters {
                prop_assert!(c.error * capacity as u64 <= n, "{:?} n={}", c, n);
            }
            prop_assert!(merged.floor * capacity as u64 <= n);
            for (v, &(hits, _)) in &exact {
                if hits * capacity as u64 > n {
                    prop_assert!(merged.counters.iter().any(|c| value(c) == *v), "{} lost", v);
                }
            }
            // Truncating keeps the guarantee for what it keeps.
            let mut cut = merged.clone();
            cut.truncate(capacity);
            for (v, &(hits, _)) in &exact {
                if hits > cut.floor {
                    prop_assert!(cut.counters.iter().any(|c| value(c) == *v), "{} cut", v);
                }
            }
        }
    }
}
