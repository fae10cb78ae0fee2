//! Counter keys: a readable, injective encoding of (domain, entries, limit identity).
//!
//! Each component is escaped (bytes outside a safe set become `%XX`, so `:`, `%`, `{`, `}`,
//! spaces, newlines and non-UTF-8 bytes never appear raw) and components are joined by `:`.
//! Distinct inputs therefore give distinct keys, and a key never contains a brace: a Redis hash
//! tag placed around a prefix of it is chosen by us, never by a request value.
//!
//! A request's value longer than the format's longest kept is counted under its SHA-256,
//! written `%#<64 hex digits>`: escaping writes `%` only before two uppercase hex digits, so
//! no value's escaped form is a digest's, and a key's length stays bounded by the config.

use super::{Limit, Zone};
use crate::value::{DEFAULT_LONGEST_KEPT, digest, push_hex};

/// What a key's Redis Cluster hash tag covers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HashTag {
    /// The domain: one slot per domain, so one script call decides a whole request.
    #[default]
    Domain,
    /// The domain and the descriptor's entries: spreads a busy domain over the cluster.
    Descriptor,
}

/// The one place a counter's key is built, final bytes included:
/// `<prefix>{<escaped domain>}:<k>:<v>…:<limit identity>` (or, per descriptor,
/// `<prefix>{<domain>:<k>:<v>…}:<limit identity>`). Every backend stores the key as it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyFormat {
    prefix: Box<[u8]>,
    tag: HashTag,
    longest_value: usize,
}

impl Default for KeyFormat {
    fn default() -> Self {
        KeyFormat {
            prefix: Box::default(),
            tag: HashTag::default(),
            longest_value: DEFAULT_LONGEST_KEPT,
        }
    }
}

/// A key prefix that would move the hash tag.
#[derive(Debug, thiserror::Error)]
#[error("key prefix '{0}' must not contain '{{' or '}}' (it would move the hash tag)")]
pub struct PrefixError(pub String);

impl KeyFormat {
    /// Keys starting with `prefix`, hash-tagged as `tag` says.
    pub fn new(prefix: &str, tag: HashTag) -> Result<KeyFormat, PrefixError> {
        if prefix.contains(['{', '}']) {
            return Err(PrefixError(prefix.to_owned()));
        }
        Ok(KeyFormat {
            prefix: prefix.as_bytes().into(),
            tag,
            longest_value: DEFAULT_LONGEST_KEPT,
        })
    }

    /// The same format, counting a request's value longer than `bytes` under its digest.
    pub fn with_longest_value(self, bytes: usize) -> KeyFormat {
        KeyFormat {
            longest_value: bytes,
            ..self
        }
    }

    /// The longest request value counted as it is; a longer one is counted under its digest.
    pub fn longest_value(&self) -> usize {
        self.longest_value
    }

    /// The prefix every key starts with.
    pub fn prefix(&self) -> &[u8] {
        &self.prefix
    }

    /// What the hash tag covers.
    pub fn hash_tag(&self) -> HashTag {
        self.tag
    }

    /// The key of a descriptor's (key, counted value) entries in `domain`, without a limit
    /// identity yet (see [`CounterKey::with_limit`]).
    pub fn descriptor_key<'a, K, V>(
        &self,
        domain: &str,
        entries: impl IntoIterator<Item = (&'a K, &'a V)>,
    ) -> CounterKey
    where
        K: AsRef<[u8]> + ?Sized + 'a,
        V: AsRef<[u8]> + ?Sized + 'a,
    {
        self.key_of(
            KeyPart::Raw(domain.as_bytes()),
            entries
                .into_iter()
                .map(|(k, v)| (KeyPart::Raw(k.as_ref()), KeyPart::Value(v.as_ref()))),
        )
    }

    /// [`KeyFormat::descriptor_key`] of parts some of which were escaped beforehand (the
    /// config's own names, escaped once when it compiles): the same bytes.
    pub(crate) fn key_of<'a>(
        &self,
        domain: KeyPart<'a>,
        entries: impl IntoIterator<Item = (KeyPart<'a>, KeyPart<'a>)>,
    ) -> CounterKey {
        let mut bytes = Vec::with_capacity(self.prefix.len() + domain.len() + 64);
        bytes.extend_from_slice(&self.prefix);
        bytes.push(b'{');
        let tag_start = bytes.len();
        domain.push_to(&mut bytes, self.longest_value);
        let mut tag_end = bytes.len();
        if self.tag == HashTag::Domain {
            bytes.push(b'}');
        }
        for (k, v) in entries {
            bytes.push(b':');
            k.push_to(&mut bytes, self.longest_value);
            bytes.push(b':');
            v.push_to(&mut bytes, self.longest_value);
        }
        if self.tag == HashTag::Descriptor {
            tag_end = bytes.len();
            bytes.push(b'}');
        }
        CounterKey {
            bytes,
            tag: (tag_start as u32, tag_end as u32),
        }
    }
}

/// One component of a key: as the request or config spells it, or already [`escaped`].
#[derive(Clone, Copy, Debug)]
pub(crate) enum KeyPart<'a> {
    /// To be escaped (a name, the config's or Envoy's).
    Raw(&'a [u8]),
    /// A request's value: escaped, or its digest when longer than the longest kept.
    Value(&'a [u8]),
    /// Escaped by [`escaped`].
    Escaped(&'a [u8]),
}

impl KeyPart<'_> {
    fn len(&self) -> usize {
        match self {
            KeyPart::Raw(s) | KeyPart::Value(s) | KeyPart::Escaped(s) => s.len(),
        }
    }

    fn push_to(self, buf: &mut Vec<u8>, longest_value: usize) {
        match self {
            KeyPart::Value(v) if v.len() > longest_value => {
                buf.extend_from_slice(b"%#");
                push_hex(buf, &digest(v));
            }
            KeyPart::Raw(s) | KeyPart::Value(s) => push_escaped(buf, s),
            KeyPart::Escaped(b) => buf.extend_from_slice(b),
        }
    }
}

/// `s` escaped as a key component, for [`KeyPart::Escaped`].
pub(crate) fn escaped(s: &str) -> Box<[u8]> {
    let mut buf = Vec::with_capacity(s.len());
    push_escaped(&mut buf, s.as_bytes());
    buf.into_boxed_slice()
}

/// [`escaped`], or `None` where escaping leaves `s` as it is (its bytes are then the escaped
/// form, and nothing need be kept).
pub(crate) fn escaped_if_needed(s: &str) -> Option<Box<[u8]>> {
    s.bytes().any(|b| !SAFE[b as usize]).then(|| escaped(s))
}

/// A counter's key: final bytes, and where its hash tag's content lies.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CounterKey {
    bytes: Vec<u8>,
    tag: (u32, u32),
}

/// Bytes a key holds as they are; every other byte is written `%XX`.
const SAFE: [bool; 256] = {
    let others = b"-_./*=@+,;!~#&()[]<>?|^$'\"`";
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        table[b] = (b as u8).is_ascii_alphanumeric();
        b += 1;
    }
    let mut i = 0;
    while i < others.len() {
        table[others[i] as usize] = true;
        i += 1;
    }
    table
};

/// Appends `bytes` escaped (this runs for every descriptor entry of every request). A value without
/// a byte to escape, the common case, is copied whole. Otherwise the escaped length is counted
/// first and every byte written in place: a call per byte once made a value of 4 KiB all to escape
/// cost enough to starve every other client (docs/performance.md, "Measurements behind the code").
fn push_escaped(buf: &mut Vec<u8>, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let Some(first) = bytes.iter().position(|&b| !SAFE[b as usize]) else {
        buf.extend_from_slice(bytes);
        return;
    };
    buf.extend_from_slice(&bytes[..first]);
    let rest = &bytes[first..];
    // Plain indexing: no call per byte, in a debug build either.
    let (mut escapes, mut i) = (0, 0);
    while i < rest.len() {
        escapes += !SAFE[rest[i] as usize] as usize;
        i += 1;
    }
    // Zeroed by the allocator, not byte by byte as a resize in place is in a debug build.
    let mut out = vec![0; rest.len() + 2 * escapes];
    let (mut i, mut j) = (0, 0);
    while i < rest.len() {
        let b = rest[i];
        if SAFE[b as usize] {
            out[j] = b;
            j += 1;
        } else {
            out[j] = b'%';
            out[j + 1] = HEX[(b >> 4) as usize];
            out[j + 2] = HEX[(b & 15) as usize];
            j += 3;
        }
        i += 1;
    }
    buf.extend_from_slice(&out);
}

/// Appends `n` in decimal without allocating (this runs for every limit of every request).
fn push_decimal(buf: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    buf.extend_from_slice(&digits[i..]);
}

/// The end of a limit's counter keys, `:<algorithm tag><window µs>[~<zone>]:<ordinal>` (see
/// [`CounterKey::with_limit`]): 28 bytes at most kept inline (a 20-digit window, a 5-digit
/// ordinal), and a calendar's zone by reference (its IANA name, at most 32 bytes in the
/// database, every byte one a key holds as it is). Kept once per configured limit, so its size
/// counts in a large config's memory. The default is empty: no limit's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimitIdentity {
    len: u8,
    /// Where `:<ordinal>` starts in `bytes` (a zone goes before it).
    split: u8,
    bytes: [u8; 28],
    zone: Option<&'static Zone>,
}

impl LimitIdentity {
    /// The identity of `limit` as the `ordinal`-th of its descriptor's limits with its
    /// algorithm and window (and calendar zone: a calendar's counters are never an epoch
    /// window's, nor another zone's). A concurrency limit's identity has no window
    /// ([`Limit::counter_window_us`]): `:c:<ordinal>`.
    pub fn new(limit: &Limit, ordinal: u16) -> Self {
        let mut buf = Vec::with_capacity(28);
        buf.push(b':');
        buf.push(limit.algorithm.tag());
        if let Some(window_us) = limit.counter_window_us() {
            push_decimal(&mut buf, window_us);
        }
        let split = buf.len();
        buf.push(b':');
        push_decimal(&mut buf, ordinal as u64);
        let mut bytes = [0; 28];
        bytes[..buf.len()].copy_from_slice(&buf);
        LimitIdentity {
            len: buf.len() as u8,
            split: split as u8,
            bytes,
            zone: limit.calendar.map(|c| c.zone()),
        }
    }

    /// Appends the bytes a key ends with. Zone names are the database's: letters, digits,
    /// '/', '_', '-' and '+', all bytes a key holds as they are (never ':'), so keys stay
    /// injective.
    pub fn push_to(&self, buf: &mut Vec<u8>) {
        match self.zone {
            None => buf.extend_from_slice(&self.bytes[..self.len as usize]),
            Some(zone) => {
                buf.extend_from_slice(&self.bytes[..self.split as usize]);
                buf.push(b'~');
                push_escaped(buf, zone.name().as_bytes());
                buf.extend_from_slice(&self.bytes[self.split as usize..self.len as usize]);
            }
        }
    }

    /// How many bytes [`push_to`](Self::push_to) appends.
    pub fn len(&self) -> usize {
        self.len as usize + self.zone.map_or(0, |z| 1 + z.name().len())
    }

    /// The bytes a key ends with.
    #[cfg(test)]
    fn to_vec(self) -> Vec<u8> {
        let mut buf = Vec::new();
        self.push_to(&mut buf);
        buf
    }
}

impl CounterKey {
    /// The key of a descriptor in `domain` with the default format (no prefix, domain tag).
    pub fn new<'a, K, V>(domain: &str, entries: impl IntoIterator<Item = (&'a K, &'a V)>) -> Self
    where
        K: AsRef<[u8]> + ?Sized + 'a,
        V: AsRef<[u8]> + ?Sized + 'a,
    {
        KeyFormat::default().descriptor_key(domain, entries)
    }

    /// Appends the identity of one limit: algorithm, window and `ordinal` (which of the
    /// descriptor's limits with that algorithm and window). Never its position among all of
    /// the descriptor's limits: inserting a limit with another window must not move counts.
    /// Limits differing in any of these never share state; a changed `requests_per_unit`
    /// keeps its count across a reload.
    pub fn with_limit(self, limit: &Limit, ordinal: u16) -> Self {
        self.with_identity(&LimitIdentity::new(limit, ordinal))
    }

    /// [`CounterKey::with_limit`] with the identity built beforehand (a configured limit's is
    /// built once, when its config compiles).
    pub fn with_identity(mut self, identity: &LimitIdentity) -> Self {
        identity.push_to(&mut self.bytes);
        self
    }

    /// [`CounterKey::with_identity`] on a copy, reserving exactly what the identity needs.
    pub fn for_identity(&self, identity: &LimitIdentity) -> Self {
        let mut bytes = Vec::with_capacity(self.bytes.len() + identity.len());
        bytes.extend_from_slice(&self.bytes);
        identity.push_to(&mut bytes);
        CounterKey {
            bytes,
            tag: self.tag,
        }
    }

    /// The whole key, as stored.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The hash tag's content (between the braces): what decides the cluster slot.
    pub fn tag(&self) -> &[u8] {
        &self.bytes[self.tag.0 as usize..self.tag.1 as usize]
    }

    /// The key up to and including the hash tag's closing brace: `<prefix>{<tag>}`. A key that
    /// continues it with anything but `:` lies in the same slot and is never a counter's key.
    pub fn through_tag(&self) -> &[u8] {
        &self.bytes[..self.tag.1 as usize + 1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Algorithm;

    #[test]
    fn decimals() {
        for n in [0, 7, 10, 1_000_000, u64::MAX] {
            let mut buf = Vec::new();
            push_decimal(&mut buf, n);
            assert_eq!(buf, n.to_string().as_bytes());
        }
    }

    /// The escaping is part of every stored key: changing which bytes pass would move every
    /// counter on upgrade. These, and only these, are kept as they are.
    #[test]
    fn exactly_the_safe_bytes_pass_unescaped() {
        let kept = b"-_./*=@+,;!~#&()[]<>?|^$'\"`";
        for b in 0..=255u8 {
            let mut buf = b"x".to_vec();
            push_escaped(&mut buf, &[b'a', b, b'z']);
            let expected = if b.is_ascii_alphanumeric() || kept.contains(&b) {
                vec![b'x', b'a', b, b'z']
            } else {
                format!("xa%{b:02X}z").into_bytes()
            };
            assert_eq!(buf, expected, "byte {b}");
        }
    }

    fn limit() -> Limit {
        Limit {
            algorithm: Algorithm::SlidingWindow,
            requests_per_unit: 1,
            window_us: 1_000_000,
            burst: 1,
            calendar: None,
        }
    }

    #[test]
    fn keys_are_readable_and_carry_exactly_our_tag() {
        let entries = [("path", "/a b:{c}\n")];
        let k = CounterKey::new("edge", entries).with_limit(&limit(), 0);
        assert_eq!(
            String::from_utf8_lossy(k.as_bytes()),
            "{edge}:path:/a%20b%3A%7Bc%7D%0A:s1000000:0"
        );
        assert_eq!(k.tag(), b"edge");
        assert_eq!(k.through_tag(), b"{edge}");
        let per_descriptor = KeyFormat::new("rl:", HashTag::Descriptor).unwrap();
        let base = per_descriptor.descriptor_key("edge", entries);
        let k = base.for_identity(&LimitIdentity::new(&limit(), 3));
        assert_eq!(k, base.with_limit(&limit(), 3));
        assert_eq!(
            String::from_utf8_lossy(k.as_bytes()),
            "rl:{edge:path:/a%20b%3A%7Bc%7D%0A}:s1000000:3"
        );
        assert_eq!(k.tag(), b"edge:path:/a%20b%3A%7Bc%7D%0A");
        assert_eq!(k.through_tag(), b"rl:{edge:path:/a%20b%3A%7Bc%7D%0A}");
        assert!(KeyFormat::new("rl{x}:", HashTag::Domain).is_err());
    }

    #[test]
    fn a_concurrency_limits_identity_names_no_lifetime() {
        let places = |window_us| Limit {
            algorithm: Algorithm::Concurrency,
            window_us,
            ..limit()
        };
        let id = LimitIdentity::new(&places(600_000_000), 1);
        assert_eq!(id.to_vec(), b":c:1");
        assert_eq!(id, LimitIdentity::new(&places(1_000_000), 1));
        assert_eq!(id.len(), 4);
    }

    #[test]
    fn the_longest_limit_identity_fits() {
        let widest = Limit {
            window_us: u64::MAX,
            ..limit()
        };
        let id = LimitIdentity::new(&widest, u16::MAX);
        assert_eq!(id.to_vec(), b":s18446744073709551615:65535");
        assert_eq!(LimitIdentity::default().to_vec(), b"");
        // Every zone of the database, with the widest window and ordinal, fits whole.
        let mut zones = 0;
        for name in jiff::tz::db().available() {
            let Some(zone) = crate::limiter::calendar::zone(name.as_str()) else {
                continue; // a name that is an alias of one already seen, or not a zone
            };
            let calendar =
                crate::limiter::Calendar::new(zone, crate::limiter::CalendarUnit::Year, 1).unwrap();
            let widest = Limit {
                window_us: u64::MAX,
                calendar: Some(calendar),
                ..limit()
            };
            let id = LimitIdentity::new(&widest, u16::MAX);
            let want = format!(":s18446744073709551615~{}:65535", zone.name());
            assert_eq!(String::from_utf8_lossy(&id.to_vec()), want);
            assert_eq!(id.len(), want.len());
            zones += 1;
        }
        assert!(zones > 300, "{zones} zones");
    }

    #[test]
    fn a_calendar_limit_has_counters_of_its_own() {
        let zone = crate::limiter::calendar::zone("Asia/Kolkata").unwrap();
        let day = Limit {
            algorithm: Algorithm::FixedWindow,
            window_us: 86_400_000_000,
            ..limit()
        };
        let calendar = Limit {
            calendar: Some(
                crate::limiter::Calendar::new(zone, crate::limiter::CalendarUnit::Day, 1).unwrap(),
            ),
            ..day
        };
        let key = |l: &Limit| {
            let k = CounterKey::new("d", [("k", "v")]).with_limit(l, 0);
            String::from_utf8_lossy(k.as_bytes()).into_owned()
        };
        assert_eq!(key(&day), "{d}:k:v:f86400000000:0");
        assert_eq!(key(&calendar), "{d}:k:v:f86400000000~Asia/Kolkata:0");
    }

    proptest::proptest! {
        #[test]
        fn injective_with_exactly_one_tag(
            a in proptest::collection::vec((".{0,5}", ".{0,5}"), 0..4),
            b in proptest::collection::vec((".{0,5}", ".{0,5}"), 0..4),
            da in ".{1,4}",
            db in ".{1,4}",
            per_descriptor: bool,
        ) {
            let tag = if per_descriptor { HashTag::Descriptor } else { HashTag::Domain };
            let format = KeyFormat::new("p:", tag).unwrap();
            let ka = format.descriptor_key(&da, a.iter().map(|(k, v)| (k.as_str(), v.as_str())));
            let kb = format.descriptor_key(&db, b.iter().map(|(k, v)| (k.as_str(), v.as_str())));
            proptest::prop_assert_eq!(ka.as_bytes() == kb.as_bytes(), a == b && da == db);
            let braces: Vec<usize> = ka.as_bytes().iter().enumerate()
                .filter(|(_, c)| b"{}".contains(c)).map(|(i, _)| i).collect();
            proptest::prop_assert_eq!(braces.len(), 2, "{:?}", ka);
            proptest::prop_assert_eq!(&ka.as_bytes()[braces[0] + 1..braces[1]], ka.tag());
        }
    }
}
