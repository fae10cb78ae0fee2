//! What a limited client is told (the `answer` extension): the headers of every answer and,
//! on a refusal, the headers and the body of the limit that speaks, each a template over what
//! the service knows at that moment. Compiled here, once, at load; rendered per answer by the
//! server (`server/answer.rs`), which knows the protocol.
//!
//! A template is text with `{{variable}}` in it (a JSON body's own braces are single). Every
//! rendered variable is cut to [`VALUE_BYTES`] bytes and escaped for where it goes (a JSON
//! string, a header value, plain text), so the size of what a template renders has a bound
//! known here: a set of headers renders at most [`HEADERS_BYTES`], a body at most
//! [`BODY_BYTES`], or the config is refused.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_saphyr::Spanned;

/// The most bytes of a variable's value a template renders (a descriptor value may be 60 KiB).
pub(crate) const VALUE_BYTES: usize = 256;
/// The most bytes one answer's headers (names and values) can render.
pub(crate) const HEADERS_BYTES: usize = 8 * 1024;
/// The most bytes a body can render.
pub(crate) const BODY_BYTES: usize = 16 * 1024;
/// The most headers one answer sets.
pub(crate) const MAX_HEADERS: usize = 32;

/// A variable a template can name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Var {
    /// The limit's `name` (empty when it has none).
    Name,
    /// Its `requests_per_unit`.
    RequestsPerUnit,
    /// Its `unit` as written (`second` … `year`).
    Unit,
    /// Its window in seconds (unit × `unit_multiplier`).
    WindowSeconds,
    /// What remains of it after this request.
    Remaining,
    /// Until it resets (or the request would fit), whole seconds rounded up.
    ResetSeconds,
    /// The same in milliseconds, rounded up.
    ResetMs,
    /// The descriptor's last entry's key.
    Key,
    /// The descriptor's last entry's value (as the client sent it).
    Value,
    /// The request's domain.
    Domain,
}

/// Every variable with its name, as templates write it.
pub(crate) const VARS: [(&str, Var); 10] = [
    ("name", Var::Name),
    ("requests_per_unit", Var::RequestsPerUnit),
    ("unit", Var::Unit),
    ("window_seconds", Var::WindowSeconds),
    ("remaining", Var::Remaining),
    ("reset_seconds", Var::ResetSeconds),
    ("reset_ms", Var::ResetMs),
    ("key", Var::Key),
    ("value", Var::Value),
    ("domain", Var::Domain),
];

impl Var {
    /// Whether it renders digits only (so it needs no escaping and no quotes in JSON).
    pub fn is_number(self) -> bool {
        matches!(
            self,
            Var::RequestsPerUnit
                | Var::WindowSeconds
                | Var::Remaining
                | Var::ResetSeconds
                | Var::ResetMs
        )
    }
}

/// A piece of a template.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// Written as it is.
    Text(Box<str>),
    /// Rendered.
    Var(Var),
}

/// A compiled template.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Template {
    /// Its pieces, in order.
    pub pieces: Vec<Piece>,
}

impl Template {
    /// Compiles `text`; the error says what is wrong.
    pub fn parse(text: &str) -> Result<Template, String> {
        let mut pieces = Vec::new();
        let mut rest = text;
        while let Some(open) = rest.find("{{") {
            if open > 0 {
                pieces.push(Piece::Text(rest[..open].into()));
            }
            let inside = &rest[open + 2..];
            let Some(close) = inside.find("}}") else {
                return Err("a '{{' that is never closed with '}}'".into());
            };
            let name = inside[..close].trim();
            let var = VARS
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| *v)
                .ok_or_else(|| {
                    let known: Vec<&str> = VARS.iter().map(|(n, _)| *n).collect();
                    format!(
                        "unknown variable '{{{{{name}}}}}' (known: {})",
                        known.join(", ")
                    )
                })?;
            pieces.push(Piece::Var(var));
            rest = &inside[close + 2..];
        }
        if !rest.is_empty() {
            pieces.push(Piece::Text(rest.into()));
        }
        Ok(Template { pieces })
    }

    /// The most bytes it renders when each variable takes at most `per_var` bytes.
    pub fn longest(&self, per_var: usize) -> usize {
        self.pieces
            .iter()
            .map(|p| match p {
                Piece::Text(t) => t.len(),
                Piece::Var(v) if v.is_number() => 20,
                Piece::Var(_) => per_var,
            })
            .sum()
    }

    /// Renders it with `sample` standing for each variable (for checks at load).
    fn sample(&self) -> String {
        self.pieces
            .iter()
            .map(|p| match p {
                Piece::Text(t) => t.to_string(),
                Piece::Var(v) if v.is_number() => "0".into(),
                Piece::Var(_) => "x".into(),
            })
            .collect()
    }
}

/// How a body's variables are escaped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyKind {
    /// As the contents of a JSON string (the template puts the quotes).
    Json,
    /// As text: control characters dropped.
    Text,
}

/// What a limit over adds: to a refusal by it, or, for a soft limit, to the request that
/// goes on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OverLimit {
    /// Headers for the client.
    pub headers: Vec<(Box<str>, Template)>,
    /// Headers for the upstream, on the request a soft limit let through.
    pub upstream_headers: Vec<(Box<str>, Template)>,
    /// The body, if any.
    pub body: Option<Template>,
    /// The body's `content-type`.
    pub content_type: Box<str>,
    /// How its variables are escaped.
    pub kind: BodyKind,
}

/// A limit's answer, as configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// Headers for the client on every answer this limit reports (a 200 and a 429).
    pub headers: Vec<(Box<str>, Template)>,
    /// What the client is told when this limit refuses it.
    pub over_limit: Option<OverLimit>,
}

/// Headers as written: name → template.
type RawHeaders = BTreeMap<String, Spanned<String>>;

/// `answer` as written in a limits file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawAnswer {
    pub headers: Option<RawHeaders>,
    pub over_limit: Option<RawOverLimit>,
}

/// `answer.over_limit` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawOverLimit {
    pub headers: Option<RawHeaders>,
    pub upstream_headers: Option<RawHeaders>,
    pub body: Option<Spanned<String>>,
    pub content_type: Option<Spanned<String>>,
}

/// Where an answer's field is wrong: the line (0: unknown), the field below `answer`, what.
pub(crate) struct AnswerError {
    pub(crate) line: u64,
    pub(crate) column: u64,
    pub(crate) field: String,
    pub(crate) message: String,
}

fn error(at: Option<&serde_saphyr::Location>, field: String, message: String) -> AnswerError {
    AnswerError {
        line: at.map_or(0, |l| l.line()),
        column: at.map_or(0, |l| l.column()),
        field,
        message,
    }
}

/// Header names a rate-limit answer may not set: the ones HTTP/2 or Envoy own, and
/// `content-type` (`over_limit.content_type` sets it).
const RESERVED: [&str; 9] = [
    "connection",
    "content-length",
    "content-type",
    "host",
    "keep-alive",
    "proxy-connection",
    "te",
    "transfer-encoding",
    "upgrade",
];

fn headers(raw: RawHeaders, field: &str) -> Result<Vec<(Box<str>, Template)>, AnswerError> {
    if raw.len() > MAX_HEADERS {
        let at = raw.values().next().map(|v| v.referenced);
        return Err(error(
            at.as_ref(),
            field.into(),
            format!("at most {MAX_HEADERS} headers"),
        ));
    }
    let mut out = Vec::with_capacity(raw.len());
    let mut longest = 0;
    for (name, value) in raw {
        let at = Some(&value.referenced);
        let here = format!("{field}.{name}");
        let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
        if name.is_empty() || name.len() > 128 || !name.chars().all(token) {
            return Err(error(
                at,
                here,
                "not a header name (letters, digits and !#$%&'*+-.^_`|~, at most 128)".into(),
            ));
        }
        let name = name.to_ascii_lowercase();
        if RESERVED.contains(&name.as_str()) {
            let why = if name == "content-type" {
                "set by over_limit.content_type"
            } else {
                "a header HTTP or Envoy owns"
            };
            return Err(error(
                at,
                here,
                format!("'{name}' cannot be set here: {why}"),
            ));
        }
        let template = Template::parse(&value.value).map_err(|m| error(at, here.clone(), m))?;
        let printable = template.pieces.iter().all(|p| match p {
            Piece::Text(t) => t.bytes().all(|b| (b' '..=b'~').contains(&b)),
            Piece::Var(_) => true,
        });
        if !printable {
            return Err(error(
                at,
                here,
                "a header value is printable ASCII (no control characters, no line breaks)".into(),
            ));
        }
        longest += name.len() + template.longest(VALUE_BYTES);
        out.push((name.into_boxed_str(), template));
    }
    if longest > HEADERS_BYTES {
        return Err(error(
            None,
            field.into(),
            format!(
                "these headers can render {longest} bytes, more than {HEADERS_BYTES} (each variable renders at most {VALUE_BYTES})"
            ),
        ));
    }
    Ok(out)
}

/// Whether a `content-type` is JSON (`application/json`, `application/problem+json`, …).
fn is_json(content_type: &str) -> bool {
    let media = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    media == "application/json" || media.ends_with("+json")
}

/// Compiles an `answer`; the error's field is below `answer`.
pub(crate) fn compile(raw: RawAnswer) -> Result<Answer, AnswerError> {
    let every = headers(raw.headers.unwrap_or_default(), "headers")?;
    let over_limit = match raw.over_limit {
        None => None,
        Some(o) => {
            let headers = headers(o.headers.unwrap_or_default(), "over_limit.headers")?;
            let upstream_headers = self::headers(
                o.upstream_headers.unwrap_or_default(),
                "over_limit.upstream_headers",
            )?;
            let body = match &o.body {
                None => None,
                Some(b) => Some(
                    Template::parse(&b.value)
                        .map_err(|m| error(Some(&b.referenced), "over_limit.body".into(), m))?,
                ),
            };
            // A body that opens as JSON does is JSON (and then must be).
            let looks_json = o
                .body
                .as_ref()
                .is_some_and(|b| b.value.trim_start().starts_with(['{', '[']));
            let content_type: Box<str> = match &o.content_type {
                Some(c) => {
                    let ok = !c.value.is_empty()
                        && c.value.len() <= 256
                        && c.value.bytes().all(|b| (b' '..=b'~').contains(&b));
                    if !ok {
                        return Err(error(
                            Some(&c.referenced),
                            "over_limit.content_type".into(),
                            "not a content type (printable ASCII, at most 256 bytes)".into(),
                        ));
                    }
                    c.value.as_str().into()
                }
                None if looks_json => "application/json".into(),
                None => "text/plain; charset=utf-8".into(),
            };
            let kind = if is_json(&content_type) {
                BodyKind::Json
            } else {
                BodyKind::Text
            };
            if let (Some(b), BodyKind::Json) = (&body, kind) {
                let at = o.body.as_ref().map(|b| b.referenced);
                if let Err(e) = serde_json::from_str::<serde_json::Value>(&b.sample()) {
                    return Err(error(
                        at.as_ref(),
                        "over_limit.body".into(),
                        format!(
                            "the body is {content_type} but not JSON ({e}); a variable that is not a number goes inside a JSON string"
                        ),
                    ));
                }
            }
            if let Some(b) = &body {
                // A JSON string escapes a byte as at most six (`\u00XX`).
                let longest = b.longest(6 * VALUE_BYTES);
                if longest > BODY_BYTES {
                    let at = o.body.as_ref().map(|b| b.referenced);
                    return Err(error(
                        at.as_ref(),
                        "over_limit.body".into(),
                        format!(
                            "the body can render {longest} bytes, more than {BODY_BYTES} (each variable renders at most {} escaped)",
                            6 * VALUE_BYTES
                        ),
                    ));
                }
            }
            if let (None, Some(c)) = (&body, &o.content_type) {
                return Err(error(
                    Some(&c.referenced),
                    "over_limit.content_type".into(),
                    "a content type without a body".into(),
                ));
            }
            Some(OverLimit {
                headers,
                upstream_headers,
                body,
                content_type,
                kind,
            })
        }
    };
    Ok(Answer {
        headers: every,
        over_limit,
    })
}

/// Reads the server's default answer (`--default-answer`): a file holding what an `answer`
/// holds. The error names the file, line and field.
pub(crate) fn read_file(path: &std::path::Path) -> Result<Answer, super::ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| super::ConfigError::io(path, &e))?;
    let raw: RawAnswer =
        serde_saphyr::from_str(&text).map_err(|e| super::ConfigError::from_yaml(path, &e))?;
    compile(raw).map_err(|e| {
        super::ConfigError::at(
            path,
            (e.line > 0).then_some((e.line, e.column)),
            e.field,
            e.message,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_compile_or_say_why() {
        let t = Template::parse(r#"{"a": {{remaining}}, "b": "{{ value }}"}"#).unwrap();
        assert_eq!(
            t.pieces,
            vec![
                Piece::Text(r#"{"a": "#.into()),
                Piece::Var(Var::Remaining),
                Piece::Text(r#", "b": ""#.into()),
                Piece::Var(Var::Value),
                Piece::Text(r#""}"#.into()),
            ]
        );
        assert_eq!(t.sample(), r#"{"a": 0, "b": "x"}"#);
        let e = Template::parse("{{nope}}").unwrap_err();
        assert!(e.contains("unknown variable '{{nope}}'"), "{e}");
        assert!(
            Template::parse("{{value")
                .unwrap_err()
                .contains("never closed")
        );
        assert_eq!(Template::parse("").unwrap().pieces, vec![]);
        assert_eq!(
            Template::parse("a}}b{c}").unwrap().pieces,
            vec![Piece::Text("a}}b{c}".into())]
        );
    }
}
