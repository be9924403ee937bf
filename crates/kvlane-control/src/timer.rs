//! The closed set of timers of a peer machine and their table.

use std::time::Instant;

/// Every timer a peer machine can arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Timer {
    /// End of the current handshake round.
    Handshake,
    /// Next keep-alive ping.
    KeepAlive,
    /// Liveness budget: the peer is dead when this fires.
    Liveness,
    /// End of the reconnect backoff.
    Backoff,
    /// End of the close linger (waiting for the remote `bye`).
    Linger,
}

impl Timer {
    /// All timers, in table order.
    pub(crate) const ALL: [Self; 5] = [
        Self::Handshake,
        Self::KeepAlive,
        Self::Liveness,
        Self::Backoff,
        Self::Linger,
    ];

    fn index(self) -> usize {
        self as usize
    }
}

/// One optional deadline per [`Timer`].
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct TimerTable {
    data: [Option<Instant>; 5],
}

impl TimerTable {
    /// Arms `timer` at `at`.
    pub(crate) fn set(&mut self, timer: Timer, at: Instant) {
        self.data[timer.index()] = Some(at);
    }

    /// Disarms `timer`.
    pub(crate) fn stop(&mut self, timer: Timer) {
        self.data[timer.index()] = None;
    }

    /// Deadline of `timer`.
    pub(crate) fn get(&self, timer: Timer) -> Option<Instant> {
        self.data[timer.index()]
    }

    /// Disarms all timers.
    pub(crate) fn stop_all(&mut self) {
        self.data = [None; 5];
    }

    /// Earliest deadline.
    pub(crate) fn next_timeout(&self) -> Option<Instant> {
        self.data.iter().flatten().min().copied()
    }

    /// Disarms and returns a timer that expired at `now`, earliest first.
    pub(crate) fn expire(&mut self, now: Instant) -> Option<Timer> {
        let (timer, _) = Timer::ALL
            .iter()
            .filter_map(|&t| self.get(t).filter(|&at| at <= now).map(|at| (t, at)))
            .min_by_key(|&(_, at)| at)?;
        self.stop(timer);
        Some(timer)
    }
}
