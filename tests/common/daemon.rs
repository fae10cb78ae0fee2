//! The `ratelimitd` binary as a process of its own, for tests that need its exit, its signals
//! or its resident memory.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use tokio::time::Instant;

use super::Client;
use super::redis::free_port;

pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_ratelimitd");

/// The binary's command line: `--config <config>` (a file or a directory; an empty path gives
/// none, for tests whose environment names the config), then `args`.
pub(crate) fn ratelimitd(config: impl AsRef<Path>, args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    let config = config.as_ref();
    if !config.as_os_str().is_empty() {
        cmd.arg("--config").arg(config);
    }
    cmd.args(args);
    cmd
}

/// The binary serving `limits` (one config file in a directory of its own, which the caller
/// keeps) with `flags`, logging warnings only and to nowhere: for tests that load it hard.
pub(crate) async fn quiet(limits: &str, flags: &[&str]) -> (Daemon, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("limits.yaml"), limits).unwrap();
    let mut cmd = ratelimitd(dir.path(), flags);
    cmd.env("RATELIMITD_LOG_LEVEL", "warn");
    (Daemon::start_with(cmd, Stdio::null).await, dir)
}

/// A running `ratelimitd` process on free loopback ports (given through the environment, as a
/// container would), with its stderr captured.
pub(crate) struct Daemon {
    pub child: Child,
    pub grpc: u16,
    pub http: SocketAddr,
}

impl Daemon {
    /// Starts `cmd` (the binary with its config and flags) and waits until it serves: its
    /// `/healthcheck` answers 200, which comes after the config is loaded and watched (the
    /// socket accepts connections as soon as it is bound, before either). The process dies
    /// with the `Daemon` (a failing test included) or, should the test process itself be
    /// killed, with the test process.
    pub(crate) async fn start(cmd: Command) -> Daemon {
        Self::start_with(cmd, Stdio::piped).await
    }

    /// [`Daemon::start`] with stderr going where `stderr` says (`Stdio::null` for a daemon that
    /// logs more than a test reads). A port found free can be taken by another process before the
    /// daemon binds it (two test runs on one machine): a daemon that exits before it serves is
    /// started again on other ports, twice at most.
    ///
    /// SIGTERM drains for `--drain-delay` (5 s) before the process stops: a test that does not
    /// name the delay (flag or `RATELIMITD_DRAIN_DELAY`) runs without one.
    pub(crate) async fn start_with(mut cmd: Command, mut stderr: impl FnMut() -> Stdio) -> Daemon {
        let named = cmd.get_args().any(|a| {
            a.to_str()
                .is_some_and(|a| a == "--drain-delay" || a.starts_with("--drain-delay="))
        }) || cmd.get_envs().any(|(k, _)| k == "RATELIMITD_DRAIN_DELAY");
        if !named {
            cmd.env("RATELIMITD_DRAIN_DELAY", "0s");
        }
        for attempt in 0..3 {
            let (grpc, http) = (free_port(), free_port());
            let child = cmd
                .env("RATELIMITD_GRPC_ADDR", format!("127.0.0.1:{grpc}"))
                .env("RATELIMITD_HTTP_ADDR", format!("127.0.0.1:{http}"))
                .stderr(stderr())
                .spawn()
                .unwrap();
            super::redis::watchdog(child.id());
            let http = format!("127.0.0.1:{http}").parse().unwrap();
            // Owned before waiting, so a daemon that never comes up is killed too.
            let mut d = Daemon { child, grpc, http };
            let until = Instant::now() + Duration::from_secs(20);
            loop {
                if serves(http).await {
                    return d;
                }
                if let Some(exit) = d.child.try_wait().unwrap() {
                    let mut log = String::new();
                    if let Some(e) = d.child.stderr.as_mut() {
                        let _ = std::io::Read::read_to_string(e, &mut log);
                    }
                    assert!(
                        attempt < 2,
                        "the daemon exited before serving ({exit}): {log}"
                    );
                    break;
                }
                assert!(
                    Instant::now() < until,
                    "the daemon does not serve after 20 s"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        unreachable!("three attempts either serve or panic")
    }

    pub(crate) async fn client(&self) -> Client {
        Client::connect(format!("http://127.0.0.1:{}", self.grpc))
            .await
            .unwrap()
    }

    /// Sends SIGTERM and waits (bounded) for the exit: its status and everything logged.
    pub(crate) async fn terminate(mut self) -> (ExitStatus, String) {
        self.signal_and_wait().await
    }

    pub(crate) async fn signal_and_wait(&mut self) -> (ExitStatus, String) {
        self.signal("TERM");
        let exit = self.exited(Duration::from_secs(15)).await;
        let mut stderr = String::new();
        std::io::Read::read_to_string(self.child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
        (exit, stderr)
    }
}

impl Daemon {
    /// Sends signal `name` (`TERM`, `INT`, `KILL`) without waiting.
    pub(crate) fn signal(&self, name: &str) {
        let kill = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(kill.success());
    }

    /// Waits for the exit, `within` at most.
    pub(crate) async fn exited(&mut self, within: Duration) -> ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(exit) = self.child.try_wait().unwrap() {
                return exit;
            }
            assert!(
                started.elapsed() < within,
                "still running {within:?} after the signal"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Whether `/healthcheck` on `http` answers 200, which comes after the config is loaded and
/// watched (the socket accepts connections as soon as it is bound, before either).
async fn serves(http: SocketAddr) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut stream) = tokio::net::TcpStream::connect(http).await else {
        return false;
    };
    let req = "GET /healthcheck HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n";
    if stream.write_all(req.as_bytes()).await.is_err() {
        return false;
    }
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer).await;
    answer.starts_with(b"HTTP/1.1 200")
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    /// The most resident memory the process has had, in bytes (VmHWM).
    pub(crate) fn hwm(&self) -> u64 {
        self.status_bytes("VmHWM:")
    }

    /// Starts VmHWM again from the present resident size, so that a peak read later is this
    /// part's, not one left from start-up or an earlier part of the test.
    pub(crate) fn reset_hwm(&self) {
        std::fs::write(format!("/proc/{}/clear_refs", self.child.id()), "5").unwrap();
    }

    /// Resident memory, in bytes.
    pub(crate) fn rss(&self) -> u64 {
        self.status_bytes("VmRSS:")
    }

    /// A field of `/proc/<pid>/status` (`field` with its colon), trimmed; `None` if the
    /// kernel does not show it.
    pub(crate) fn status(&self, field: &str) -> Option<String> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .map(|v| v.trim().to_owned())
    }

    /// A `kB` field of `/proc/<pid>/status`, in bytes.
    fn status_bytes(&self, field: &str) -> u64 {
        let kb: u64 = self
            .status(field)
            .and_then(|v| v.trim_end_matches("kB").trim().parse().ok())
            .unwrap();
        kb * 1024
    }

    /// Open file descriptors (sockets included).
    pub(crate) fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .map(|d| d.count())
            .unwrap_or(0)
    }
}
