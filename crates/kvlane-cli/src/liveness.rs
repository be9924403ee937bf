//! Control-plane liveness options shared by `serve` and `soak`.

use crate::units;
use clap::Args;
use kvlane_control::{Config, ConfigError};
use std::time::Duration;

/// Keep-alive, liveness budget and handshake options. The defaults are
/// those of [`Config::default`].
#[derive(Args, Debug, Clone)]
pub(crate) struct LivenessArgs {
    /// Interval between keep-alive pings (e.g. 1s, 250ms).
    #[arg(long, default_value = "1s", value_parser = units::parse_duration)]
    pub(crate) keepalive_interval: Duration,
    /// Unanswered keep-alives before a peer is dead: a silent peer is
    /// declared dead, and its in-flight transfers fail, at most
    /// keepalive-interval x (liveness-budget + 1) after it was last heard.
    #[arg(long, default_value_t = 3)]
    pub(crate) liveness_budget: u32,
    /// Deadline of one handshake (also bounds each reconnect attempt).
    #[arg(long, default_value = "5s", value_parser = units::parse_duration)]
    pub(crate) handshake_timeout: Duration,
    /// Longest wait between two reconnect attempts to a dead peer.
    #[arg(long, default_value = "5s", value_parser = units::parse_duration)]
    pub(crate) reconnect_max: Duration,
}

impl LivenessArgs {
    /// The control-plane configuration these options describe; the error
    /// names the option that is out of range.
    pub(crate) fn config(&self) -> Result<Config, ConfigError> {
        let defaults = Config::default();
        let config = Config {
            keepalive_interval: self.keepalive_interval,
            liveness_budget: self.liveness_budget,
            handshake_timeout: self.handshake_timeout,
            backoff_max: self.reconnect_max.max(defaults.backoff_min),
            ..defaults
        };
        config.validate()?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        liveness: LivenessArgs,
    }

    #[test]
    fn defaults_are_the_control_plane_defaults() {
        let c = Cli::parse_from(["x"]).liveness.config().unwrap();
        let d = Config::default();
        assert_eq!(c.keepalive_interval, d.keepalive_interval);
        assert_eq!(c.liveness_budget, d.liveness_budget);
        assert_eq!(c.handshake_timeout, d.handshake_timeout);
        assert_eq!(c.backoff_max, d.backoff_max);
        assert_eq!(c.death_bound(), Duration::from_secs(4));
    }

    #[test]
    fn short_budgets_parse_and_zero_is_refused() {
        let cli = Cli::parse_from([
            "x",
            "--keepalive-interval",
            "250ms",
            "--liveness-budget",
            "4",
            "--reconnect-max",
            "1s",
        ]);
        let c = cli.liveness.config().unwrap();
        assert_eq!(c.death_bound(), Duration::from_millis(1250));
        assert_eq!(c.backoff_max, Duration::from_secs(1));
        let e = Cli::parse_from(["x", "--liveness-budget", "0"])
            .liveness
            .config()
            .unwrap_err();
        assert_eq!(e.field, "liveness_budget");
    }
}
