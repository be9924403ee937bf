//! Send lanes of the ZeroMQ channel: the driver hands a frame straight to the
//! socket and falls back to a task only when that would wait.
//!
//! A `zeromq` 0.7 send pushes the message onto the peer's writer queue (the
//! library's own writer task does the socket I/O, 100 000 messages deep), so
//! it completes on its first poll unless that queue is full or the peer table
//! is locked by a connect or disconnect at that moment. The driver polls the
//! send once. If it would wait, that send and every later frame of the lane
//! go to a spill task that awaits them in order, each bounded by
//! [`SEND_TIMEOUT`]; the driver sends directly again once the spill has handed
//! every queued frame to the socket (a counter says so). Frames of a lane keep
//! their order and the driver never waits on a slow peer: past [`QUEUE`]
//! spilled frames, or on a send error, the lane reports a failure instead.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::sync::{mpsc, Mutex};
use tokio::task::JoinHandle;
use zeromq::{DealerSendHalf, RouterSendHalf, SocketSend, ZmqMessage, ZmqResult};

/// Bound on one send that had to wait; past it the frame is dropped and the
/// lane reports a failure.
pub(super) const SEND_TIMEOUT: Duration = Duration::from_secs(2);
/// Frames a lane queues behind a waiting send (and a dial before it is
/// connected) before it reports "send queue full".
pub(super) const QUEUE: usize = 4096;

type SendFuture = Pin<Box<dyn Future<Output = ZmqResult<()>> + Send>>;

/// Where a lane reports a failed send (a reason such as `send failed: …`).
pub(super) type Report = Arc<dyn Fn(String) + Send + Sync>;

/// A socket's send side that can start a send owning all it needs, so a send
/// that has to wait can move to the spill task.
pub(super) trait SendHandle: Clone + Send + 'static {
    fn send_owned(&self, msg: ZmqMessage) -> SendFuture;
}

impl SendHandle for RouterSendHalf {
    fn send_owned(&self, msg: ZmqMessage) -> SendFuture {
        let mut half = self.clone();
        Box::pin(async move { half.send(msg).await })
    }
}

/// A DEALER's send half, shared by the driver and its spill task. The lock
/// is never contended: the driver only sends itself while no spill is busy.
#[derive(Clone)]
pub(super) struct DealerTx(Arc<Mutex<DealerSendHalf>>);

impl DealerTx {
    pub(super) fn new(half: DealerSendHalf) -> Self {
        Self(Arc::new(Mutex::new(half)))
    }
}

impl SendHandle for DealerTx {
    fn send_owned(&self, msg: ZmqMessage) -> SendFuture {
        let half = Arc::clone(&self.0);
        Box::pin(async move { half.lock().await.send(msg).await })
    }
}

/// Frames queued behind a send that would have waited.
struct Spill {
    queue: mpsc::Sender<ZmqMessage>,
    /// Frames handed to the spill and not yet accepted by the socket (or
    /// failed); 0 means the driver may send directly again.
    pending: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

/// The send side of one socket (or of one routed peer set) as the driver sees it.
pub(super) struct Lane<H> {
    handle: H,
    report: Report,
    spill: Option<Spill>,
}

impl<H: SendHandle> Lane<H> {
    pub(super) fn new(handle: H, report: Report) -> Self {
        Self {
            handle,
            report,
            spill: None,
        }
    }

    /// Hands `msg` to the socket without waiting; a finished spill task is
    /// moved to `retired`.
    pub(super) fn send(&mut self, msg: ZmqMessage, retired: &mut Vec<JoinHandle<()>>) {
        if let Some(spill) = &self.spill {
            // Acquire: pairs with the spill's Release after each send, so
            // every spilled frame is in the socket before ours.
            if spill.pending.load(Ordering::Acquire) > 0 {
                spill.pending.fetch_add(1, Ordering::Relaxed);
                if spill.queue.try_send(msg).is_err() {
                    spill.pending.fetch_sub(1, Ordering::Relaxed);
                    (self.report)("send queue full".into());
                }
                return;
            }
            if let Some(done) = self.spill.take() {
                // Dropping the queue ends the idle task.
                retired.push(done.task);
            }
        }
        let mut send = self.handle.send_owned(msg);
        match send.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(Ok(())) => {}
            Poll::Ready(Err(e)) => (self.report)(format!("send failed: {e}")),
            Poll::Pending => self.spill = Some(self.start_spill(send)),
        }
    }

    fn start_spill(&self, first: SendFuture) -> Spill {
        let (queue, rx) = mpsc::channel(QUEUE);
        let pending = Arc::new(AtomicUsize::new(1));
        let task = tokio::spawn(run_spill(
            first,
            self.handle.clone(),
            rx,
            Arc::clone(&pending),
            Arc::clone(&self.report),
        ));
        Spill {
            queue,
            pending,
            task,
        }
    }

    /// The socket's send side.
    pub(super) fn handle(&self) -> &H {
        &self.handle
    }

    /// Frames handed to the spill task and not yet to the socket: `None`
    /// when every frame sent so far is in the socket.
    pub(super) fn spilled(&self) -> Option<Arc<AtomicUsize>> {
        self.spill
            .as_ref()
            .map(|s| Arc::clone(&s.pending))
            .filter(|p| p.load(Ordering::Acquire) > 0)
    }

    /// Releases the lane; a spill still sends what it holds, and its task
    /// goes to `retired` (to be awaited on close).
    pub(super) fn retire(self, retired: &mut Vec<JoinHandle<()>>) {
        if let Some(spill) = self.spill {
            retired.push(spill.task);
        }
    }
}

async fn run_spill<H: SendHandle>(
    first: SendFuture,
    handle: H,
    mut queue: mpsc::Receiver<ZmqMessage>,
    pending: Arc<AtomicUsize>,
    report: Report,
) {
    let mut send = first;
    loop {
        match tokio::time::timeout(SEND_TIMEOUT, send).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => report(format!("send failed: {e}")),
            Err(_) => report(format!("send timed out after {SEND_TIMEOUT:?}")),
        }
        pending.fetch_sub(1, Ordering::Release);
        match queue.recv().await {
            Some(msg) => send = handle.send_owned(msg),
            None => break,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex as StdMutex;
    use tokio::sync::watch;

    /// A send side whose sends wait while the gate is shut, and record the
    /// first byte of each message once they go through.
    #[derive(Clone)]
    struct Gate {
        open: Arc<watch::Sender<bool>>,
        sent: Arc<StdMutex<Vec<u8>>>,
    }

    impl Gate {
        fn new() -> Self {
            Self {
                open: Arc::new(watch::channel(true).0),
                sent: Arc::default(),
            }
        }

        fn sent(&self) -> Vec<u8> {
            self.sent.lock().unwrap().clone()
        }
    }

    impl SendHandle for Gate {
        fn send_owned(&self, msg: ZmqMessage) -> SendFuture {
            let mut open = self.open.subscribe();
            let sent = Arc::clone(&self.sent);
            Box::pin(async move {
                let _ = open.wait_for(|o| *o).await;
                sent.lock().unwrap().push(msg.get(0).map_or(0, |b| b[0]));
                Ok(())
            })
        }
    }

    fn lane(gate: &Gate) -> (Lane<Gate>, Arc<StdMutex<Vec<String>>>) {
        let reports: Arc<StdMutex<Vec<String>>> = Arc::default();
        let r = Arc::clone(&reports);
        let report: Report = Arc::new(move |why| r.lock().unwrap().push(why));
        (Lane::new(gate.clone(), report), reports)
    }

    fn msg(n: u8) -> ZmqMessage {
        ZmqMessage::from(vec![n])
    }

    async fn until(what: &str, mut done: impl FnMut() -> bool) {
        for _ in 0..1000 {
            if done() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("{what} did not happen within 1 s");
    }

    #[tokio::test]
    async fn a_waiting_send_spills_in_order_then_the_lane_sends_directly_again() {
        let gate = Gate::new();
        let (mut lane, reports) = lane(&gate);
        let mut retired = Vec::new();
        lane.send(msg(1), &mut retired);
        assert_eq!(gate.sent(), [1], "an open socket takes the frame at once");
        assert!(lane.spill.is_none());

        gate.open.send_replace(false);
        for n in 2..=4 {
            lane.send(msg(n), &mut retired);
        }
        assert_eq!(gate.sent(), [1], "frames wait behind the shut socket");
        assert!(
            lane.spill.is_some(),
            "the waiting send moved to a spill task"
        );

        gate.open.send_replace(true);
        until("the spill draining", || gate.sent() == [1, 2, 3, 4]).await;
        let spill = lane.spill.as_ref().unwrap();
        until("the spill's count reaching 0", || {
            spill.pending.load(Ordering::Acquire) == 0
        })
        .await;
        lane.send(msg(5), &mut retired);
        assert_eq!(gate.sent(), [1, 2, 3, 4, 5], "direct again, in order");
        assert!(
            lane.spill.is_none() && retired.len() == 1,
            "the idle spill was retired"
        );
        for task in retired {
            task.await.unwrap();
        }
        assert!(reports.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn frames_sent_while_the_spill_is_busy_queue_behind_it() {
        let gate = Gate::new();
        let (mut lane, _) = lane(&gate);
        let mut retired = Vec::new();
        gate.open.send_replace(false);
        lane.send(msg(1), &mut retired);
        gate.open.send_replace(true);
        // The spill may not have run yet: frame 2 must still go after 1.
        lane.send(msg(2), &mut retired);
        until("both frames", || gate.sent().len() == 2).await;
        assert_eq!(gate.sent(), [1, 2]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_send_that_never_completes_is_reported_after_the_timeout() {
        let gate = Gate::new();
        let (mut lane, reports) = lane(&gate);
        let mut retired = Vec::new();
        gate.open.send_replace(false);
        lane.send(msg(1), &mut retired);
        lane.send(msg(2), &mut retired);
        tokio::time::sleep(SEND_TIMEOUT + Duration::from_millis(1)).await;
        tokio::task::yield_now().await;
        let r = reports.lock().unwrap().clone();
        assert_eq!(r.len(), 1, "{r:?}");
        assert!(r[0].contains("send timed out"), "{r:?}");
        assert!(gate.sent().is_empty());
    }

    #[tokio::test]
    async fn a_full_spill_queue_is_reported_not_waited_on() {
        let gate = Gate::new();
        let (mut lane, reports) = lane(&gate);
        let mut retired = Vec::new();
        gate.open.send_replace(false);
        // One waiting send plus QUEUE queued frames fill the lane.
        for _ in 0..=QUEUE + 1 {
            lane.send(msg(7), &mut retired);
        }
        let r = reports.lock().unwrap().clone();
        assert!(
            !r.is_empty() && r.iter().all(|w| w == "send queue full"),
            "{:?}",
            &r[..r.len().min(3)]
        );
        gate.open.send_replace(true);
        until("the queued frames", || gate.sent().len() >= QUEUE).await;
    }
}
