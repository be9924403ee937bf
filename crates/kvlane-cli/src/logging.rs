//! Log and event output that never blocks the caller.
//!
//! `tracing` writes each event with one `write` call from the thread that
//! logged it: the agent's control loop, a transfer path. When stderr is a
//! pipe nobody drains, that `write` blocks and so does the control plane
//! (`kvlane serve` stopped answering). Here a logged line goes into a
//! bounded queue and a dedicated thread writes it to stderr; when the queue
//! is full the line is dropped and counted, and the writer thread reports
//! the count (`N log lines dropped`) once it can write again. The same
//! lossy, non-blocking design as `tracing-appender`'s `non_blocking` with
//! `lossy(true)`, without the dependency.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;

use tracing_subscriber::fmt::MakeWriter;

/// Lines queued for the writer thread. Each is one formatted event (a few
/// hundred bytes), so this bounds the queue at about 1 MiB.
const QUEUE_LINES: usize = 4096;

/// Where a [`Lossy`] writes.
#[derive(Clone, Copy)]
enum Sink {
    Stdout,
    Stderr,
}

/// A bounded queue of lines and the thread writing them; a [`MakeWriter`]
/// for `tracing`. Cloning shares the queue.
#[derive(Clone)]
pub(crate) struct Lossy {
    tx: Option<SyncSender<Vec<u8>>>,
    dropped: Arc<AtomicU64>,
    /// Lines queued and not yet written.
    pending: Arc<AtomicU64>,
}

impl Lossy {
    /// Lines to stderr. If the writer thread cannot be started, lines are
    /// dropped (counted) rather than written from the caller.
    pub(crate) fn stderr() -> Self {
        Self::spawn(Sink::Stderr).unwrap_or_else(|_| Self {
            tx: None,
            dropped: Arc::default(),
            pending: Arc::default(),
        })
    }

    /// Lines to stdout.
    pub(crate) fn stdout() -> std::io::Result<Self> {
        Self::spawn(Sink::Stdout)
    }

    /// Starts the writer thread (it ends when every clone is dropped; at
    /// process exit queued lines may be lost, as with any lossy logger).
    fn spawn(sink: Sink) -> std::io::Result<Self> {
        let (tx, rx) = sync_channel(QUEUE_LINES);
        let dropped = Arc::new(AtomicU64::new(0));
        let pending = Arc::new(AtomicU64::new(0));
        let counters = (Arc::clone(&dropped), Arc::clone(&pending));
        std::thread::Builder::new()
            .name("kvlane-output".into())
            .spawn(move || match sink {
                Sink::Stdout => drain(&rx, &counters, std::io::stdout()),
                Sink::Stderr => drain(&rx, &counters, std::io::stderr()),
            })?;
        Ok(Self {
            tx: Some(tx),
            dropped,
            pending,
        })
    }

    /// Queues one line (a newline is added); never waits.
    pub(crate) fn line(&self, mut line: String) {
        line.push('\n');
        self.push(line.into_bytes());
    }

    fn push(&self, bytes: Vec<u8>) {
        self.pending.fetch_add(1, Ordering::AcqRel);
        let sent = self.tx.as_ref().is_some_and(|tx| match tx.try_send(bytes) {
            Ok(()) => true,
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => false,
        });
        if !sent {
            self.pending.fetch_sub(1, Ordering::AcqRel);
            self.dropped.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Waits (at most `bound`) until the queued lines are written: called
    /// once before the process exits so its last lines are not lost.
    pub(crate) fn drain_for(&self, bound: std::time::Duration) {
        let until = std::time::Instant::now() + bound;
        while self.pending.load(Ordering::Acquire) > 0 && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

fn drain(
    rx: &Receiver<Vec<u8>>,
    (dropped, pending): &(Arc<AtomicU64>, Arc<AtomicU64>),
    mut out: impl Write,
) {
    while let Ok(line) = rx.recv() {
        let lost = dropped.swap(0, Ordering::AcqRel);
        if lost > 0 {
            let _ = writeln!(
                out,
                "kvlane: {lost} output lines dropped (output is not being read)"
            );
        }
        let _ = out.write_all(&line);
        let _ = out.flush();
        pending.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One event's writer: `write` queues the bytes or drops them, never waits.
pub(crate) struct Line(Lossy);

impl Write for Line {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.push(buf.to_vec());
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Lossy {
    type Writer = Line;

    fn make_writer(&'a self) -> Self::Writer {
        Line(self.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With nobody draining, writes still return at once: the queue fills,
    /// then lines are counted as dropped.
    #[test]
    fn a_full_queue_drops_and_counts_instead_of_blocking() {
        let (tx, rx) = sync_channel(2);
        let dropped = Arc::new(AtomicU64::new(0));
        let w = Lossy {
            tx: Some(tx),
            dropped: Arc::clone(&dropped),
            pending: Arc::default(),
        };
        for _ in 0..10 {
            let mut line = w.make_writer();
            assert_eq!(line.write(b"x\n").expect("write"), 2);
        }
        assert_eq!(dropped.load(Ordering::Acquire), 8);
        assert_eq!(rx.try_iter().count(), 2);
    }
}
