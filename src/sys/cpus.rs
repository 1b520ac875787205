//! How many CPUs the ranks of this host can use.

/// CPUs this job's ranks can use: the CPUs online, fewer when the control group the
/// process runs in (a container, a batch scheduler's job) confines it to a cpuset or caps
/// it with a CPU quota. Not `available_parallelism`, which counts only this process's
/// affinity: a launcher that pins each rank to its own core would make every rank see one
/// CPU and give up spinning exactly where spinning pays (2 pinned ranks on 2 cores: the
/// 4 KiB shm allreduce spent half its time in sched_yield). Pinning changes the affinity,
/// never the control group. Assumed: the ranks of a host share one control group (a
/// container, a job step). A scheduler that puts every rank in a cgroup of its own with one
/// CPU makes each see 1 CPU, and they stop spinning although each has its core: small
/// calls get slower, never wrong.
pub fn host_cpus() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    let online = if n > 0 { n as usize } else { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) };
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    cgroup_cpu_limit(&own, |path| std::fs::read_to_string(path).ok()).map_or(online, |limit| limit.clamp(1, online))
}

/// The CPU limit of the control groups in `own` (the text of /proc/self/cgroup): the
/// smaller of the effective cpuset's size and the CPU quota rounded up, from cgroup v1's
/// `cpuset` and `cpu` controllers or else from cgroup v2. A parent's quota caps its
/// children, so every ancestor's counts; a container that mounts its own group at the root
/// (its path in `own` missing there) is read at the root. `read` returns a file's text.
fn cgroup_cpu_limit(own: &str, read: impl Fn(&str) -> Option<String>) -> Option<usize> {
    let groups: Vec<(&str, &str)> = own
        .lines()
        .filter_map(|l| {
            let mut f = l.splitn(3, ':');
            f.next()?;
            Some((f.next()?, f.next()?))
        })
        .collect();
    // The group's directory under `top` and every ancestor up to `top`, innermost first.
    let dirs = |controller: &str, top: &str| -> Vec<String> {
        let Some(&(_, path)) = groups.iter().find(|(c, _)| if controller.is_empty() { c.is_empty() } else { c.split(',').any(|c| c == controller) }) else {
            return vec![];
        };
        let mut rel = path.trim().trim_end_matches('/').to_string();
        let mut v = vec![format!("{top}{rel}")];
        while let Some(i) = rel.rfind('/') {
            rel.truncate(i);
            v.push(format!("{top}{rel}"));
        }
        v
    };
    let cpuset = |dirs: &[String], file: &str| dirs.iter().find_map(|d| read(&format!("{d}/{file}"))).and_then(|t| cpu_list_len(&t));
    let mut limits = vec![];
    let v1_cpuset = dirs("cpuset", "/sys/fs/cgroup/cpuset");
    limits.extend(cpuset(&v1_cpuset, "cpuset.effective_cpus"));
    for d in dirs("cpu", "/sys/fs/cgroup/cpu") {
        let number = |f: &str| read(&format!("{d}/{f}")).and_then(|t| t.trim().parse::<i64>().ok());
        if let (Some(q), Some(p)) = (number("cpu.cfs_quota_us"), number("cpu.cfs_period_us")) {
            limits.extend(quota_cpus(q, p));
        }
    }
    // v2 only where no v1 controller answered: a hybrid host mounts v2 without them.
    if v1_cpuset.is_empty() && limits.is_empty() {
        let v2 = dirs("", "/sys/fs/cgroup");
        limits.extend(cpuset(&v2, "cpuset.cpus.effective"));
        for d in &v2 {
            let max = read(&format!("{d}/cpu.max")).unwrap_or_default();
            let mut f = max.split_whitespace().map(str::parse::<i64>);
            if let (Some(Ok(q)), Some(Ok(p))) = (f.next(), f.next()) {
                limits.extend(quota_cpus(q, p));
            }
        }
    }
    limits.into_iter().min()
}

/// CPUs a quota of `quota` µs per `period` µs allows, rounded up; none for "no limit"
/// (a negative quota in v1; "max" does not parse in v2).
fn quota_cpus(quota: i64, period: i64) -> Option<usize> {
    (quota > 0 && period > 0).then(|| (quota as u64).div_ceil(period as u64) as usize)
}

/// How many CPUs a kernel CPU list names ("0-3,8,10-11" is 7); none if it does not parse
/// or is empty.
fn cpu_list_len(list: &str) -> Option<usize> {
    let mut n = 0;
    for range in list.trim().split(',').filter(|r| !r.is_empty()) {
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        let (lo, hi): (usize, usize) = (lo.trim().parse().ok()?, hi.trim().parse().ok()?);
        n = hi.checked_sub(lo).and_then(|d| d.checked_add(1)).and_then(|k| k.checked_add(n))?;
    }
    (n > 0).then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn limit(own: &str, files: &[(&str, &str)]) -> Option<usize> {
        let files: HashMap<&str, &str> = files.iter().copied().collect();
        cgroup_cpu_limit(own, |p| files.get(p).map(|t| t.to_string()))
    }

    #[test]
    fn cpu_lists_and_quotas() {
        assert_eq!(cpu_list_len("0-3,8,10-11\n"), Some(7));
        assert_eq!(cpu_list_len("5"), Some(1));
        assert_eq!(cpu_list_len(""), None);
        assert_eq!(cpu_list_len("3-1"), None);
        assert_eq!(cpu_list_len("a-b"), None);
        assert_eq!(cpu_list_len("0-18446744073709551615"), None);
        assert_eq!(quota_cpus(150_000, 100_000), Some(2));
        assert_eq!(quota_cpus(-1, 100_000), None);
        assert_eq!(quota_cpus(100_000, 0), None);
    }

    #[test]
    fn cgroup_v1_cpuset_and_an_ancestors_quota() {
        let own = "9:name=systemd:/\n3:cpuset:/job\n1:cpu,cpuacct:/job/step\n0::/\n";
        let files = [
            ("/sys/fs/cgroup/cpuset/job/cpuset.effective_cpus", "0-5\n"),
            ("/sys/fs/cgroup/cpu/job/step/cpu.cfs_quota_us", "-1\n"),
            ("/sys/fs/cgroup/cpu/job/step/cpu.cfs_period_us", "100000\n"),
            ("/sys/fs/cgroup/cpu/job/cpu.cfs_quota_us", "250000\n"),
            ("/sys/fs/cgroup/cpu/job/cpu.cfs_period_us", "100000\n"),
        ];
        assert_eq!(limit(own, &files), Some(3));
        assert_eq!(limit(own, &files[..1]), Some(6));
        assert_eq!(limit(own, &[]), None);
    }

    #[test]
    fn cgroup_v1_container_that_mounts_its_group_at_the_root() {
        // The host's path is not under the container's mount: the root is its group.
        let own = "3:cpuset:/docker/abc\n";
        assert_eq!(limit(own, &[("/sys/fs/cgroup/cpuset/cpuset.effective_cpus", "2-3")]), Some(2));
    }

    #[test]
    fn cgroup_v2_cpuset_and_cpu_max() {
        let own = "0::/user.slice/job\n";
        let files = [
            ("/sys/fs/cgroup/user.slice/job/cpuset.cpus.effective", "0-7"),
            ("/sys/fs/cgroup/user.slice/job/cpu.max", "max 100000"),
            ("/sys/fs/cgroup/user.slice/cpu.max", "400000 100000"),
        ];
        assert_eq!(limit(own, &files), Some(4));
        assert_eq!(limit(own, &files[..2]), Some(8));
        assert_eq!(limit("0::/\n", &[("/sys/fs/cgroup/cpuset.cpus.effective", "0")]), Some(1));
    }
}
