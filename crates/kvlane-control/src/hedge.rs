//! Fresh connect attempts beside one that goes unanswered.
//!
//! A listener whose accept queue is full (a flood of connections) drops a
//! new SYN, and the kernel resends it only after its initial retransmission
//! timeout, 1 s on Linux. A fresh connect (a new socket, a new SYN) gets in
//! as soon as the queue has room. So a connect that has not finished
//! [`HEDGE_AFTER`] after its start gets a second one beside it, and so on
//! up to [`HEDGE_ATTEMPTS`]; the first to finish wins and the others are
//! dropped. The control dial does this inside zeromq
//! (`SocketOptions::hedged_connect`, connect and ZMTP greeting together).

use std::time::Duration;

/// How long a connect runs alone before a fresh one joins it; each later
/// gap doubles. Well above a connect (and ZMTP greeting) on the networks
/// kvlane runs on (loopback, a datacenter: under 10 ms even loaded), well
/// below the kernel's 1 s SYN resend.
pub(crate) const HEDGE_AFTER: Duration = Duration::from_millis(200);

/// Attempts one connect starts at most (the first included): at 0, 200
/// and 600 ms. Bounded so that a listener that is down or overloaded
/// sees at most this many from one connect; an attempt that fails (refused,
/// reset) starts none.
pub(crate) const HEDGE_ATTEMPTS: usize = 3;
