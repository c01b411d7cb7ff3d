//! NVRTC compilation of the CUDA C++ sources under `kernels/cuda/`, straight to CUBIN, cached on disk.
//!
//! Invariants:
//! - The sources are embedded in the binary ([`SOURCES`]), each with `prelude.cuh` prepended; nothing is
//!   read from the source tree at run time, and no nvcc is needed anywhere.
//! - A cached CUBIN is keyed by the SHA-256 of (source, arch, options, NVRTC version), so a changed
//!   kernel, target or compiler never loads a stale binary. Cache writes go through a temporary file
//!   and a rename, so a crash never leaves a truncated CUBIN under a valid key.
//! - Options: `-std=c++17`, no `--use_fast_math` (the forward is compared op by op with the CPU
//!   reference; fast-math `expf`/division would widen those tolerances for no speed that matters here).
//!
//! Follows shared/reference/rust-stack.md §1.5 ("going straight to CUBIN") and §1.6.

use std::ffi::CString;
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{result as nr, sys as ns};
use sha2::{Digest, Sha256};

use crate::error::{KernelError, Result};

/// One kernel source file.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    /// File name under `kernels/cuda/`.
    pub name: &'static str,
    pub code: &'static str,
}

/// A kernel source: `kernels/cuda/prelude.cuh` (the helpers every source shares), then the file itself.
macro_rules! source {
    ($name:literal) => {
        KernelSource {
            name: $name,
            code: concat!(include_str!("../../cuda/prelude.cuh"), include_str!(concat!("../../cuda/", $name))),
        }
    };
}

/// Every CUDA source of the crate.
pub const SOURCES: &[KernelSource] = &[
    source!("common.cu"),
    source!("kda.cu"),
    source!("mla.cu"),
    source!("moe_route.cu"),
    source!("moe.cu"),
    source!("sample.cu"),
    source!("gemm.cu"),
    source!("gemm_tc.cu"),
    source!("drafter.cu"),
];

/// Where NVRTC finds `cuda_bf16.h`: `SPARKD_CUDA_INCLUDE`, then `$CUDA_HOME/include`,
/// `$CUDA_PATH/include`, then `/usr/local/cuda/include`.
pub fn default_include_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("SPARKD_CUDA_INCLUDE") {
        return PathBuf::from(dir);
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = std::env::var_os(var) {
            let dir = PathBuf::from(home).join("include");
            if dir.join("cuda_bf16.h").exists() {
                return dir;
            }
        }
    }
    PathBuf::from("/usr/local/cuda/include")
}

/// The CUBIN cache folder: `SPARKD_KERNEL_CACHE`, else `$XDG_CACHE_HOME/sparkd/kernels`, else
/// `$HOME/.cache/sparkd/kernels`; `None` when none of them is set (compile every time).
pub fn default_cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("SPARKD_KERNEL_CACHE") {
        return Some(PathBuf::from(dir));
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(dir).join("sparkd/kernels"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/sparkd/kernels"))
}

/// The NVRTC version `(major, minor)`. NVRTC must be loadable (see `device::nvrtc_present`).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters.
    unsafe { ns::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| KernelError::Device(format!("nvrtcVersion: {e}")))?;
    Ok((major, minor))
}

/// How to compile.
#[derive(Clone, Debug)]
pub struct Compiler {
    /// `sm_90a`, `sm_100a`, ...
    pub arch: String,
    pub include_dir: PathBuf,
    pub cache_dir: Option<PathBuf>,
}

impl Compiler {
    fn options(&self) -> Vec<String> {
        vec![
            format!("--gpu-architecture={}", self.arch),
            format!("--include-path={}", self.include_dir.display()),
            "-std=c++17".to_string(),
        ]
    }

    /// The cache key of `src` under these options.
    pub fn cache_key(&self, src: &KernelSource) -> Result<String> {
        let (major, minor) = nvrtc_version()?;
        let mut h = Sha256::new();
        h.update(src.code.as_bytes());
        for o in self.options() {
            h.update([0u8]);
            h.update(o.as_bytes());
        }
        h.update(format!("nvrtc {major}.{minor}").as_bytes());
        let digest = h.finalize();
        Ok(digest.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// The CUBIN of `src`, from the cache when present, else compiled (and cached).
    pub fn cubin(&self, src: &KernelSource) -> Result<Vec<u8>> {
        let cached = match &self.cache_dir {
            Some(dir) => Some(dir.join(format!("{}-{}.cubin", src.name.trim_end_matches(".cu"), self.cache_key(src)?))),
            None => None,
        };
        if let Some(path) = &cached {
            if let Ok(bytes) = std::fs::read(path) {
                return Ok(bytes);
            }
        }
        let bytes = self.compile(src)?;
        if let Some(path) = &cached {
            // A cache that cannot be written only costs a recompile next time.
            let _ = write_atomically(path, &bytes);
        }
        Ok(bytes)
    }

    /// Compiles `src` to CUBIN with NVRTC; a compile error carries NVRTC's log.
    pub fn compile(&self, src: &KernelSource) -> Result<Vec<u8>> {
        let code = CString::new(src.code).map_err(|_| KernelError::Device(format!("{} holds a NUL byte", src.name)))?;
        let name = CString::new(src.name).map_err(|_| KernelError::Device("kernel name holds a NUL byte".into()))?;
        let prog = nr::create_program(&code, Some(&name))
            .map_err(|e| KernelError::Device(format!("nvrtcCreateProgram({}): {e}", src.name)))?;
        // SAFETY: `prog` is a live program from `create_program`, destroyed once below.
        let out = unsafe {
            let compiled = nr::compile_program(prog, &self.options());
            let result = match compiled {
                Ok(()) => get_cubin(prog),
                Err(e) => {
                    let log = nr::get_program_log(prog).map(|l| c_chars_to_string(&l)).unwrap_or_default();
                    Err(KernelError::Device(format!("NVRTC failed on {} for {}: {e}\n{log}", src.name, self.arch)))
                }
            };
            let _ = nr::destroy_program(prog);
            result
        };
        out
    }
}

/// # Safety
/// `prog` must be a compiled, live NVRTC program.
unsafe fn get_cubin(prog: ns::nvrtcProgram) -> Result<Vec<u8>> {
    let mut size = 0usize;
    ns::nvrtcGetCUBINSize(prog, &mut size)
        .result()
        .map_err(|e| KernelError::Device(format!("nvrtcGetCUBINSize: {e}")))?;
    let mut cubin = vec![0u8; size];
    ns::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut _)
        .result()
        .map_err(|e| KernelError::Device(format!("nvrtcGetCUBIN: {e}")))?;
    Ok(cubin)
}

fn c_chars_to_string(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().take_while(|c| **c != 0).map(|c| *c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// The value of `#define name value` (decimal, or hex with `0x`; an unsigned `u` suffix allowed) in the embedded
/// kernel source `file` (for tests that pin a constant of the host to the kernel's).
#[cfg(test)]
pub(crate) fn source_define(file: &str, name: &str) -> u32 {
    let src = SOURCES.iter().find(|s| s.name == file).unwrap_or_else(|| panic!("{file} is not embedded"));
    let prefix = format!("#define {name} ");
    let line = src.code.lines().find(|l| l.starts_with(&prefix)).unwrap_or_else(|| panic!("no #define {name}"));
    let value = line[prefix.len()..].split_whitespace().next().unwrap_or_default().trim_end_matches('u');
    let parsed = match value.strip_prefix("0x") {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => value.parse(),
    };
    parsed.unwrap_or_else(|_| panic!("#define {name} is not a number: {line}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The functions of a source: (is a kernel entry, name, body), found by matching the parentheses after each
    /// `__global__` / `__device__` signature and the braces of the body. Macro continuations are left in the text.
    fn functions(code: &str) -> Vec<(bool, String, String)> {
        let matching = |from: usize, open: u8, close: u8| -> Option<usize> {
            let mut depth = 0usize;
            for (i, &c) in code.as_bytes().iter().enumerate().skip(from) {
                if c == open {
                    depth += 1;
                } else if c == close {
                    depth = depth.checked_sub(1)?;
                    if depth == 0 {
                        return Some(i);
                    }
                }
            }
            None
        };
        let mut out = Vec::new();
        for (at, marker) in code.match_indices("__global__").chain(code.match_indices("__device__")) {
            let rest = &code[at..];
            let (Some(paren), semi) = (rest.find('('), rest.find(';')) else { continue };
            if semi.is_some_and(|s| s < paren) {
                continue; // a declaration, not a definition
            }
            // Skip attribute parentheses to reach the parameter list.
            let mut open = at + paren;
            while ["__launch_bounds__", "__cluster_dims__"].iter().any(|a| code[..open].trim_end().ends_with(a)) {
                let Some(close) = matching(open, b'(', b')') else { break };
                let Some(next) = code[close..].find('(') else { break };
                open = close + next;
            }
            let name: String = code[..open]
                .trim_end()
                .chars()
                .rev()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '#')
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            let Some(close) = matching(open, b'(', b')') else { continue };
            let Some(brace) = code[close..].find(['{', ';']).map(|i| close + i) else { continue };
            if code.as_bytes()[brace] == b';' {
                continue;
            }
            let Some(end) = matching(brace, b'{', b'}') else { continue };
            out.push((marker == "__global__", name, code[brace..=end].to_string()));
        }
        out
    }

    /// Whether `body` calls `name` (as `name(` or `name<`).
    fn calls(body: &str, name: &str) -> bool {
        body.match_indices(name).any(|(i, _)| {
            let before = body[..i].chars().next_back().is_some_and(|c| c.is_alphanumeric() || c == '_');
            let after = body[i + name.len()..].trim_start().chars().next();
            !before && matches!(after, Some('(') | Some('<'))
        })
    }

    #[test]
    fn every_kernel_waits_for_the_kernel_before_it() {
        // The host launches every kernel with programmatic stream serialisation (`cuda::launch`); a kernel that never
        // reached `grid_dependency_wait` could read its predecessor's output before it is written.
        for src in SOURCES {
            let fns = functions(src.code);
            let mut waiting = vec!["grid_dependency_wait".to_string()];
            loop {
                let before = waiting.len();
                for (_, name, body) in &fns {
                    if !waiting.contains(name) && waiting.iter().any(|w| calls(body, w)) {
                        waiting.push(name.clone());
                    }
                }
                if waiting.len() == before {
                    break;
                }
            }
            let kernels: Vec<_> = fns.iter().filter(|f| f.0).collect();
            assert!(!kernels.is_empty(), "{}: no kernels found", src.name);
            for (_, name, body) in kernels {
                assert!(
                    waiting.iter().any(|w| calls(body, w)),
                    "kernel {name} of {} never calls grid_dependency_wait",
                    src.name
                );
            }
        }
    }

    #[test]
    fn the_kernel_scan_sees_a_kernel_without_a_wait() {
        let code = "__device__ void helper(int x) { grid_dependency_wait(); }\n\
                    extern \"C\" __global__ void __launch_bounds__(128) good(int x) { helper(x); }\n\
                    extern \"C\" __global__ void bad(int x) { int helper_count = x; }\n";
        let fns = functions(code);
        let names: Vec<_> = fns.iter().map(|f| (f.0, f.1.as_str())).collect();
        assert_eq!(names, [(true, "good"), (true, "bad"), (false, "helper")]);
        assert!(calls(&fns[0].2, "helper"));
        assert!(!calls(&fns[1].2, "helper"));
    }
}
