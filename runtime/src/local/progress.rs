//! The progress of a local run: a live line on a terminal, structured logs
//! otherwise.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use crate::checkpoint::metadata::now_unix_ms;
use crate::control::JobStatus;

pub struct Progress {
    tty: bool,
    last_log: Instant,
    last: Option<(Instant, u64)>,
    rate: f64,
    drawn: bool,
}

impl Progress {
    pub fn new() -> Self {
        Progress { tty: std::io::stderr().is_terminal(), last_log: Instant::now(), last: None, rate: 0.0, drawn: false }
    }

    pub fn is_tty(&self) -> bool {
        self.tty
    }

    pub fn update(&mut self, st: &JobStatus, restarts: u32) {
        let now = Instant::now();
        if let Some((t, n)) = self.last {
            let dt = now.duration_since(t).as_secs_f64();
            if dt > 0.2 {
                self.rate = st.records_in.saturating_sub(n) as f64 / dt;
                self.last = Some((now, st.records_in));
            }
        } else {
            self.last = Some((now, st.records_in));
        }
        let checkpoint = match &st.latest_checkpoint {
            Some(c) => format!("checkpoint {} ({:.1}s ago)", c.id, now_unix_ms().saturating_sub(c.completed_unix_ms) as f64 / 1000.0),
            None => "no checkpoint yet".into(),
        };
        if self.tty {
            let line = format!(
                "{} {}: {:>10.0} records/s  in {:>11}  out {:>11}  {}  restarts {}",
                st.job, st.phase, self.rate, st.records_in, st.records_out, checkpoint, restarts
            );
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[2K{line}");
            let _ = err.flush();
            self.drawn = true;
        } else if self.last_log.elapsed() >= Duration::from_secs(5) {
            self.last_log = now;
            tracing::info!(
                job = %st.job, phase = %st.phase, records_per_s = self.rate as u64, records_in = st.records_in,
                records_out = st.records_out, last_checkpoint = st.latest_checkpoint.as_ref().map(|c| c.id), restarts,
                "progress"
            );
        }
    }

    /// Ends the live line so that the next message starts on its own line.
    pub fn finish_line(&mut self) {
        if self.drawn {
            eprintln!();
            self.drawn = false;
        }
    }
}
