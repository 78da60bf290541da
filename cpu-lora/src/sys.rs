//! The crate's only `unsafe` outside the kernel: a `pre_exec` hook that ties a spawned
//! worker's life to the engine's, and the read-only mapping of an adapter's file.

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

/// Maps `file` read-only and shared (the page cache's pages, no copy), `len` bytes.
///
/// The map is read-only, so this process never writes it; the hazard is another process
/// truncating the file while it is mapped, after which a load beyond the new end raises
/// SIGBUS. Callers check the file's length and identity against what the engine registered
/// before mapping and again at every step ([`crate::file_maps`]); adapter files are
/// immutable once written (PEFT writes a new file, and Thaw's docs say not to rewrite a file
/// that is being served), so the remaining window is a file rewritten in place mid-step.
pub(crate) fn map_readonly(file: &std::fs::File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: read-only shared mapping of a file we hold open; see above for the only hazard
    // (a truncation by another process), which the callers narrow to a mid-step rewrite.
    unsafe { memmap2::MmapOptions::new().map(file) }
}
