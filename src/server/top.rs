//! `GET /top` on the HTTP port (and the debug port): who is being limited, as JSON.
//!
//! `?domain=` keeps one domain's limits, `?limit=` the limits whose rule path or name it is,
//! `?n=` lists that many descriptors per limit (10 unless given; at most `--top-capacity`).
//! Values are JSON strings exactly as sent (or hashed, or `null`, as the limit and
//! `--top-values` say): never parsed, never structure.

use std::collections::HashMap;

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::engine::Engine;
use crate::engine::top::{DEFAULT_TOP_N, TopQuery, TopReport};
use crate::top::{OVERRIDE, Top};

/// `GET /top` on `engine`, with the query's `params` (`http.rs` routes it).
pub(crate) async fn top(engine: &Engine, params: HashMap<String, String>) -> Response {
    let bad = |message: String| {
        (
            StatusCode::BAD_REQUEST,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            message + "\n",
        )
            .into_response()
    };
    if let Some(other) = params
        .keys()
        .find(|k| !["domain", "limit", "n"].contains(&k.as_str()))
    {
        return bad(format!(
            "unknown parameter '{other}' (expected domain, limit or n)"
        ));
    }
    let n = match params.get("n") {
        None => DEFAULT_TOP_N,
        Some(n) => match n.parse::<usize>() {
            Ok(n) if n > 0 => n,
            _ => return bad(format!("n must be a whole number above 0, not '{n}'")),
        },
    };
    let query = TopQuery {
        domain: params.get("domain").cloned(),
        limit: params.get("limit").cloned(),
        prefix: Vec::new(),
        n,
    };
    match engine.top_report(&query).await {
        Ok(report) => (
            [(header::CONTENT_TYPE, "application/json")],
            report_json(&report).to_string(),
        )
            .into_response(),
        Err(e) => {
            let status = super::grpc::to_status(e);
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                status.message().to_owned(),
            )
                .into_response()
        }
    }
}

/// The JSON form of `report` (the shape docs/operations.md shows).
pub(crate) fn report_json(report: &TopReport) -> Value {
    let limits: Vec<Value> = report
        .limits
        .iter()
        .map(|l| {
            let descriptors: Vec<Value> = l
                .descriptors
                .iter()
                .map(|d| {
                    let entries: Vec<Value> = d
                        .entries
                        .iter()
                        .map(|e| {
                            let mut o = json!({"key": e.key, "value": e.value});
                            if e.escaped {
                                o["escaped"] = Value::Bool(true);
                            }
                            o
                        })
                        .collect();
                    let mut o = json!({
                        "entries": entries,
                        "hits": d.hits,
                        "over_limit": d.over_limit,
                        "error": d.error,
                        "over_limit_error": d.over_limit_error,
                        "remaining": d.remaining,
                    });
                    if d.elided {
                        o["elided"] = Value::Bool(true);
                    }
                    o
                })
                .collect();
            json!({
                "domain": l.info.domain,
                "rule": l.info.rule,
                "name": l.info.name,
                "override": l.info.index == OVERRIDE,
                "algorithm": l.info.algorithm,
                "unit": l.info.unit,
                "window_seconds": l.info.window_seconds,
                "requests_per_unit": l.info.requests_per_unit,
                "values": l.values.as_str(),
                "hits": l.hits,
                "absent_at_most": l.floor,
                "descriptors": descriptors,
            })
        })
        .collect();
    json!({
        "window_seconds": report.window.as_secs(),
        "capacity": report.capacity,
        "untracked_hits": report.untracked_hits,
        "memory_bytes": report.memory_bytes,
        "memory_limit_bytes": report.memory_limit_bytes,
        "limits": limits,
    })
}

/// Most series each `ratelimit_top_*` family exports, whatever the number of limits.
pub(crate) const MAX_TOP_SERIES: usize = 1000;
/// Longest label value, in characters: a longer value is cut (and marked with `…`).
const LABEL_CHARS: usize = 128;

/// `ratelimit_top_hits` and `ratelimit_top_over_limit`: each limit's `--top-metrics`
/// heaviest descriptors, in OpenMetrics text (gauges over `/top`'s window).
pub(crate) fn metrics_text(top: &Top, longest: usize) -> String {
    use std::fmt::Write as _;
    let n = top.options().metrics;
    let mut series: Vec<(String, u64, u64)> = Vec::new();
    for mut l in top.merged(|_| true) {
        let listed = crate::engine::top::listing(&mut l, &Vec::new(), n);
        let limit = match (&l.info.name, l.info.index) {
            (Some(name), _) => name.clone(),
            (None, OVERRIDE) => format!("override {}/{}", l.info.requests_per_unit, l.info.unit),
            (None, i) => i.to_string(),
        };
        for (entries, c) in &listed {
            if series.len() == MAX_TOP_SERIES {
                break;
            }
            let descriptor = if c.kept {
                entries
                    .iter()
                    .map(|(k, v)| {
                        let k = crate::value::shown(k, usize::MAX);
                        let v = l.values.apply(v, longest);
                        format!("{k}={}", v.unwrap_or_else(|| "-".into()))
                    })
                    .collect::<Vec<_>>()
                    .join(",")
            } else {
                "(entries not kept)".to_owned()
            };
            let labels = format!(
                "domain=\"{}\",rule=\"{}\",limit=\"{}\",descriptor=\"{}\"",
                label(&l.info.domain),
                label(&l.info.rule),
                label(&limit),
                label(&descriptor)
            );
            series.push((labels, c.hits, c.over));
        }
    }
    let mut out = String::new();
    for (pick, (family, help)) in crate::metrics::TOP_FAMILIES.into_iter().enumerate() {
        let _ = writeln!(out, "# HELP {family} {help}");
        let _ = writeln!(out, "# TYPE {family} gauge");
        for (labels, hits, over) in &series {
            let v = if pick == 0 { hits } else { over };
            let _ = writeln!(out, "{family}{{{labels}}} {v}");
        }
    }
    out
}

/// `s` as an OpenMetrics label value: escaped, cut to [`LABEL_CHARS`] characters.
fn label(s: &str) -> String {
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i == LABEL_CHARS {
            out.push('…');
            break;
        }
        match ch {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}
