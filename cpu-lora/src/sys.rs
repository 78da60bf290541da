//! The crate's only `unsafe` outside the kernel: a `pre_exec` hook that ties a spawned
//! worker's life to the engine's.

use std::os::unix::process::CommandExt;
use std::process::Command;

/// Makes the child spawned by `cmd` receive SIGKILL when the thread that spawns it exits
/// (`PR_SET_PDEATHSIG`; for the engine, whose pool lives on a long-lived thread, that is
/// when the server dies, even by SIGKILL). If the parent is already gone by the time the
/// hook runs, the spawn fails instead of leaving an orphan.
pub(crate) fn die_with_parent(cmd: &mut Command) {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the hook runs in the forked child before exec, where only async-signal-safe
    // calls are allowed: prctl(2) and getppid(2) on plain integers, and building an
    // io::Error from a raw errno (no allocation, no lock). It captures only a pid_t.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}
