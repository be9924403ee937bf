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

use crate::handle::{busy_park, lock, poll_inline, poll_once, Polled, Shared, IDLE_PARK};
use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
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
    home: Arc<Home>,
}

impl Member {
    /// Asks its thread to poll it (work submitted, a lock let go,
    /// completions announced by the backend).
    pub(crate) fn wake(self: &Arc<Self>) {
        if !self.queued.swap(true, Ordering::AcqRel) {
            lock(&self.home.ready).push(self.clone());
            self.home.unpark();
        }
    }

    /// Polls the backend on this thread when it is free; false when it
    /// was not polled here, or a driver skipped it meanwhile (then the
    /// caller wakes the member).
    fn poll_here(&self) -> bool {
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
            r.unwrap_or_else(|_| {
                tracing::error!(
                    "a kvlane backend panicked while polled; failing its in-flight transfers"
                );
                *polled = Polled::default();
                self.shared.fail_all_panicked();
                true
            })
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
    let mut members: HashMap<u64, (Arc<Member>, Instant)> = HashMap::new();
    let mut timers: BinaryHeap<Reverse<(Instant, u64)>> = BinaryHeap::new();
    let mut ready: Vec<Arc<Member>> = Vec::new();
    let mut polled = Polled::default();
    while !home.stop.load(Ordering::Acquire) {
        std::mem::swap(&mut ready, &mut *lock(&home.ready));
        for m in ready.drain(..) {
            m.queued.store(false, Ordering::Release);
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
            if members.get(&id).is_some_and(|(_, due)| *due == at) {
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
    members: &mut HashMap<u64, (Arc<Member>, Instant)>,
    timers: &mut BinaryHeap<Reverse<(Instant, u64)>>,
    polled: &mut Polled,
) {
    if m.retired.load(Ordering::Acquire) {
        return;
    }
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
    } else if p.in_flight > 0 {
        Some(now + busy_park(p.poll_by))
    } else if p.announces && !p.held {
        // Idle, and every arrival wakes it: no periodic wake-up (each one
        // preempts the engine's threads on the cores it shares with
        // them), only the time the backend itself names, if any.
        p.poll_by.map(|t| t.max(now + Duration::from_millis(1)))
    } else {
        Some(now + IDLE_PARK)
    };
    match at {
        Some(at) => {
            timers.push(Reverse((at, m.id)));
            members.insert(m.id, (m, at));
        }
        // Kept, with no timer: a wake-up puts it on the ready list.
        None => {
            members.insert(m.id, (m, now + Duration::from_secs(365 * 86_400)));
        }
    }
}
