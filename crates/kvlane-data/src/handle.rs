//! [`Transport`]: a [`Backend`] driven by a progress thread (shared by the
//! process's transports, see `progress.rs`, or its own), handing out
//! [`TransferHandle`]s that can be polled, awaited or waited on.

use crate::backend::{Backend, Submitted};
use crate::error::{DataError, SubmitError};
use crate::ids::{FastMap, IdHasher, RegionId};
use crate::ids::{PeerId, TransferId};
use crate::memory::{Region, RemoteRegion};
use crate::progress::{Member, ProgressPool};
use crate::transfer::{BackendKind, Completion, Endpoint, Notification, Op, Transfer};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// How long the progress thread sleeps when nothing is in flight on a
/// backend that does not announce arrivals, or while notifications are
/// held back (it is woken at once by `submit` and by backends that
/// announce completions; those, idle, are not re-polled at all).
pub(crate) const IDLE_PARK: Duration = Duration::from_millis(50);

/// Notifications a [`Transport`]'s channel holds until its receiver takes
/// them (see [`Transport::take_notifications`]): with tcp's largest
/// notification (64 KiB) at most 64 MiB; more wait in the backend's own
/// bounded queue.
pub const NOTIFY_CHANNEL: usize = 1024;
/// How often a driver re-polls while work is in flight on a backend that
/// does not say by when it must be polled ([`Backend::poll_by`] is
/// `None`).
const BUSY_PARK: Duration = Duration::from_millis(1);
/// A thread that waits for a transfer submitted less than this long ago
/// spins until then before it sleeps (see [`TransferHandle::wait`]).
pub const SPIN_WINDOW: Duration = Duration::from_micros(50);

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Called once with a transfer's result, on the thread that resolves it,
/// before any waiter sees the result (see [`Transport::submit_then`]).
pub type OnDone = Box<dyn FnOnce(&Result<(), DataError>) + Send>;

/// Told of each transfer submitted with it when that transfer ends, on the
/// thread that resolves it, before any waiter sees the result (see
/// [`Then::Observe`]). One observer serves many transfers (a peer's
/// metrics, say), so observing costs no allocation per transfer, where an
/// [`OnDone`] closure is a box each.
pub trait Observer: Send + Sync {
    /// `transfer` ended with `result`. Keep it short: it runs on the
    /// thread that resolves transfers.
    fn ended(&self, transfer: Ended, result: &Result<(), DataError>);
}

/// What an [`Observer`] is told of an ended transfer.
#[derive(Clone, Copy, Debug)]
pub struct Ended {
    /// READ or WRITE.
    pub op: Op,
    /// Payload bytes.
    pub bytes: u64,
    /// From submission to the result.
    pub elapsed: Duration,
}

/// What runs when a transfer ends (see [`Transport::submit_batch`]).
pub enum Then {
    /// A closure of the transfer's own.
    Call(OnDone),
    /// A shared observer.
    Observe(Arc<dyn Observer>),
}

impl std::fmt::Debug for Then {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Call(_) => "Then::Call",
            Self::Observe(_) => "Then::Observe",
        })
    }
}

/// A slot's [`Then`], with what an observer is told.
enum AtEnd {
    Call(OnDone),
    Observe {
        observer: Arc<dyn Observer>,
        op: Op,
        bytes: u64,
        submitted: Instant,
    },
}

impl AtEnd {
    fn new(then: Then, t: &Transfer, submitted: Instant) -> Self {
        match then {
            Then::Call(f) => Self::Call(f),
            Then::Observe(observer) => Self::Observe {
                observer,
                op: t.op,
                bytes: t.total_len(),
                submitted,
            },
        }
    }

    /// [`run`](Self::run), a panic in it logged and going no further: the
    /// result is still published (and those of the other transfers
    /// resolved with it).
    fn run_caught(self, result: &Result<(), DataError>, now: Instant) {
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run(result, now))).is_err()
        {
            tracing::error!("a transfer's on_done callback panicked; its result is delivered");
        }
    }

    /// Runs it for a transfer that ended by `now` (read once for a
    /// poll's whole batch of completions).
    fn run(self, result: &Result<(), DataError>, now: Instant) {
        match self {
            Self::Call(f) => f(result),
            Self::Observe {
                observer,
                op,
                bytes,
                submitted,
            } => observer.ended(
                Ended {
                    op,
                    bytes,
                    elapsed: now.saturating_duration_since(submitted),
                },
                result,
            ),
        }
    }
}

#[derive(Default)]
struct SlotState {
    result: Option<Result<(), DataError>>,
    waker: Option<Waker>,
    on_done: Option<AtEnd>,
    /// Threads blocked in `wait`: the condition variable is signalled only
    /// for them (a signal is a system call even when nobody waits, and a
    /// batch's handles are mostly done before they are waited on).
    waiting: usize,
}

struct Slot {
    state: Mutex<SlotState>,
    done: Condvar,
    /// When the transfer was submitted (see [`SPIN_WINDOW`]).
    submitted: Instant,
    /// The result is in `state`: what a spinning waiter watches.
    ready: AtomicBool,
}

impl Slot {
    /// A slot whose transfer runs `on_done` when it ends, if any.
    fn new(submitted: Instant, on_done: Option<AtEnd>) -> Self {
        Self {
            state: Mutex::new(SlotState {
                on_done,
                ..SlotState::default()
            }),
            done: Condvar::new(),
            submitted,
            ready: AtomicBool::new(false),
        }
    }

    fn complete(&self, result: Result<(), DataError>) {
        self.run_on_done(&result, Instant::now());
        self.publish(result);
    }

    /// Calls the transfer's `on_done`, if it has one (once). A panic in it
    /// is logged and goes no further: the result is still published (and
    /// those of the other transfers resolved with it).
    fn run_on_done(&self, result: &Result<(), DataError>, now: Instant) {
        let on_done = lock(&self.state).on_done.take();
        if let Some(p) = on_done {
            p.run_caught(result, now);
        }
    }

    /// Hands the result to the handle and wakes whoever waits for it.
    fn publish(&self, result: Result<(), DataError>) {
        let (waker, waiting) = self.set_result(result);
        if waiting {
            self.done.notify_all();
        }
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Hands the result to the handle; what is to be woken for it (the
    /// task awaiting it, whether threads wait in `wait`), left to the
    /// caller.
    fn set_result(&self, result: Result<(), DataError>) -> (Option<Waker>, bool) {
        let mut s = lock(&self.state);
        s.result = Some(result);
        self.ready.store(true, Ordering::Release);
        (s.waker.take(), s.waiting > 0)
    }
}

/// The pending result of one submitted transfer.
///
/// Poll it with [`try_result`](Self::try_result), block on it with
/// [`wait`](Self::wait), or `.await` it. The result can be taken once.
#[must_use = "a transfer's result reports whether its bytes landed"]
pub struct TransferHandle {
    id: TransferId,
    peer: PeerId,
    state: HandleState,
}

/// Where a handle's result is.
enum HandleState {
    /// The backend finished the transfer inside the submission
    /// ([`Backend::submit_now`]): the result, until it is taken. No slot,
    /// no lock, nothing for the driver to resolve.
    Done {
        // The error boxed: a handle is moved about by value, and most
        // results are `Ok`.
        result: Option<Result<(), Box<DataError>>>,
        submitted: Instant,
    },
    /// Resolved by whoever polls the backend next.
    Pending(Arc<Slot>),
}

/// A result as a resolved handle keeps it.
fn boxed(r: Result<(), DataError>) -> Result<(), Box<DataError>> {
    r.map_err(Box::new)
}

/// A resolved handle's result as it is handed out.
fn unbox(r: Result<(), Box<DataError>>) -> Result<(), DataError> {
    r.map_err(|e| *e)
}

/// What a handle whose result was taken gives when asked again.
fn taken() -> DataError {
    DataError::Unsupported {
        backend: "transfer handle",
        what: "its result was already taken",
    }
}

impl std::fmt::Debug for TransferHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferHandle")
            .field("id", &self.id)
            .field("peer", &self.peer)
            .finish()
    }
}

impl TransferHandle {
    /// The transfer's id.
    pub fn id(&self) -> TransferId {
        self.id
    }

    /// The transfer's target.
    pub fn peer(&self) -> PeerId {
        self.peer
    }

    /// When the transfer was submitted: the transport's clock read at
    /// submission, or the time its caller passed
    /// ([`Transport::submit_observed_at`]); one for all of a
    /// [`Transport::submit_batch`].
    pub fn submitted_at(&self) -> Instant {
        match &self.state {
            HandleState::Done { submitted, .. } => *submitted,
            HandleState::Pending(slot) => slot.submitted,
        }
    }

    /// Whether the result is ready.
    pub fn is_done(&self) -> bool {
        match &self.state {
            HandleState::Done { result, .. } => result.is_some(),
            HandleState::Pending(slot) => lock(&slot.state).result.is_some(),
        }
    }

    /// Takes the result if it is ready.
    pub fn try_result(&mut self) -> Option<Result<(), DataError>> {
        match &mut self.state {
            HandleState::Done { result, .. } => result.take().map(unbox),
            HandleState::Pending(slot) => lock(&slot.state).result.take(),
        }
    }

    /// Blocks the thread until the transfer completes. Every transfer
    /// completes by its deadline, so this does not hang.
    ///
    /// A transfer submitted less than [`SPIN_WINDOW`] ago is spun for
    /// until then (checking a flag, no lock) before the thread sleeps: a
    /// lone transfer's answer then does not also have to wake this thread
    /// (a futex wake and a context switch, several microseconds on a VM).
    /// Measured, batch-1 4 KiB READ over loopback tcp on a 2-vCPU VM,
    /// from before the post to the result: 41 µs sleeping, 25-28 µs
    /// spinning. A thread that waits on a batch's handles after posting
    /// it finds them older than that, and sleeps at once.
    pub fn wait(self) -> Result<(), DataError> {
        let slot = match self.state {
            HandleState::Done { result, .. } => return result.map_or_else(|| Err(taken()), unbox),
            HandleState::Pending(slot) => slot,
        };
        spin_until(&slot, slot.submitted + SPIN_WINDOW);
        let mut s = lock(&slot.state);
        loop {
            if let Some(r) = s.result.take() {
                return r;
            }
            s.waiting += 1;
            s = slot.done.wait(s).unwrap_or_else(|e| e.into_inner());
            s.waiting -= 1;
        }
    }

    /// Blocks for at most `timeout`; `None` if the transfer is still running.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<Result<(), DataError>> {
        let slot = match &mut self.state {
            HandleState::Done { result, .. } => {
                return Some(result.take().map_or_else(|| Err(taken()), unbox))
            }
            HandleState::Pending(slot) => slot,
        };
        let end = Instant::now() + timeout;
        spin_until(slot, end);
        let mut s = lock(&slot.state);
        loop {
            if let Some(r) = s.result.take() {
                return Some(r);
            }
            let left = end.checked_duration_since(Instant::now())?;
            s.waiting += 1;
            s = slot
                .done
                .wait_timeout(s, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            s.waiting -= 1;
        }
    }
}

/// Spins until `slot`'s result is ready, the transfer is [`SPIN_WINDOW`]
/// old, or `end`. It yields the CPU between rounds of checks: the thread
/// that completes the transfer may be runnable on this CPU (two vCPUs,
/// the target on the other), and a pure spin would hold it off until the
/// window ends.
fn spin_until(slot: &Slot, end: Instant) {
    let end = end.min(slot.submitted + SPIN_WINDOW);
    if slot.ready.load(Ordering::Acquire) || Instant::now() >= end {
        return;
    }
    loop {
        for _ in 0..64 {
            if slot.ready.load(Ordering::Acquire) {
                return;
            }
            std::hint::spin_loop();
        }
        if Instant::now() >= end {
            return;
        }
        thread::yield_now();
    }
}

impl Future for TransferHandle {
    type Output = Result<(), DataError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let slot = match &mut self.get_mut().state {
            HandleState::Done { result, .. } => {
                return Poll::Ready(result.take().map_or_else(|| Err(taken()), unbox))
            }
            HandleState::Pending(slot) => slot,
        };
        let mut s = lock(&slot.state);
        if let Some(r) = s.result.take() {
            return Poll::Ready(r);
        }
        s.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

pub(crate) struct Shared {
    backend: Mutex<Box<dyn Backend>>,
    slots: Mutex<FastMap<TransferId, Arc<Slot>>>,
    notifications: mpsc::Sender<Notification>,
    /// Notifications taken from the backend that did not fit in the
    /// channel (at most one poll's worth): while any wait here, the
    /// backend's own (bounded) queue is left alone, so a target whose
    /// application does not take its notifications fills that queue and
    /// refuses more (the tcp target answers a NOTIFY with an error)
    /// instead of this side holding them without bound.
    held: Mutex<VecDeque<Notification>>,
    stop: AtomicBool,
    /// A driver found the backend locked and skipped it: the holder wakes
    /// it after letting go (see [`poll_once`]).
    skipped: AtomicBool,
}

/// What one poll of a backend found.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PollResult {
    /// Completions and notifications taken.
    pub(crate) results: usize,
    pub(crate) in_flight: usize,
    pub(crate) busy: bool,
    pub(crate) poll_by: Option<Instant>,
    /// The backend announces arrivals through its waker
    /// ([`Backend::announces_arrivals`]).
    pub(crate) announces: bool,
    /// Notifications are held back (the channel was full), or the
    /// backend's own queue was left alone because some were: only a later
    /// poll passes them on.
    pub(crate) held: bool,
}

/// Buffers a driver reuses from poll to poll.
#[derive(Default)]
pub(crate) struct Polled {
    completions: Vec<Completion>,
    notes: Vec<Notification>,
    /// The slots of `completions`, taken out of the map.
    ready: Vec<(Arc<Slot>, Result<(), DataError>)>,
    /// Slots with threads in `wait`, and tasks awaiting handles, to be
    /// woken once every result of the poll is published.
    waiting: Vec<Arc<Slot>>,
    wakers: Vec<Waker>,
}

impl Shared {
    pub(crate) fn set_waker(&self, waker: Waker) {
        lock(&self.backend).set_waker(waker);
    }

    /// Polls the backend (the caller holds its lock); its notifications
    /// only while none are held back (see [`held`](Self::held)).
    fn poll_backend(&self, b: &mut dyn Backend, polled: &mut Polled) -> PollResult {
        let mut results = b.poll(&mut polled.completions);
        let holding = !lock(&self.held).is_empty();
        if !holding {
            results += b.poll_notifications(&mut polled.notes);
        }
        PollResult {
            results,
            in_flight: b.in_flight(),
            busy: b.needs_busy_poll(),
            poll_by: b.poll_by(),
            announces: b.announces_arrivals(),
            // The backend's own queue was left alone: a later poll takes it.
            held: holding,
        }
    }

    /// Resolves the handles of what a poll found and passes its
    /// notifications on (off the backend lock).
    fn resolve(&self, polled: &mut Polled) {
        if !polled.completions.is_empty() {
            let mut slots = lock(&self.slots);
            polled.ready.extend(
                polled
                    .completions
                    .drain(..)
                    .filter_map(|c| slots.remove(&c.id).map(|s| (s, c.result))),
            );
            drop(slots);
            // Every `on_done` first, then every result, then the wake-ups:
            // a waiter finds the poll's whole batch done instead of going
            // back to sleep for each. A batch's handles are waited for in
            // order; resolved one by one, the waiting thread was woken
            // once per transfer, and as it often shares a CPU with the
            // I/O thread resolving them, it preempted that thread every
            // time (4 KiB READ, batch 128: a context switch pair every
            // 2.3 us, 128 per batch, one CPU busy and the other idle).
            // One clock read for the batch: the time it was found done.
            let now = Instant::now();
            for (slot, result) in &polled.ready {
                slot.run_on_done(result, now);
            }
            for (slot, result) in polled.ready.drain(..) {
                let (waker, waiting) = slot.set_result(result);
                if waiting {
                    polled.waiting.push(slot);
                }
                polled.wakers.extend(waker);
            }
            // Woken once all are published: a waiter woken here (often
            // on this CPU, where it preempts this thread) finds the
            // batch done.
            for slot in polled.waiting.drain(..) {
                slot.done.notify_all();
            }
            for w in polled.wakers.drain(..) {
                w.wake();
            }
        }
        self.pass_notes(polled);
    }

    /// Passes held-back notifications, then the poll's, into the channel,
    /// in order, as far as it has room; the rest is held back for the
    /// next poll (a member holding notifications back is re-polled every
    /// [`IDLE_PARK`]).
    fn pass_notes(&self, polled: &mut Polled) {
        let mut held = lock(&self.held);
        if held.is_empty() && polled.notes.is_empty() {
            return;
        }
        held.extend(polled.notes.drain(..));
        while let Some(note) = held.pop_front() {
            match self.notifications.try_send(note) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(note)) => {
                    held.push_front(note);
                    return;
                }
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    // The receiver was dropped: nobody listens, and the
                    // notifications are dropped.
                    held.clear();
                    return;
                }
            }
        }
    }

    /// After a panic while polling: take no more work and fail everything
    /// in flight.
    pub(crate) fn fail_all_panicked(&self) {
        self.stop.store(true, Ordering::Release);
        let slots: Vec<_> = lock(&self.slots).drain().collect();
        for (id, slot) in slots {
            slot.complete(Err(DataError::Shutdown(id)));
        }
    }
}

impl Shared {
    /// The backend, unless another thread holds it.
    fn try_backend(&self) -> Option<MutexGuard<'_, Box<dyn Backend>>> {
        match self.backend.try_lock() {
            Ok(b) => Some(b),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// Polls the locked backend, lets it go, then resolves what it found.
    fn poll_locked(
        &self,
        mut b: MutexGuard<'_, Box<dyn Backend>>,
        polled: &mut Polled,
    ) -> PollResult {
        let mut r = self.poll_backend(&mut **b, polled);
        drop(b);
        self.resolve(polled);
        r.held |= !lock(&self.held).is_empty();
        r
    }

    /// Called by a holder of the backend after letting it go: whether a
    /// driver skipped it meanwhile (and is to be woken). Pairs with the
    /// fence in [`poll_once`]: a driver that found the lock taken either
    /// got it on its retry or its flag is seen here.
    fn take_skipped(&self) -> bool {
        std::sync::atomic::fence(Ordering::SeqCst);
        self.skipped.swap(false, Ordering::Relaxed)
    }
}

/// Polls `shared`'s backend once unless its lock is taken (then `None`:
/// the holder wakes the driver when it lets go).
pub(crate) fn poll_once(shared: &Shared, polled: &mut Polled) -> Option<PollResult> {
    let b = match shared.try_backend() {
        Some(b) => b,
        None => {
            // Say so, then try once more: a holder that let go before the
            // flag was set is not there any more, and one that still holds
            // the lock sees the flag after letting go (the fences order
            // this store before the retry, and the holder's unlock before
            // its read of the flag, see `take_skipped`).
            shared.skipped.store(true, Ordering::Relaxed);
            std::sync::atomic::fence(Ordering::SeqCst);
            shared.try_backend()?
        }
    };
    Some(shared.poll_locked(b, polled))
}

/// Polls `shared`'s backend on the calling thread if nobody holds it (a
/// thread that woke it, see `progress.rs`): what the poll found, or
/// `None` when it did not poll, or a driver skipped the backend while it
/// was held here: then the driver is to be woken.
pub(crate) fn poll_inline(shared: &Shared, polled: &mut Polled) -> Option<PollResult> {
    let b = shared.try_backend()?;
    let r = shared.poll_locked(b, polled);
    (!shared.take_skipped()).then_some(r)
}

/// What drives a transport's backend.
enum Driver {
    /// A thread of its own (backends that need busy polling).
    Own {
        thread: Mutex<Option<JoinHandle<()>>>,
        progress: Thread,
    },
    /// A member slot on the process's shared progress threads.
    Pooled {
        member: Arc<Member>,
        // Held for as long as the member.
        _pool: Arc<ProgressPool>,
    },
}

impl Driver {
    /// Asks the driver to poll soon.
    fn kick(&self) {
        match self {
            Self::Own { progress, .. } => progress.unpark(),
            Self::Pooled { member, .. } => member.wake(),
        }
    }

    /// Polls on the calling thread when it can (see
    /// [`Backend::completes_inline`]), else asks the driver to.
    fn poll_or_kick(&self) {
        match self {
            Self::Own { progress, .. } => progress.unpark(),
            Self::Pooled { member, .. } => {
                if !member.poll_here() {
                    member.wake();
                }
            }
        }
    }
}

struct ThreadWaker(Thread);

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// A backend plus the thread that drives it.
///
/// `submit` from any thread; the progress thread (one of the process's
/// shared ones, or its own for a backend that needs busy polling) polls
/// the backend and
/// resolves [`TransferHandle`]s. Dropping the transport (or
/// [`shutdown`](Self::shutdown)) stops the thread and fails every transfer
/// still in flight with [`DataError::Shutdown`].
pub struct Transport {
    shared: Arc<Shared>,
    driver: Driver,
    notifications: Mutex<Option<mpsc::Receiver<Notification>>>,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport")
            .field("in_flight", &lock(&self.shared.slots).len())
            .finish()
    }
}

impl Transport {
    /// Starts driving `backend`: on the process's shared progress threads
    /// when it announces completions through its waker, else (it needs
    /// busy polling) on a progress thread of its own.
    pub fn new(backend: impl Backend) -> Result<Self, DataError> {
        let (tx, rx) = mpsc::channel(NOTIFY_CHANNEL);
        let busy = backend.needs_busy_poll();
        let shared = Arc::new(Shared {
            backend: Mutex::new(Box::new(backend)),
            slots: Mutex::new(FastMap::default()),
            notifications: tx,
            held: Mutex::new(VecDeque::new()),
            stop: AtomicBool::new(false),
            skipped: AtomicBool::new(false),
        });
        let spawn_err = |source| DataError::Io {
            op: "spawn progress thread".into(),
            source,
        };
        let driver = if busy {
            let thread_shared = shared.clone();
            let builder = thread::Builder::new().name("kvlane-progress".into());
            let handle = crate::placement::spawn(builder, move || {
                let shared = &thread_shared;
                // A panicking backend must not leave handles waiting
                // forever: stop taking work and fail everything in flight.
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| progress_loop(shared)))
                    .is_err()
                {
                    tracing::error!("kvlane progress thread panicked; failing in-flight transfers");
                    shared.fail_all_panicked();
                }
            })
            .map_err(spawn_err)?;
            Driver::Own {
                progress: handle.thread().clone(),
                thread: Mutex::new(Some(handle)),
            }
        } else {
            let pool = ProgressPool::for_process().map_err(spawn_err)?;
            Driver::Pooled {
                member: pool.join(shared.clone()),
                _pool: pool,
            }
        };
        Ok(Self {
            shared,
            driver,
            notifications: Mutex::new(Some(rx)),
        })
    }

    /// Runs `f` with exclusive access to the backend (registration,
    /// connecting peers). Keep it short: the progress thread waits.
    pub fn with_backend<R>(&self, f: impl FnOnce(&mut dyn Backend) -> R) -> R {
        let mut b = lock(&self.shared.backend);
        let r = f(&mut **b);
        drop(b);
        self.driver.kick();
        r
    }

    /// Prepares a data-plane peer and connects it to `remote`, holding the
    /// backend only for the short steps: the dial and its authentication
    /// ([`Connecting::run`](crate::Connecting::run)) run on the calling
    /// thread while the progress thread and other callers go on. Returns
    /// the peer and this side's endpoint for it; on failure nothing is
    /// left behind. Blocks for up to the backend's connect timeout.
    pub fn connect_peer(
        &self,
        remote: &Endpoint,
        regions: &[RemoteRegion],
    ) -> Result<(PeerId, Endpoint), DataError> {
        let (peer, endpoint) = self.with_backend(|b| b.prepare_peer())?;
        self.connect_prepared(peer, remote, regions)?;
        Ok((peer, endpoint))
    }

    /// Connects a peer from [`Backend::prepare_peer`] (see
    /// [`connect_peer`](Self::connect_peer)); on failure the peer is removed.
    pub fn connect_prepared(
        &self,
        peer: PeerId,
        remote: &Endpoint,
        regions: &[RemoteRegion],
    ) -> Result<(), DataError> {
        let result = self
            .with_backend(|b| b.start_connect(peer, remote, regions))
            .and_then(|connecting| connecting.run())
            .and_then(|connected| self.with_backend(|b| b.finish_connect(peer, connected)));
        if result.is_err() {
            self.with_backend(|b| b.remove_peer(peer));
        }
        result
    }

    /// Submits a transfer. A full queue hands it back
    /// ([`SubmitError::QueueFull`]); wait for earlier handles and retry.
    pub fn submit(&self, transfer: Transfer) -> Result<TransferHandle, SubmitError> {
        self.submit_one(transfer, None, Instant::now())
    }

    /// Submits a transfer and calls `on_done` with its result when it ends
    /// (on the progress thread, before the handle resolves; keep it short).
    /// A transfer the backend refuses at submission returns the error and
    /// `on_done` is not called.
    pub fn submit_then(
        &self,
        transfer: Transfer,
        on_done: OnDone,
    ) -> Result<TransferHandle, SubmitError> {
        self.submit_one(transfer, Some(Then::Call(on_done)), Instant::now())
    }

    /// Submits a transfer and tells `observer` when it ends (see
    /// [`Observer`]; as [`submit_then`](Self::submit_then), without a
    /// closure to allocate per transfer).
    pub fn submit_observed(
        &self,
        transfer: Transfer,
        observer: Arc<dyn Observer>,
    ) -> Result<TransferHandle, SubmitError> {
        self.submit_one(transfer, Some(Then::Observe(observer)), Instant::now())
    }

    /// [`submit_observed`](Self::submit_observed) by a caller that read
    /// the clock just before (`now`): the transfer's submission time, and
    /// the backend's, without reading it again. A caller that stamps the
    /// transfer's deadline at post time reads the clock once per transfer.
    pub fn submit_observed_at(
        &self,
        transfer: Transfer,
        observer: Arc<dyn Observer>,
        now: Instant,
    ) -> Result<TransferHandle, SubmitError> {
        self.submit_one(transfer, Some(Then::Observe(observer)), now)
    }

    /// Submits one transfer (see [`submit_batch`](Self::submit_batch) for
    /// how a result found inside the submission is handed over).
    fn submit_one(
        &self,
        transfer: Transfer,
        then: Option<Then>,
        submitted: Instant,
    ) -> Result<TransferHandle, SubmitError> {
        let (id, peer) = (transfer.id, transfer.peer);
        if self.shared.stop.load(Ordering::Acquire) {
            return Err(SubmitError::Rejected(DataError::Shutdown(id)));
        }
        let mut at_end = then.map(|then| AtEnd::new(then, &transfer, submitted));
        let (r, due, inline) = {
            let mut b = lock(&self.shared.backend);
            // Slots enter the map only with the backend held, so an id
            // found free here is still free once the backend took it.
            if lock(&self.shared.slots).contains_key(&id) {
                drop(b);
                return Err(SubmitError::Rejected(DataError::DuplicateTransfer(id)));
            }
            let r = b.submit_now(transfer, submitted).map(|s| match s {
                Submitted::Queued => {
                    let slot = Arc::new(Slot::new(submitted, at_end.take()));
                    lock(&self.shared.slots).insert(id, slot.clone());
                    Err(slot)
                }
                Submitted::Done(result) => Ok(result),
            });
            (r, b.poll_after_submit(), b.completes_inline())
        };
        self.after_submit(matches!(r, Ok(Err(_))), due, inline);
        let state = match r? {
            Err(slot) => HandleState::Pending(slot),
            // Its `on_done` first, off the backend's lock, as a poll
            // would run it.
            Ok(result) => {
                if let Some(p) = at_end {
                    p.run_caught(&result, Instant::now());
                }
                HandleState::Done {
                    result: Some(boxed(result)),
                    submitted,
                }
            }
        };
        Ok(TransferHandle { id, peer, state })
    }

    /// Wakes what must move on after a submission: a backend whose work
    /// the submitting thread does (`inline`) is polled here when something
    /// was `queued`; otherwise the driver is woken when the backend says
    /// work is `due`, or when it skipped the backend while it was held
    /// here (also after a refusal).
    fn after_submit(&self, queued: bool, due: bool, inline: bool) {
        // A wake-up per submission cost the driver thousands of context
        // switches a second (tcp hands every chunk to its stream from
        // `submit`; only a deadline or a queued failure needs the poll).
        if inline && queued {
            self.driver.poll_or_kick();
        } else if due || self.shared.take_skipped() {
            self.driver.kick();
        }
    }

    /// Submits several transfers in one call, each with what runs when it
    /// ends, if anything (as [`submit_then`](Self::submit_then) or
    /// [`submit_observed`](Self::submit_observed)): one result per
    /// transfer, in order. The backend is locked once and may hand the
    /// batch's work on together (tcp: one hand-over, and at most one
    /// wake-up of each stream's I/O thread, for the batch instead of one
    /// per transfer), so a batch of small transfers costs about what one
    /// transfer of as many blocks does. A transfer refused at submission
    /// gets its error in its place and the others go on; its `on_done` is
    /// not called.
    ///
    /// A backend that finishes transfers inside the submission
    /// ([`Backend::submit_batch_now`]; shm copies them there) hands their
    /// results back at once: their `on_done` runs here, on the calling
    /// thread, before this returns, and their handles come back resolved,
    /// without a slot in the transport's table or a wake-up (one clock
    /// read for all of them).
    pub fn submit_batch(
        &self,
        transfers: Vec<(Transfer, Option<Then>)>,
    ) -> Vec<Result<TransferHandle, SubmitError>> {
        let stopped = self.shared.stop.load(Ordering::Acquire);
        let n = transfers.len();
        let mut submit = Vec::with_capacity(n);
        // Each transfer handed to the backend: its id, peer and what runs
        // when it ends; and each one refused here, with where it was.
        let mut pending: Vec<(TransferId, PeerId, Option<AtEnd>)> = Vec::with_capacity(n);
        let mut refused: Vec<(usize, SubmitError)> = Vec::new();
        let submitted = Instant::now();
        let mut b = lock(&self.shared.backend);
        {
            // Slots enter the map only with the backend held (see
            // `submit_one`): ids found free here stay free until then.
            let slots = lock(&self.shared.slots);
            // The batch's ids so far are told apart by their order while
            // they increase (as `TransferId::next` makes them), by a set
            // once a caller's choice does not.
            let mut last = None;
            let mut seen: Option<
                std::collections::HashSet<TransferId, std::hash::BuildHasherDefault<IdHasher>>,
            > = None;
            for (i, (t, then)) in transfers.into_iter().enumerate() {
                let id = t.id;
                if stopped {
                    refused.push((i, SubmitError::Rejected(DataError::Shutdown(id))));
                    continue;
                }
                let again = match &mut seen {
                    None if last.is_none_or(|l| id > l) => false,
                    None => {
                        let set = seen.insert(pending.iter().map(|p| p.0).collect());
                        !set.insert(id)
                    }
                    Some(set) => !set.insert(id),
                };
                if again || slots.contains_key(&id) {
                    refused.push((i, SubmitError::Rejected(DataError::DuplicateTransfer(id))));
                    continue;
                }
                last = Some(id);
                pending.push((id, t.peer, then.map(|then| AtEnd::new(then, &t, submitted))));
                submit.push(t);
            }
        }
        let mut results = Vec::with_capacity(submit.len());
        let (due, inline) = if submit.is_empty() {
            (false, false)
        } else {
            (
                b.submit_batch_now(submit, submitted, &mut results),
                b.completes_inline(),
            )
        };
        let mut queued = false;
        let mut done = Vec::new();
        let mut out: Vec<Result<TransferHandle, SubmitError>> = Vec::with_capacity(n);
        {
            let mut slots = None;
            let mut results = results.into_iter();
            let mut refused = refused.into_iter().peekable();
            for (id, peer, at_end) in pending {
                while let Some((_, e)) = refused.next_if(|(i, _)| *i == out.len()) {
                    out.push(Err(e));
                }
                // A backend that answered fewer than it was given left the
                // rest unsubmitted: refused, never left to wait.
                let r = results
                    .next()
                    .unwrap_or_else(|| Err(SubmitError::Rejected(DataError::Shutdown(id))));
                let at = out.len();
                out.push(r.map(|s| {
                    let state = match (s, at_end) {
                        (Submitted::Queued, at_end) => {
                            queued = true;
                            let slot = Arc::new(Slot::new(submitted, at_end));
                            slots
                                .get_or_insert_with(|| lock(&self.shared.slots))
                                .insert(id, slot.clone());
                            HandleState::Pending(slot)
                        }
                        (Submitted::Done(result), None) => HandleState::Done {
                            result: Some(boxed(result)),
                            submitted,
                        },
                        // The result goes in once its `on_done` ran.
                        (Submitted::Done(result), Some(p)) => {
                            done.push((at, p, result));
                            HandleState::Done {
                                result: None,
                                submitted,
                            }
                        }
                    };
                    TransferHandle { id, peer, state }
                }));
            }
            out.extend(refused.map(|(_, e)| Err(e)));
        }
        drop(b);
        self.after_submit(queued, due, inline);
        // Their `on_done`s, off the backend's lock, as a poll runs them.
        if !done.is_empty() {
            let now = Instant::now();
            for (at, p, result) in done {
                p.run_caught(&result, now);
                if let Some(Ok(TransferHandle {
                    state: HandleState::Done { result: slot, .. },
                    ..
                })) = out.get_mut(at)
                {
                    *slot = Some(boxed(result));
                }
            }
        }
        out
    }

    /// Submits, and when the queue is full waits for room (up to the
    /// transfer's deadline) instead of handing the transfer back.
    pub fn submit_wait(&self, mut transfer: Transfer) -> Result<TransferHandle, SubmitError> {
        loop {
            match self.submit(transfer) {
                Err(SubmitError::QueueFull {
                    transfer: t,
                    in_flight,
                }) => {
                    if Instant::now() >= t.deadline {
                        return Err(SubmitError::QueueFull {
                            transfer: t,
                            in_flight,
                        });
                    }
                    transfer = *t;
                    thread::sleep(Duration::from_micros(50));
                }
                other => return other,
            }
        }
    }

    /// The stream of notifications that arrive for this side. Returns
    /// `None` after the first call (there is one receiver).
    ///
    /// The channel holds [`NOTIFY_CHANNEL`] notifications; while it is
    /// full (the receiver is not read, or was never taken) the backend
    /// keeps what arrives in its own bounded queue, and once that is full
    /// too the tcp target refuses further notifications (the initiator's
    /// transfer fails with
    /// [`DataError::NotificationQueueFull`]); none is dropped silently.
    /// Dropping the receiver drops the notifications that arrive later.
    pub fn take_notifications(&self) -> Option<mpsc::Receiver<Notification>> {
        lock(&self.notifications).take()
    }

    /// Transfers submitted and not yet resolved.
    pub fn in_flight(&self) -> usize {
        lock(&self.shared.slots).len()
    }

    /// Stops the progress thread and drops the backend (closing its
    /// sockets and releasing its registrations); transfers still in flight
    /// fail with [`DataError::Shutdown`]. Idempotent.
    pub fn shutdown(&self) {
        self.shared.stop.store(true, Ordering::Release);
        match &self.driver {
            Driver::Own { thread, progress } => {
                progress.unpark();
                if let Some(h) = lock(thread).take() {
                    if h.join().is_err() {
                        tracing::error!("kvlane progress thread panicked");
                    }
                }
            }
            Driver::Pooled { member, .. } => member.retire(),
        }
        let kind = lock(&self.shared.backend).kind();
        drop(std::mem::replace(
            &mut *lock(&self.shared.backend),
            Box::new(Closed(kind)),
        ));
        let slots: Vec<_> = lock(&self.shared.slots).drain().collect();
        for (id, slot) in slots {
            slot.complete(Err(DataError::Shutdown(id)));
        }
    }
}

impl Drop for Transport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// What a shut-down transport holds instead of its backend.
struct Closed(BackendKind);

impl Closed {
    fn err(&self) -> DataError {
        DataError::Unsupported {
            backend: "closed transport",
            what: "the transport was shut down",
        }
    }
}

impl Backend for Closed {
    fn kind(&self) -> BackendKind {
        self.0
    }
    fn register(&mut self, _: &Region) -> Result<RemoteRegion, DataError> {
        Err(self.err())
    }
    fn deregister(&mut self, _: RegionId) -> Result<(), DataError> {
        Err(self.err())
    }
    fn prepare_peer(&mut self) -> Result<(PeerId, Endpoint), DataError> {
        Err(self.err())
    }
    fn connect_peer(
        &mut self,
        _: PeerId,
        _: &Endpoint,
        _: &[RemoteRegion],
    ) -> Result<(), DataError> {
        Err(self.err())
    }
    fn remove_peer(&mut self, _: PeerId) {}
    fn submit(&mut self, t: Transfer) -> Result<(), SubmitError> {
        Err(SubmitError::Rejected(DataError::Shutdown(t.id)))
    }
    fn poll(&mut self, _: &mut Vec<Completion>) -> usize {
        0
    }
    fn poll_notifications(&mut self, _: &mut Vec<Notification>) -> usize {
        0
    }
    fn in_flight(&self) -> usize {
        0
    }
}

/// How long a driver parks while work is in flight on a backend that
/// does not announce every arrival (a backend's own progress thread, or
/// a pool member whose backend says
/// [`announces_arrivals`](Backend::announces_arrivals) false): until the
/// backend's [`poll_by`](Backend::poll_by) (at most [`IDLE_PARK`]), or
/// [`BUSY_PARK`] when it does not say. One that announces every arrival
/// is polled at its `poll_by` alone (see `progress.rs`). A thousand agents in one process
/// re-polling every millisecond cost a million wake-ups a second: on 2
/// cores that alone kept ~700 threads runnable and starved the I/O.
pub(crate) fn busy_park(poll_by: Option<Instant>) -> Duration {
    match poll_by {
        None => BUSY_PARK,
        Some(at) => at.saturating_duration_since(Instant::now()).min(IDLE_PARK),
    }
}

fn progress_loop(shared: &Shared) {
    let waker = Waker::from(Arc::new(ThreadWaker(thread::current())));
    shared.set_waker(waker);
    let mut polled = Polled::default();
    while !shared.stop.load(Ordering::Acquire) {
        let p = shared.poll_locked(lock(&shared.backend), &mut polled);
        if p.results > 0 {
            continue;
        }
        match (p.in_flight > 0, p.busy) {
            (true, true) => thread::yield_now(),
            (true, false) => thread::park_timeout(busy_park(p.poll_by)),
            (false, _) => thread::park_timeout(IDLE_PARK),
        }
    }
}
