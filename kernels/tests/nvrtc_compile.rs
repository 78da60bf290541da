//! CI check with no GPU: every kernel in the registry compiles with NVRTC for sm_80 (A100) and
//! sm_90 (H100/H200), both to PTX (`compute_XX`, where every listed entry point must appear as
//! `.entry`) and to a CUBIN (`sm_XX`, which also runs ptxas: register and shared-memory limits).
//!
//! libnvrtc is found through `THAW_NVRTC_LIB` (a path to `libnvrtc.so*`), else in the pip wheel
//! `nvidia-cuda-nvrtc` under `target/nvrtc-venv` or `.venv-nvrtc`, else by the loader's search
//! path. With `CI=true` a missing libnvrtc fails; otherwise the test says it skipped and why.
//! It is dlopened here with `libloading` (no cudarc, no CUDA feature), so plain `cargo test`
//! runs it.
use std::ffi::{c_char, c_int, CStr, CString};
use std::path::{Path, PathBuf};

use thaw_kernels::cuda::registry::{nvrtc_options, GpuArch, Target, KERNELS};

type Prog = *mut std::ffi::c_void;
type CreateFn = unsafe extern "C" fn(
    *mut Prog,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type CompileFn = unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> c_int;
type SizeFn = unsafe extern "C" fn(Prog, *mut usize) -> c_int;
type GetFn = unsafe extern "C" fn(Prog, *mut c_char) -> c_int;
type DestroyFn = unsafe extern "C" fn(*mut Prog) -> c_int;
type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;

/// The NVRTC entry points this test uses, resolved once.
struct Nvrtc {
    create: CreateFn,
    compile: CompileFn,
    log_size: SizeFn,
    log: GetFn,
    ptx_size: SizeFn,
    ptx: GetFn,
    cubin_size: SizeFn,
    cubin: GetFn,
    destroy: DestroyFn,
    version: VersionFn,
    _lib: libloading::Library,
    _builtins: Vec<libloading::Library>,
}

impl Nvrtc {
    fn open(path: &Path) -> Result<Self, String> {
        // libnvrtc dlopens `libnvrtc-builtins.so.<ver>` by name at compile time. A pip wheel is
        // not on the loader path, so load the builtins next to it first: the dynamic linker then
        // reuses the already loaded object by its soname.
        let mut builtins = Vec::new();
        if let Some(Ok(files)) = path.parent().map(std::fs::read_dir) {
            for f in files.flatten() {
                let name = f.file_name().to_string_lossy().into_owned();
                if name.starts_with("libnvrtc-builtins.so") {
                    // SAFETY: the builtins library has no initialiser preconditions.
                    if let Ok(l) = unsafe { libloading::Library::new(f.path()) } {
                        builtins.push(l);
                    }
                }
            }
        }
        // SAFETY: loading libnvrtc runs only its initialisers, which have no preconditions.
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| format!("cannot load {}: {e}", path.display()))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol is NVRTC's public C API; its signature is the type alias the
                // field is declared with (nvrtc.h, stable since CUDA 11). The fn pointer is kept
                // next to `_lib`, so it never outlives the library.
                *unsafe { lib.get($name) }
                    .map_err(|e| format!("{}: {e}", String::from_utf8_lossy($name)))?
            };
        }
        Ok(Self {
            create: sym!(b"nvrtcCreateProgram\0"),
            compile: sym!(b"nvrtcCompileProgram\0"),
            log_size: sym!(b"nvrtcGetProgramLogSize\0"),
            log: sym!(b"nvrtcGetProgramLog\0"),
            ptx_size: sym!(b"nvrtcGetPTXSize\0"),
            ptx: sym!(b"nvrtcGetPTX\0"),
            cubin_size: sym!(b"nvrtcGetCUBINSize\0"),
            cubin: sym!(b"nvrtcGetCUBIN\0"),
            destroy: sym!(b"nvrtcDestroyProgram\0"),
            version: sym!(b"nvrtcVersion\0"),
            _lib: lib,
            _builtins: builtins,
        })
    }

    fn version(&self) -> (i32, i32) {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: both pointers are valid for one c_int write.
        unsafe { (self.version)(&mut major, &mut minor) };
        (major, minor)
    }

    /// Compiles `src`; Ok(output bytes) or Err(log).
    fn compile(
        &self,
        name: &str,
        src: &str,
        opts: &[String],
        target: Target,
    ) -> Result<Vec<u8>, String> {
        let src = CString::new(src).expect("kernel source has a NUL byte");
        let name = CString::new(format!("{name}.cu")).expect("kernel name has a NUL byte");
        let opts: Vec<CString> = opts
            .iter()
            .map(|o| CString::new(o.as_str()).unwrap())
            .collect();
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Prog = std::ptr::null_mut();
        // SAFETY: `src` and `name` are NUL-terminated and outlive the call; zero headers, so the
        // header arrays may be null.
        let rc = unsafe {
            (self.create)(
                &mut prog,
                src.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        if rc != 0 {
            return Err(format!("nvrtcCreateProgram failed with {rc}"));
        }
        // SAFETY: `prog` was created above and is destroyed once at the end of this function;
        // `opt_ptrs` holds `opts.len()` pointers to NUL-terminated strings alive until then.
        let rc = unsafe { (self.compile)(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
        let out = if rc != 0 {
            Err(self.read(prog, self.log_size, self.log))
        } else {
            let (size, get) = match target {
                Target::Ptx => (self.ptx_size, self.ptx),
                Target::Cubin => (self.cubin_size, self.cubin),
            };
            Ok(self.read(prog, size, get).into_bytes())
        };
        // SAFETY: `prog` is a live program, destroyed exactly once.
        unsafe { (self.destroy)(&mut prog) };
        out
    }

    /// Reads one of the program's outputs (log, PTX, CUBIN) through its size/get pair.
    fn read(&self, prog: Prog, size: SizeFn, get: GetFn) -> String {
        let mut n = 0usize;
        // SAFETY: `prog` is live; `n` is valid for one write.
        unsafe { size(prog, &mut n) };
        let mut buf = vec![0u8; n.max(1)];
        // SAFETY: `buf` holds the `n` bytes NVRTC said it writes.
        unsafe { get(prog, buf.as_mut_ptr().cast()) };
        match CStr::from_bytes_until_nul(&buf) {
            // PTX and logs are text; a CUBIN is binary: keep every byte for it.
            Ok(c) if c.to_bytes().len() + 1 == buf.len() => c.to_string_lossy().into_owned(),
            _ => String::from_utf8_lossy(&buf).into_owned(),
        }
    }
}

fn find_libnvrtc() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    if let Some(p) = std::env::var_os("THAW_NVRTC_LIB") {
        // cargo runs tests in the crate directory; a relative path is meant from the root.
        let p = PathBuf::from(p);
        return Some(if p.is_relative() { root.join(p) } else { p });
    }
    for venv in ["target/nvrtc-venv", ".venv-nvrtc", ".venv"] {
        let lib = root.join(venv).join("lib");
        let Ok(pys) = std::fs::read_dir(&lib) else {
            continue;
        };
        for py in pys.flatten() {
            let nvidia = py.path().join("site-packages/nvidia");
            for sub in ["cu13/lib", "cuda_nvrtc/lib"] {
                let Ok(files) = std::fs::read_dir(nvidia.join(sub)) else {
                    continue;
                };
                for f in files.flatten() {
                    let name = f.file_name().to_string_lossy().into_owned();
                    if name.starts_with("libnvrtc.so") {
                        return Some(f.path());
                    }
                }
            }
        }
    }
    for p in [
        "/usr/local/cuda/lib64/libnvrtc.so",
        "libnvrtc.so.13",
        "libnvrtc.so.12",
        "libnvrtc.so",
    ] {
        // SAFETY: as in `Nvrtc::open`.
        if unsafe { libloading::Library::new(p) }.is_ok() {
            return Some(PathBuf::from(p));
        }
    }
    None
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90() {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    let Some(path) = find_libnvrtc() else {
        assert!(
            !ci,
            "libnvrtc not found and CI=true: set THAW_NVRTC_LIB or pip install nvidia-cuda-nvrtc"
        );
        println!(
            "skipped: libnvrtc not found (set THAW_NVRTC_LIB or pip install nvidia-cuda-nvrtc)"
        );
        return;
    };
    let nvrtc = match Nvrtc::open(&path) {
        Ok(n) => n,
        Err(e) if !ci => {
            println!("skipped: {e} (set THAW_NVRTC_LIB to a working libnvrtc.so)");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let (major, minor) = nvrtc.version();
    println!("NVRTC {major}.{minor} from {}", path.display());
    println!(
        "{:<12} {:<6} {:>10} {:>10}  entry points",
        "source", "arch", "ptx B", "cubin B"
    );
    let mut failures = Vec::new();
    for k in KERNELS {
        let src = k.full_source();
        for arch in [GpuArch::SM80, GpuArch::SM90] {
            let ptx = nvrtc.compile(k.name, &src, &nvrtc_options(arch, Target::Ptx), Target::Ptx);
            let cubin = nvrtc.compile(
                k.name,
                &src,
                &nvrtc_options(arch, Target::Cubin),
                Target::Cubin,
            );
            match (&ptx, &cubin) {
                (Ok(ptx), Ok(cubin)) => {
                    let ptx = String::from_utf8_lossy(ptx);
                    let missing: Vec<_> = k
                        .entry_points
                        .iter()
                        .filter(|e| !ptx.contains(&format!(".entry {e}(")))
                        .collect();
                    if !missing.is_empty() {
                        failures.push(format!(
                            "{} sm_{}: entry points missing: {missing:?}",
                            k.name,
                            arch.number()
                        ));
                    }
                    println!(
                        "{:<12} sm_{:<3} {:>10} {:>10}  {} ok",
                        k.name,
                        arch.number(),
                        ptx.len(),
                        cubin.len(),
                        k.entry_points.len() - missing.len()
                    );
                }
                (Err(log), _) | (_, Err(log)) => {
                    println!("{:<12} sm_{:<3} FAILED", k.name, arch.number());
                    failures.push(format!("{} sm_{}:\n{log}", k.name, arch.number()));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "NVRTC failures:\n{}",
        failures.join("\n")
    );
}
