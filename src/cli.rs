//! The binary's clients of a running service, for a `kubectl exec` session:
//!
//! - `ratelimitd top`: who is being limited, as a table in a terminal, refreshed like `top`. A
//!   client of `GET /top` on the HTTP port.
//! - `ratelimitd override set|list|delete`: the operator's overrides, a client of
//!   `/v1/overrides` on the admin listener, the token read from a file or the environment
//!   (never a flag's value, which `ps` shows).

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
    let path = format!("/top?{}", query.join("&"));
    let (status, body) = call(&args.addr, "GET", &path, ("", ""), Duration::from_secs(5))?;
    if status != 200 {
        return Err(format!("{}: HTTP {status}: {}", args.addr, body.trim()));
    }
    serde_json::from_str(&body).map_err(|e| format!("{}: not /top's JSON: {e}", args.addr))
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

/// `ratelimitd override`'s flags.
#[derive(Parser, Debug)]
#[command(
    name = "ratelimitd override",
    about = "The operator's overrides on the admin listener: set, list or delete one. The token comes from --token-file or RATELIMITD_ADMIN_TOKEN, never from a flag's value"
)]
struct OverrideArgs {
    /// The admin listener (--admin-addr).
    #[arg(long, default_value = "127.0.0.1:9090", global = true)]
    addr: String,
    /// A file holding the bearer token (its first line); else RATELIMITD_ADMIN_TOKEN.
    #[arg(long, global = true)]
    token_file: Option<std::path::PathBuf>,
    #[command(subcommand)]
    action: OverrideAction,
}

#[derive(clap::Subcommand, Debug)]
enum OverrideAction {
    /// Sets the limits of one descriptor (replacing its override, if one is in force).
    Set {
        /// The config domain.
        #[arg(long)]
        domain: String,
        /// The descriptor's entries in order, each key=value.
        #[arg(long = "entry", required = true, value_parser = key_value)]
        entries: Vec<(String, String)>,
        /// A limit: N/unit, or N/unit/algorithm (`5000/hour`, `100/minute/sliding_window`;
        /// 0 blocks). Repeat for several.
        #[arg(long = "limit", required = true, value_parser = limit_of)]
        limits: Vec<Value>,
        /// How long it lasts (`30s`, `15m`, `24h`, `7d`); none: until deleted.
        #[arg(long)]
        ttl: Option<String>,
        /// Why, for the audit log.
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Lists the overrides in force.
    List {
        /// Only this domain's.
        #[arg(long)]
        domain: Option<String>,
    },
    /// Deletes one override: its domain's config limits apply again.
    Delete {
        /// Its id, as set or list printed it.
        id: String,
    },
}

fn key_value(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .filter(|(k, _)| !k.is_empty())
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("'{s}' is not key=value"))
}

fn limit_of(s: &str) -> Result<Value, String> {
    let mut parts = s.split('/');
    let (Some(n), Some(unit)) = (parts.next(), parts.next()) else {
        return Err(format!("'{s}' is not N/unit (e.g. 5000/hour)"));
    };
    let n: u64 = n
        .parse()
        .map_err(|_| format!("'{n}' is not a whole number of 0 or more"))?;
    let mut limit = serde_json::json!({ "requests_per_unit": n, "unit": unit });
    if let Some(algorithm) = parts.next() {
        limit["algorithm"] = Value::String(algorithm.to_owned());
    }
    if parts.next().is_some() {
        return Err(format!("'{s}' is not N/unit or N/unit/algorithm"));
    }
    Ok(limit)
}

/// Runs `ratelimitd override` with `args` (the words after `override`); the exit code.
pub fn overrides(
    args: impl IntoIterator<Item = String>,
    env: impl Fn(&str) -> Option<String>,
) -> ExitCode {
    let args = match OverrideArgs::try_parse_from(
        std::iter::once("ratelimitd override".to_owned()).chain(args),
    ) {
        Ok(a) => a,
        Err(e) => e.exit(),
    };
    let token = match &args.token_file {
        Some(path) => match std::fs::read_to_string(path) {
            Ok(text) => text.lines().next().unwrap_or("").trim().to_owned(),
            Err(e) => {
                eprintln!("ratelimitd override: --token-file {}: {e}", path.display());
                return ExitCode::from(2);
            }
        },
        None => env("RATELIMITD_ADMIN_TOKEN").unwrap_or_default(),
    };
    if token.is_empty() {
        eprintln!("ratelimitd override: no token: --token-file, or RATELIMITD_ADMIN_TOKEN");
        return ExitCode::from(2);
    }
    let (method, path, body) = match args.action {
        OverrideAction::Set {
            domain,
            entries,
            limits,
            ttl,
            reason,
        } => {
            let entries: Vec<Value> = entries
                .into_iter()
                .map(|(key, value)| serde_json::json!({ "key": key, "value": value }))
                .collect();
            let mut body = serde_json::json!({
                "domain": domain, "entries": entries, "limits": limits, "reason": reason,
            });
            if let Some(ttl) = ttl {
                body["ttl"] = Value::String(ttl);
            }
            ("PUT", "/v1/overrides".to_owned(), body.to_string())
        }
        OverrideAction::List { domain } => {
            let query = domain
                .map(|d| format!("?domain={}", percent_encode(&d)))
                .unwrap_or_default();
            ("GET", format!("/v1/overrides{query}"), String::new())
        }
        OverrideAction::Delete { id } => (
            "DELETE",
            format!("/v1/overrides/{}", percent_encode(&id)),
            String::new(),
        ),
    };
    let headers = format!("Authorization: Bearer {token}\r\nContent-Type: application/json\r\n");
    match call(
        &args.addr,
        method,
        &path,
        (&headers, &body),
        Duration::from_secs(10),
    ) {
        Ok((status, answer)) => {
            println!("{}", answer.trim());
            if (200..300).contains(&status) {
                ExitCode::SUCCESS
            } else {
                eprintln!("ratelimitd override: HTTP {status}");
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("ratelimitd override: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One HTTP/1.0 call of the service at `addr`, with `headers` (lines each ending in CRLF) and
/// `body`: its status and body, at most 64 MiB, within `timeout` per read and write.
fn call(
    addr: &str,
    method: &str,
    path: &str,
    (headers, body): (&str, &str),
    timeout: Duration,
) -> Result<(u16, String), String> {
    let to = addr
        .to_socket_addrs()
        .map_err(|e| format!("{addr}: {e}"))?
        .next()
        .ok_or_else(|| format!("{addr}: no address"))?;
    let mut stream =
        TcpStream::connect_timeout(&to, timeout).map_err(|e| format!("{addr}: {e}"))?;
    let _ = stream.set_read_timeout(Some(timeout));
    let _ = stream.set_write_timeout(Some(timeout));
    let req = format!(
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\n{headers}Content-Length: {}\r\n\r\n{body}",
        body.len()
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
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("{addr}: not an HTTP answer"))?;
    Ok((status, body.to_owned()))
}
