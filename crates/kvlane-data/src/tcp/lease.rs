//! What the target side serves, and the accesses to it in flight.
//!
//! Every region the target serves sits in the table as a [`Served`]. A
//! request that passes the checks takes a [`Lease`] on it, held for as long
//! as the request may touch the memory: a WRITE until its last payload byte
//! is stored, a READ until its last answer byte has left (the payload goes
//! from region memory straight to the socket). Deregistration removes the
//! entry (later requests are refused), waits a grace period for the leases
//! to end, then has every I/O thread cut the ones left (see
//! [`Server::deregister`](super::server::Server::deregister)), so that
//! once it returns no byte of the region is read or written any more: the
//! caller may free the memory.

use crate::memory::Region;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A region served under a key, and how many accesses to it are in flight.
pub(crate) struct Served {
    region: Region,
    /// Leases held now.
    leases: AtomicUsize,
    /// Waited on by [`wait_idle`](Self::wait_idle); notified when the last
    /// lease ends while a deregistration waits (`draining`).
    idle: Condvar,
    waiting: Mutex<()>,
    /// Set by [`wait_idle`](Self::wait_idle) before it checks the count:
    /// the last lease notifies only then, so a request's lease costs two
    /// atomic operations and no syscall (`Condvar::notify_all` always makes
    /// one: 4 KiB transfers lost 16-19% of their rate to it).
    draining: AtomicBool,
}

impl Served {
    pub(crate) fn new(region: Region) -> Arc<Self> {
        Arc::new(Self {
            region,
            leases: AtomicUsize::new(0),
            idle: Condvar::new(),
            waiting: Mutex::new(()),
            draining: AtomicBool::new(false),
        })
    }

    pub(crate) fn region(&self) -> &Region {
        &self.region
    }

    /// Takes a lease. Call only while the entry is in the table (under its
    /// read lock): once it was removed, nobody may take one.
    pub(crate) fn lease(self: &Arc<Self>) -> Lease {
        self.leases.fetch_add(1, Ordering::AcqRel);
        Lease(self.clone())
    }

    /// Leases held now.
    pub(crate) fn leases(&self) -> usize {
        self.leases.load(Ordering::Acquire)
    }

    /// Waits until no lease is held, at most `grace`; whether none is.
    pub(crate) fn wait_idle(&self, grace: Duration) -> bool {
        let deadline = Instant::now() + grace;
        let mut g = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        // SeqCst here and in `Lease::drop` (count, then flag): either the
        // last lease sees the flag and notifies under `waiting`, or this
        // side sees the count at 0.
        self.draining.store(true, Ordering::SeqCst);
        loop {
            // Checked under `waiting`, which the last lease takes before it
            // notifies: the wake-up cannot fall between check and wait.
            if self.leases.load(Ordering::SeqCst) == 0 {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            g = self
                .idle
                .wait_timeout(g, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// One access in flight to a [`Served`] region (see the [module
/// docs](self)); the region's memory may be touched only while one is held.
pub(crate) struct Lease(Arc<Served>);

impl Lease {
    pub(crate) fn region(&self) -> &Region {
        &self.0.region
    }

    /// Whether this is a lease on `served`.
    pub(crate) fn is_on(&self, served: &Arc<Served>) -> bool {
        Arc::ptr_eq(&self.0, served)
    }
}

impl Clone for Lease {
    fn clone(&self) -> Self {
        self.0.lease()
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.0.leases.fetch_sub(1, Ordering::SeqCst) == 1
            && self.0.draining.load(Ordering::SeqCst)
        {
            // The last one, and a deregistration waits for it: wake it.
            let _g = self.0.waiting.lock().unwrap_or_else(|e| e.into_inner());
            self.0.idle.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Access;

    #[test]
    fn waiting_for_idle_ends_when_the_last_lease_does_or_at_the_grace() {
        let served = Served::new(Region::alloc(64, Access::ALL).unwrap());
        assert!(served.wait_idle(Duration::ZERO));
        let a = served.lease();
        let b = a.clone();
        assert_eq!(served.leases(), 2);
        assert!(!served.wait_idle(Duration::from_millis(20)));
        drop(a);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(b);
        });
        let start = Instant::now();
        assert!(served.wait_idle(Duration::from_secs(30)));
        assert!(start.elapsed() < Duration::from_secs(20), "not woken");
        t.join().unwrap();
        assert_eq!(served.leases(), 0);
    }
}
