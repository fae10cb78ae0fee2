//! Counter keys: a readable, injective encoding of (domain, entries, limit identity).
//!
//! Each component is escaped (bytes outside a safe set become `%XX`, so `:`, `%`, `{`, `}`,
//! spaces, newlines and non-UTF-8 bytes never appear raw) and components are joined by `:`.
//! Distinct inputs therefore give distinct keys, and a key never contains a brace: a Redis hash
//! tag placed around a prefix of it is chosen by us, never by a request value.

use super::Limit;

/// An encoded counter key with the boundaries the Redis backend uses for hash tags.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CounterKey {
    bytes: Vec<u8>,
    domain_end: usize,
    descriptor_end: usize,
}

fn safe(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-_./*=@+,;!~#&()[]<>?|^$'\"`".contains(&b)
}

fn push_escaped(buf: &mut Vec<u8>, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    for &b in bytes {
        if safe(b) {
            buf.push(b);
        } else {
            buf.extend_from_slice(&[b'%', HEX[(b >> 4) as usize], HEX[(b & 15) as usize]]);
        }
    }
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

impl CounterKey {
    /// The key of a descriptor's entries in `domain` (without a limit identity yet).
    pub fn new<'a>(domain: &str, entries: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        let mut bytes = Vec::with_capacity(64);
        push_escaped(&mut bytes, domain.as_bytes());
        let domain_end = bytes.len();
        for (k, v) in entries {
            bytes.push(b':');
            push_escaped(&mut bytes, k.as_bytes());
            bytes.push(b':');
            push_escaped(&mut bytes, v.as_bytes());
        }
        let descriptor_end = bytes.len();
        CounterKey {
            bytes,
            domain_end,
            descriptor_end,
        }
    }

    /// Appends the identity of one limit: algorithm, window and `ordinal` (which of the
    /// descriptor's limits with that algorithm and window). Never its position among all of
    /// the descriptor's limits: inserting a limit with another window must not move counts.
    /// Limits differing in any of these never share state; a changed `requests_per_unit`
    /// keeps its count across a reload.
    pub fn with_limit(mut self, limit: &Limit, ordinal: u16) -> Self {
        self.bytes.push(b':');
        self.bytes.push(limit.algorithm.tag());
        push_decimal(&mut self.bytes, limit.window_us);
        self.bytes.push(b':');
        push_decimal(&mut self.bytes, ordinal as u64);
        self
    }

    /// The whole key.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The escaped domain (never empty for a valid request, never contains braces).
    pub fn domain_part(&self) -> &[u8] {
        &self.bytes[..self.domain_end]
    }

    /// The escaped domain and entries: what all limits of one descriptor share.
    pub fn descriptor_part(&self) -> &[u8] {
        &self.bytes[..self.descriptor_end]
    }

    /// The key split at `at` (a boundary above), for placing a hash tag around the head.
    pub fn split_at(&self, at: usize) -> (&[u8], &[u8]) {
        self.bytes.split_at(at)
    }

    /// Length of the domain part.
    pub fn domain_len(&self) -> usize {
        self.domain_end
    }

    /// Length of the descriptor part.
    pub fn descriptor_len(&self) -> usize {
        self.descriptor_end
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

    #[test]
    fn keys_are_readable_and_brace_free() {
        let limit = Limit {
            algorithm: Algorithm::SlidingWindow,
            requests_per_unit: 1,
            window_us: 1_000_000,
            burst: 1,
        };
        let k = CounterKey::new("edge", [("path", "/a b:{c}\n")]).with_limit(&limit, 0);
        assert_eq!(
            String::from_utf8_lossy(k.as_bytes()),
            "edge:path:/a%20b%3A%7Bc%7D%0A:s1000000:0"
        );
        assert_eq!(k.domain_part(), b"edge");
        assert_eq!(k.descriptor_part(), b"edge:path:/a%20b%3A%7Bc%7D%0A");
    }

    proptest::proptest! {
        #[test]
        fn injective_and_never_braced(
            a in proptest::collection::vec((".{0,5}", ".{0,5}"), 0..4),
            b in proptest::collection::vec((".{0,5}", ".{0,5}"), 0..4),
            da in ".{1,4}",
            db in ".{1,4}",
        ) {
            let ka = CounterKey::new(&da, a.iter().map(|(k, v)| (k.as_str(), v.as_str())));
            let kb = CounterKey::new(&db, b.iter().map(|(k, v)| (k.as_str(), v.as_str())));
            proptest::prop_assert_eq!(ka.as_bytes() == kb.as_bytes(), a == b && da == db);
            let braced = ka.as_bytes().iter().any(|c| b"{}".contains(c));
            proptest::prop_assert!(!braced, "a brace in {:?}", ka);
        }
    }
}
