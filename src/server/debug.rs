//! The debug port's own pages (`--debug-addr`, envoyproxy/ratelimit's `DEBUG_PORT`), beside the
//! HTTP endpoints it serves too:
//!
//! - `/stats`: that service's stat names with their values so far, and the process's memory,
//!   threads and descriptors, one `name: value` per line (its `/stats` lists Go's runtime
//!   variables);
//! - `/debug/pprof/profile?seconds=N`: a CPU profile of N seconds (10 unless given, at most
//!   [`MAX_PROFILE_SECONDS`], and less than the connection idle timeout: the client sends
//!   nothing meanwhile) in the protobuf format `go tool pprof` and `pprof` read, sampled
//!   [`PROFILE_HZ`] times a second; one at a time (another is answered 429);
//! - `/debug/pprof/`: what is there.
//!
//! The profiler samples only while a profile is asked for. Served on the debug port alone,
//! which is off unless `--debug-addr` (or `DEBUG_PORT` in envoyproxy/ratelimit's environment)
//! names one.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::metrics::{Metrics, ProcessStatus};

/// Longest profile one request may ask for.
pub(crate) const MAX_PROFILE_SECONDS: u64 = 20;
/// A profile's length unless the request gives one.
const DEFAULT_PROFILE_SECONDS: u64 = 10;
/// Samples per second while profiling (Go's default).
pub(crate) const PROFILE_HZ: i32 = 100;

/// Whether a profile is being taken (one at a time: the profiler is process-wide).
static PROFILING: AtomicBool = AtomicBool::new(false);

/// What the pages read.
#[derive(Clone)]
struct Debug {
    metrics: Arc<Metrics>,
    /// The longest profile: [`MAX_PROFILE_SECONDS`], or less than the idle timeout.
    max_seconds: u64,
}

/// The debug pages. A connection that sends nothing for `idle_timeout` is closed, so a
/// profile is kept shorter than that.
pub(crate) fn router(metrics: Arc<Metrics>, idle_timeout: Duration) -> Router {
    let max_seconds = MAX_PROFILE_SECONDS
        .min(idle_timeout.as_secs().saturating_sub(1))
        .max(1);
    Router::new()
        .route("/stats", get(stats))
        .route("/debug/pprof/", get(index))
        .route("/debug/pprof/profile", get(profile))
        .with_state(Debug {
            metrics,
            max_seconds,
        })
}

async fn index(State(debug): State<Debug>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        format!(
            "/debug/pprof/profile?seconds=N: CPU profile of N seconds (default {}, at most {}), pprof protobuf\n\
             /stats: envoyproxy/ratelimit's stats so far and the process's resources\n",
            DEFAULT_PROFILE_SECONDS.min(debug.max_seconds),
            debug.max_seconds
        ),
    )
}

async fn stats(State(debug): State<Debug>) -> impl IntoResponse {
    let metrics = debug.metrics;
    let mut out = String::new();
    for stat in crate::statsd::reference_stats(&metrics) {
        if stat.timer.is_none() {
            let _ = writeln!(out, "{}: {}", stat.key, stat.value);
        }
    }
    if let Some(status) = ProcessStatus::read() {
        for (name, value) in [
            ("process.resident_bytes", status.resident_bytes),
            ("process.resident_peak_bytes", status.resident_peak_bytes),
            ("process.virtual_bytes", status.virtual_bytes),
            ("process.threads", status.threads),
        ] {
            let _ = writeln!(out, "{name}: {value}");
        }
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        let _ = writeln!(out, "process.open_fds: {}", fds.count());
    }
    ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], out)
}

#[derive(serde::Deserialize)]
struct ProfileQuery {
    seconds: Option<u64>,
}

/// Clears [`PROFILING`] when the profile ends, however it ends.
struct Profiling;

impl Drop for Profiling {
    fn drop(&mut self) {
        PROFILING.store(false, Ordering::Release);
    }
}

async fn profile(
    State(debug): State<Debug>,
    query: Result<Query<ProfileQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let max = debug.max_seconds;
    let seconds = match query {
        Ok(Query(q)) => q.seconds.unwrap_or(DEFAULT_PROFILE_SECONDS.min(max)),
        Err(e) => return (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response(),
    };
    if !(1..=max).contains(&seconds) {
        let why = format!("seconds must be from 1 to {max}\n");
        return (StatusCode::BAD_REQUEST, why).into_response();
    }
    if PROFILING.swap(true, Ordering::AcqRel) {
        let why = "a profile is being taken; ask again when it is done\n";
        return (StatusCode::TOO_MANY_REQUESTS, why).into_response();
    }
    let busy = Profiling;
    // The profiler's guard is not Send: it lives on a blocking thread for the whole profile.
    let taken = tokio::task::spawn_blocking(move || {
        let _busy = busy;
        take_profile(Duration::from_secs(seconds))
    })
    .await;
    match taken {
        Ok(Ok(bytes)) => (
            [
                (header::CONTENT_TYPE, "application/octet-stream"),
                (
                    header::CONTENT_DISPOSITION,
                    "attachment; filename=\"profile\"",
                ),
            ],
            bytes,
        )
            .into_response(),
        Ok(Err(why)) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{why}\n")).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
    }
}

/// Samples the process for `length` and encodes what was seen as a pprof protobuf.
fn take_profile(length: Duration) -> Result<Vec<u8>, String> {
    use pprof::protos::Message as _;
    // Frames in these libraries are skipped: unwinding through them from a signal handler may
    // deadlock (the profiler's own advice).
    let guard = pprof::ProfilerGuardBuilder::default()
        .frequency(PROFILE_HZ)
        .blocklist(&["libc", "libgcc", "pthread", "vdso"])
        .build()
        .map_err(|e| format!("cannot start the profiler: {e}"))?;
    std::thread::sleep(length);
    let report = guard
        .report()
        .build()
        .map_err(|e| format!("cannot build the profile: {e}"))?;
    drop(guard);
    let profile = report
        .pprof()
        .map_err(|e| format!("cannot encode the profile: {e}"))?;
    Ok(profile.encode_to_vec())
}
