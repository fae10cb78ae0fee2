//! The `ratelimitd` binary: flags and environment, logging, listeners, signals.

use std::process::ExitCode;

use anyhow::Context;
use ratelimitd::runtime::WorkerGate;
use ratelimitd::settings::{Options, Startup};
use ratelimitd::{GrpcSocket, Listeners, Shutdown, bind, check_config, run};

/// mimalloc: the hot path allocates small, short-lived buffers per request (decoded protos, keys,
/// responses); a thread-caching allocator measurably beats the system one there (`make bench`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// SIGTERM (Kubernetes, systemd) drains; SIGINT (a terminal's Ctrl-C) stops at once.
async fn shutdown_signal() -> Shutdown {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing a SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => Shutdown::Now,
            _ = term.recv() => Shutdown::Drain,
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
        Shutdown::Now
    }
}

async fn serve(startup: Startup, options: Options) -> anyhow::Result<()> {
    // Bound now (a port taken fails at once); listening once the service can serve.
    let grpc = match startup.grpc_uds {
        Some((path, mode)) => GrpcSocket::Unix { path, mode },
        None => bind(startup.grpc_addr)
            .with_context(|| format!("--grpc-addr: cannot bind {}", startup.grpc_addr))?
            .into(),
    };
    let http = bind(startup.http_addr)
        .with_context(|| format!("--http-addr: cannot bind {}", startup.http_addr))?;
    let mut extra_http = Vec::new();
    for (flag, addr) in &startup.extra_http {
        let l = bind(*addr).with_context(|| format!("{flag}: cannot bind {addr}"))?;
        extra_http.push(l);
    }
    let debug_http = match startup.debug_addr {
        Some(addr) => {
            Some(bind(addr).with_context(|| format!("--debug-addr: cannot bind {addr}"))?)
        }
        None => None,
    };
    let admin = match startup.admin_addr {
        Some(addr) => {
            Some(bind(addr).with_context(|| format!("--admin-addr: cannot bind {addr}"))?)
        }
        None => None,
    };
    for note in &startup.ignored_env {
        tracing::warn!("{note}");
    }
    run(
        options,
        Listeners {
            grpc,
            http,
            extra_http,
            debug_http,
            admin,
        },
        shutdown_signal(),
    )
    .await?;
    Ok(())
}

fn main() -> ExitCode {
    // No transparent huge pages for this process: mimalloc advises them on its arenas, and the
    // first touch of a fresh (or, after a second idle, purged) 2 MiB region makes the kernel
    // zero all of it. A fresh replica's first wave of 64 calls took 5.5-15 ms of CPU, mostly
    // clearing pages that way, and through Envoy missed its 20 ms; without, 2.4-4.7 ms.
    #[cfg(target_os = "linux")]
    if let Err(e) = rustix::thread::disable_transparent_huge_pages(true) {
        eprintln!("ratelimitd: cannot turn off transparent huge pages: {e}");
    }
    // `ratelimitd top`: the terminal client of GET /top, not the service.
    if std::env::args().nth(1).as_deref() == Some("top") {
        return ratelimitd::cli::top(std::env::args().skip(2));
    }
    // `ratelimitd override`: the admin listener's overrides.
    if std::env::args().nth(1).as_deref() == Some("override") {
        return ratelimitd::cli::overrides(std::env::args().skip(2), |k| std::env::var(k).ok());
    }
    let (startup, options) =
        match ratelimitd::settings::parse(std::env::args(), |k| std::env::var(k).ok()) {
            Ok(parsed) => parsed,
            Err(e) => e.exit(),
        };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("ratelimitd: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Logging first (--check shows the files' warnings too); span export runs on the runtime.
    let telemetry = {
        let _inside = runtime.enter();
        match ratelimitd::telemetry::init(&startup.telemetry) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("ratelimitd: {e}");
                return ExitCode::from(2);
            }
        }
    };
    let code = if startup.check {
        match check_config(&options) {
            Ok(rules) => {
                print!("{rules}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("ratelimitd: {e}");
                ExitCode::FAILURE
            }
        }
    } else {
        // Held workers are let go (the gate dropped) before the runtime is.
        let gate = startup
            .worker_gate
            .then(|| WorkerGate::start(runtime.handle()));
        let code = match runtime.block_on(serve(startup, options)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("ratelimitd: {e:#}");
                ExitCode::FAILURE
            }
        };
        drop(gate);
        code
    };
    // Flushes the spans not yet exported, while the runtime that sends them still runs.
    let _inside = runtime.enter();
    drop(telemetry);
    code
}
