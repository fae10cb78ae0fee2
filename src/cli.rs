//! `ratelimitd top`: who is being limited, as a table in a terminal, refreshed like `top` (for
//! a `kubectl exec` session). A client of `GET /top` on the HTTP port; it needs nothing else
//! of the service.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use serde_json::Value;

/// `ratelimitd top`'s flags.
#[derive(Parser, Debug)]
#[command(
    name = "ratelimitd top",
    about = "Who is being limited: each limit's most refused, then heaviest descriptors, from GET /top, refreshed"
)]
struct TopArgs {
    /// The service's HTTP port (or its debug port).
    #[arg(long, default_value = "127.0.0.1:8080")]
    addr: String,
    /// Only this domain's limits.
    #[arg(long)]
    domain: Option<String>,
    /// Only limits whose rule path or name this is.
    #[arg(long)]
    limit: Option<String>,
    /// Descriptors per limit.
    #[arg(short, long, default_value_t = 10)]
    n: usize,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 2.0)]
    interval: f64,
    /// Print once and exit (no screen clearing).
    #[arg(long)]
    once: bool,
}

/// Runs `ratelimitd top` with `args` (the words after `top`); the process's exit code.
pub fn top(args: impl IntoIterator<Item = String>) -> ExitCode {
    let args =
        match TopArgs::try_parse_from(std::iter::once("ratelimitd top".to_owned()).chain(args)) {
            Ok(a) => a,
            Err(e) => e.exit(),
        };
    let interval = Duration::from_secs_f64(args.interval.clamp(0.1, 3600.0));
    loop {
        let screen = match fetch(&args) {
            Ok(report) => table(&args, &report),
            Err(e) if args.once => {
                eprintln!("ratelimitd top: {e}");
                return ExitCode::FAILURE;
            }
            Err(e) => format!("ratelimitd top: {e}\n"),
        };
        let mut out = std::io::stdout().lock();
        if !args.once {
            let _ = out.write_all(b"\x1b[H\x1b[2J");
        }
        let _ = out.write_all(screen.as_bytes());
        let _ = out.flush();
        if args.once {
            return ExitCode::SUCCESS;
        }
        std::thread::sleep(interval);
    }
}

/// `GET /top` with the flags' query, as JSON.
fn fetch(args: &TopArgs) -> Result<Value, String> {
    let mut query = vec![format!("n={}", args.n)];
    for (name, v) in [("domain", &args.domain), ("limit", &args.limit)] {
        if let Some(v) = v {
            query.push(format!("{name}={}", percent_encode(v)));
        }
    }
    let addr = args
        .addr
        .to_socket_addrs()
        .map_err(|e| format!("{}: {e}", args.addr))?
        .next()
        .ok_or_else(|| format!("{}: no address", args.addr))?;
    let timeout = Duration::from_secs(5);
    let mut stream =
        TcpStream::connect_timeout(&addr, timeout).map_err(|e| format!("{addr}: {e}"))?;
    let _ = stream.set_read_timeout(Some(timeout));
    let _ = stream.set_write_timeout(Some(timeout));
    let req = format!(
        "GET /top?{} HTTP/1.0\r\nHost: {}\r\n\r\n",
        query.join("&"),
        args.addr
    );
    stream
        .write_all(req.as_bytes())
        .map_err(|e| format!("{addr}: {e}"))?;
    let mut raw = Vec::new();
    stream
        .take(64 << 20)
        .read_to_end(&mut raw)
        .map_err(|e| format!("{addr}: {e}"))?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("{addr}: not an HTTP answer"))?;
    let status = head.split_whitespace().nth(1).unwrap_or("");
    if status != "200" {
        return Err(format!("{addr}: HTTP {status}: {}", body.trim()));
    }
    serde_json::from_str(body).map_err(|e| format!("{addr}: not /top's JSON: {e}"))
}

/// `s` with every byte but RFC 3986's unreserved ones percent-encoded.
fn percent_encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// Longest value shown in a row, in characters.
const SHOWN_CHARS: usize = 48;

/// A value as one safe cell: escaped (a value may carry terminal control sequences), cut.
fn cell(v: &Value) -> String {
    match v.as_str() {
        None => "-".to_owned(),
        Some(s) => {
            let escaped: String = s.escape_debug().collect();
            if escaped.chars().count() > SHOWN_CHARS {
                let cut: String = escaped.chars().take(SHOWN_CHARS - 1).collect();
                cut + "…"
            } else {
                escaped
            }
        }
    }
}

fn table(args: &TopArgs, report: &Value) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "ratelimitd top  {}  window {}s (counts cover one to two)  untracked hits {}",
        args.addr, report["window_seconds"], report["untracked_hits"]
    );
    let limits = report["limits"].as_array().cloned().unwrap_or_default();
    if limits.is_empty() {
        let _ = writeln!(out, "\nno limit has counted a hit yet");
    }
    for l in &limits {
        let name = l["name"]
            .as_str()
            .map(|n| format!(" ({})", cell(&Value::String(n.to_owned()))))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "\n{} {}{}  {}/{} x{}s {}  hits {}  values {}",
            cell(&l["domain"]),
            cell(&l["rule"]),
            name,
            l["requests_per_unit"],
            cell(&l["unit"]),
            l["window_seconds"],
            cell(&l["algorithm"]),
            l["hits"],
            cell(&l["values"]),
        );
        let _ = writeln!(
            out,
            "{:>10} {:>10} {:>8} {:>10}  DESCRIPTOR",
            "OVER", "HITS", "±", "LEFT"
        );
        for d in l["descriptors"].as_array().into_iter().flatten() {
            let entries: Vec<String> = d["entries"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|e| format!("{}={}", cell(&e["key"]), cell(&e["value"])))
                .collect();
            let remaining = match &d["remaining"] {
                Value::Null => "-".to_owned(),
                r => r.to_string(),
            };
            let _ = writeln!(
                out,
                "{:>10} {:>10} {:>8} {:>10}  {}",
                match d["over_limit_error"].as_u64() {
                    Some(e) if e > 0 => format!("{}±{e}", d["over_limit"]),
                    _ => d["over_limit"].to_string(),
                },
                d["hits"].to_string(),
                d["error"].to_string(),
                remaining,
                if entries.is_empty() {
                    "(entries not kept)".to_owned()
                } else {
                    entries.join(", ")
                }
            );
        }
    }
    out
}
