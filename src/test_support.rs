//! Helpers for the library's own tests.

use std::sync::atomic::{AtomicUsize, Ordering};

static PANICS: AtomicUsize = AtomicUsize::new(0);

/// Panics so far on any thread of this process (a server's connection thread too, where a
/// panic would not fail the test by itself); counting starts at the first call.
pub fn panics_so_far() -> usize {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            default(info);
        }));
    });
    PANICS.load(Ordering::SeqCst)
}
