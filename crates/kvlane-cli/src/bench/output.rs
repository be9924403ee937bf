//! What `kvlane bench` prints: rows as a table or JSON lines on stdout,
//! progress on stderr.

use super::Row;
use crate::units::fmt_size;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::{self, IsTerminal, Write};

/// The table's header line.
pub(crate) fn table_header() -> String {
    format!(
        "{:<9} {:<7} {:<5} {:>6} {:>5} {:>8} {:>10} {:>10} {:>10} {:>10}",
        "backend",
        "memory",
        "op",
        "block",
        "batch",
        "GB/s",
        "lat avg us",
        "lat p99 us",
        "prep us",
        "post us"
    )
}

/// One table line.
pub(crate) fn table_line(r: &Row) -> String {
    format!(
        "{:<9} {:<7} {:<5} {:>6} {:>5} {:>8.2} {:>10.1} {:>10.1} {:>10.3} {:>10.3}",
        r.backend,
        r.memory,
        r.op,
        fmt_size(r.block_size),
        r.batch,
        r.gbps,
        r.lat_avg_us,
        r.lat_p99_us,
        r.prepare_avg_us,
        r.post_avg_us
    )
}

/// Rows to stdout, a progress bar to stderr (when it is a terminal).
pub(crate) struct Output {
    json: bool,
    bar: ProgressBar,
}

impl Output {
    /// Prints the table header (unless `json`); `total` rows are expected.
    pub(crate) fn new(json: bool, total: u64) -> io::Result<Self> {
        let bar = if io::stderr().is_terminal() {
            let bar = ProgressBar::new(total);
            if let Ok(style) = ProgressStyle::with_template("[{pos}/{len}] {bar:30} {msg}") {
                bar.set_style(style);
            }
            bar
        } else {
            ProgressBar::hidden()
        };
        if !json {
            writeln!(io::stdout(), "{}", table_header())?;
        }
        Ok(Self { json, bar })
    }

    pub(crate) fn progress(&self, what: &str) {
        self.bar.set_message(what.to_owned());
    }

    /// Prints one row at once (a failed write, such as a closed pipe, ends
    /// the run).
    pub(crate) fn row(&self, row: &Row) -> io::Result<()> {
        let line = if self.json {
            serde_json::to_string(row)?
        } else {
            table_line(row)
        };
        self.bar.suspend(|| {
            let mut out = io::stdout().lock();
            writeln!(out, "{line}")?;
            out.flush()
        })?;
        self.bar.inc(1);
        Ok(())
    }

    pub(crate) fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
