//! Helpers shared by the driver tests.
#![allow(dead_code)] // each test binary uses a subset

use std::time::Duration;

use kvlane_control::{Config, ConnectionId, Event, LocalInfo, PeerEvent, Ranks};
use tokio::sync::broadcast;

pub(crate) fn local(engine: &str) -> LocalInfo {
    LocalInfo::new(
        engine,
        Ranks {
            dp_rank: 0,
            tp_rank: 0,
            tp_size: 1,
        },
        "fp",
    )
    .with_data_plane(format!("{engine}-blob").into_bytes())
}

pub(crate) fn fast_config() -> Config {
    Config {
        keepalive_interval: Duration::from_millis(100),
        liveness_budget: 3,
        handshake_timeout: Duration::from_secs(2),
        backoff_min: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
        close_linger: Duration::from_millis(200),
        ..Config::default()
    }
}

/// Waits (bounded) for the first event matching `f`.
pub(crate) async fn wait_for(
    rx: &mut broadcast::Receiver<PeerEvent>,
    within: Duration,
    mut f: impl FnMut(&PeerEvent) -> bool,
) -> PeerEvent {
    let fut = async {
        loop {
            match rx.recv().await {
                Ok(ev) if f(&ev) => return ev,
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => panic!("event stream closed"),
            }
        }
    };
    tokio::time::timeout(within, fut)
        .await
        .expect("expected event did not arrive in time")
}

pub(crate) fn is_ready(id: Option<ConnectionId>) -> impl FnMut(&PeerEvent) -> bool {
    move |ev| matches!(ev.event, Event::Ready(_)) && id.is_none_or(|i| i == ev.id)
}
