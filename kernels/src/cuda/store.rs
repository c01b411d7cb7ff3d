//! [`ModuleStore`]: every kernel source of [`SOURCES`] compiled (or loaded from the CUBIN cache) once per
//! device and kept for the device's life, with lookup of a kernel by its name.
//!
//! Invariants:
//! - Each source is compiled and loaded exactly once per [`ModuleStore`] (one per `Gpu`); every op family, the
//!   drafter included, takes its kernels from it and never compiles a source itself.
//! - Kernel names are unique across the sources: [`ModuleStore::function`] looks a name up in every module and
//!   refuses a name found in none or in more than one, so a kernel can never come from the wrong file.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;

use crate::cuda::compile::{default_cache_dir, default_include_dir, Compiler, SOURCES};
use crate::cuda::device::{device_err, DeviceInfo};
use crate::error::{KernelError, Result};

/// The loaded modules of every kernel source, in [`SOURCES`] order.
pub struct ModuleStore {
    modules: Vec<(&'static str, Arc<CudaModule>)>,
}

impl ModuleStore {
    /// Compiles (or loads from the cache) every source for `info`'s arch and loads it into `ctx`.
    pub(crate) fn load(ctx: &Arc<CudaContext>, info: &DeviceInfo) -> Result<Self> {
        let compiler =
            Compiler { arch: info.arch(), include_dir: default_include_dir(), cache_dir: default_cache_dir() };
        let mut modules = Vec::with_capacity(SOURCES.len());
        for src in SOURCES {
            let cubin = compiler.cubin(src)?;
            let module = ctx
                .load_module(Ptx::from_binary(cubin))
                .map_err(|e| device_err(&format!("loading {}", src.name), e))?;
            modules.push((src.name, module));
        }
        Ok(ModuleStore { modules })
    }

    /// The kernel `name`, from whichever source defines it (exactly one must).
    pub fn function(&self, name: &str) -> Result<CudaFunction> {
        let mut found = self.modules.iter().filter_map(|(src, m)| m.load_function(name).ok().map(|f| (*src, f)));
        let (src, func) =
            found.next().ok_or_else(|| KernelError::Device(format!("no kernel source defines {name}")))?;
        if let Some((other, _)) = found.next() {
            return Err(KernelError::Device(format!("kernel {name} is defined by both {src} and {other}")));
        }
        Ok(func)
    }
}
