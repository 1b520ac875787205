//! What the host allows: page size, memory, the locked-memory limit.

/// RAM plus swap of this host in bytes (0 if unknown).
pub fn host_memory() -> u64 {
    // SAFETY: a zeroed sysinfo is valid, and sysinfo writes only into it.
    let mut info: libc::sysinfo = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is a valid sysinfo, exclusively borrowed for the call.
    if unsafe { libc::sysinfo(&mut info) } != 0 {
        return 0;
    }
    (info.totalram as u64).saturating_add(info.totalswap as u64).saturating_mul(u64::from(info.mem_unit))
}

/// The system page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// The size of this host's largest CPU cache (the last level, which the cores share), as
/// sysfs gives it; 32 MiB where it does not.
pub fn last_level_cache() -> usize {
    static SIZE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *SIZE.get_or_init(|| {
        (0..8)
            .filter_map(|i| std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu0/cache/index{i}/size")).ok())
            .filter_map(|s| cache_bytes(s.trim()))
            .max()
            .unwrap_or(32 << 20)
    })
}

/// A cache size as sysfs writes it ("32768K", "2M", "512").
fn cache_bytes(s: &str) -> Option<usize> {
    let (digits, unit) = match s.as_bytes().last()? {
        b'K' => (&s[..s.len() - 1], 1 << 10),
        b'M' => (&s[..s.len() - 1], 1 << 20),
        _ => (s, 1),
    };
    digits.parse::<usize>().ok().and_then(|v| v.checked_mul(unit))
}

/// `RLIMIT_MEMLOCK` (soft, hard): how much memory this process may pin, which RDMA
/// registration needs.
fn memlock() -> Option<(libc::rlim_t, libc::rlim_t)> {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: r is a valid rlimit out-parameter.
    (unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } == 0).then_some((r.rlim_cur, r.rlim_max))
}

/// `RLIMIT_MEMLOCK` as "soft X, hard Y".
pub fn memlock_text() -> String {
    let f = |v: libc::rlim_t| if v == libc::RLIM_INFINITY { "unlimited".to_string() } else { format!("{} KiB", v / 1024) };
    memlock().map_or_else(|| "unknown".into(), |(soft, hard)| format!("soft {}, hard {}", f(soft), f(hard)))
}

/// True when the soft `RLIMIT_MEMLOCK` is below `bytes`.
pub fn memlock_below(bytes: u64) -> bool {
    memlock().is_some_and(|(soft, _)| soft != libc::RLIM_INFINITY && soft < bytes)
}

#[cfg(test)]
mod tests {
    use super::cache_bytes;

    #[test]
    fn cache_sizes_read_as_sysfs_writes_them() {
        assert_eq!(cache_bytes("32768K"), Some(32 << 20));
        assert_eq!(cache_bytes("2M"), Some(2 << 20));
        assert_eq!(cache_bytes("512"), Some(512));
        assert_eq!(cache_bytes(""), None);
        assert_eq!(cache_bytes("K"), None);
        assert_eq!(cache_bytes("lots"), None);
    }
}
