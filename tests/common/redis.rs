//! Real `redis-server` processes on free loopback ports: standalone, a three-master cluster,
//! sentinel and TLS. They can be killed, stalled, flushed and restarted. A watchdog shell ends
//! each one when the test process exits, so shared instances never outlive the run.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// The server the tests start: `redis-server`, or what `RATELIMITD_TEST_REDIS_SERVER` names
/// (`valkey-server`: `make test` runs the Redis suites again on Valkey where it is installed).
pub(crate) fn server_binary() -> String {
    std::env::var("RATELIMITD_TEST_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into())
}

/// A port that is free, with port + 10000 free too (the cluster bus).
pub(crate) fn free_port() -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let base = 20_000 + (std::process::id() % 500) as u16 * 20;
    loop {
        let p = base + NEXT.fetch_add(1, Ordering::SeqCst) % 10_000;
        let ok = |port: u16| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok();
        if ok(p) && ok(p + 10_000) {
            return p;
        }
    }
}

/// A unique key prefix, so tests can share one Redis.
pub(crate) fn unique_prefix() -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "t{}-{}:",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

pub(crate) struct RedisProc {
    pub port: u16,
    args: Vec<String>,
    /// Its environment beyond the test's (the fake clock's preload).
    env: Vec<(String, String)>,
    child: Option<Child>,
    pub dir: tempfile::TempDir,
    /// CA of a TLS-only server.
    tls_ca: Option<PathBuf>,
}

/// Kills `pid` once the test process has exited, however it exits, if it is still the process
/// it was (its start time in /proc unchanged): a pid that ended and was reused, as the next test
/// binary's once was (CI: `tests/examples.rs` killed by SIGKILL at its start), is left alone.
pub(crate) fn watchdog(pid: u32) {
    let script = format!(
        "started() {{ cut -d' ' -f22 /proc/{pid}/stat 2>/dev/null; }}; s=$(started); \
         while kill -0 {} 2>/dev/null; do sleep 0.5; done; \
         [ -n \"$s\" ] && [ \"$(started)\" = \"$s\" ] && kill -9 {pid} 2>/dev/null",
        std::process::id()
    );
    let _ = Command::new("sh")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
}

impl RedisProc {
    /// Starts `redis-server` with `extra` arguments and waits until it answers PING.
    pub(crate) fn start(extra: &[&str]) -> RedisProc {
        Self::start_on(free_port(), extra)
    }

    pub(crate) fn start_on(port: u16, extra: &[&str]) -> RedisProc {
        Self::start_with(port, extra, None)
    }

    /// A Sentinel on a free port monitoring the master on `master_port` as `main` (quorum 1),
    /// with `conf` lines added after the monitor line (`sentinel auth-pass main …`, `tls-*`)
    /// and `extra` arguments (e.g. `--requirepass` for its own clients). Its config file
    /// lives in its own directory (Sentinel rewrites it).
    pub(crate) fn start_sentinel(master_port: u16, conf: &str, extra: &[&str]) -> RedisProc {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("sentinel.conf");
        let port = free_port();
        std::fs::write(
            &file,
            format!(
                "port {port}\nbind 127.0.0.1\nsentinel monitor main 127.0.0.1 {master_port} 1\n{conf}"
            ),
        )
        .unwrap();
        let mut args = vec![file.display().to_string(), "--sentinel".into()];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut p = RedisProc {
            port,
            args,
            env: Vec::new(),
            child: None,
            dir,
            tls_ca: None,
        };
        p.spawn();
        p
    }

    /// A TLS-only server (plain port off) using the certificates of [`make_certs`].
    pub(crate) fn start_tls(certs: &std::path::Path) -> RedisProc {
        Self::start_tls_as(certs, "server")
    }

    /// [`RedisProc::start_tls`] presenting `name.crt` (and `name.key`) from `certs`.
    pub(crate) fn start_tls_as(certs: &std::path::Path, name: &str) -> RedisProc {
        Self::start_tls_with(certs, name, &[])
    }

    /// [`RedisProc::start_tls_as`] with `more` arguments (a cluster node's).
    pub(crate) fn start_tls_with(certs: &std::path::Path, name: &str, more: &[&str]) -> RedisProc {
        let port = free_port();
        let path = |f: &str| certs.join(f).display().to_string();
        let extra = [
            "--tls-port".to_string(),
            port.to_string(),
            "--tls-cert-file".into(),
            path(&format!("{name}.crt")),
            "--tls-key-file".into(),
            path(&format!("{name}.key")),
            "--tls-ca-cert-file".into(),
            path("ca.crt"),
            "--tls-auth-clients".into(),
            "no".into(),
        ];
        let mut extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        extra.extend_from_slice(more);
        Self::start_with(0, &extra, Some(certs.join("ca.crt")))
    }

    fn start_with(port: u16, extra: &[&str], tls_ca: Option<PathBuf>) -> RedisProc {
        let dir = tempfile::tempdir().unwrap();
        let mut args: Vec<String> = vec![
            "--port".into(),
            port.to_string(),
            "--bind".into(),
            "127.0.0.1".into(),
            "--save".into(),
            "".into(),
            "--appendonly".into(),
            "no".into(),
            "--dir".into(),
            dir.path().display().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let tls_port = extra
            .iter()
            .position(|a| *a == "--tls-port")
            .map(|i| extra[i + 1].parse().unwrap());
        let mut p = RedisProc {
            port: tls_port.unwrap_or(port),
            args,
            env: Vec::new(),
            child: None,
            dir,
            tls_ca,
        };
        p.spawn();
        p
    }

    fn spawn(&mut self) {
        let server = server_binary();
        let child = Command::new(&server)
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{server} is installed: {e}"));
        watchdog(child.id());
        self.child = Some(child);
        let until = Instant::now() + Duration::from_secs(10);
        while self.try_cli(&["PING"]).as_deref() != Some("PONG") {
            assert!(
                Instant::now() < until,
                "redis-server on {} did not start",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A standalone server whose wall clock the test sets (see [`FakeClock`]).
    pub(crate) fn start_with_fake_clock(clock: &FakeClock) -> RedisProc {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let mut p = RedisProc {
            port,
            args: [
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                &dir.path().display().to_string(),
            ]
            .map(str::to_owned)
            .to_vec(),
            env: vec![
                (
                    "LD_PRELOAD".into(),
                    fake_clock_library().display().to_string(),
                ),
                (
                    "FAKECLOCK_OFFSET_FILE".into(),
                    clock.file.display().to_string(),
                ),
            ],
            child: None,
            dir,
            tls_ca: None,
        };
        p.spawn();
        p
    }

    pub(crate) fn url(&self) -> String {
        let scheme = if self.tls_ca.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    fn cli_command(&self) -> Command {
        let mut c = Command::new("redis-cli");
        c.args(["-h", "127.0.0.1"]);
        if let Some(ca) = &self.tls_ca {
            c.args(["--tls", "--cacert"]).arg(ca);
        }
        c.args(["-p", &self.port.to_string()]);
        if let Some(i) = self.args.iter().position(|a| a == "--requirepass") {
            c.args(["--no-auth-warning", "-a", &self.args[i + 1]]);
        }
        c
    }

    pub(crate) fn try_cli(&self, args: &[&str]) -> Option<String> {
        let out = self.cli_command().args(args).output().ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// Runs redis-cli against this server.
    pub(crate) fn cli(&self, args: &[&str]) -> String {
        self.try_cli(args)
            .unwrap_or_else(|| panic!("redis-cli {args:?} failed"))
    }

    /// Kills the server (SIGKILL: nothing is saved).
    pub(crate) fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port, empty.
    pub(crate) fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Makes the server unresponsive for `secs` (DEBUG SLEEP), without waiting.
    pub(crate) fn stall(&self, secs: f64) -> Child {
        self.cli_command()
            .args(["DEBUG", "SLEEP", &secs.to_string()])
            .stdout(Stdio::null())
            .spawn()
            .unwrap()
    }
}

impl Drop for RedisProc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Three masters, no replicas, all slots assigned.
pub(crate) struct RedisCluster {
    pub nodes: Vec<RedisProc>,
}

impl RedisCluster {
    pub(crate) fn start() -> RedisCluster {
        Self::start_with(3, 0, &[])
    }

    /// `masters` masters with `replicas` replicas each, every node started with `extra`.
    pub(crate) fn start_with(masters: usize, replicas: usize, extra: &[&str]) -> RedisCluster {
        Self::start_nodes(masters, replicas, extra, None)
    }

    /// Three masters serving TLS only (the cluster bus too), each presenting `name.crt` from
    /// the certificates of [`make_certs`] in `certs`.
    pub(crate) fn start_tls(certs: &std::path::Path, name: &str) -> RedisCluster {
        Self::start_nodes(3, 0, &["--tls-cluster", "yes"], Some((certs, name)))
    }

    fn start_nodes(
        masters: usize,
        replicas: usize,
        extra: &[&str],
        tls: Option<(&std::path::Path, &str)>,
    ) -> RedisCluster {
        let nodes: Vec<RedisProc> = (0..masters * (1 + replicas))
            .map(|_| {
                let mut args = vec![
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    // Replicas sync at once (the default waits 5 s for more replicas), so a
                    // test can kill a master as soon as the cluster is up.
                    "--repl-diskless-sync-delay",
                    "0",
                ];
                args.extend_from_slice(extra);
                match tls {
                    Some((certs, name)) => RedisProc::start_tls_with(certs, name, &args),
                    None => RedisProc::start(&args),
                }
            })
            .collect();
        let mut create = Command::new("redis-cli");
        if let Some((certs, _)) = tls {
            create.args(["--tls", "--cacert"]).arg(certs.join("ca.crt"));
        }
        create.arg("--cluster").arg("create");
        for n in &nodes {
            create.arg(format!("127.0.0.1:{}", n.port));
        }
        let out = create
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "cluster create: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let until = Instant::now() + Duration::from_secs(30);
        for n in &nodes {
            while !n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok") {
                assert!(Instant::now() < until, "cluster not ok");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        // A replica that has not finished its first sync would never be promoted.
        for n in &nodes {
            loop {
                let info = n.cli(&["INFO", "replication"]);
                if info.contains("role:master") || info.contains("master_link_status:up") {
                    break;
                }
                assert!(Instant::now() < until, "replica not in sync");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        RedisCluster { nodes }
    }

    pub(crate) fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(|n| n.url())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The node serving `key`'s slot (from each node's own `CLUSTER NODES` "myself" line).
    pub(crate) fn node_for_key(&self, key: &str) -> &RedisProc {
        self.try_node_for_key(key)
            .unwrap_or_else(|| panic!("no node serves {key}'s slot"))
    }

    /// The node serving `key`'s slot, if one says it does (none while a master is dead and
    /// its replica not yet promoted).
    pub(crate) fn try_node_for_key(&self, key: &str) -> Option<&RedisProc> {
        let slot: u16 = self
            .nodes
            .iter()
            .find_map(|n| n.try_cli(&["CLUSTER", "KEYSLOT", key]))
            .expect("a live node")
            .parse()
            .unwrap();
        for node in &self.nodes {
            let Some(nodes) = node.try_cli(&["CLUSTER", "NODES"]) else {
                continue; // a killed node
            };
            let Some(me) = nodes
                .lines()
                .find(|l| l.contains("myself") && l.contains("master"))
            else {
                continue; // a replica owns no slot
            };
            let owns = me.split_whitespace().skip(8).any(|range| {
                let (from, to) = range.split_once('-').unwrap_or((range, range));
                match (from.parse::<u16>(), to.parse::<u16>()) {
                    (Ok(f), Ok(t)) => (f..=t).contains(&slot),
                    _ => false,
                }
            });
            if owns {
                return Some(node);
            }
        }
        None
    }
}

/// One standalone Redis shared by the tests of this binary.
pub(crate) fn shared_standalone() -> &'static RedisProc {
    static R: OnceLock<RedisProc> = OnceLock::new();
    R.get_or_init(|| RedisProc::start(&[]))
}

/// One cluster shared by the tests of this binary.
pub(crate) fn shared_cluster() -> &'static RedisCluster {
    static C: OnceLock<RedisCluster> = OnceLock::new();
    C.get_or_init(RedisCluster::start)
}

/// The hash tag of the heavy-hitter views each replica publishes under the key prefix
/// (`/top` across replicas): not counters, so left out of [`keys_with_ttl`].
pub(crate) const TOP_TAG: &str = "{ratelimitd-top}";

/// Every counter key under `prefix` on `node`, with its PTTL.
pub(crate) fn keys_with_ttl(node: &RedisProc, prefix: &str) -> Vec<(String, i64)> {
    let keys = node.cli(&["--scan", "--pattern", &format!("{prefix}*")]);
    keys.lines()
        .filter(|k| !k.is_empty() && !k.contains(TOP_TAG))
        .map(|k| (k.to_string(), node.cli(&["PTTL", k]).parse().unwrap()))
        .collect()
}

/// A CA, a server certificate for 127.0.0.1 and localhost, and a client certificate (for
/// `envoy.ratelimitd.test`), made with openssl in `dir/certs`.
pub(crate) fn make_certs(dir: &std::path::Path) -> PathBuf {
    let certs = dir.join("certs");
    std::fs::create_dir_all(&certs).unwrap();
    openssl(
        &certs,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "2",
            "-subj",
            "/CN=ratelimitd-test-ca",
        ],
    );
    sign(
        &certs,
        "server",
        "/CN=127.0.0.1",
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    );
    // For mutual TLS.
    sign(
        &certs,
        "client",
        "/CN=ratelimitd-test-client",
        "extendedKeyUsage=clientAuth\nsubjectAltName=DNS:envoy.ratelimitd.test\n",
    );
    certs
}

/// Runs openssl with `args` in `dir`.
fn openssl(dir: &std::path::Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The name `elsewhere.crt` of [`certs_naming_elsewhere`] is for: one no test dials.
pub(crate) const ELSEWHERE: &str = "elsewhere.ratelimitd.test";

/// The certificates of [`make_certs`] in `dir`, plus `elsewhere.crt` (and its key), signed by
/// the same CA for [`ELSEWHERE`] only: a server presenting it is refused by a client that
/// checks the name it dialled.
pub(crate) fn certs_naming_elsewhere(dir: &std::path::Path) -> PathBuf {
    let certs = make_certs(dir);
    sign(
        &certs,
        "elsewhere",
        "/CN=elsewhere",
        &format!("subjectAltName=DNS:{ELSEWHERE}\n"),
    );
    certs
}

/// `name.key` and `name.crt` in `certs`, signed by its CA, v3 (webpki refuses v1) with the
/// extensions `ext`.
pub(crate) fn sign(certs: &std::path::Path, name: &str, subject: &str, ext: &str) {
    std::fs::write(certs.join(format!("{name}.cnf")), ext).unwrap();
    let (key, csr, crt, cnf) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.crt"),
        format!("{name}.cnf"),
    );
    openssl(
        certs,
        &[
            "req", "-newkey", "rsa:2048", "-nodes", "-keyout", &key, "-out", &csr, "-subj", subject,
        ],
    );
    openssl(
        certs,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &crt,
            "-days",
            "2",
            "-extfile",
            &cnf,
        ],
    );
}

/// The wall clock of a Redis started with [`RedisProc::start_with_fake_clock`]: real time plus
/// an offset the test sets, read by the server on every clock read (tests/common/fakeclock.c,
/// preloaded). Only the wall clock moves; Redis' monotonic clock stays real.
pub(crate) struct FakeClock {
    _dir: tempfile::TempDir,
    file: PathBuf,
}

impl FakeClock {
    /// A clock at real time.
    pub(crate) fn new() -> FakeClock {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("offset");
        std::fs::write(&file, "0").unwrap();
        FakeClock { _dir: dir, file }
    }

    /// Sets the server's wall clock to `at_us` (µs since the epoch) now; it runs on from there.
    pub(crate) fn set(&self, at_us: u64) {
        use ratelimitd::testing::{Clock, SystemClock};
        let offset = at_us as i64 - SystemClock.now_us() as i64;
        // Written whole, then renamed: the server never reads half a number.
        let tmp = self.file.with_extension("tmp");
        std::fs::write(&tmp, offset.to_string()).unwrap();
        std::fs::rename(&tmp, &self.file).unwrap();
    }
}

/// The fake clock's library, built once per test binary with the C compiler.
fn fake_clock_library() -> PathBuf {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("ratelimitd-fakeclock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let lib = dir.join("libfakeclock.so");
        let source = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/common/fakeclock.c");
        let status = Command::new("cc")
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(&lib)
            .arg(source)
            .status()
            .expect("a C compiler (cc) builds the fake clock");
        assert!(status.success(), "cc failed to build {source}");
        lib
    })
    .clone()
}

/// The clock that decides a stepped test: the service's own (the memory backend), or the
/// store's (a Redis started with [`RedisProc::start_with_fake_clock`]), which runs on in real
/// time from where it is set.
pub(crate) enum Stepped {
    Memory(ratelimitd::testing::ManualClock),
    Redis(FakeClock),
}

impl Stepped {
    /// Sets the deciding clock to `at_us`.
    pub(crate) fn set(&self, at_us: u64) {
        match self {
            Stepped::Memory(c) => c.set(at_us),
            Stepped::Redis(c) => c.set(at_us),
        }
    }

    /// How much a reset may be short of the exact one: nothing on a stopped clock; on a
    /// running one, the time between setting it and the answer (a loaded machine: seconds).
    pub(crate) fn slack(&self) -> Duration {
        match self {
            Stepped::Memory(_) => Duration::ZERO,
            Stepped::Redis(_) => Duration::from_secs(10),
        }
    }
}

/// `files` served twice, each with its clock set to `at_us` and stepped by the test: on the
/// memory backend (the service's clock), and on a Redis of its own whose wall clock is the
/// one that counts (the service's clock is `service_us` and never moves). The Redis is
/// returned too: it lives as long as the test holds it.
pub(crate) async fn stepped_servers(
    files: &[(&str, &str)],
    at_us: u64,
    service_us: u64,
) -> (Vec<(&'static str, super::TestServer, Stepped)>, RedisProc) {
    use ratelimitd::testing::ManualClock;
    use std::sync::Arc;
    let memory = ManualClock::new(at_us);
    let fake = FakeClock::new();
    fake.set(at_us);
    let redis = RedisProc::start_with_fake_clock(&fake);
    let url = redis.url();
    let flags = [
        "--backend",
        "redis",
        "--redis-url",
        &url,
        "--redis-key-prefix",
        "stepped:",
        "--redis-timeout",
        "2s",
    ];
    let servers = vec![
        (
            "memory",
            super::TestServer::start_with(files, &[], Arc::new(memory.clone())).await,
            Stepped::Memory(memory),
        ),
        (
            "redis",
            super::TestServer::start_with(files, &flags, Arc::new(ManualClock::new(service_us)))
                .await,
            Stepped::Redis(fake),
        ),
    ];
    (servers, redis)
}
