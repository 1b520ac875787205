//! Which stores the staged form writes with: plain or streaming, chosen by timing.

use crate::config::StagedStores;
use crate::dtype::DType;
use std::time::Duration;

/// Picks the stores of the staged form per call (unless `GRADWIRE_SHM_STORES` forces a
/// kind), by size class (a power of two) and dtype (a bf16 reduction costs more per byte
/// than an f32 one), from the time per byte of past calls, each kind's cost being the least
/// of its last three (the noise of a shared machine only ever adds time). A class's first
/// call only warms up (page faults, cold caches); then each kind is timed twice, in turns of
/// two calls, and the faster one is kept. Only the second call of a turn is timed: the first
/// after a change of kind pays for the change (cache lines the other kind left where this
/// one does not want them), which steady use of a kind never does (a first call after a
/// change took about three times as long as one in a row). The other is tried again (two calls)
/// after 32 calls, then twice as seldom each time it loses again, at most every 1024 calls: a host whose cache
/// hand-off slows down shows in the kind in use within three calls, one that recovers
/// within the probe interval, and trying the slower kind costs little once the interval has
/// grown (a probe of plain stores in a slow minute, two calls, costs about ten). The kind in use
/// changes only when the other is at least 10 % faster, so that noise does not flip it back
/// and forth. Every rank makes the same calls, so the first tries coincide; ranks that
/// later disagree lose speed, never correctness. Measured (2 ranks, 1-256 MiB, alternating
/// runs): in a good minute within 1-4 % of plain stores, 1.7x streaming ones; in a slow
/// minute, 3.5-4.5x plain.
///
/// The same chooser picks, for the collectives other than the allreduce, between staging
/// private buffers and reading them through cross-memory attach ([`StoreChooser::forms`]):
/// which is faster depends on the host (the kernel's page pinning against a second copy).
/// There rank 0's chooser decides for every rank (`pulled_or_staged` says why).
#[derive(Default)]
pub struct StoreChooser {
    setting: StagedStores,
    /// What the two choices are, for the log: [false, true].
    kinds: [&'static str; 2],
    classes: Vec<StoreClass>,
}

#[derive(Clone, Copy, Default)]
struct StoreClass {
    /// Nanoseconds per byte of the latest calls, [plain, streaming].
    recent: [Recent; 2],
    /// The kind in use, once both are timed: true for streaming.
    streaming: Option<bool>,
    /// The kind of the last call (none before the class's first, which only warms up, and
    /// after a call that ran another form): a call of the other kind is not timed.
    last: Option<bool>,
    calls_since_probe: u32,
    probe_every: u32,
}

/// The last (up to) three figures of one kind, newest at `next - 1`.
#[derive(Clone, Copy, Default)]
struct Recent {
    figures: [f64; 3],
    len: usize,
    next: usize,
}

impl Recent {
    fn push(&mut self, x: f64) {
        self.figures[self.next] = x;
        self.next = (self.next + 1) % self.figures.len();
        self.len = (self.len + 1).min(self.figures.len());
    }

    fn least(&self) -> f64 {
        self.figures[..self.len].iter().copied().fold(f64::INFINITY, f64::min)
    }
}

/// Calls between probes of the other kind: at first, and after a change (see [`StoreChooser`]).
const PROBE_MIN: u32 = 32;
/// Calls between probes of the other kind: at most.
const PROBE_MAX: u32 = 1024;
/// The other kind must cost at most this fraction of the kind in use to replace it.
const SWITCH_GAIN: f64 = 0.9;

impl StoreChooser {
    pub fn new(setting: StagedStores) -> Self {
        StoreChooser { setting, kinds: ["plain stores", "streaming stores"], classes: Vec::new() }
    }

    /// Between staging (false) and cross-memory attach (true) for private buffers, timed as
    /// the stores are; staging only unless `attach` (`GRADWIRE_SHM_CMA`).
    pub(super) fn forms(attach: bool) -> Self {
        let setting = if attach { StagedStores::Auto } else { StagedStores::Plain };
        StoreChooser { setting, kinds: ["staging", "cross-memory attach"], classes: Vec::new() }
    }

    fn class(&mut self, len: usize, dtype: DType) -> &mut StoreClass {
        let c = (usize::BITS - len.leading_zeros()) as usize * DType::ALL.len() + dtype as usize;
        if self.classes.len() <= c {
            self.classes.resize(c + 1, StoreClass { probe_every: PROBE_MIN, ..Default::default() });
        }
        &mut self.classes[c]
    }

    /// Whether the staged allreduce of `len` bytes uses streaming stores.
    pub fn choose(&mut self, len: usize, dtype: DType) -> bool {
        match self.setting {
            StagedStores::Plain => false,
            StagedStores::Streaming => true,
            StagedStores::Auto => {
                let c = self.class(len, dtype);
                match c.streaming {
                    None => c.recent[1].len < c.recent[0].len,
                    Some(in_use) => in_use != (c.calls_since_probe + 1 >= c.probe_every),
                }
            }
        }
    }

    /// Notes that a call of `len` bytes ran neither kind (the collective attached instead of
    /// staging): the next call of this class is not timed, as after a change of kind, since
    /// it too finds the cache as another form left it.
    pub(super) fn ran_another_form(&mut self, len: usize, dtype: DType) {
        self.class(len, dtype).last = None;
    }

    /// Records the time of a call of `len` bytes; returns the new choice, explained, when
    /// it changed.
    pub fn record(&mut self, len: usize, dtype: DType, streaming: bool, took: Duration) -> Option<String> {
        let [off, on] = self.kinds;
        let c = self.class(len, dtype);
        let changed = c.last.replace(streaming) != Some(streaming);
        if changed {
            return None;
        }
        let per_byte = took.as_nanos() as f64 / len.max(1) as f64;
        let probe = c.streaming.is_some_and(|s| s != streaming);
        // A probe is the only recent figure for the other kind: it replaces the old ones.
        let kind = &mut c.recent[streaming as usize];
        if probe {
            *kind = Recent::default();
        }
        kind.push(per_byte);
        if c.streaming.is_none() && c.recent.iter().any(|r| r.len < 2) {
            return None;
        }
        let (plain, stream) = (c.recent[0].least(), c.recent[1].least());
        let before = c.streaming;
        let after = match before {
            None => stream < plain,
            Some(true) => plain >= SWITCH_GAIN * stream,
            Some(false) => stream < SWITCH_GAIN * plain,
        };
        c.streaming = Some(after);
        if before == Some(after) {
            if probe {
                c.calls_since_probe = 0;
                c.probe_every = (c.probe_every * 2).min(PROBE_MAX);
            } else {
                c.calls_since_probe += 1;
            }
            return None;
        }
        // A first choice, or the host changed: look at the other kind again soon.
        c.calls_since_probe = 0;
        c.probe_every = PROBE_MIN;
        let kind = if after { on } else { off };
        Some(format!("{len} bytes of {} now uses {kind} ({off} {plain:.3} ns/B, {on} {stream:.3} ns/B)", dtype.name()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `calls` calls of `len` bytes on a host where a byte costs `plain` or
    /// `streaming` ns; returns the kinds used, true for streaming.
    fn run(ch: &mut StoreChooser, len: usize, calls: usize, plain: f64, streaming: f64) -> Vec<bool> {
        (0..calls)
            .map(|_| {
                let s = ch.choose(len, DType::F32);
                ch.record(len, DType::F32, s, Duration::from_nanos((len as f64 * if s { streaming } else { plain }) as u64));
                s
            })
            .collect()
    }

    #[test]
    fn tries_both_then_keeps_the_faster_and_probes_ever_more_seldom() {
        let mut ch = StoreChooser::default();
        let used = run(&mut ch, 1 << 20, 4000, 0.1, 0.2);
        // The first call warms up (plain, not timed), then each kind is timed twice, in turns
        // of two calls (the first of a turn untimed).
        assert_eq!(&used[..8], &[false, false, true, true, false, false, true, true]);
        // Probes are turns of two calls too.
        let probes: Vec<usize> = used.iter().enumerate().skip(8).filter(|&(i, &s)| s && !used[i - 1]).map(|(i, _)| i).collect();
        assert!(probes.iter().all(|&i| used[i + 1] && !used[i + 2]), "{probes:?}");
        let gaps: Vec<usize> = probes.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.windows(2).all(|g| g[1] >= g[0]) && gaps.iter().all(|&g| g <= PROBE_MAX as usize + 3), "{probes:?}");
        assert!(probes.len() >= 4 && probes.len() <= 12, "{probes:?}");
    }

    #[test]
    fn follows_the_host_when_it_changes_and_classes_are_separate() {
        let mut ch = StoreChooser::default();
        run(&mut ch, 1 << 20, 100, 0.1, 0.2);
        // Cross-core fetches slow down 5x: once the fast figures have left plain's last
        // three, streaming takes over, and plain is tried again only after PROBE_MIN calls,
        // then ever more seldom.
        let used = run(&mut ch, 1 << 20, 3 * PROBE_MIN as usize, 0.5, 0.2);
        let plain: Vec<usize> = used.iter().enumerate().skip(4).filter(|&(i, &s)| !s && used[i - 1]).map(|(i, _)| i).collect();
        assert!(plain.len() <= 2 && plain.windows(2).all(|w| w[1] - w[0] >= PROBE_MIN as usize), "{used:?}");
        // They recover: the next probe of plain (the interval has grown to twice
        // PROBE_MIN) finds it, and plain is kept again.
        let used = run(&mut ch, 1 << 20, 3 * PROBE_MIN as usize, 0.1, 0.2);
        let back = used.iter().position(|&s| !s).expect("plain never tried again");
        assert!(back <= 2 * PROBE_MIN as usize && used[back..].iter().filter(|&&s| s).count() <= 3, "{used:?}");
        // Another size class starts from scratch, and so does another dtype.
        assert_eq!(run(&mut ch, 16 << 20, 8, 0.5, 0.2), [false, false, true, true, false, false, true, true]);
        assert!(!ch.choose(1 << 20, DType::BF16));
    }

    #[test]
    fn noise_does_not_flip_the_choice() {
        let mut ch = StoreChooser::default();
        let mut used = vec![];
        for i in 0..400 {
            // Within 5 % of each other, the lead changing with every call.
            let (p, s) = if i % 2 == 0 { (0.100, 0.104) } else { (0.104, 0.100) };
            used.extend(run(&mut ch, 4 << 20, 1, p, s));
        }
        // After the first tries, one kind stays in use: the other appears only in probes of
        // two calls, ever more seldom.
        let after = &used[8..];
        let in_use = after[0];
        let probes = after.iter().filter(|&&s| s != in_use).count();
        assert!(probes <= 16 && after.windows(3).all(|w| w[0] == in_use || w[2] == in_use), "{probes} probes: {used:?}");
    }

    #[test]
    fn the_first_call_after_a_change_of_kind_is_not_timed() {
        // Streaming stores are twice as fast in a row, but the first call after plain ones
        // costs 10x (what changing forms costs on a real host): they must still win.
        let mut ch = StoreChooser::default();
        let mut last = None;
        let used: Vec<bool> = (0..40)
            .map(|_| {
                let s = ch.choose(1 << 20, DType::F32);
                let per_byte = match (s, last.replace(s)) {
                    (true, Some(false)) => 0.5,
                    (true, _) => 0.05,
                    (false, _) => 0.1,
                };
                ch.record(1 << 20, DType::F32, s, Duration::from_nanos(((1 << 20) as f64 * per_byte) as u64));
                s
            })
            .collect();
        // Streaming from the first choice on, plain only in a probe (after 32 calls).
        assert!(used[8..].iter().filter(|&&s| !s).count() <= 2 && used[8..].iter().take(PROBE_MIN as usize - 1).all(|&s| s), "{used:?}");
    }

    #[test]
    fn a_call_right_after_another_form_is_not_timed() {
        // Streaming stores are in use; then the collective mostly attaches, and each staged
        // call right after an attached one costs 20x: those calls must not flip the choice.
        let mut ch = StoreChooser::default();
        run(&mut ch, 1 << 20, 20, 0.1, 0.05);
        assert!(ch.choose(1 << 20, DType::F32));
        for _ in 0..10 {
            ch.ran_another_form(1 << 20, DType::F32);
            let s = ch.choose(1 << 20, DType::F32);
            assert!(s);
            assert_eq!(ch.record(1 << 20, DType::F32, s, Duration::from_millis(1)), None);
        }
        assert!(ch.choose(1 << 20, DType::F32));
    }

    #[test]
    fn a_forced_kind_is_always_used() {
        let (mut plain, mut streaming) = (StoreChooser::new(StagedStores::Plain), StoreChooser::new(StagedStores::Streaming));
        for _ in 0..50 {
            assert!(!plain.choose(1 << 20, DType::F32));
            assert!(streaming.choose(1 << 20, DType::BF16));
        }
    }
}
