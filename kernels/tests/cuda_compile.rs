//! CI check that every CUDA kernel compiles with NVRTC for Hopper (sm_90a) and Blackwell (sm_100a),
//! on a machine with no GPU and no CUDA toolkit.
//!
//! NVRTC and `cuda_bf16.h` come from the PyPI wheels `nvidia-cuda-nvrtc==13.0.*` and
//! `nvidia-cuda-runtime==13.0.*` (scripts/test.sh installs them). They are found through
//! `SPARKD_NVRTC_WHEELS` (a folder holding `nvidia/cu13/`) or python3's site-packages. Because the
//! dynamic loader reads `LD_LIBRARY_PATH` only at process start, a process that cannot load
//! libnvrtc re-runs this test in a child with the wheel's lib folder on the path. When no wheel is
//! found the test says plainly that it skipped.

use std::path::PathBuf;
use std::process::Command;

use sparkd_kernels::cuda::compile::{Compiler, SOURCES};
use sparkd_kernels::cuda::device::nvrtc_present;

const CHILD_MARK: &str = "SPARKD_NVRTC_CHILD";

/// `<root>/nvidia/cu13` of the wheels, when present.
fn wheel_root() -> Option<PathBuf> {
    let has_both = |dir: &PathBuf| dir.join("lib/libnvrtc.so.13").exists() && dir.join("include/cuda_bf16.h").exists();
    if let Some(dir) = std::env::var_os("SPARKD_NVRTC_WHEELS") {
        let dir = PathBuf::from(dir).join("nvidia/cu13");
        return has_both(&dir).then_some(dir);
    }
    let out = Command::new("python3")
        .args([
            "-c",
            "import site, sys; print('\\n'.join(site.getsitepackages() + [site.getusersitepackages()] + sys.path))",
        ])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout).lines().map(|l| PathBuf::from(l.trim()).join("nvidia/cu13")).find(has_both)
}

#[test]
fn every_kernel_compiles_for_sm90a_and_sm100a() {
    let Some(root) = wheel_root() else {
        eprintln!(
            "SKIPPED: no nvidia-cuda-nvrtc / nvidia-cuda-runtime 13.0 wheels found (set SPARKD_NVRTC_WHEELS or run \
             scripts/test.sh, which installs them); the CUDA kernels were NOT compile-checked"
        );
        return;
    };
    if !nvrtc_present() {
        assert!(std::env::var_os(CHILD_MARK).is_none(), "libnvrtc.so.13 from {} does not load", root.display());
        let lib = root.join("lib");
        let path = match std::env::var_os("LD_LIBRARY_PATH") {
            Some(old) => format!("{}:{}", lib.display(), old.to_string_lossy()),
            None => lib.display().to_string(),
        };
        let exe = std::env::current_exe().expect("test binary path");
        let status = Command::new(exe)
            .args(["every_kernel_compiles_for_sm90a_and_sm100a", "--exact", "--nocapture"])
            .env("LD_LIBRARY_PATH", path)
            .env(CHILD_MARK, "1")
            .status()
            .expect("re-run the test with libnvrtc on the library path");
        assert!(status.success(), "kernel compilation failed (see the child's output above)");
        return;
    }
    let (major, minor) = sparkd_kernels::cuda::compile::nvrtc_version().unwrap();
    eprintln!("NVRTC {major}.{minor}, headers from {}", root.display());
    let mut failures = Vec::new();
    for arch in ["sm_90a", "sm_100a"] {
        let compiler = Compiler { arch: arch.to_string(), include_dir: root.join("include"), cache_dir: None };
        for src in &SOURCES {
            match compiler.compile(src) {
                Ok(cubin) => {
                    assert!(cubin.starts_with(b"\x7fELF"), "{} for {arch} is not an ELF cubin", src.name);
                    eprintln!("{arch} {}: {} bytes of CUBIN", src.name, cubin.len());
                }
                Err(e) => failures.push(e.to_string()),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
