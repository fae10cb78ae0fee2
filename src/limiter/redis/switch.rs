//! Sentinel's `+switch-master`: a sentinel announces on this channel the moment a replica is
//! promoted. A store behind Sentinel listens on every sentinel and probes at once when one
//! speaks, instead of at its next probe (every 0.1 s while it is down), so that the new master
//! is used as soon as it exists.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use redis::Client;
use tokio::sync::Notify;

/// How long a listener waits before it tries a sentinel again after losing it.
const AGAIN_AFTER: Duration = Duration::from_secs(1);

/// Listens on `sentinel` until the returned task is aborted; `wake` is notified at each
/// announcement of a new master named `master`.
pub(super) fn listen(
    sentinel: Client,
    master: String,
    wake: Arc<Notify>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            match announcements(&sentinel, &master, &wake).await {
                Ok(()) => tracing::debug!("sentinel announcements ended; listening again"),
                Err(e) => tracing::debug!(error = %e, "cannot listen to a sentinel; trying again"),
            }
            tokio::time::sleep(AGAIN_AFTER).await;
        }
    })
}

async fn announcements(sentinel: &Client, master: &str, wake: &Notify) -> redis::RedisResult<()> {
    let mut pubsub = sentinel.get_async_pubsub().await?;
    pubsub.subscribe("+switch-master").await?;
    let mut messages = pubsub.on_message();
    while let Some(msg) = messages.next().await {
        // `<master name> <old ip> <old port> <new ip> <new port>`
        let text: String = msg.get_payload().unwrap_or_default();
        if text.split_whitespace().next() == Some(master) {
            tracing::info!(announced = %text, "a sentinel announced a new master; probing it now");
            wake.notify_one();
        }
    }
    Ok(())
}
