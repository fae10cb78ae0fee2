//! Renders the limits' `answer`s (config/answer.rs) into what Envoy passes on: headers for the
//! client and, on a refusal, a body. Only limits that have an answer (their own or the
//! server's default) cost anything; without any, [`render`] returns at its first check.
//!
//! On a 429 the limit the client must wait longest for speaks (as Envoy 1.40 picks
//! `Retry-After`): its `over_limit` headers and body. On every answer, each descriptor's
//! reported limit adds its `headers`. A request a soft limit let through gets, for each soft
//! limit over, its `over_limit.upstream_headers` on the way to the upstream ([`SOFT_HEADER`]
//! when it names none) and its `over_limit.headers` on the answer. A name is set once, the
//! speaker's first, then in request order; each set stops at [`RESPONSE_HEADERS_BYTES`].

use std::time::Duration;

use super::headers::secs_ceil;
use super::wire::RateLimitRequest;
use crate::config::Unit;
use crate::config::answer::{Answer, BodyKind, Piece, Template, VALUE_BYTES, Var};
use crate::engine::{Code, Response, Status};

/// The most bytes (names and values) of answer headers one response carries (and, apart, of
/// headers for the upstream).
pub(crate) const RESPONSE_HEADERS_BYTES: usize = 16 * 1024;

/// The header a soft limit over adds to the upstream request when its answer names none: the
/// limit's name (`over` when it has none).
pub(crate) const SOFT_HEADER: &str = "x-ratelimit-soft";

/// What the answers add to a response.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Rendered {
    /// Headers for the client, names lowercase, each name once.
    pub(crate) headers: Vec<(String, String)>,
    /// Headers for the upstream (soft limits over), names lowercase, each name once.
    pub(crate) upstream: Vec<(String, String)>,
    /// The 429's body, and its content type.
    pub(crate) body: Option<(Vec<u8>, String)>,
}

/// What a template can say about one status.
struct Vars<'a> {
    status: &'a Status,
    key: &'a [u8],
    value: &'a [u8],
    domain: &'a [u8],
}

/// Where a rendered variable goes, which says how it is escaped.
#[derive(Clone, Copy)]
enum Escape {
    /// A header value: printable ASCII only, anything else dropped.
    Header,
    /// The inside of a JSON string.
    Json,
    /// Text: control characters dropped.
    Text,
}

/// A unit as `rate_limit.unit` writes it.
fn unit_name(unit: Unit) -> &'static str {
    match unit {
        Unit::Second => "second",
        Unit::Minute => "minute",
        Unit::Hour => "hour",
        Unit::Day => "day",
        Unit::Week => "week",
        Unit::Month => "month",
        Unit::Year => "year",
    }
}

fn ceil_ms(d: Duration) -> u128 {
    d.as_nanos().div_ceil(1_000_000)
}

/// At most [`VALUE_BYTES`] of `bytes`.
fn cut(bytes: &[u8]) -> &[u8] {
    &bytes[..bytes.len().min(VALUE_BYTES)]
}

fn push_escaped(out: &mut String, bytes: &[u8], sink: Escape) {
    let bytes = cut(bytes);
    match sink {
        Escape::Header => out.extend(
            bytes
                .iter()
                .filter(|b| (b' '..=b'~').contains(*b))
                .map(|b| *b as char),
        ),
        Escape::Json => {
            for c in String::from_utf8_lossy(bytes).chars() {
                match c {
                    '"' => out.push_str("\\\""),
                    '\\' => out.push_str("\\\\"),
                    c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                    c => out.push(c),
                }
            }
        }
        Escape::Text => out.extend(
            String::from_utf8_lossy(bytes)
                .chars()
                .filter(|c| !c.is_control()),
        ),
    }
}

fn render_template(t: &Template, v: &Vars<'_>, sink: Escape, out: &mut String) {
    let limit = v.status.limit.as_ref();
    let reset = v.status.reset.unwrap_or_default();
    for piece in &t.pieces {
        match piece {
            Piece::Text(text) => out.push_str(text),
            Piece::Var(var) => match var {
                Var::Name => push_escaped(
                    out,
                    limit
                        .and_then(|l| l.name.as_deref())
                        .unwrap_or_default()
                        .as_bytes(),
                    sink,
                ),
                Var::RequestsPerUnit => {
                    out.push_str(&limit.map_or(0, |l| l.requests_per_unit).to_string())
                }
                Var::Unit => out.push_str(limit.map_or("", |l| unit_name(l.unit))),
                Var::WindowSeconds => {
                    out.push_str(&limit.map_or(0, |l| l.window.as_secs()).to_string())
                }
                Var::Remaining => out.push_str(&v.status.remaining.to_string()),
                Var::ResetSeconds => out.push_str(&secs_ceil(reset).to_string()),
                Var::ResetMs => out.push_str(&ceil_ms(reset).to_string()),
                Var::Key => push_escaped(out, v.key, sink),
                Var::Value => push_escaped(out, v.value, sink),
                Var::Domain => push_escaped(out, v.domain, sink),
            },
        }
    }
}

/// The answers of `resp` to `req`; `default` is the server's for limits without their own.
/// `None` when no reported limit has one.
pub(crate) fn render(
    req: &RateLimitRequest,
    resp: &Response,
    default: Option<&Answer>,
) -> Option<Rendered> {
    fn answer_of<'a>(s: &'a Status, default: Option<&'a Answer>) -> Option<&'a Answer> {
        s.limit.as_ref()?.answer.as_deref().or(default)
    }
    let answer_of = |s| answer_of(s, default);
    if resp.soft.is_empty() && !resp.statuses.iter().any(|s| answer_of(s).is_some()) {
        return None;
    }
    let vars = |i: usize| {
        let last = req.descriptors.get(i).and_then(|d| d.entries.last());
        Vars {
            status: &resp.statuses[i],
            key: last.map_or(&[][..], |e| &e.key[..]),
            value: last.map_or(&[][..], |e| &e.value[..]),
            domain: &req.domain,
        }
    };
    // The refusal's speaker: of the statuses over, the one that resets last (the first of
    // equals).
    let speaker = (resp.overall == Code::OverLimit)
        .then(|| {
            let mut best: Option<usize> = None;
            for (i, s) in resp.statuses.iter().enumerate() {
                if s.code == Code::OverLimit
                    && best.is_none_or(|b| s.reset > resp.statuses[b].reset)
                {
                    best = Some(i);
                }
            }
            best
        })
        .flatten();
    let mut out = Rendered::default();
    let mut bytes = 0;
    let mut add = |out: &mut Rendered, name: &str, t: &Template, v: &Vars<'_>| {
        let mut value = String::new();
        render_template(t, v, Escape::Header, &mut value);
        push(&mut out.headers, &mut bytes, name, value);
    };
    if let Some(i) = speaker
        && let Some(answer) = answer_of(&resp.statuses[i])
    {
        let v = vars(i);
        if let Some(over) = &answer.over_limit {
            for (name, t) in &over.headers {
                add(&mut out, name, t, &v);
            }
            if let Some(body) = &over.body {
                let sink = match over.kind {
                    BodyKind::Json => Escape::Json,
                    BodyKind::Text => Escape::Text,
                };
                let mut text = String::new();
                render_template(body, &v, sink, &mut text);
                out.body = Some((text.into_bytes(), over.content_type.to_string()));
            }
        }
        for (name, t) in &answer.headers {
            add(&mut out, name, t, &v);
        }
    }
    for (i, s) in resp.statuses.iter().enumerate() {
        if Some(i) == speaker {
            continue;
        }
        if let Some(answer) = answer_of(s) {
            let v = vars(i);
            for (name, t) in &answer.headers {
                add(&mut out, name, t, &v);
            }
        }
    }
    let mut upstream_bytes = 0;
    for soft in &resp.soft {
        let v = Vars {
            status: &soft.status,
            ..vars(soft.descriptor)
        };
        let over = answer_of(&soft.status).and_then(|a| a.over_limit.as_ref());
        match over {
            Some(over) if !over.upstream_headers.is_empty() => {
                for (name, t) in &over.upstream_headers {
                    let mut value = String::new();
                    render_template(t, &v, Escape::Header, &mut value);
                    push(&mut out.upstream, &mut upstream_bytes, name, value);
                }
            }
            _ => {
                let name = soft.status.limit.as_ref().and_then(|l| l.name.as_deref());
                let mut value = String::new();
                push_escaped(
                    &mut value,
                    name.unwrap_or("over").as_bytes(),
                    Escape::Header,
                );
                push(&mut out.upstream, &mut upstream_bytes, SOFT_HEADER, value);
            }
        }
        for (name, t) in over.map_or(&[][..], |o| &o.headers[..]) {
            add(&mut out, name, t, &v);
        }
    }
    Some(out)
}

/// Adds header `name: value` to `set` unless the name is there, or `bytes` (the set's size so
/// far) would pass [`RESPONSE_HEADERS_BYTES`].
fn push(set: &mut Vec<(String, String)>, bytes: &mut usize, name: &str, value: String) {
    if set.iter().any(|(n, _)| n == name) {
        return;
    }
    if *bytes + name.len() + value.len() > RESPONSE_HEADERS_BYTES {
        return;
    }
    *bytes += name.len() + value.len();
    set.push((name.to_owned(), value));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_escaped_for_where_they_go() {
        let hostile = b"a\"b\\c\r\nd\0e\xff\xfe f\x7f";
        let mut h = String::new();
        push_escaped(&mut h, hostile, Escape::Header);
        assert_eq!(h, "a\"b\\cde f");
        let mut j = String::from("\"");
        push_escaped(&mut j, hostile, Escape::Json);
        j.push('"');
        let parsed: String = serde_json::from_str(&j).unwrap();
        assert_eq!(parsed, "a\"b\\c\r\nd\0e\u{fffd}\u{fffd} f\u{7f}");
        let mut t = String::new();
        push_escaped(&mut t, hostile, Escape::Text);
        assert_eq!(t, "a\"b\\cde\u{fffd}\u{fffd} f");
        // Cut at VALUE_BYTES, before escaping: a JSON string stays closed.
        let long = vec![b'"'; 60 * 1024];
        let mut j = String::new();
        push_escaped(&mut j, &long, Escape::Json);
        assert_eq!(j.len(), 2 * VALUE_BYTES);
    }

    #[test]
    fn resets_round_up() {
        assert_eq!(secs_ceil(Duration::from_millis(930)), 1);
        assert_eq!(secs_ceil(Duration::from_secs(2)), 2);
        assert_eq!(ceil_ms(Duration::from_micros(1_001)), 2);
    }
}
