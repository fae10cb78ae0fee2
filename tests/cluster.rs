//! Redis Cluster under change, on nodes the tests start on loopback: a master killed under
//! load (its replica takes over) and slots holding live counters migrated under load.

mod common;

use std::time::Duration;

use tokio::time::Instant;

use common::redis::*;
use common::*;
use envoy_types::pb::google::protobuf::UInt64Value;

/// Answers come within the Redis timeout plus a margin for a debug build on a busy machine.
const TIMEOUT_MS: u64 = 200;
const ANSWER_BOUND: Duration = Duration::from_millis(TIMEOUT_MS + 300);

async fn server(cluster: &RedisCluster, yaml: &str, extra: &[&str]) -> TestServer {
    let urls = cluster.urls();
    let target = [&["--redis-cluster-nodes", urls.as_str()], extra].concat();
    let timeout = format!("{TIMEOUT_MS}ms");
    redis_server(&[("c.yaml", yaml)], &target, &unique_prefix(), &timeout).await
}

fn used(c: &mut Client, domain: &str) -> impl std::future::Future<Output = u64> {
    let mut req = request(domain, &[&[("k", "v")], &[("j", "v")]]);
    req.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
    req.descriptors[1].hits_addend = Some(UInt64Value { value: 0 });
    let mut c = c.clone();
    async move {
        let r = call(&mut c, req).await;
        1_000_000 - r.statuses[0].limit_remaining as u64
    }
}

/// What one stream of sequential requests saw.
#[derive(Default, Debug)]
struct Seen {
    ok: u64,
    over: u64,
    errors: u64,
    slowest: Duration,
    /// Time from `since` to the first and the last error.
    first_error: Option<Duration>,
    last_error: Option<Duration>,
}

/// Sends requests from `workers` concurrent streams until `stop`, recording answers.
async fn load(
    c: &Client,
    domain: &'static str,
    workers: usize,
    since: Instant,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Seen {
    let tasks: Vec<_> = (0..workers)
        .map(|_| {
            let mut c = c.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut seen = Seen::default();
                while !*stop.borrow() {
                    let started = Instant::now();
                    let r = c
                        .should_rate_limit(request(domain, &[&[("k", "v")], &[("j", "v")]]))
                        .await;
                    seen.slowest = seen.slowest.max(started.elapsed());
                    match r {
                        Ok(r) if is_ok(r.get_ref()) => seen.ok += 1,
                        Ok(_) => seen.over += 1,
                        Err(_) => {
                            seen.errors += 1;
                            let at = since.elapsed();
                            seen.first_error.get_or_insert(at);
                            seen.last_error = Some(at);
                        }
                    }
                }
                seen
            })
        })
        .collect();
    let mut all = Seen::default();
    for t in tasks {
        let s = t.await.unwrap();
        all.ok += s.ok;
        all.over += s.over;
        all.errors += s.errors;
        all.slowest = all.slowest.max(s.slowest);
        all.first_error = match (all.first_error, s.first_error) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        all.last_error = all.last_error.max(s.last_error);
    }
    all
}

const BIG: &str = "domain: DOMAIN\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1000000}\n  - key: j\n    rate_limit: {unit: hour, requests_per_unit: 1000000, algorithm: sliding_window}\n";

/// Kills the master holding a domain's slot while requests flow. Answers fail (or fall back)
/// only until the replica is promoted and ratelimitd has found it, with no restart; every
/// answer comes within the timeout. Prints the failure window and what Redis lost: increments
/// the master acknowledged but had not yet replicated when it died (async replication), the
/// bound on what a failover can over-admit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_fails_over_under_load_without_a_restart() {
    let mut cluster = RedisCluster::start_with(3, 1, &["--cluster-node-timeout", "1000"]);
    let domain = "failover";
    let s = server(&cluster, &BIG.replace("DOMAIN", domain), &[]).await;
    let mut c = s.client().await;
    assert!(is_ok(
        &call(&mut c, request(domain, &[&[("k", "v")], &[("j", "v")]])).await
    ));

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let killed_at = Instant::now() + Duration::from_millis(500);
    let traffic = {
        let c = c.clone();
        tokio::spawn(async move { load(&c, "failover", 4, killed_at, stop_rx).await })
    };
    tokio::time::sleep_until(killed_at).await;
    let master_port = cluster.node_for_key(domain).port;
    let master = cluster
        .nodes
        .iter_mut()
        .find(|n| n.port == master_port)
        .unwrap();
    master.kill();

    // Recovered: a request decided by Redis again (the default failure mode is `error`).
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut probe_errors = 0;
    loop {
        let r = c
            .clone()
            .should_rate_limit(request(domain, &[&[("k", "v")], &[("j", "v")]]))
            .await;
        if r.as_ref().is_ok_and(|r| is_ok(r.get_ref())) {
            break;
        }
        probe_errors += r.is_err() as u64;
        if Instant::now() > deadline {
            let (_, m) = s.http_get("/metrics").await;
            for n in &cluster.nodes {
                eprintln!("{}: {:?}", n.port, n.try_cli(&["CLUSTER", "NODES"]));
            }
            let backend: Vec<&str> = m.lines().filter(|l| l.contains("backend")).collect();
            panic!("not recovered within 30 s:\n{}", backend.join("\n"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let recovered_after = killed_at.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await; // traffic on the new master
    stop_tx.send(true).unwrap();
    let seen = traffic.await.unwrap();
    let counted = used(&mut c, domain).await;
    let admitted = seen.ok + 2; // and the two single requests above
    eprintln!(
        "failover: answers failed from {:?} to {:?} after the kill ({} errors of {} answers); \
         decided by Redis again {recovered_after:?} after it; slowest answer {:?}; \
         {admitted} admitted, {counted} counted on the promoted replica: {} increments lost",
        seen.first_error,
        seen.last_error,
        seen.errors,
        seen.ok + seen.over + seen.errors,
        seen.slowest,
        admitted.saturating_sub(counted)
    );
    assert!(seen.slowest <= ANSWER_BOUND, "{:?}", seen.slowest);
    // A call whose answer was lost (its master killed after it ran and replicated, or a
    // timeout after Redis ran it) may be counted though its client got an error: nothing is
    // counted beyond what was admitted and those calls of unknown outcome.
    assert!(
        counted <= admitted + seen.errors + probe_errors,
        "{counted} counted for {admitted} admitted, {} + {probe_errors} failed",
        seen.errors
    );
    assert_ne!(
        cluster.node_for_key(domain).port,
        master_port,
        "a replica took over"
    );
}

const LIMIT: u64 = 150;
const TIGHT: &str = "domain: moving\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 150}\n  - key: j\n    rate_limit: {unit: hour, requests_per_unit: 1000000, algorithm: token_bucket}\n";

/// Migrates the slot holding a domain's live counters (two keys per request: the script's
/// keys may be split between the nodes mid-migration, answered with TRYAGAIN) while four
/// streams of requests run against a limit they exceed: every answer within the timeout,
/// never more than the limit admitted (exactly the limit when no call failed; a call that
/// timed out may have been counted without being admitted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrating_live_counters_under_load_never_over_admits() {
    let cluster = RedisCluster::start();
    let domain = "moving";
    let s = server(&cluster, TIGHT, &[]).await;
    let c = s.client().await;
    let slot = cluster.nodes[0].cli(&["CLUSTER", "KEYSLOT", domain]);
    let src = cluster.node_for_key(domain);
    let dst = cluster.nodes.iter().find(|n| n.port != src.port).unwrap();
    let id = |n: &RedisProc| n.cli(&["CLUSTER", "MYID"]);
    let (src_id, dst_id) = (id(src), id(dst));

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let traffic = {
        let c = c.clone();
        tokio::spawn(async move { load(&c, "moving", 4, Instant::now(), stop_rx).await })
    };
    // The counters are live on the source, and the limit is used up, before the move starts.
    poll(Duration::from_secs(10), || {
        let mut c = c.clone();
        async move {
            let mut req = request("moving", &[&[("k", "v")]]);
            req.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
            let r = c.should_rate_limit(req).await.ok()?;
            (r.get_ref().statuses[0].limit_remaining == 0).then_some(())
        }
    })
    .await;
    dst.cli(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", &src_id]);
    src.cli(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", &dst_id]);
    let port = dst.port.to_string();
    // One key at a time, so requests meet a slot whose keys are split between the nodes.
    loop {
        let keys = src.cli(&["CLUSTER", "GETKEYSINSLOT", &slot, "1"]);
        let Some(key) = keys.lines().find(|k| !k.is_empty()) else {
            break;
        };
        src.cli(&["MIGRATE", "127.0.0.1", &port, key, "0", "5000"]);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for n in &cluster.nodes {
        n.cli(&["CLUSTER", "SETSLOT", &slot, "NODE", &dst_id]);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop_tx.send(true).unwrap();
    let seen = traffic.await.unwrap();
    let (_, m) = s.http_get("/metrics").await;
    let errors: Vec<&str> = m
        .lines()
        .filter(|l| l.starts_with("ratelimit_backend_errors_total") && !l.ends_with(" 0"))
        .collect();
    eprintln!("migration under load: {seen:?}, {errors:?}");
    assert!(seen.slowest <= ANSWER_BOUND, "{:?}", seen.slowest);
    assert!(seen.ok <= LIMIT, "over-admitted: {} of {LIMIT}", seen.ok);
    if seen.errors == 0 {
        assert_eq!(seen.ok, LIMIT, "without errors, exactly the limit");
    }
    assert!(seen.over > 0, "the load went past the limit");
    assert_eq!(cluster.node_for_key(domain).port, dst.port);
}

/// `--redis-tls-skip-hostname-verification` with a cluster whose nodes serve TLS only (the bus
/// too) and present a certificate for another name: refused without the flag, served with it,
/// and a certificate from another CA refused either way: only the name check is skipped, on
/// the seed nodes and on the nodes the cluster names alike.
#[tokio::test]
async fn tls_cluster_nodes_hostname_verification_can_be_skipped_and_only_it() {
    let certs_dir = tempfile::tempdir().unwrap();
    let certs = certs_naming_elsewhere(certs_dir.path());
    let cluster = RedisCluster::start_tls(&certs, "elsewhere");
    let urls = cluster.urls();
    assert!(urls.starts_with("rediss://"), "{urls}");
    let answers = |ca: std::path::PathBuf, skip: bool| {
        let mut flags = vec![
            "--redis-cluster-nodes".to_string(),
            urls.clone(),
            "--redis-tls-ca".into(),
            ca.display().to_string(),
        ];
        if skip {
            flags.push("--redis-tls-skip-hostname-verification".into());
        }
        async move {
            let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
            let yaml = "domain: t\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 10}\n";
            // Keys in every slot range, so that every node is asked.
            let values = ["a", "b", "c", "d", "e", "f"];
            answers_on(&[("t.yaml", yaml)], &flags, "t", &values).await
        }
    };
    let ca = certs.join("ca.crt");
    let refused = answers(ca.clone(), false).await;
    assert!(
        refused.iter().all(|a| *a == Err(tonic::Code::Unavailable)),
        "the certificates name another host: {refused:?}"
    );
    let served = answers(ca, true).await;
    assert!(served.iter().all(|a| *a == Ok(true)), "{served:?}");
    let other_dir = tempfile::tempdir().unwrap();
    let other = make_certs(other_dir.path());
    let refused = answers(other.join("ca.crt"), true).await;
    assert!(
        refused.iter().all(|a| *a == Err(tonic::Code::Unavailable)),
        "certificates from another CA: {refused:?}"
    );
}
