//! Every way a Redis call can fail, as the service tells them apart: a bounded metric label,
//! whether the failure mode answers (transient) or the request fails (gRPC INTERNAL), and what
//! the failure says about Redis's own health.

use redis::RedisError;

use crate::limiter::BackendError;

/// Why a Redis call failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ErrorKind {
    /// No answer within the call budget.
    Timeout,
    /// The connection failed, dropped or was refused.
    Connection,
    /// Out of memory (`maxmemory` reached).
    Oom,
    /// Too few replicas to write (`min-replicas-to-write`).
    NoReplicas,
    /// A failed snapshot stops writes (`stop-writes-on-bgsave-error`).
    Misconf,
    /// A replica: it does not take writes.
    ReadOnly,
    /// Loading its dataset.
    Loading,
    /// A replica whose master is down.
    MasterDown,
    /// Another script is running too long.
    Busy,
    /// The script is not cached (after a restart or `SCRIPT FLUSH`) and EVAL failed too.
    NoScript,
    /// Credentials refused or missing.
    Auth,
    /// Cluster redirections or a failover in progress.
    Cluster,
    /// Another error the client would retry.
    Other,
    /// Keys of one call in different slots: a bug.
    CrossSlot,
    /// Any other script error: a bug, or data this service did not write.
    Script,
    /// A counter holds data this service did not write (the script said so, for one request).
    ForeignData,
    /// The script's reply did not have the expected shape.
    Reply,
    /// A calendar window's boundaries missed Redis' time twice (its clock jumped between two
    /// calls of one request).
    Clock,
    /// The backend is shutting down.
    Closed,
    /// The queue of calls was full: refused at once.
    Overloaded,
    /// The circuit is open after evidence that Redis is unwell: not tried.
    CircuitOpen,
}

/// What a failed call says about Redis itself (see `circuit.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Evidence {
    /// Nothing: Redis answered, or the failure is the call's own.
    None,
    /// Redis cannot be reached.
    Unreachable,
    /// Redis did not answer in time: unwell if a PING does not answer either.
    Stalled,
}

/// Redis's replies that mean "cannot serve now", by their error code. Found by code, or inside
/// a script error's message (where a Redis before 7 puts the code of the command that failed).
const CANNOT_SERVE_NOW: [(&str, ErrorKind); 7] = [
    ("OOM", ErrorKind::Oom),
    ("NOREPLICAS", ErrorKind::NoReplicas),
    ("MISCONF", ErrorKind::Misconf),
    ("READONLY", ErrorKind::ReadOnly),
    ("LOADING", ErrorKind::Loading),
    ("MASTERDOWN", ErrorKind::MasterDown),
    ("BUSY", ErrorKind::Busy),
];

impl ErrorKind {
    /// Classifies an error of the Redis client.
    ///
    /// Transient: timeouts, connection errors, NOSCRIPT, authentication, cluster redirections
    /// and failovers, and the "cannot serve now" replies. Permanent: CROSSSLOT and any other
    /// script error.
    pub(super) fn of(err: &RedisError) -> ErrorKind {
        use redis::{ErrorKind as Client, ServerErrorKind as Server};
        if err.is_timeout() {
            return ErrorKind::Timeout;
        }
        if err.is_io_error() || err.is_connection_dropped() || err.is_connection_refusal() {
            return ErrorKind::Connection;
        }
        let code = err.code().unwrap_or_default();
        if let Some((_, kind)) = CANNOT_SERVE_NOW.iter().find(|(c, _)| {
            *c == code
                || err.detail().is_some_and(|d| {
                    d.starts_with(&format!("{c} ")) || d.contains(&format!(" {c} "))
                })
        }) {
            return *kind;
        }
        if function_missing(err) {
            return ErrorKind::NoScript;
        }
        match err.kind() {
            Client::Server(Server::NoScript) => ErrorKind::NoScript,
            Client::Server(Server::CrossSlot) => ErrorKind::CrossSlot,
            Client::AuthenticationFailed | Client::Server(Server::NoPerm) => ErrorKind::Auth,
            _ if err.is_cluster_error() => ErrorKind::Cluster,
            _ => match code {
                "NOAUTH" | "WRONGPASS" => ErrorKind::Auth,
                _ if !matches!(err.retry_method(), redis::RetryMethod::NoRetry) => ErrorKind::Other,
                _ => ErrorKind::Script,
            },
        }
    }

    /// Every kind, for the zero series exported before the first error.
    pub(super) const ALL: [ErrorKind; 21] = [
        ErrorKind::Timeout,
        ErrorKind::Connection,
        ErrorKind::Oom,
        ErrorKind::NoReplicas,
        ErrorKind::Misconf,
        ErrorKind::ReadOnly,
        ErrorKind::Loading,
        ErrorKind::MasterDown,
        ErrorKind::Busy,
        ErrorKind::NoScript,
        ErrorKind::Auth,
        ErrorKind::Cluster,
        ErrorKind::Other,
        ErrorKind::CrossSlot,
        ErrorKind::Script,
        ErrorKind::ForeignData,
        ErrorKind::Reply,
        ErrorKind::Clock,
        ErrorKind::Closed,
        ErrorKind::Overloaded,
        ErrorKind::CircuitOpen,
    ];

    /// The metric label (`ratelimit_backend_errors_total{kind}`).
    pub(super) fn label(self) -> &'static str {
        match self {
            ErrorKind::Timeout => "timeout",
            ErrorKind::Connection => "connection",
            ErrorKind::Oom => "oom",
            ErrorKind::NoReplicas => "noreplicas",
            ErrorKind::Misconf => "misconf",
            ErrorKind::ReadOnly => "readonly",
            ErrorKind::Loading => "loading",
            ErrorKind::MasterDown => "masterdown",
            ErrorKind::Busy => "busy",
            ErrorKind::NoScript => "noscript",
            ErrorKind::Auth => "auth",
            ErrorKind::Cluster => "cluster",
            ErrorKind::Other => "other",
            ErrorKind::CrossSlot => "crossslot",
            ErrorKind::Script => "script",
            ErrorKind::ForeignData => "foreign_data",
            ErrorKind::Reply => "reply",
            ErrorKind::Clock => "clock",
            ErrorKind::Closed => "closed",
            ErrorKind::Overloaded => "overloaded",
            ErrorKind::CircuitOpen => "circuit_open",
        }
    }

    /// Whether a retry, or Redis a moment later, may succeed: then the failure mode answers.
    /// Otherwise the request fails (a bug, or data this service did not write).
    pub(super) fn is_transient(self) -> bool {
        !matches!(
            self,
            ErrorKind::CrossSlot | ErrorKind::Script | ErrorKind::ForeignData | ErrorKind::Reply
        )
    }

    /// What a script call that failed this way says about Redis's health. Replies such as
    /// BUSY or LOADING say nothing: Redis answered, at once.
    pub(super) fn evidence(self) -> Evidence {
        match self {
            ErrorKind::Connection => Evidence::Unreachable,
            ErrorKind::Timeout => Evidence::Stalled,
            _ => Evidence::None,
        }
    }

    /// The backend error of this kind, with `detail` for the log.
    pub(super) fn error(self, detail: impl Into<String>) -> BackendError {
        let (kind, detail) = (self.label(), detail.into());
        if self.is_transient() {
            BackendError::Unavailable { kind, detail }
        } else {
            BackendError::Internal { kind, detail }
        }
    }
}

/// Whether FCALL failed because Redis does not hold the function (a Redis restarted without
/// persistence, `FUNCTION FLUSH`, a new cluster node): load the library and call again.
pub(super) fn function_missing(err: &RedisError) -> bool {
    err.code() == Some("ERR")
        && err
            .detail()
            .is_some_and(|d| d.starts_with("Function not found"))
}

/// Whether Redis refuses functions for good: a Redis before 7 (FCALL and FUNCTION are unknown
/// commands) or a user whose ACL forbids them. The script is then called by EVALSHA.
pub(super) fn functions_refused(err: &RedisError) -> bool {
    err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm)
        || (err.code() == Some("ERR")
            && err.detail().is_some_and(|d| {
                let d = d.to_ascii_lowercase();
                d.starts_with("unknown command") || d.starts_with("unknown subcommand")
            }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error a Redis error reply (`reply`, without its leading `-`) becomes.
    fn err(reply: &str) -> RedisError {
        match redis::parse_redis_value(format!("-{reply}\r\n").as_bytes()).unwrap() {
            redis::Value::ServerError(e) => e.into(),
            v => panic!("{v:?}"),
        }
    }

    /// Every reply Redis can give a script call has a stated class: transient (the failure
    /// mode answers) or permanent (INTERNAL), with its own metric kind.
    #[test]
    fn every_redis_error_has_a_stated_class() {
        #[rustfmt::skip]
        let cases = [
            ("OOM command not allowed when used memory > 'maxmemory'.", "oom", true),
            ("NOREPLICAS Not enough good replicas to write.", "noreplicas", true),
            ("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.", "misconf", true),
            ("READONLY You can't write against a read only replica.", "readonly", true),
            ("LOADING Redis is loading the dataset in memory", "loading", true),
            ("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.", "masterdown", true),
            ("BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.", "busy", true),
            ("NOSCRIPT No matching script. Please use EVAL.", "noscript", true),
            // FCALL of a library Redis lost (it is loaded and called again first).
            ("ERR Function not found", "noscript", true),
            ("NOAUTH Authentication required.", "auth", true),
            ("WRONGPASS invalid username-password pair or user is disabled.", "auth", true),
            ("NOPERM User has no permissions to run the 'evalsha' command", "auth", true),
            ("TRYAGAIN Multiple keys request during rehashing of slot", "cluster", true),
            ("CLUSTERDOWN The cluster is down", "cluster", true),
            ("CROSSSLOT Keys in request don't hash to the same slot", "crossslot", false),
            ("WRONGTYPE Operation against a key holding the wrong kind of value", "script", false),
            ("ERR Error running script (call to f_1): @user_script:1: Script attempted to access nonexistent global variable 'x'", "script", false),
            // A Redis before 7 reports a failed command inside the script's own error.
            ("ERR Error running script (call to f_1): @user_script:12: OOM command not allowed when used memory > 'maxmemory'.", "oom", true),
        ];
        for (reply, label, transient) in cases {
            let kind = ErrorKind::of(&err(reply));
            assert_eq!(
                (kind.label(), kind.is_transient()),
                (label, transient),
                "{reply}"
            );
            // Redis answered: no evidence that it is unwell.
            assert_eq!(kind.evidence(), Evidence::None, "{reply}");
        }
    }

    /// What makes the service load its function library, and what makes it call the script by
    /// EVALSHA instead (Redis 6's and 7's own replies).
    #[test]
    fn function_replies_say_load_it_or_do_without() {
        let missing = err("ERR Function not found");
        assert!(function_missing(&missing) && !functions_refused(&missing));
        for refused in [
            "ERR unknown command 'FCALL', with args beginning with: 'ratelimitd_x' '2' ",
            "ERR unknown command `FUNCTION`, with args beginning with: `LOAD`, ",
            "ERR unknown subcommand 'LOAD'. Try FUNCTION HELP.",
            "NOPERM this user has no permissions to run the 'fcall' command",
            "NOPERM this user has no permissions to run the 'function|load' command",
        ] {
            let e = err(refused);
            assert!(functions_refused(&e) && !function_missing(&e), "{refused}");
        }
        for other in [
            "NOSCRIPT No matching script. Please use EVAL.",
            "ERR Error running script (call to f_1): @user_script:1: boom",
            "OOM command not allowed when used memory > 'maxmemory'.",
        ] {
            let e = err(other);
            assert!(!functions_refused(&e) && !function_missing(&e), "{other}");
        }
    }
}
