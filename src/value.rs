//! Descriptor values as clients send them: any bytes (HTTP allows any but NUL, CR and LF in a
//! header value, so not necessarily UTF-8) and any length Envoy passes (60 KiB by default).
//! Every value is decided; what is bounded is what is kept and shown:
//!
//! - A value longer than the longest kept (`--max-value-bytes`) is counted under its SHA-256:
//!   two long values that differ in any byte are two counters (a collision among `n` distinct
//!   values has probability below `n² / 2^257`), and a counter's key stays short.
//! - A value is shown (in `/top`, the admin API, logs, metric names, statsd, traces) as it is
//!   when it is UTF-8 and kept as it is. Otherwise it is *escaped*: UTF-8 text that names its
//!   bytes, each byte that is not part of valid UTF-8 written `\xHH` and a backslash `\\`, or
//!   for a value counted under its digest `\#sha256:<64 hex digits>`. Where the output has
//!   room for it (`/top`'s JSON, the admin API), an escaped value is marked so, and [`unshown`]
//!   reads it back; in a metric name or a log line the escaped text stands alone.

use std::borrow::Cow;

/// A descriptor entry as sent: its key and value, bytes.
pub(crate) type KeyValue<'a> = (&'a [u8], &'a [u8]);

/// A descriptor's entries, keys and values as bytes, held.
pub(crate) type OwnedEntries = Vec<(Vec<u8>, Vec<u8>)>;

/// Held entries, borrowed as a request's are.
pub(crate) fn borrowed(entries: &[(Vec<u8>, Vec<u8>)]) -> Vec<KeyValue<'_>> {
    entries.iter().map(|(k, v)| (&k[..], &v[..])).collect()
}

/// The longest value kept as it is unless the settings say otherwise (`--max-value-bytes`).
pub(crate) const DEFAULT_LONGEST_KEPT: usize = 4096;

/// How a digest begins when shown.
const SHOWN_DIGEST: &str = "\\#sha256:";

/// The SHA-256 of `value`.
pub(crate) fn digest(value: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, value);
    let mut out = [0; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// Appends `bytes` in lowercase hexadecimal.
pub(crate) fn push_hex(out: &mut Vec<u8>, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        out.push(HEX[(b >> 4) as usize]);
        out.push(HEX[(b & 15) as usize]);
    }
}

/// `value` shown as text (see the module's comment): borrowed as it is when it is UTF-8 and
/// not longer than `longest`, the common case; else [`escaped`].
pub(crate) fn shown(value: &[u8], longest: usize) -> Cow<'_, str> {
    match std::str::from_utf8(value) {
        Ok(s) if value.len() <= longest => Cow::Borrowed(s),
        _ => Cow::Owned(escaped(value, longest)),
    }
}

/// Whether [`shown`] escapes `value`.
pub(crate) fn is_escaped(value: &[u8], longest: usize) -> bool {
    value.len() > longest || std::str::from_utf8(value).is_err()
}

/// `value` escaped: its digest past `longest`, else its text with each byte that is not part
/// of valid UTF-8 as `\xHH` and each backslash doubled.
pub(crate) fn escaped(value: &[u8], longest: usize) -> String {
    if value.len() > longest {
        let mut out = SHOWN_DIGEST.as_bytes().to_vec();
        push_hex(&mut out, &digest(value));
        return String::from_utf8(out).expect("ASCII");
    }
    let mut out = String::with_capacity(value.len() + 8);
    for chunk in value.utf8_chunks() {
        for c in chunk.valid().chars() {
            if c == '\\' {
                out.push_str("\\\\");
            } else {
                out.push(c);
            }
        }
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out
}

/// The bytes an [`escaped`] value names, or `None` where it names a digest (the value itself is
/// not kept) or is no shown value (a lone `\`, or `\x` without two hex digits).
pub(crate) fn unshown(shown: &str) -> Option<Vec<u8>> {
    if shown.starts_with(SHOWN_DIGEST) {
        return None;
    }
    let bytes = shown.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => match bytes.get(i + 1)? {
                b'\\' => {
                    out.push(b'\\');
                    i += 2;
                }
                b'x' => {
                    let hex = std::str::from_utf8(bytes.get(i + 2..i + 4)?).ok()?;
                    out.push(u8::from_str_radix(hex, 16).ok()?);
                    i += 4;
                }
                _ => return None,
            },
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_escaped_value_names_its_bytes_and_reads_back() {
        let cases: [&[u8]; 9] = [
            b"plain",
            b"caf\xe9",
            b"\xff\xfe",
            b"ok\xc0\xafx",
            b"\xed\xa0\x80",
            b"\x80",
            b"back\\slash",
            b"\\x41",
            "caf\u{e9} \u{1f600}".as_bytes(),
        ];
        let mut seen = std::collections::HashSet::new();
        for v in cases {
            let s = escaped(v, 64);
            assert_eq!(unshown(&s).as_deref(), Some(v), "{s}");
            assert!(seen.insert(s), "two values escaped alike");
        }
        assert_eq!(escaped(b"caf\xe9", 64), "caf\\xe9");
        assert_eq!(escaped(b"\\x41", 64), "\\\\x41");
    }

    #[test]
    fn a_utf8_value_is_shown_as_it_is_and_others_escaped() {
        assert!(matches!(shown(b"a\\b", 64), Cow::Borrowed("a\\b")));
        assert!(!is_escaped(b"a\\b", 64));
        assert_eq!(shown(b"caf\xe9", 64), "caf\\xe9");
        assert!(is_escaped(b"caf\xe9", 64));
    }

    #[test]
    fn a_long_value_is_shown_as_its_digest() {
        let long = vec![b'a'; 65];
        let s = shown(&long, 64);
        assert!(s.starts_with("\\#sha256:") && s.len() == 9 + 64, "{s}");
        assert!(is_escaped(&long, 64));
        assert_eq!(unshown(&s), None);
        let mut other = long.clone();
        other[0] = b'b';
        assert_ne!(shown(&other, 64), s);
        assert_eq!(shown(&long[..64], 64), "a".repeat(64));
    }
}
