//! The receive streams of the open DEALERs, each polled only when it was
//! woken, from the driver's own task.
//!
//! `futures::stream::SelectAll` would do, but after it has polled every
//! stream once it wakes its own task and returns `Pending` (against
//! starvation); with one stream per peer that is after nearly every frame,
//! and tokio runs a self-woken task as a yield (it may wake an idle worker
//! for it). Here a stream is polled once per wake, at most one item is taken
//! per call, and [`Inbound::remove`] drops a stream (its receive half) at
//! once rather than on the next poll.

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Wake, Waker};

use futures::stream::Stream;

/// Streams keyed by a unique `u64`, polled when woken.
pub(super) struct Inbound<S> {
    streams: HashMap<u64, Entry<S>>,
    ready: Arc<Ready>,
}

struct Entry<S> {
    stream: S,
    state: Arc<StreamWaker>,
    waker: Waker,
}

#[derive(Default)]
struct Ready {
    /// Keys to poll, and the task polling the set.
    inner: Mutex<(VecDeque<u64>, Option<Waker>)>,
}

impl Ready {
    fn push(&self, key: u64) -> Option<Waker> {
        let mut g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        g.0.push_back(key);
        g.1.take()
    }
}

struct StreamWaker {
    key: u64,
    /// Already queued (cleared before each poll of the stream).
    queued: AtomicBool,
    ready: Arc<Ready>,
}

impl Wake for StreamWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if !self.queued.swap(true, Ordering::AcqRel) {
            if let Some(parent) = self.ready.push(self.key) {
                parent.wake();
            }
        }
    }
}

impl<S: Stream + Unpin> Inbound<S> {
    pub(super) fn new() -> Self {
        Self {
            streams: HashMap::new(),
            ready: Arc::default(),
        }
    }

    /// Adds a stream (replacing one with the same key); it is polled first
    /// on the next [`poll_next`](Self::poll_next).
    pub(super) fn insert(&mut self, key: u64, stream: S) {
        let state = Arc::new(StreamWaker {
            key,
            queued: AtomicBool::new(true),
            ready: Arc::clone(&self.ready),
        });
        // Only the polling task inserts, and it polls again next: queue the
        // key without waking it.
        drop(self.ready.push(key));
        let waker = Waker::from(Arc::clone(&state));
        self.streams.insert(
            key,
            Entry {
                stream,
                state,
                waker,
            },
        );
    }

    /// Drops a stream at once.
    pub(super) fn remove(&mut self, key: u64) {
        self.streams.remove(&key);
    }

    /// Drops every stream.
    pub(super) fn clear(&mut self) {
        self.streams.clear();
    }

    /// The next item of any woken stream; a stream that ended is dropped.
    /// Cancel-safe. `Pending` (never `None`) when nothing is ready.
    pub(super) fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<S::Item> {
        loop {
            let key = {
                let mut g = self
                    .ready
                    .inner
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                match g.0.pop_front() {
                    Some(key) => key,
                    None => {
                        if !g.1.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                            g.1 = Some(cx.waker().clone());
                        }
                        return Poll::Pending;
                    }
                }
            };
            // A key of a removed (or replaced and re-woken) stream polls nothing.
            let Some(e) = self.streams.get_mut(&key) else {
                continue;
            };
            e.state.queued.store(false, Ordering::Release);
            match Pin::new(&mut e.stream).poll_next(&mut Context::from_waker(&e.waker)) {
                Poll::Ready(Some(item)) => {
                    // It may hold more: poll it again, after the others.
                    e.state.wake_by_ref();
                    return Poll::Ready(item);
                }
                Poll::Ready(None) => {
                    self.streams.remove(&key);
                }
                Poll::Pending => {}
            }
        }
    }
}
