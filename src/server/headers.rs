//! Rate-limit headers for Envoy to add to the client's response (`--response-headers`), from
//! the statuses of a decision. Every mode reports the most restrictive status: an enforced
//! limit that is over, else the one with the fewest hits left; with any mode on, an
//! OVER_LIMIT answer also carries `Retry-After`.

use std::time::Duration;

use crate::engine::{Code, Response, Status};

/// Which headers to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HeaderMode {
    /// None.
    Off,
    /// `X-RateLimit-Limit`, `-Remaining`, `-Reset`, as Envoy's DRAFT_VERSION_03 writes them.
    Draft03,
    /// `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers).
    Ietf,
    /// envoyproxy/ratelimit's own `RateLimit-Limit`, `-Remaining`, `-Reset`
    /// (`LIMIT_RESPONSE_HEADERS_ENABLED=true`), under these names.
    Reference(ReferenceNames),
}

/// The names of the reference mode's three headers (`LIMIT_LIMIT_HEADER`,
/// `LIMIT_REMAINING_HEADER`, `LIMIT_RESET_HEADER`). Names live as long as the process: they are
/// read once at start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReferenceNames {
    /// The limit's requests per unit.
    pub(crate) limit: &'static str,
    /// What is left.
    pub(crate) remaining: &'static str,
    /// Seconds to the end of the limit's unit.
    pub(crate) reset: &'static str,
}

impl Default for ReferenceNames {
    fn default() -> Self {
        ReferenceNames {
            limit: "RateLimit-Limit",
            remaining: "RateLimit-Remaining",
            reset: "RateLimit-Reset",
        }
    }
}

/// The most restrictive limited status: of those over, the one that resets last (a client that
/// waits it out is admitted by all of them), the last between equals (as envoyproxy/ratelimit
/// picks it); else the first with the fewest hits left.
fn most_restrictive(statuses: &[Status]) -> Option<usize> {
    let mut best: Option<usize> = None;
    for (i, s) in statuses.iter().enumerate() {
        if s.limit.is_none() {
            continue;
        }
        best = match best {
            None => Some(i),
            Some(b) if s.code == Code::OverLimit && statuses[b].code == Code::OverLimit => {
                if s.reset >= statuses[b].reset {
                    Some(i)
                } else {
                    Some(b)
                }
            }
            Some(_) if s.code == Code::OverLimit => Some(i),
            Some(b) if statuses[b].code == Code::OverLimit => Some(b),
            Some(b) if s.remaining < statuses[b].remaining => Some(i),
            keep => keep,
        };
    }
    best
}

/// `d` in whole seconds, rounded up.
pub(crate) fn secs_ceil(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// A Structured Field string: quoted, with `\` and `"` escaped and anything else outside
/// printable ASCII dropped.
fn sf_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => {}
        }
    }
    out.push('"');
    out
}

/// The `now_s` [`headers`] needs in `mode`: seconds since the Unix epoch for the reference
/// service's headers, the only ones that read it; else 0, sparing a clock read per request.
pub(crate) fn now_s(mode: HeaderMode) -> u64 {
    if matches!(mode, HeaderMode::Reference(_)) {
        use crate::limiter::Clock;
        crate::limiter::SystemClock.now_us() / 1_000_000
    } else {
        0
    }
}

/// The headers `mode` asks for on `resp`; `now_s` is the Unix time in seconds (the reference
/// mode's reset is the end of the limit's unit, aligned to the epoch, as that service
/// computes it).
pub(crate) fn headers(
    mode: HeaderMode,
    resp: &Response,
    now_s: u64,
) -> Vec<(&'static str, String)> {
    let Some(m) = (mode != HeaderMode::Off)
        .then(|| most_restrictive(&resp.statuses))
        .flatten()
    else {
        return Vec::new();
    };
    let min = &resp.statuses[m];
    let limit = min.limit.as_ref().expect("a limited status");
    let reset = min.reset.unwrap_or_default();
    let mut out = Vec::with_capacity(4);
    match mode {
        HeaderMode::Off => {}
        HeaderMode::Reference(names) => {
            let unit = limit.unit.seconds();
            out.push((names.limit, limit.requests_per_unit.to_string()));
            out.push((names.remaining, min.remaining.to_string()));
            // A calendar window ends where the calendar says, not where the epoch's would.
            let left = if limit.calendar {
                secs_ceil(reset)
            } else {
                unit - now_s % unit
            };
            out.push((names.reset, left.to_string()));
        }
        HeaderMode::Draft03 => {
            let mut value = limit.requests_per_unit.to_string();
            for s in &resp.statuses {
                let Some(l) = &s.limit else { continue };
                value.push_str(&format!(
                    ", {};w={}",
                    l.requests_per_unit,
                    l.window.as_secs()
                ));
                if let Some(name) = &l.name {
                    value.push_str(&format!(";name={}", sf_string(name)));
                }
            }
            out.push(("X-RateLimit-Limit", value));
            out.push(("X-RateLimit-Remaining", min.remaining.to_string()));
            out.push(("X-RateLimit-Reset", reset.as_secs().to_string()));
        }
        HeaderMode::Ietf => {
            let mut names: Vec<String> = Vec::new();
            let mut policies = Vec::new();
            for (i, s) in resp.statuses.iter().enumerate() {
                let Some(l) = &s.limit else { continue };
                let mut name = l
                    .name
                    .as_deref()
                    .map_or(format!("descriptor{i}"), str::to_owned);
                if names.contains(&name) {
                    name = format!("{name}-{i}");
                }
                policies.push(format!(
                    "{};q={};w={}",
                    sf_string(&name),
                    l.requests_per_unit,
                    l.window.as_secs()
                ));
                names.push(name);
            }
            let min_name = resp.statuses[..m]
                .iter()
                .filter(|s| s.limit.is_some())
                .count();
            out.push(("RateLimit-Policy", policies.join(", ")));
            out.push((
                "RateLimit",
                format!(
                    "{};r={};t={}",
                    sf_string(&names[min_name]),
                    min.remaining,
                    secs_ceil(reset)
                ),
            ));
        }
    }
    if resp.overall == Code::OverLimit {
        out.push(("Retry-After", secs_ceil(reset).max(1).to_string()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Unit;
    use crate::engine::ReportedLimit;
    use std::sync::Arc;

    fn status(
        rpu: u64,
        unit: Unit,
        remaining: u64,
        reset_ms: u64,
        over: bool,
        name: Option<&str>,
    ) -> Status {
        Status {
            code: if over { Code::OverLimit } else { Code::Ok },
            limit: Some(ReportedLimit {
                name: name.map(Arc::from),
                requests_per_unit: rpu,
                unit,
                window: Duration::from_secs(unit.seconds()),
                calendar: false,
                answer: None,
                soft: false,
            }),
            remaining,
            reset: Some(Duration::from_millis(reset_ms)),
            refused_by: None,
        }
    }

    fn response(statuses: Vec<Status>) -> Response {
        let overall = if statuses.iter().any(|s| s.code == Code::OverLimit) {
            Code::OverLimit
        } else {
            Code::Ok
        };
        Response {
            overall,
            statuses,
            metadata: None,
            soft: Vec::new(),
        }
    }

    fn get(h: &[(&str, String)], name: &str) -> Option<String> {
        h.iter().find(|(k, _)| *k == name).map(|(_, v)| v.clone())
    }

    #[test]
    fn draft03_as_envoy_writes_it() {
        let r = response(vec![status(10, Unit::Minute, 7, 42_500, false, None)]);
        let h = headers(HeaderMode::Draft03, &r, 0);
        assert_eq!(get(&h, "X-RateLimit-Limit").unwrap(), "10, 10;w=60");
        assert_eq!(get(&h, "X-RateLimit-Remaining").unwrap(), "7");
        assert_eq!(get(&h, "X-RateLimit-Reset").unwrap(), "42");
        assert_eq!(get(&h, "Retry-After"), None);

        let r = response(vec![
            Status::unlimited(),
            status(100, Unit::Hour, 50, 1_000, false, Some("hourly")),
            status(10, Unit::Second, 0, 300, true, None),
        ]);
        let h = headers(HeaderMode::Draft03, &r, 0);
        assert_eq!(
            get(&h, "X-RateLimit-Limit").unwrap(),
            "10, 100;w=3600;name=\"hourly\", 10;w=1"
        );
        assert_eq!(get(&h, "X-RateLimit-Remaining").unwrap(), "0");
        assert_eq!(get(&h, "Retry-After").unwrap(), "1", "at least one second");
    }

    #[test]
    fn ietf_structured_fields() {
        let r = response(vec![
            status(100, Unit::Minute, 50, 30_000, false, Some("burst")),
            status(1000, Unit::Day, 20, 86_000_000, false, Some("daily")),
        ]);
        let h = headers(HeaderMode::Ietf, &r, 0);
        assert_eq!(
            get(&h, "RateLimit-Policy").unwrap(),
            "\"burst\";q=100;w=60, \"daily\";q=1000;w=86400"
        );
        assert_eq!(get(&h, "RateLimit").unwrap(), "\"daily\";r=20;t=86000");
    }

    #[test]
    fn a_calendar_limit_resets_when_its_window_ends_not_the_epochs() {
        // A day in Kolkata with 6 h 30 min left, at a time 12 h before a UTC midnight.
        let mut s = status(5, Unit::Day, 4, 23_400_000, false, None);
        if let Some(l) = &mut s.limit {
            l.calendar = true;
        }
        let r = response(vec![s]);
        let h = headers(
            HeaderMode::Reference(ReferenceNames::default()),
            &r,
            1_780_315_200,
        );
        assert_eq!(get(&h, "RateLimit-Reset").unwrap(), "23400");
    }

    #[test]
    fn reference_resets_at_the_end_of_the_unit() {
        let r = response(vec![status(5, Unit::Minute, 4, 1_000, false, None)]);
        let h = headers(
            HeaderMode::Reference(ReferenceNames::default()),
            &r,
            1_800_000_015,
        );
        assert_eq!(
            h,
            vec![
                ("RateLimit-Limit", "5".to_string()),
                ("RateLimit-Remaining", "4".to_string()),
                ("RateLimit-Reset", "45".to_string()),
            ]
        );
        assert!(headers(HeaderMode::Off, &r, 0).is_empty());
        assert!(
            headers(
                HeaderMode::Reference(ReferenceNames::default()),
                &response(vec![Status::unlimited()]),
                0
            )
            .is_empty()
        );
        // Names as configured (LIMIT_*_HEADER).
        let names = ReferenceNames {
            limit: "X-Quota-Limit",
            remaining: "X-Quota-Left",
            reset: "X-Quota-Reset",
        };
        let names_of =
            |h: Vec<(&'static str, String)>| h.into_iter().map(|(n, _)| n).collect::<Vec<_>>();
        assert_eq!(
            names_of(headers(HeaderMode::Reference(names), &r, 0)),
            ["X-Quota-Limit", "X-Quota-Left", "X-Quota-Reset"]
        );
    }
}
