//! A blocking wrapper for engines that do not run tokio.

use crate::agent::{Agent, AgentBuilder};
use crate::error::{Error, ErrorKind};
use crate::events::{Notification, PeerEvent};
use crate::peer::Peer;
use std::time::Duration;
use tokio::sync::{broadcast, mpsc};

/// An [`Agent`] with its own tokio runtime, driven from plain threads.
///
/// [`Peer`]'s transfer methods are not async and work as they are; their
/// [`TransferHandle`](crate::TransferHandle)s are waited on with `wait()`.
/// Do not call these methods from inside an async task.
#[derive(Debug)]
pub struct BlockingAgent {
    agent: Agent,
    notifications: Option<mpsc::Receiver<Notification>>,
    runtime: tokio::runtime::Runtime,
}

impl BlockingAgent {
    /// Starts a runtime (`worker_threads` threads) and builds the agent on it.
    pub fn build(builder: AgentBuilder, worker_threads: usize) -> Result<Self, Error> {
        // Its workers are kvlane's threads too: placed as the agent's.
        let cpus = builder.placement()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(worker_threads.max(1))
            .thread_name("kvlane-agent")
            .on_thread_start(move || cpus.clone().enter())
            .enable_all()
            .build()
            .map_err(|e| Error::msg(ErrorKind::Io, format!("start tokio runtime: {e}")))?;
        let agent = runtime.block_on(builder.build())?;
        let notifications = agent.notifications();
        Ok(Self {
            agent,
            notifications,
            runtime,
        })
    }

    /// The async agent (for everything not wrapped here).
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// See [`Agent::connect`].
    pub fn connect(&self, addr: &str) -> Result<Peer, Error> {
        self.runtime.block_on(self.agent.connect(addr))
    }

    /// See [`Agent::connect_group`].
    pub fn connect_group(
        &self,
        host: &str,
        base_port: u16,
        dp_rank: u32,
        tp_size: u32,
    ) -> Result<Vec<Peer>, Error> {
        self.runtime
            .block_on(self.agent.connect_group(host, base_port, dp_rank, tp_size))
    }

    /// Waits up to `timeout` for the next notification.
    pub fn recv_notification(&mut self, timeout: Duration) -> Option<Notification> {
        let rx = self.notifications.as_mut()?;
        self.runtime.block_on(async {
            tokio::time::timeout(timeout, rx.recv())
                .await
                .ok()
                .flatten()
        })
    }

    /// Peer events; read them with `blocking_recv()`.
    pub fn events(&self) -> broadcast::Receiver<PeerEvent> {
        self.agent.events()
    }

    /// See [`Agent::close`]; then stops the runtime.
    pub fn close(self) {
        self.runtime.block_on(self.agent.close());
        self.runtime.shutdown_timeout(Duration::from_secs(5));
    }
}
