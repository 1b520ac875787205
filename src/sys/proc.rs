//! What /proc says about other processes.

/// Whether a process has exited (gone from /proc or a zombie not yet reaped): the reason,
/// if so.
pub fn process_gone(pid: u32) -> Option<String> {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => Some(format!("process {pid} exited")),
        Ok(s) => {
            let state = s.rsplit(')').next().and_then(|rest| rest.split_whitespace().next()).unwrap_or("");
            matches!(state, "Z" | "X").then(|| format!("process {pid} exited"))
        }
    }
}
