//! The worker gate: a light load on one tokio worker, more workers as the load needs them.
//!
//! tokio's multi-thread scheduler spreads even a light load over every worker: a worker with a
//! second runnable task wakes a parked sibling, which steals one and parks again. At a few
//! requests in flight that is most of what the Redis path cost over a naive server
//! (docs/performance.md, "The runtime's shape"): one worker carrying the same load spends a
//! quarter less CPU a request and answers sooner; a second is needed only when one is busy.
//!
//! The gate keeps workers out of the scheduler while the others have room. A held worker runs
//! a task that blocks its thread on a condition variable: tokio neither wakes it (a worker
//! running a task is not an idle one) nor hands it work, and what was left in its queue is
//! stolen by a worker that runs out of its own. A controller, a thread of its own, reads
//! tokio's worker metrics every [`TICK`]: when the active workers are saturated (busy nearly
//! all the tick and parked hardly at all), it lets one go at once; when they are not and the
//! load would fit on one fewer, it holds one again. A hold that proves too few is let go and
//! the next try waits twice as long (from [`PROBE_MIN`] up to [`PROBE_MAX`]), so a load just
//! above one worker's settles on two and pays one short try every ten seconds; a load well
//! under the one that failed is tried at once.
//!
//! **Costly requests.** One worker is enough for a light load of small requests, not for a
//! light load beside one costly request: a request of many counters (a few milliseconds of
//! work) would make every request queued behind it on the only worker wait that long, while
//! the worker, waiting on Redis between its steps, is never saturated. So a request of more
//! than [`COSTLY_COUNTERS`] counters says so while it is handled ([`Costly`]), and while any
//! is, the gate lets every worker go and holds none: one client's costly requests never set
//! another's latency. Measured (`make worst`): a victim at 200 requests/s beside one
//! 256-counter request always in flight had p50 3.9-4.2 ms with the gate holding a worker,
//! against 1.8 ms with the gate off.
//!
//! **The I/O driver.** A parking worker polls the I/O and timer driver only if no other worker
//! has it; otherwise it sleeps on its own condition variable until it is sent work. A worker
//! that comes out of the driver and then blocks in a hold leaves every other worker asleep and
//! nobody polling sockets or timers: the whole service stops (seen: a server that never
//! answered its first health check, and a stream left unanswered in the bounds tests). So
//! after every hold begins, the controller spawns an empty task from its own thread: tokio
//! wakes a sleeping worker for a task from outside, and that worker, out of work again, parks
//! on the driver, which is free. One wake a hold, and a hold is tried at most every
//! [`PROBE_MIN`].

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::runtime::{Handle, RuntimeMetrics};
use tokio::time::Instant;

/// How often the controller reads the workers' metrics.
pub const TICK: Duration = Duration::from_millis(10);
/// The least time between tries with one worker fewer (after a try that held).
pub const PROBE_MIN: Duration = Duration::from_millis(100);
/// The most time between tries, after tries that proved too few workers in a row.
pub const PROBE_MAX: Duration = Duration::from_secs(10);
/// Saturated: the active workers were busy more than this share of a tick...
const SATURATED_BUSY: f64 = 0.8;
/// ...and parked at most once each. A worker at 95% with requests waiting on Redis still
/// parks dozens of times a tick; one with a queue never does.
const SATURATED_PARKS: u64 = 1;
/// One fewer is tried only while the active workers' busy time is under this many workers'
/// worth of the fewer: two workers cost more CPU a request than one at a light load, so their
/// sum overstates what one would need.
const FIT: f64 = 1.5;

/// A load under this share of the one at which the last try failed is tried at once: after a
/// burst, a light load is back on one worker within a tick or two, not after the wait.
const LIGHTER: f64 = 0.7;

/// Workers in the scheduler now, while a gate runs (0: none runs); for the metrics.
static ACTIVE: AtomicUsize = AtomicUsize::new(0);

/// A request of more counters than this is costly: while one is handled, no worker is held
/// (the Redis backend's large-request lane starts at the same size).
pub const COSTLY_COUNTERS: usize = 64;

/// Costly requests being handled now.
static COSTLY: AtomicUsize = AtomicUsize::new(0);

/// A costly request being handled (see the module's documentation, "Costly requests"): while
/// one lives, the gate holds no worker.
#[derive(Debug)]
pub struct Costly(());

impl Costly {
    /// A request of `counters` counters: costly, or `None`.
    pub fn of(counters: usize) -> Option<Costly> {
        (counters > COSTLY_COUNTERS).then(|| {
            COSTLY.fetch_add(1, Ordering::Relaxed);
            Costly(())
        })
    }
}

impl Drop for Costly {
    fn drop(&mut self) {
        COSTLY.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Workers in the scheduler now, if a [`WorkerGate`] runs in this process.
pub fn active_workers() -> Option<usize> {
    match ACTIVE.load(Ordering::Relaxed) {
        0 => None,
        n => Some(n),
    }
}

/// Shared by the controller, the held workers and the owner.
#[derive(Debug)]
struct Shared {
    state: Mutex<GateState>,
    /// Held workers wait on this to be let go.
    wake: Condvar,
    /// The controller waits on this between ticks: a hold began, or the gate stopped.
    changed: Condvar,
    workers: usize,
}

#[derive(Debug, Default)]
struct GateState {
    /// Workers the controller wants held.
    target: usize,
    /// Workers held now.
    held: usize,
    /// Holds begun so far: the controller wakes a sleeping worker after each (see the module's
    /// documentation, "The I/O driver").
    begun: u64,
    stopped: bool,
}

/// The gate of a runtime. [`WorkerGate::stop`] (or dropping it) lets every worker go, and must
/// come before the runtime is dropped: a held worker is inside a task's poll.
#[derive(Debug)]
pub struct WorkerGate {
    shared: Arc<Shared>,
    controller: Option<JoinHandle<()>>,
}

impl WorkerGate {
    /// Starts the controller for `runtime`, a multi-thread runtime, on a thread of its own;
    /// with one worker there is nothing to hold and no controller runs.
    pub fn start(runtime: &Handle) -> WorkerGate {
        let workers = runtime.metrics().num_workers();
        let shared = Arc::new(Shared {
            state: Mutex::new(GateState::default()),
            wake: Condvar::new(),
            changed: Condvar::new(),
            workers,
        });
        ACTIVE.store(workers, Ordering::Relaxed);
        let controller = (workers > 1).then(|| {
            let (shared, runtime) = (Arc::clone(&shared), runtime.clone());
            std::thread::Builder::new()
                .name("worker-gate".into())
                .spawn(move || control(&shared, &runtime))
                .expect("the worker gate's thread starts")
        });
        WorkerGate { shared, controller }
    }

    /// Lets every held worker go and holds none again.
    pub fn stop(&self) {
        let mut state = lock(&self.shared.state);
        state.stopped = true;
        state.target = 0;
        self.shared.wake.notify_all();
        self.shared.changed.notify_all();
    }
}

impl Drop for WorkerGate {
    fn drop(&mut self) {
        self.stop();
        if let Some(controller) = self.controller.take() {
            let _ = controller.join();
        }
    }
}

fn lock(m: &Mutex<GateState>) -> MutexGuard<'_, GateState> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The workers' busy time and park count so far, summed (a held worker adds nothing while it
/// is held: tokio records both when a worker parks or between tasks).
fn totals(metrics: &RuntimeMetrics) -> (Duration, u64) {
    (0..metrics.num_workers()).fold((Duration::ZERO, 0), |(busy, parks), w| {
        (
            busy + metrics.worker_total_busy_duration(w),
            parks + metrics.worker_park_count(w),
        )
    })
}

/// Waits until `until`, and after each hold that begins meanwhile spawns an empty task from
/// this thread, so that a sleeping worker wakes and takes the I/O driver (see the module's
/// documentation, "The I/O driver"); `woken` counts the holds already followed by a wake.
/// False once the gate has stopped.
fn between_ticks(shared: &Shared, runtime: &Handle, until: Instant, woken: &mut u64) -> bool {
    let mut state = lock(&shared.state);
    loop {
        if state.stopped {
            return false;
        }
        if state.begun != *woken {
            *woken = state.begun;
            drop(state);
            runtime.spawn(async {});
            state = lock(&shared.state);
            continue;
        }
        let now = Instant::now();
        if now >= until {
            return true;
        }
        state = shared
            .changed
            .wait_timeout(state, until - now)
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .0;
    }
}

/// The controller, on its own thread: see the module's documentation.
fn control(shared: &Arc<Shared>, runtime: &Handle) {
    let metrics = runtime.metrics();
    let mut last = (Instant::now(), totals(&metrics));
    let mut woken = 0;
    let mut probe_wait = PROBE_MIN;
    let mut next_probe = Instant::now();
    // When the hold on trial began (a try is on trial for one probe interval).
    let mut trial: Option<Instant> = None;
    // The busy time at which the last try began, and at which the last try that failed did:
    // a load well under that one is tried at once, whatever the wait.
    let mut tried_at = f64::INFINITY;
    let mut failed_at = f64::INFINITY;
    while between_ticks(shared, runtime, last.0 + TICK, &mut woken) {
        let now = (Instant::now(), totals(&metrics));
        let wall = now.0.saturating_duration_since(last.0).as_secs_f64();
        let busy = now.1.0.saturating_sub(last.1.0).as_secs_f64() / wall.max(1e-6);
        let parks = now.1.1.saturating_sub(last.1.1);
        last = now;
        let target = lock(&shared.state).target;
        let active = shared.workers - target;
        let saturated =
            parks <= SATURATED_PARKS * active as u64 && busy > SATURATED_BUSY * active as f64;
        let costly = COSTLY.load(Ordering::Relaxed) > 0;
        if target > 0 && costly {
            // Every worker, at once, whatever the tries so far.
            trial = None;
            lock(&shared.state).target = 0;
            shared.wake.notify_all();
        } else if costly {
            // Nothing is held while a costly request is handled.
        } else if target > 0 && saturated {
            // Too few: let one go now; after a try, wait longer before the next.
            if trial.take().is_some() {
                probe_wait = (probe_wait * 2).min(PROBE_MAX);
                failed_at = tried_at;
            }
            next_probe = now.0 + probe_wait;
            lock(&shared.state).target -= 1;
            shared.wake.notify_one();
        } else if active > 1
            && !saturated
            && busy < FIT * (active - 1) as f64
            && (now.0 >= next_probe || busy < LIGHTER * failed_at)
        {
            trial = Some(now.0);
            tried_at = busy;
            next_probe = now.0 + probe_wait;
            lock(&shared.state).target += 1;
            runtime.spawn(hold(Arc::clone(shared)));
        } else if trial.is_some_and(|since| now.0.saturating_duration_since(since) >= probe_wait) {
            // The try held a whole interval: the next may come soon.
            trial = None;
            probe_wait = PROBE_MIN;
            failed_at = f64::INFINITY;
        }
    }
    ACTIVE.store(0, Ordering::Relaxed);
}

/// Holds the worker that runs it while the controller wants it held.
async fn hold(shared: Arc<Shared>) {
    // Deferred behind what is queued on this worker, which so runs before the thread blocks.
    tokio::task::yield_now().await;
    hold_now(&shared);
}

/// Blocks this worker's thread while the controller wants it held (not at all if it wants no
/// more held than are).
fn hold_now(shared: &Shared) {
    let mut state = lock(&shared.state);
    if state.stopped || state.held >= state.target {
        return;
    }
    state.held += 1;
    state.begun += 1;
    shared.changed.notify_all();
    ACTIVE.fetch_sub(1, Ordering::Relaxed);
    while !state.stopped && state.held <= state.target {
        state = shared
            .wake
            .wait(state)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
    }
    state.held -= 1;
    ACTIVE.fetch_add(1, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// Polls `done` every 10 ms until it holds or `within` passes.
    fn eventually(within: Duration, mut done: impl FnMut() -> bool) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if done() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        done()
    }

    fn held(gate: &WorkerGate) -> usize {
        lock(&gate.shared.state).held
    }

    /// A runtime of two workers and its gate, once the gate holds one of them (at rest).
    fn two_workers_one_held() -> (tokio::runtime::Runtime, WorkerGate) {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let gate = WorkerGate::start(runtime.handle());
        assert!(
            eventually(Duration::from_secs(20), || held(&gate) == 1),
            "never held one"
        );
        (runtime, gate)
    }

    /// A costly request in flight lets the held worker go at once, idle as the runtime is;
    /// when it is done, one is held again. Small requests do not count.
    #[test]
    fn a_costly_request_lets_every_worker_go_while_it_is_handled() {
        let (runtime, gate) = two_workers_one_held();
        assert!(Costly::of(COSTLY_COUNTERS).is_none());
        let costly = Costly::of(COSTLY_COUNTERS + 1).expect("costly");
        assert!(
            eventually(Duration::from_secs(20), || held(&gate) == 0),
            "held on beside a costly request"
        );
        drop(costly);
        assert!(
            eventually(Duration::from_secs(30), || held(&gate) == 1),
            "never held again"
        );
        gate.stop();
        drop(runtime);
    }

    /// Idle, the gate holds all workers but one; a load that keeps every active worker busy
    /// gets them back; once it stops, one is held again; stopping lets every worker go, and the
    /// runtime then drops as usual (the test would hang otherwise).
    #[test]
    fn holds_when_idle_and_lets_go_under_load() {
        let (runtime, gate) = two_workers_one_held();

        // CPU-bound tasks that yield between slices: one worker alone never parks.
        let spinning = Arc::new(AtomicBool::new(true));
        for _ in 0..4 {
            let spinning = Arc::clone(&spinning);
            runtime.spawn(async move {
                while spinning.load(Ordering::Relaxed) {
                    let until = Instant::now() + Duration::from_micros(200);
                    while Instant::now() < until {
                        std::hint::spin_loop();
                    }
                    tokio::task::yield_now().await;
                }
            });
        }
        assert!(
            eventually(Duration::from_secs(20), || held(&gate) == 0),
            "never let go"
        );
        spinning.store(false, Ordering::Relaxed);
        assert!(
            eventually(Duration::from_secs(30), || held(&gate) == 1),
            "never held again"
        );

        gate.stop();
        assert!(
            eventually(Duration::from_secs(5), || held(&gate) == 0),
            "stop held on"
        );
        drop(runtime);
    }

    /// The I/O driver is polled while a worker is held, however the hold began: here a hold
    /// runs inline in a task a timer woke, so on the worker that was polling the driver, with
    /// the other worker asleep and nothing sent to it. Without the controller's wake after a
    /// hold begins, sockets and timers stop for good and the echo never comes.
    #[test]
    fn the_io_driver_is_polled_while_a_worker_is_held() {
        use std::io::{Read, Write};
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        runtime.spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            while let Ok((mut socket, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut byte = [0u8; 1];
                    while socket.read_exact(&mut byte).await.is_ok() {
                        let _ = socket.write_all(&byte).await;
                    }
                });
            }
        });
        let shared = Arc::new(Shared {
            state: Mutex::new(GateState {
                target: 1,
                ..GateState::default()
            }),
            wake: Condvar::new(),
            changed: Condvar::new(),
            workers: 2,
        });
        // A gate without its controller thread: dropped, it stops, which lets the held worker go
        // however the test ends (before the runtime drops).
        let gate = WorkerGate {
            shared: Arc::clone(&shared),
            controller: None,
        };
        // The controller's wake alone, without its policy (which would hold on its own).
        let waker = {
            let (shared, handle) = (Arc::clone(&shared), runtime.handle().clone());
            std::thread::spawn(move || {
                let mut woken = 0;
                while between_ticks(&shared, &handle, Instant::now() + TICK, &mut woken) {}
            })
        };
        for round in 0..20 {
            // Both workers idle: one polls the driver, the other sleeps on its condvar.
            std::thread::sleep(Duration::from_millis(20));
            let held = Arc::clone(&shared);
            runtime.spawn(async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                hold_now(&held);
            });
            assert!(
                eventually(Duration::from_secs(10), || lock(&shared.state).held == 1),
                "round {round}: never held"
            );
            let mut client = std::net::TcpStream::connect(addr).unwrap();
            client
                .set_read_timeout(Some(Duration::from_secs(5)))
                .unwrap();
            client.write_all(b"x").unwrap();
            let mut byte = [0u8; 1];
            assert!(
                client.read_exact(&mut byte).is_ok(),
                "round {round}: no echo while a worker was held: nobody polls the I/O driver"
            );
            // Let the worker go for the next round.
            lock(&shared.state).target = 0;
            shared.wake.notify_all();
            assert!(
                eventually(Duration::from_secs(10), || lock(&shared.state).held == 0),
                "round {round}: never let go"
            );
            lock(&shared.state).target = 1;
        }
        drop(gate);
        waker.join().unwrap();
        drop(runtime);
    }

    /// While a worker is held, tasks spawned from outside and from inside all run: the active
    /// worker takes them (nothing waits on the held one).
    #[test]
    fn tasks_run_while_a_worker_is_held() {
        let (runtime, gate) = two_workers_one_held();
        let done = runtime.block_on(async {
            let tasks: Vec<_> = (0..200u64)
                .map(|i| {
                    tokio::spawn(async move {
                        let inner = tokio::spawn(async move { i * 2 });
                        tokio::time::sleep(Duration::from_millis(i % 5)).await;
                        inner.await.unwrap()
                    })
                })
                .collect();
            let mut sum = 0;
            for t in tasks {
                sum += tokio::time::timeout(Duration::from_secs(20), t)
                    .await
                    .expect("a task never ran")
                    .unwrap();
            }
            sum
        });
        assert_eq!(done, (0..200u64).map(|i| i * 2).sum::<u64>());
        drop(gate);
        drop(runtime);
    }
}
