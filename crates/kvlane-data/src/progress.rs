//! Progress threads shared by the [`Transport`](crate::Transport)s of a
//! process whose backends announce completions through their waker (tcp,
//! loopback).
//!
//! A transport used to own a thread that polled its backend. A process
//! that runs many agents (the `--peers` bench runs 500 per process; an
//! engine may run one per GPU) then had one progress thread per agent,
//! each woken for its own completions: 1,000 agents in two processes on
//! 2 cores spent about a fifth of the CPU switching between them. Here
//! [`ProgressPool::for_process`] gives every such transport a member slot
//! on one of a few threads (the available parallelism, at most 4): a
//! backend's waker puts its member on that thread's ready list (once per
//! burst) and unparks the thread, which polls every ready member in one
//! turn, and re-polls a member with work in flight by its backend's
//! [`poll_by`](crate::Backend::poll_by) (its next deadline). Backends that
//! must be polled busily (verbs' completion queues) keep a thread of their
//! own.
//!
//! A member whose backend is locked by its transport (a registration, a
//! connect step, a submission) is skipped: every such caller wakes the
//! member when it lets the lock go. A panic while polling a member fails
//! that transport's in-flight transfers and retires the member; the thread
//! and the other members go on.
//!
//! A wake-up from a thread that does not hold the backend (a tcp I/O
//! thread that just read the last answer of a transfer) polls the member
//! right there instead of handing it to its progress thread: the waiting
//! thread is woken by the thread that finished the transfer, one context
//! switch instead of two (I/O thread, progress thread, waiter). An I/O
//! thread defers its wake-ups to the end of its event loop's turn
//! ([`WakeBatch`]), so a turn that finished a whole batch polls once. A
//! backend found locked, or a driver that skipped it meanwhile, is left to
//! the progress thread as before; the progress thread still re-polls every
//! member by its deadlines.
//!
//! A member whose backend announces every arrival (tcp) has no periodic
//! poll: it is polled when woken and at its backend's `poll_by` (the
//! earliest deadline), and with nothing in flight not at all; a thread
//! with no timer parks until unparked. A thread that polled a member
//! itself wakes it when that poll found something due before the time
//! its progress thread planned (`Member::due`): held-back notifications,
//! a deadline the thread does not know of.

use crate::handle::{
    busy_park, lock, poll_inline, poll_once, PollResult, Polled, Shared, IDLE_PARK,
};
use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::collections::HashMap;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::task::{Wake, Waker};
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

/// The thread pools the backends and transports of a process share, one
/// per thread count: the live pool of `threads` threads, or a new one from
/// `start` (a pool lives while something holds it). The progress threads
/// here and the tcp backend's I/O threads of either side use it.
pub(crate) fn process_pool<T, E>(
    pools: &Mutex<Vec<(usize, Weak<T>)>>,
    threads: usize,
    start: impl FnOnce(usize) -> Result<T, E>,
) -> Result<Arc<T>, E> {
    let threads = threads.max(1);
    let mut pools = lock(pools);
    pools.retain(|(_, p)| p.strong_count() > 0);
    if let Some(p) = pools
        .iter()
        .filter(|(n, _)| *n == threads)
        .find_map(|(_, p)| p.upgrade())
    {
        return Ok(p);
    }
    let pool = Arc::new(start(threads)?);
    pools.push((threads, Arc::downgrade(&pool)));
    Ok(pool)
}

/// Polls of one member in a row while it keeps yielding results, before
/// the others get their turn.
const ROUNDS: usize = 8;

/// One transport's place on a pool thread.
pub(crate) struct Member {
    id: u64,
    shared: Arc<Shared>,
    /// On its thread's ready list (one wake-up per burst).
    queued: AtomicBool,
    /// Its transport shut down: the thread forgets it.
    retired: AtomicBool,
    /// When its thread means to poll it next ([`ticks`]; `u64::MAX`: not
    /// before it is woken, or being polled there now). A thread that
    /// polled it itself reads this to tell whether that plan still holds
    /// (see [`poll_here`](Self::poll_here)).
    due: AtomicU64,
    home: Arc<Home>,
}

impl Member {
    /// Asks its thread to poll it (work submitted, a lock let go,
    /// completions announced by the backend).
    pub(crate) fn wake(self: &Arc<Self>) {
        // What the caller changed (an answer queued, a lock let go) is
        // ordered before the read of `queued`: a thread that cleared it
        // (see `run`) and then polls sees the change, or this call sees
        // the flag clear and queues the member. Without the fences both
        // could read the old values and the member sleep with work.
        fence(Ordering::SeqCst);
        if !self.queued.swap(true, Ordering::AcqRel) {
            lock(&self.home.ready).push(self.clone());
            self.home.unpark();
        }
    }

    /// Polls the backend on this thread when it is free; false when it
    /// was not polled here, a driver skipped it meanwhile, or the poll
    /// found it needs a poll sooner than its thread plans one (notes held
    /// back, say, or a deadline the thread does not know of): then the
    /// caller wakes the member, and its thread polls and plans again.
    pub(crate) fn poll_here(&self) -> bool {
        if thread::panicking() || self.retired.load(Ordering::Acquire) {
            return false;
        }
        INLINE.with(|p| {
            // Re-entered from this thread's own poll: leave it to the pool.
            let Ok(mut polled) = p.try_borrow_mut() else {
                return false;
            };
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                poll_inline(&self.shared, &mut polled)
            }));
            match r {
                // Read after the poll: a thread that polls it after this
                // one stored `u64::MAX` before its own poll (see `turn`),
                // and the backend's lock orders the two polls.
                Ok(Some(p)) => next_poll(&p, Instant::now())
                    .is_none_or(|at| ticks(at) >= self.due.load(Ordering::Relaxed)),
                Ok(None) => false,
                Err(_) => {
                    tracing::error!(
                        "a kvlane backend panicked while polled; failing its in-flight transfers"
                    );
                    *polled = Polled::default();
                    self.shared.fail_all_panicked();
                    true
                }
            }
        })
    }

    /// Its transport is shutting down: the thread drops it at its next
    /// turn (promptly: it is woken).
    pub(crate) fn retire(self: &Arc<Self>) {
        self.retired.store(true, Ordering::Release);
        self.queued.store(false, Ordering::Release);
        self.wake();
    }
}

struct MemberWaker(Weak<Member>);

impl Wake for MemberWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        if let Some(m) = self.0.upgrade() {
            if !m.poll_here() {
                m.wake();
            }
        }
    }
}

thread_local! {
    /// The buffers of the polls a thread makes for a member it woke.
    static INLINE: RefCell<Polled> = RefCell::new(Polled::default());
    /// Whether this thread defers its wake-ups ([`WakeBatch`]), and the
    /// ones it deferred.
    static DEFERRED: RefCell<(bool, Vec<Waker>)> = const { RefCell::new((false, Vec::new())) };
}

/// Wakes `waker` now, or at the end of this thread's [`WakeBatch`].
pub(crate) fn wake(waker: Waker) {
    let now = DEFERRED
        .try_with(|d| {
            let mut d = d.borrow_mut();
            if d.0 {
                d.1.push(waker.clone());
                false
            } else {
                true
            }
        })
        .unwrap_or(true);
    if now {
        waker.wake();
    }
}

/// While one lives, this thread's [`wake`]s are deferred; they run when it
/// drops, each once per backend that asked (a backend asks once until it
/// is polled). An I/O thread holds one for each turn of its event loop.
pub(crate) struct WakeBatch(());

impl WakeBatch {
    pub(crate) fn begin() -> Self {
        DEFERRED.with(|d| d.borrow_mut().0 = true);
        Self(())
    }
}

impl Drop for WakeBatch {
    fn drop(&mut self) {
        let mut wakers = DEFERRED.with(|d| {
            let mut d = d.borrow_mut();
            d.0 = false;
            std::mem::take(&mut d.1)
        });
        // Wake-ups made while these run happen at once.
        for w in wakers.drain(..) {
            w.wake();
        }
        DEFERRED.with(|d| {
            let mut d = d.borrow_mut();
            if d.1.is_empty() {
                d.1 = wakers;
            }
        });
    }
}

/// How other threads reach one pool thread.
struct Home {
    ready: Mutex<Vec<Arc<Member>>>,
    /// Set as the thread is started, before any member can join.
    thread: OnceLock<Thread>,
    stop: AtomicBool,
}

impl Home {
    fn unpark(&self) {
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }
}

/// The shared progress threads of this process.
pub(crate) struct ProgressPool {
    homes: Vec<Arc<Home>>,
    threads: Vec<JoinHandle<()>>,
    next: AtomicUsize,
}

static POOLS: Mutex<Vec<(usize, Weak<ProgressPool>)>> = Mutex::new(Vec::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl ProgressPool {
    /// The process's pool, started if no live transport holds it.
    pub(crate) fn for_process() -> std::io::Result<Arc<Self>> {
        let n = thread::available_parallelism().map_or(2, |n| n.get().min(4));
        EPOCH.get_or_init(Instant::now);
        process_pool(&POOLS, n, Self::start)
    }

    fn start(n: usize) -> std::io::Result<Self> {
        let mut pool = Self {
            homes: Vec::new(),
            threads: Vec::new(),
            next: AtomicUsize::new(0),
        };
        for i in 0..n {
            let home = Arc::new(Home {
                ready: Mutex::new(Vec::new()),
                thread: OnceLock::new(),
                stop: AtomicBool::new(false),
            });
            let h = home.clone();
            let handle = crate::placement::spawn(
                thread::Builder::new().name(format!("kvlane-progress-{i}")),
                move || run(&h),
            )?;
            let _ = home.thread.set(handle.thread().clone());
            pool.homes.push(home);
            // On an error `pool` drops here and stops the threads started.
            pool.threads.push(handle);
        }
        Ok(pool)
    }

    /// Gives `shared` a member slot (threads taken in turn) and sets its
    /// backend's waker. The caller holds the pool as long as the member.
    pub(crate) fn join(&self, shared: Arc<Shared>) -> Arc<Member> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.homes.len();
        let member = Arc::new(Member {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            shared,
            queued: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            due: AtomicU64::new(u64::MAX),
            home: self.homes[i].clone(),
        });
        let waker = Waker::from(Arc::new(MemberWaker(Arc::downgrade(&member))));
        member.shared.set_waker(waker);
        member.wake();
        member
    }
}

impl Drop for ProgressPool {
    fn drop(&mut self) {
        for home in &self.homes {
            home.stop.store(true, Ordering::Release);
            home.unpark();
        }
        for t in self.threads.drain(..) {
            // The last transport dropped from a completion callback on a
            // pool thread: that thread ends on its own.
            if t.thread().id() == thread::current().id() {
                continue;
            }
            if t.join().is_err() {
                tracing::error!("a kvlane progress thread panicked");
            }
        }
    }
}

/// One pool thread: polls ready members, then members whose time came.
fn run(home: &Home) {
    let mut members: HashMap<u64, (Arc<Member>, Option<Instant>)> = HashMap::new();
    let mut timers: BinaryHeap<Reverse<(Instant, u64)>> = BinaryHeap::new();
    let mut ready: Vec<Arc<Member>> = Vec::new();
    let mut polled = Polled::default();
    while !home.stop.load(Ordering::Acquire) {
        std::mem::swap(&mut ready, &mut *lock(&home.ready));
        for m in ready.drain(..) {
            m.queued.store(false, Ordering::Release);
            // Pairs with the fence in `Member::wake`: the poll below sees
            // what a waker changed, or the waker sees the flag clear.
            fence(Ordering::SeqCst);
            let m = members.remove(&m.id).map_or(m, |(m, _)| m);
            turn(m, &mut members, &mut timers, &mut polled);
        }
        let now = Instant::now();
        while let Some(&Reverse((at, id))) = timers.peek() {
            if at > now {
                break;
            }
            timers.pop();
            // A stale entry: the member was polled since and rescheduled.
            if members.get(&id).is_some_and(|(_, due)| *due == Some(at)) {
                if let Some((m, _)) = members.remove(&id) {
                    turn(m, &mut members, &mut timers, &mut polled);
                }
            }
        }
        if !lock(&home.ready).is_empty() {
            continue;
        }
        match timers.peek() {
            Some(&Reverse((at, _))) => {
                thread::park_timeout(at.saturating_duration_since(Instant::now()))
            }
            // Every member is idle and wakes this thread when it has
            // work (`Member::wake`, `stop` on drop).
            None => thread::park(),
        }
    }
}

/// Polls one member and schedules its next poll (or forgets it).
fn turn(
    m: Arc<Member>,
    members: &mut HashMap<u64, (Arc<Member>, Option<Instant>)>,
    timers: &mut BinaryHeap<Reverse<(Instant, u64)>>,
    polled: &mut Polled,
) {
    if m.retired.load(Ordering::Acquire) {
        return;
    }
    // No plan while it is polled here: a thread that polls it meanwhile
    // wakes it for anything it finds due (see `Member::poll_here`).
    m.due.store(u64::MAX, Ordering::Relaxed);
    let mut next = None;
    for _ in 0..ROUNDS {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            poll_once(&m.shared, polled)
        }));
        match r {
            Err(_) => {
                tracing::error!(
                    "a kvlane backend panicked while polled; failing its in-flight transfers"
                );
                m.shared.fail_all_panicked();
                return;
            }
            // Locked by its transport, which wakes it when done.
            Ok(None) => return,
            Ok(Some(p)) => {
                next = Some(p);
                if p.results == 0 {
                    break;
                }
            }
        }
    }
    let Some(p) = next else { return };
    let now = Instant::now();
    let at = if p.results > 0 {
        // Still yielding after its rounds: again at the next turn.
        Some(now)
    } else {
        next_poll(&p, now)
    };
    m.due.store(at.map_or(u64::MAX, ticks), Ordering::Relaxed);
    if let Some(at) = at {
        timers.push(Reverse((at, m.id)));
    }
    // With no timer, a wake-up puts it on the ready list.
    members.insert(m.id, (m, at));
}

/// When a member is to be polled next, from what a poll of it found
/// (`None`: not until it is woken). What the poll yielded does not count:
/// [`turn`] re-polls a member still yielding, and a thread that polled
/// it itself took what had been announced.
///
/// A backend that announces arrivals through its waker
/// ([`Backend::announces_arrivals`](crate::Backend::announces_arrivals))
/// is polled by a timer only for what polling alone notices: its
/// [`poll_by`](crate::Backend::poll_by) (a deadline, a link read), with
/// work in flight or without; an answer, a notification or a lost peer
/// wakes it. Idle, it is not polled at all: each wake-up would preempt
/// the engine's threads on the cores it shares with them. Any other
/// backend is polled at least every [`IDLE_PARK`], and so is a member
/// holding notifications back (only a poll passes them on once the
/// application makes room).
fn next_poll(p: &PollResult, now: Instant) -> Option<Instant> {
    let at = if !p.announces {
        Some(if p.in_flight > 0 {
            now + busy_park(p.poll_by)
        } else {
            now + IDLE_PARK
        })
    } else if p.in_flight > 0 {
        Some(p.poll_by.unwrap_or_else(|| now + busy_park(None)))
    } else {
        // A deadline already past is noticed by this poll (it is not
        // repeated at once).
        p.poll_by.map(|t| t.max(now + Duration::from_millis(1)))
    };
    if p.held {
        let held = now + IDLE_PARK;
        Some(at.map_or(held, |t| t.min(held)))
    } else {
        at
    }
}

/// The instant the first pool started: [`ticks`] counts from it.
static EPOCH: OnceLock<Instant> = OnceLock::new();

/// `at` as nanoseconds since [`EPOCH`] (0 for an instant before it;
/// below `u64::MAX`, which means "none").
fn ticks(at: Instant) -> u64 {
    let epoch = *EPOCH.get_or_init(Instant::now);
    let n = at.saturating_duration_since(epoch).as_nanos();
    u64::try_from(n).unwrap_or(u64::MAX).min(u64::MAX - 1)
}
