//! Holds: what one request's admission took from a counter, remembered under an id the
//! request names (a descriptor entry, Envoy's `x-request-id`), so that what is given back
//! later, by a refund that names the same id, is at most what that admission took, once.
//!
//! A hold on a rate limit remembers its hits and when they were charged: they go back only to
//! the window (or the part of the bucket) they were charged to, and the hold ends with it. A
//! hold on a concurrency limit is a place, kept until it is released or its lifetime ends.
//! The Redis script keeps the same records (script.lua, "Holds").

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use crate::value::digest;

/// The most holds one counter keeps. Past it, a rate limit drops its oldest hold (whose hits
/// stay counted: a refund naming it gives nothing back), and a concurrency limit can have no
/// more places than this (its `requests_per_unit` is at most this).
pub(crate) const MAX_HOLDS: usize = 10_000;

/// Hold ids up to this many bytes are kept as they are; a longer one as its SHA-256.
pub(crate) const LONGEST_KEPT_ID: usize = 64;

/// Bytes a release owed to a refused replay costs beyond its hold (a slot in one more index;
/// the id is shared). At most one per hold.
const OWED_OVERHEAD: u64 = 48;

/// Bytes a hold costs the memory backend beyond its id: its slots in two indexes and the
/// shared id's header (160, measured against the allocator, rounded up), and the slot of a
/// release it may come to owe, counted from the start so that a refused replay (noted while
/// a request is only checked) never takes its counter past the bound.
pub(crate) const HOLD_OVERHEAD: u64 = 160 + OWED_OVERHEAD;

/// A hold's id as it is stored: `=` and the id as sent (up to [`LONGEST_KEPT_ID`] bytes), or
/// `#` and the SHA-256 of a longer one. Injective, and at most 65 bytes however long the id.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HoldId(Arc<[u8]>);

impl HoldId {
    /// The stored form of the id a request sent.
    pub fn new(id: &[u8]) -> HoldId {
        let kept = id.len() <= LONGEST_KEPT_ID;
        let mut bytes = Vec::with_capacity(1 + if kept { id.len() } else { 32 });
        if kept {
            bytes.push(b'=');
            bytes.extend_from_slice(id);
        } else {
            bytes.push(b'#');
            bytes.extend_from_slice(&digest(id));
        }
        HoldId(bytes.into())
    }

    /// The stored bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The id as sent, when it was kept (`None` for a digested one).
    pub fn sent(&self) -> Option<&[u8]> {
        self.0.strip_prefix(b"=")
    }

    /// The id from its stored bytes (as the Redis holds keep it), if they are one's.
    pub(crate) fn from_stored(bytes: &[u8]) -> Option<HoldId> {
        match bytes.first() {
            Some(b'=') if bytes.len() <= 1 + LONGEST_KEPT_ID => Some(HoldId(bytes.into())),
            Some(b'#') if bytes.len() == 33 => Some(HoldId(bytes.into())),
            _ => None,
        }
    }

    /// The id as shown (the admin API): as sent where it is UTF-8, else escaped as `/top`
    /// escapes values, and a digested one as `\#sha256:<hex>`; and whether it is escaped.
    pub(crate) fn shown(&self) -> (String, bool) {
        match self.sent() {
            Some(id) => (
                crate::value::shown(id, usize::MAX).into_owned(),
                crate::value::is_escaped(id, usize::MAX),
            ),
            None => {
                let mut hex = Vec::with_capacity(64);
                crate::value::push_hex(&mut hex, &self.0[1..]);
                let hex = String::from_utf8(hex).expect("hex digits");
                (format!("\\#sha256:{hex}"), true)
            }
        }
    }
}

/// One live hold, for the admin API.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HoldView {
    /// Its id.
    pub id: HoldId,
    /// What it took (a place: 1).
    pub hits: u64,
    /// Time until it ends.
    pub ends_in: std::time::Duration,
}

/// Whether and how a hit names a hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Hold {
    /// Its descriptor's node has no `hold_key`: counted as ever.
    #[default]
    Unheld,
    /// Its node has a `hold_key` and the descriptor named no hold: an admission takes no
    /// hold (a concurrency limit is checked, no place taken), a refund gives nothing back.
    Unnamed,
    /// The hold the descriptor named.
    Named(HoldId),
}

impl Hold {
    /// Whether the hit's node keeps holds (named or not).
    pub fn is_held(&self) -> bool {
        !matches!(self, Hold::Unheld)
    }

    /// The id named, if any.
    pub fn id(&self) -> Option<&HoldId> {
        match self {
            Hold::Named(id) => Some(id),
            _ => None,
        }
    }
}

/// What one hold took.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Held {
    /// When it was taken (µs): which window its hits were charged to.
    pub at: u64,
    /// The hits it took (a place: 1).
    pub hits: u64,
    /// When it ends (µs): its window's end, the time its bucket tokens are refilled, or a
    /// place's lifetime.
    pub end: u64,
}

/// One counter's holds, by id and by end.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Holds {
    by_id: HashMap<HoldId, Held>,
    by_end: BTreeSet<(u64, HoldId)>,
    /// Heap bytes of the ids held (for the memory bound).
    id_bytes: u64,
    /// Holds that ended unreleased and were dropped since [`Holds::take_ended`] last ran.
    ended: u64,
    /// Releases owed by live holds to admissions refused because they named them (a replayed
    /// id): each is consumed by a release of that id before the hold itself is.
    owed: HashMap<HoldId, u32>,
}

impl Holds {
    /// How many are held (ended ones included until [`Holds::end_by`] drops them).
    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }

    /// The hold of `id`, if held and not ended at `now`.
    pub(crate) fn get(&self, id: &HoldId, now: u64) -> Option<Held> {
        self.by_id.get(id).filter(|h| h.end > now).copied()
    }

    /// Drops every hold ended by `now`; returns how many.
    pub(crate) fn end_by(&mut self, now: u64) -> u64 {
        let mut ended = 0;
        while let Some((end, _)) = self.by_end.first() {
            if *end > now {
                break;
            }
            let (_, id) = self.by_end.pop_first().expect("just seen");
            self.forget(&id);
            ended += 1;
        }
        self.ended += ended;
        ended
    }

    /// How many holds ended unreleased and were dropped since the last call.
    pub(crate) fn take_ended(&mut self) -> u64 {
        std::mem::take(&mut self.ended)
    }

    /// The earliest end of a hold, if any.
    pub(crate) fn first_end(&self) -> Option<u64> {
        self.by_end.first().map(|(end, _)| *end)
    }

    /// The latest end of a hold, if any.
    pub(crate) fn last_end(&self) -> Option<u64> {
        self.by_end.last().map(|(end, _)| *end)
    }

    /// Takes a hold under `id` (replacing one of that id). Past [`MAX_HOLDS`] the one that
    /// ends first is dropped; returns whether one was.
    pub(crate) fn take(&mut self, id: HoldId, held: Held) -> bool {
        self.release(&id);
        self.id_bytes += id.0.len() as u64;
        self.by_end.insert((held.end, id.clone()));
        self.by_id.insert(id, held);
        if self.by_id.len() > MAX_HOLDS {
            let (_, oldest) = self.by_end.pop_first().expect("more than MAX_HOLDS");
            self.forget(&oldest);
            return true;
        }
        false
    }

    /// Drops the hold that ends first (ties: the smallest id), as [`Holds::take`] does past
    /// [`MAX_HOLDS`]; returns whether there was one.
    pub(crate) fn drop_first(&mut self) -> bool {
        match self.by_end.pop_first() {
            Some((_, id)) => {
                self.forget(&id);
                true
            }
            None => false,
        }
    }

    /// Notes that an admission naming `id` was refused while `id` is held (a replayed id):
    /// that request's own release will come (Envoy sends the stream-done call for a refused
    /// request too) and must not end the hold of the request that took it. Saturates at
    /// `u32::MAX` releases owed; nothing is noted for an id not held.
    pub(crate) fn owe(&mut self, id: &HoldId) {
        if self.by_id.contains_key(id) {
            let n = self.owed.entry(id.clone()).or_insert(0);
            *n = n.saturating_add(1);
        }
    }

    /// A release naming `id`: consumes a release the hold owes, if any (and ends nothing), else
    /// ends the hold and returns what it took. So a refused replay's release never frees the
    /// place (or gives back the reservation) of the request it collided with; if the refused
    /// request's release never comes, the hold ends at its end (the safe direction).
    pub(crate) fn settle(&mut self, id: &HoldId) -> Option<Held> {
        if let Some(n) = self.owed.get_mut(id) {
            *n -= 1;
            if *n == 0 {
                self.owed.remove(id);
            }
            return None;
        }
        self.release(id)
    }

    /// Ends the hold of `id` and returns what it took, if it was held.
    pub(crate) fn release(&mut self, id: &HoldId) -> Option<Held> {
        let held = self.forget(id)?;
        self.by_end.remove(&(held.end, id.clone()));
        Some(held)
    }

    fn forget(&mut self, id: &HoldId) -> Option<Held> {
        let held = self.by_id.remove(id)?;
        self.id_bytes -= id.0.len() as u64;
        self.owed.remove(id);
        Some(held)
    }

    /// Every hold not ended at `now`, the first to end first.
    pub(crate) fn views(&self, now: u64) -> Vec<HoldView> {
        self.by_end
            .iter()
            .filter(|(end, _)| *end > now)
            .map(|(end, id)| HoldView {
                id: id.clone(),
                hits: self.by_id[id].hits,
                ends_in: std::time::Duration::from_micros(end - now),
            })
            .collect()
    }

    /// Heap bytes these holds cost, for the memory bound (the releases they may owe
    /// included).
    pub(crate) fn heap_bytes(&self) -> u64 {
        self.id_bytes + self.by_id.len() as u64 * HOLD_OVERHEAD
    }

    /// What one more hold under `id` would add to [`Holds::heap_bytes`].
    pub(crate) fn cost_of(id: &HoldId) -> u64 {
        id.0.len() as u64 + HOLD_OVERHEAD
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_kept_short_and_apart() {
        let short = HoldId::new(b"7f3a");
        assert_eq!(short.as_bytes(), b"=7f3a");
        assert_eq!(short.sent(), Some(&b"7f3a"[..]));
        let long = HoldId::new(&[b'x'; 65]);
        assert_eq!(long.as_bytes().len(), 33);
        assert_eq!(long.sent(), None);
        assert_ne!(long, HoldId::new(&[b'x'; 66]));
        // A short id that spells a digest's stored form is still another id.
        let spelled = HoldId::new(long.as_bytes());
        assert_ne!(spelled, long);
    }

    #[test]
    fn holds_end_release_once_and_stay_bounded() {
        let mut holds = Holds::default();
        let id = |i: usize| HoldId::new(i.to_string().as_bytes());
        for i in 0..MAX_HOLDS {
            let held = Held {
                at: i as u64,
                hits: 1,
                end: 1_000 + i as u64,
            };
            assert!(!holds.take(id(i), held));
        }
        let newest = Held {
            at: 0,
            hits: 2,
            end: 50_000,
        };
        assert!(holds.take(id(MAX_HOLDS), newest), "the oldest goes");
        assert_eq!(holds.len(), MAX_HOLDS);
        assert_eq!(holds.get(&id(0), 0), None);
        assert_eq!(holds.release(&id(MAX_HOLDS)), Some(newest));
        assert_eq!(holds.release(&id(MAX_HOLDS)), None, "once");
        assert_eq!(holds.end_by(1_010), 10, "holds 1..=10 end by 1,010");
        assert_eq!(holds.get(&id(11), 1_010), Some(holds.by_id[&id(11)]));
        assert_eq!(holds.first_end(), Some(1_011));
        let before = holds.heap_bytes();
        holds.release(&id(11));
        assert_eq!(before - holds.heap_bytes(), Holds::cost_of(&id(11)));
        let first = holds.first_end();
        assert!(holds.drop_first());
        assert_ne!(holds.first_end(), first, "the first to end went");
        assert_eq!(holds.len(), MAX_HOLDS - 13);
    }
}
