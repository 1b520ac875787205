//! Warnings about refused connections, at a bounded rate. A stranger, or a job started with
//! the wrong secret, that retries in a loop must not flood the log (one line per attempt
//! came to 11,986 lines in 15 s): the first refusal is logged at once, later ones at most
//! once per [`INTERVAL`], with the count of those left out.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// At most one refusal line per this long, per process.
pub const INTERVAL: Duration = Duration::from_secs(10);

/// When the last line was logged, and how many refusals have not been since.
static STATE: Mutex<(Option<Instant>, u64)> = Mutex::new((None, 0));

/// Logs the refusal `what` describes (built only when it is logged) unless one was logged
/// within the last [`INTERVAL`]; then it is counted, and the next line says how many were
/// left out.
pub fn warn(what: impl FnOnce() -> String) {
    if let Some(left_out) = due(&STATE, Instant::now()) {
        match left_out {
            0 => log::warn!("{}", what()),
            n => log::warn!("{} ({n} more refused connections since the last such line, not logged)", what()),
        }
    }
}

/// Whether a refusal at `now` is logged: Some(how many were left out before it), or None.
fn due(state: &Mutex<(Option<Instant>, u64)>, now: Instant) -> Option<u64> {
    let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
    match s.0 {
        Some(last) if now.saturating_duration_since(last) < INTERVAL => {
            s.1 += 1;
            None
        }
        _ => {
            s.0 = Some(now);
            Some(std::mem::take(&mut s.1))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_with_the_count_left_out() {
        let state = Mutex::new((None, 0));
        let t0 = Instant::now();
        assert_eq!(due(&state, t0), Some(0));
        for i in 1..1000u32 {
            assert_eq!(due(&state, t0 + Duration::from_millis(u64::from(i))), None);
        }
        assert_eq!(due(&state, t0 + INTERVAL), Some(999));
        assert_eq!(due(&state, t0 + INTERVAL + Duration::from_secs(1)), None);
        assert_eq!(due(&state, t0 + INTERVAL * 3), Some(1));
    }
}
