//! Plain output to stdout that never panics: `println!` panics when stdout
//! is a closed pipe (`kvlane ping ... | head`). A failed write is dropped
//! and later output is skipped; the command itself goes on (a `serve`
//! keeps serving), and its exit status is what it would have been.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

static CLOSED: AtomicBool = AtomicBool::new(false);

/// Writes `args` to stdout, unless an earlier write failed.
pub(crate) fn write(args: std::fmt::Arguments<'_>) {
    if CLOSED.load(Ordering::Relaxed) {
        return;
    }
    let mut out = std::io::stdout().lock();
    if out.write_fmt(args).and_then(|()| out.flush()).is_err() {
        CLOSED.store(true, Ordering::Relaxed);
    }
}

/// `println!` to stdout without the panic on a closed pipe.
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::out::write(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `print!` to stdout without the panic on a closed pipe.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::out::write(format_args!($($arg)*))
    };
}

pub(crate) use {out, outln};
