//! What `/proc` says about a running `thaw serve`, for the tools that watch one from outside
//! (the soak bench and test, the cache bench): memory, open descriptors and live workers.

/// A `/proc/PID/status` field in KiB (`VmRSS:`, `VmHWM:`); `None` when the process or the
/// field is gone.
pub fn status_kib(pid: u32, field: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// Resident memory in MiB (NaN when it cannot be read).
pub fn rss_mib(pid: u32) -> f64 {
    status_kib(pid, "VmRSS:").map_or(f64::NAN, |kb| kb as f64 / 1024.0)
}

/// Open file descriptors of `pid`, and how many of them are memfd segments.
pub fn fds(pid: u32) -> (usize, usize) {
    let fds: Vec<_> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.flatten().collect())
        .unwrap_or_default();
    let memfds = fds
        .iter()
        .filter(|e| {
            std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().contains("memfd:"))
        })
        .count();
    (fds.len(), memfds)
}

/// Live children of `pid` (the CPU LoRA workers): not zombies, since a killed worker stays in
/// /proc until the server reaps it.
pub fn live_children(pid: u32) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let parent = pid.to_string();
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| {
                let mut f = s.rsplit(')').next().unwrap_or("").split_whitespace();
                let (state, ppid) = (f.next(), f.next());
                state != Some("Z") && ppid == Some(parent.as_str())
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_reads_itself() {
        let me = std::process::id();
        assert!(rss_mib(me) > 0.0);
        assert!(status_kib(me, "VmHWM:").unwrap() >= status_kib(me, "VmRSS:").unwrap() / 2);
        let memfd = nix::sys::memfd::memfd_create(
            c"thaw-procfs-test",
            nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC,
        )
        .unwrap();
        let (n, m) = fds(me);
        assert!(n >= 1 && m >= 1, "{n} fds, {m} memfds");
        drop(memfd);
        assert_eq!(fds(me).1, m - 1);
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        assert!(live_children(me).contains(&(child.id() as i32)));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!live_children(me).contains(&(child.id() as i32)));
    }
}
