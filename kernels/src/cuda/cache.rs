//! NVRTC compilation on first use, one module per (device ordinal, arch, source); the CUBINs
//! are kept on disk for the next process ([`cubin_store`]).
//!
//! Sources compile to a CUBIN for the device's real architecture (`sm_XX`), not PTX: a CUBIN
//! loads without the driver's JIT, so an NVRTC newer than the driver (a pip wheel, say) still
//! produces loadable code within the same CUDA major version.
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, DriverError};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys, Ptx};

use super::cubin_store;
use super::registry::{nvrtc_options, source_of, GpuArch, KernelSource, Target};

/// Why a kernel could not be made ready to launch.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    #[error(
        "libnvrtc was not found; install the CUDA toolkit's NVRTC (or `pip install \
         nvidia-cuda-nvrtc` and add its lib directory to LD_LIBRARY_PATH)"
    )]
    NvrtcMissing,
    #[error("no registered kernel source defines `{0}`; see kernels/src/cuda/registry.rs")]
    UnknownEntry(String),
    #[error("NVRTC failed to compile {source_name}.cu for sm_{arch}:\n{log}")]
    Compile {
        source_name: &'static str,
        arch: u32,
        log: String,
    },
    #[error("NVRTC error in {0}: {1:?}")]
    Nvrtc(&'static str, nvrtc::NvrtcError),
    #[error("CUDA driver error while loading kernels: {0}")]
    Driver(#[from] DriverError),
}

type Key = (usize, GpuArch, &'static str);

/// Compiled modules, shared by every backend in the process.
#[derive(Default)]
pub struct KernelCache {
    modules: Mutex<HashMap<Key, Arc<CudaModule>>>,
}

impl std::fmt::Debug for KernelCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.modules.lock().map(|m| m.len()).unwrap_or(0);
        f.debug_struct("KernelCache").field("modules", &n).finish()
    }
}

impl KernelCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// The process-wide cache.
    pub fn global() -> &'static KernelCache {
        static CACHE: std::sync::OnceLock<KernelCache> = std::sync::OnceLock::new();
        CACHE.get_or_init(KernelCache::new)
    }

    /// The arch of `ctx`'s device.
    pub fn arch(ctx: &CudaContext) -> Result<GpuArch, CompileError> {
        let (major, minor) = ctx.compute_capability()?;
        Ok(GpuArch {
            major: major as u32,
            minor: minor as u32,
        })
    }

    /// The kernel `entry` (e.g. `rms_norm_bf16`) for `ctx`'s device, compiling its source the
    /// first time any of its kernels is asked for on that device.
    pub fn function(
        &self,
        ctx: &Arc<CudaContext>,
        entry: &str,
    ) -> Result<CudaFunction, CompileError> {
        let src = source_of(entry).ok_or_else(|| CompileError::UnknownEntry(entry.into()))?;
        let arch = Self::arch(ctx)?;
        let key = (ctx.ordinal(), arch, src.name);
        // A poisoned lock only means another thread panicked mid-insert; the map is still valid.
        let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        let module = match modules.get(&key) {
            Some(m) => m.clone(),
            None => {
                let m = load_or_compile(ctx, src, arch)?;
                modules.insert(key, m.clone());
                m
            }
        };
        Ok(module.load_function(entry)?)
    }
}

/// `src`'s module on `ctx`'s device: its CUBIN from the on-disk store ([`cubin_store`]) when
/// a whole entry for this very source, options and arch is there and the driver loads it,
/// else compiled with NVRTC (and stored for the next process; a store that cannot be written
/// only costs the next process a compile).
fn load_or_compile(
    ctx: &Arc<CudaContext>,
    src: &KernelSource,
    arch: GpuArch,
) -> Result<Arc<CudaModule>, CompileError> {
    let dir = cubin_store::store_dir(|k| std::env::var(k).ok());
    let sm = arch.number();
    let key = dir.as_ref().map(|_| {
        cubin_store::key_text(&src.full_source(), &nvrtc_options(arch, Target::Cubin), sm)
    });
    if let (Some(d), Some(k)) = (&dir, &key) {
        if let Some(cubin) = cubin_store::load(d, src.name, sm, k) {
            match ctx.load_module(Ptx::from_binary(cubin)) {
                Ok(m) => return Ok(m),
                // Written by an NVRTC newer than this driver, say: compile it afresh.
                Err(_) => cubin_store::forget(d, src.name, sm, k),
            }
        }
    }
    let cubin = compile_cubin(src, arch)?;
    if let (Some(d), Some(k)) = (&dir, &key) {
        if let Err(e) = cubin_store::store(d, src.name, sm, k, &cubin) {
            warn_store_unwritable(d, &e);
        }
    }
    Ok(ctx.load_module(Ptx::from_binary(cubin))?)
}

/// The store could not be written: said once on stderr (thaw-kernels logs nothing else), the
/// compile goes on.
fn warn_store_unwritable(dir: &std::path::Path, e: &std::io::Error) {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        eprintln!(
            "thaw-kernels: cannot store compiled kernels in {} ({e}); each process compiles \
             them again (set {} to a writable directory, or to off)",
            dir.display(),
            cubin_store::CACHE_DIR_ENV
        )
    });
}

/// Compiles `src` (with the prelude) to a CUBIN for `arch` with the registry's options.
pub fn compile_cubin(src: &KernelSource, arch: GpuArch) -> Result<Vec<u8>, CompileError> {
    // SAFETY: only probes for the library (dlopen); no NVRTC function is called.
    if !unsafe { nvrtc_sys::is_culib_present() } {
        return Err(CompileError::NvrtcMissing);
    }
    let code = CString::new(src.full_source()).expect("kernel sources contain no NUL byte");
    let name = CString::new(format!("{}.cu", src.name)).expect("kernel names contain no NUL");
    let prog = nvrtc::create_program(&code, Some(&name))
        .map_err(|e| CompileError::Nvrtc("nvrtcCreateProgram", e))?;
    let out = compile_and_read(prog, src, arch);
    // SAFETY: `prog` came from create_program above and is destroyed exactly once, after its
    // last use in `compile_and_read`; `code` and `name` outlive it.
    let destroyed = unsafe { nvrtc::destroy_program(prog) };
    let cubin = out?;
    destroyed.map_err(|e| CompileError::Nvrtc("nvrtcDestroyProgram", e))?;
    Ok(cubin)
}

fn compile_and_read(
    prog: nvrtc_sys::nvrtcProgram,
    src: &KernelSource,
    arch: GpuArch,
) -> Result<Vec<u8>, CompileError> {
    let opts = nvrtc_options(arch, Target::Cubin);
    // SAFETY: `prog` is a live program from create_program (the caller destroys it after).
    if unsafe { nvrtc::compile_program(prog, &opts) }.is_err() {
        // SAFETY: as above; the log exists after a compile attempt.
        let log = unsafe { nvrtc::get_program_log(prog) }
            .map(|l| {
                let bytes: Vec<u8> = l.iter().map(|&c| c as u8).collect();
                CStr::from_bytes_until_nul(&bytes)
                    .map(|c| c.to_string_lossy().into_owned())
                    .unwrap_or_default()
            })
            .unwrap_or_default();
        return Err(CompileError::Compile {
            source_name: src.name,
            arch: arch.number(),
            log,
        });
    }
    let mut size = 0usize;
    // SAFETY: `prog` compiled successfully for a real arch, so it has a CUBIN; `size` is valid
    // for one write.
    unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size) }
        .result()
        .map_err(|e| CompileError::Nvrtc("nvrtcGetCUBINSize", e))?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` holds exactly the `size` bytes NVRTC reported.
    unsafe { nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()) }
        .result()
        .map_err(|e| CompileError::Nvrtc("nvrtcGetCUBIN", e))?;
    Ok(cubin)
}
