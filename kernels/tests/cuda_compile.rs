//! CI check that every CUDA kernel compiles with NVRTC for Ampere (sm_80: the Hopper-only kernels trap there and
//! the host never launches them), Hopper (sm_90a) and Blackwell (sm_100a), on a machine with no GPU and no CUDA
//! toolkit, and that no kernel name is defined by two sources (the module store looks kernels up by name).
//! The sources take every width as a launch argument (nothing of a model's config is compiled in), so one compile
//! serves every shard of a tensor-parallel group; what a shard must satisfy is the kernels' width preconditions,
//! checked for k3-mini and K3 over 2, 4 and 8 ranks by `every_shard_of_k3_and_k3_mini_fits_the_kernels`.
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
use sparkd_kernels::cuda::weights::check_shapes;
use sparkd_kernels::shard_rule::Shard;
use sparkd_kernels::ModelConfig;

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

/// Runs `check` with NVRTC loadable: in this process when it already is, else in a child process of
/// this test binary (test `name`) with the wheel's lib folder on `LD_LIBRARY_PATH`. Returns `None`
/// (after saying so) when no wheel is found.
fn with_nvrtc(name: &str, check: impl FnOnce(&PathBuf)) -> Option<()> {
    let Some(root) = wheel_root() else {
        eprintln!(
            "SKIPPED: no nvidia-cuda-nvrtc / nvidia-cuda-runtime 13.0 wheels found (set SPARKD_NVRTC_WHEELS or run \
             scripts/test.sh, which installs them); `{name}` did NOT run"
        );
        return None;
    };
    if nvrtc_present() {
        check(&root);
        return Some(());
    }
    assert!(std::env::var_os(CHILD_MARK).is_none(), "libnvrtc.so.13 from {} does not load", root.display());
    let lib = root.join("lib");
    let path = match std::env::var_os("LD_LIBRARY_PATH") {
        Some(old) => format!("{}:{}", lib.display(), old.to_string_lossy()),
        None => lib.display().to_string(),
    };
    let exe = std::env::current_exe().expect("test binary path");
    let status = Command::new(exe)
        .args([name, "--exact", "--nocapture"])
        .env("LD_LIBRARY_PATH", path)
        .env(CHILD_MARK, "1")
        .status()
        .expect("re-run the test with libnvrtc on the library path");
    assert!(status.success(), "`{name}` failed in the child process (see its output above)");
    Some(())
}

/// The kernel entry points a CUBIN defines: the names of its ELF symbols that are global functions marked as CUDA
/// entries (`STO_CUDA_ENTRY` in `st_other`).
fn entry_points(cubin: &[u8]) -> Vec<String> {
    let u16_at = |at: usize| u16::from_le_bytes(cubin[at..at + 2].try_into().unwrap()) as usize;
    let u32_at = |at: usize| u32::from_le_bytes(cubin[at..at + 4].try_into().unwrap()) as usize;
    let u64_at = |at: usize| u64::from_le_bytes(cubin[at..at + 8].try_into().unwrap()) as usize;
    let (shoff, shentsize, shnum) = (u64_at(0x28), u16_at(0x3a), u16_at(0x3c));
    let section = |i: usize| shoff + i * shentsize;
    let mut names = Vec::new();
    for i in 0..shnum {
        let sh = section(i);
        if u32_at(sh + 4) != 2 {
            continue; // not SHT_SYMTAB
        }
        let (offset, size, strtab) = (u64_at(sh + 24), u64_at(sh + 32), section(u32_at(sh + 40)));
        let strings = u64_at(strtab + 24);
        for sym in (offset..offset + size).step_by(24) {
            let (info, other) = (cubin[sym + 4], cubin[sym + 5]);
            if info >> 4 == 1 && info & 0xf == 2 && other & 0x10 != 0 {
                let name = &cubin[strings + u32_at(sym)..];
                let end = name.iter().position(|&c| c == 0).unwrap_or(name.len());
                names.push(String::from_utf8_lossy(&name[..end]).into_owned());
            }
        }
    }
    names
}

#[test]
fn every_kernel_compiles_for_sm80_sm90a_and_sm100a() {
    with_nvrtc("every_kernel_compiles_for_sm80_sm90a_and_sm100a", |root| {
        let (major, minor) = sparkd_kernels::cuda::compile::nvrtc_version().unwrap();
        eprintln!("NVRTC {major}.{minor}, headers from {}", root.display());
        let mut failures = Vec::new();
        for arch in ["sm_80", "sm_90a", "sm_100a"] {
            let compiler = Compiler { arch: arch.to_string(), include_dir: root.join("include"), cache_dir: None };
            // Which source defines each kernel: the module store looks kernels up by name alone.
            let mut defined_in = std::collections::HashMap::new();
            for src in SOURCES {
                match compiler.compile(src) {
                    Ok(cubin) => {
                        assert!(cubin.starts_with(b"\x7fELF"), "{} for {arch} is not an ELF cubin", src.name);
                        eprintln!("{arch} {}: {} bytes of CUBIN", src.name, cubin.len());
                        let entries = entry_points(&cubin);
                        assert!(!entries.is_empty(), "{} for {arch}: no kernel entry points found", src.name);
                        for name in entries {
                            if let Some(other) = defined_in.insert(name.clone(), src.name) {
                                failures.push(format!("{arch}: kernel {name} is defined by {other} and {}", src.name));
                            }
                        }
                    }
                    Err(e) => failures.push(e.to_string()),
                }
            }
            for kernel in
                ["rms_norm", "skinny_gemm_t1", "moe_router_logits", "kda_step_128", "sample_rows", "markov_pick"]
            {
                assert!(defined_in.contains_key(kernel), "{arch}: no source defines {kernel}");
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    });
}

#[test]
fn the_cubin_cache_is_keyed_by_source_and_arch_and_reused() {
    with_nvrtc("the_cubin_cache_is_keyed_by_source_and_arch_and_reused", |root| {
        let dir = tempfile::tempdir().unwrap();
        let compiler =
            Compiler { arch: "sm_90a".into(), include_dir: root.join("include"), cache_dir: Some(dir.path().into()) };
        let src = SOURCES[0];
        let first = compiler.cubin(&src).unwrap();
        let cached: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().path()).collect();
        assert_eq!(cached.len(), 1, "one cache file per compiled source: {cached:?}");
        // A planted cache entry under the same key is what the next call returns (no recompile).
        std::fs::write(&cached[0], b"planted").unwrap();
        assert_eq!(compiler.cubin(&src).unwrap(), b"planted");
        // Another arch or another source is another key.
        let other_arch = Compiler { arch: "sm_100a".into(), ..compiler.clone() };
        assert_ne!(other_arch.cache_key(&src).unwrap(), compiler.cache_key(&src).unwrap());
        assert_ne!(compiler.cache_key(&SOURCES[1]).unwrap(), compiler.cache_key(&src).unwrap());
        assert!(first.starts_with(b"\x7fELF"));
    });
}

#[test]
fn a_kernel_that_does_not_compile_is_an_error_with_the_nvrtc_log() {
    with_nvrtc("a_kernel_that_does_not_compile_is_an_error_with_the_nvrtc_log", |root| {
        let compiler = Compiler { arch: "sm_90a".into(), include_dir: root.join("include"), cache_dir: None };
        let broken = sparkd_kernels::cuda::compile::KernelSource {
            name: "broken.cu",
            code: "extern \"C\" __global__ void k(float *x) { x[0] = undefined_name; }",
        };
        let err = compiler.compile(&broken).unwrap_err();
        assert_eq!(err.kind(), "device");
        assert!(err.to_string().contains("undefined_name"), "{err}");
    });
}

/// `SPARKD_FILL_KERNEL_CACHE=DIR` fills DIR with every kernel's sm_90a CUBIN under the key the runtime
/// uses, so that a GPU machine started bare can begin from a warm cache (copy DIR to its
/// `SPARKD_KERNEL_CACHE`, and give it the same NVRTC version and `SPARKD_CUDA_INCLUDE` path string).
#[test]
fn the_kernel_cache_can_be_filled_on_a_host_without_a_gpu() {
    let Some(dir) = std::env::var_os("SPARKD_FILL_KERNEL_CACHE") else {
        eprintln!("SKIPPED: SPARKD_FILL_KERNEL_CACHE is not set; no cache was filled");
        return;
    };
    with_nvrtc("the_kernel_cache_can_be_filled_on_a_host_without_a_gpu", |root| {
        let compiler =
            Compiler { arch: "sm_90a".into(), include_dir: root.join("include"), cache_dir: Some(dir.into()) };
        for src in SOURCES {
            let cubin = compiler.cubin(src).unwrap();
            eprintln!("cached {} ({} bytes) as {}", src.name, cubin.len(), compiler.cache_key(src).unwrap());
        }
    });
}

/// Every rank's widths of k3-mini and K3 over 2, 4 and 8 ranks (experts split by width, or placed whole) pass the
/// CUDA kernels' preconditions (`cuda::weights::check_shapes`, what `DevWeights::load_shard` checks first). Needs
/// no NVRTC: the CUBINs `every_kernel_compiles_for_sm80_sm90a_and_sm100a` builds are every shard's.
#[test]
fn every_shard_of_k3_and_k3_mini_fits_the_kernels() {
    for preset in ["k3-mini", "k3"] {
        let cfg = ModelConfig::preset(preset).unwrap();
        check_shapes(&cfg).unwrap_or_else(|e| panic!("{preset}: {e}"));
        for world in [2, 4, 8] {
            for expert_parallel in [false, true] {
                let what = format!("{preset} over {world} ranks (expert parallel: {expert_parallel})");
                if let Err(e) = Shard::check(&cfg, world, expert_parallel) {
                    // Only the routed experts may fail to place whole over a group; heads and widths must split.
                    assert!(expert_parallel, "{what}: {e}");
                    eprintln!("{what}: refused as it should be: {e}");
                    continue;
                }
                for rank in [0, world - 1] {
                    let local = Shard { rank, world, expert_parallel }.local_config(&cfg).unwrap();
                    check_shapes(&local).unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert_eq!(local.kda.num_heads * world, cfg.kda.num_heads, "{what}");
                    assert_eq!(local.mla.num_heads * world, cfg.mla.num_heads, "{what}");
                }
            }
        }
    }
}
