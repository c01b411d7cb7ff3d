//! Finding a CUDA device without ever letting cudarc panic.
//!
//! Invariant: no cudarc driver call is made before [`probe`] has confirmed, with
//! `is_culib_present()`, that the driver library can be loaded (cudarc panics instead of returning an
//! error when it cannot; shared/reference/rust-stack.md §1.3). Every failure is a
//! [`KernelError::Device`] that says what is missing.

use std::sync::Arc;

use cudarc::driver::CudaContext;

use crate::error::{KernelError, Result};

/// What [`probe`] found.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// `(major, minor)` compute capability, e.g. `(9, 0)` for an H200.
    pub compute_capability: (i32, i32),
    pub total_memory: usize,
    pub free_memory: usize,
}

impl DeviceInfo {
    /// The NVRTC architecture to compile for: the arch-specific target (`sm_90a`, `sm_100a`) from
    /// Hopper on, the plain one before.
    pub fn arch(&self) -> String {
        let (major, minor) = self.compute_capability;
        if major >= 9 {
            format!("sm_{major}{minor}a")
        } else {
            format!("sm_{major}{minor}")
        }
    }
}

/// True when the CUDA driver library can be loaded (never panics).
pub fn driver_present() -> bool {
    // SAFETY: `is_culib_present` only tries to dlopen the library; it touches no CUDA state.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// True when NVRTC can be loaded (never panics).
pub fn nvrtc_present() -> bool {
    // SAFETY: as above, a dlopen probe only.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// True when cuBLAS can be loaded (never panics).
pub fn cublas_present() -> bool {
    // SAFETY: as above, a dlopen probe only.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

pub(crate) fn device_err(what: &str, e: impl std::fmt::Display) -> KernelError {
    KernelError::Device(format!("{what}: {e}"))
}

/// Opens device `ordinal` after checking that the driver, NVRTC and cuBLAS libraries load.
pub fn open(ordinal: usize) -> Result<Arc<CudaContext>> {
    if !driver_present() {
        return Err(KernelError::Device(
            "no CUDA driver: libcuda.so could not be loaded (no NVIDIA driver on this machine, or it is not on the \
             library path)"
                .into(),
        ));
    }
    if !nvrtc_present() {
        return Err(KernelError::Device(
            "NVRTC not found: libnvrtc.so.13 could not be loaded (install the CUDA 13 toolkit or the \
             nvidia-cuda-nvrtc wheel and put its lib folder on LD_LIBRARY_PATH)"
                .into(),
        ));
    }
    if !cublas_present() {
        return Err(KernelError::Device("cuBLAS not found: libcublas.so.13 could not be loaded".into()));
    }
    let count = CudaContext::device_count().map_err(|e| device_err("counting devices", e))?;
    if ordinal >= count as usize {
        return Err(KernelError::Device(format!("device {ordinal} asked for, but this machine has {count}")));
    }
    CudaContext::new(ordinal).map_err(|e| device_err(&format!("opening device {ordinal}"), e))
}

/// Describes device `ordinal`, or says why there is none.
pub fn probe(ordinal: usize) -> Result<DeviceInfo> {
    let ctx = open(ordinal)?;
    info(&ctx)
}

pub(crate) fn info(ctx: &CudaContext) -> Result<DeviceInfo> {
    let name = ctx.name().map_err(|e| device_err("device name", e))?;
    let compute_capability = ctx.compute_capability().map_err(|e| device_err("compute capability", e))?;
    let (free_memory, total_memory) = ctx.mem_get_info().map_err(|e| device_err("memory info", e))?;
    Ok(DeviceInfo { ordinal: ctx.ordinal(), name, compute_capability, total_memory, free_memory })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_cc(major: i32, minor: i32) -> DeviceInfo {
        DeviceInfo { ordinal: 0, name: "x".into(), compute_capability: (major, minor), total_memory: 0, free_memory: 0 }
    }

    #[test]
    fn hopper_and_later_compile_for_the_arch_specific_target() {
        assert_eq!(with_cc(9, 0).arch(), "sm_90a");
        assert_eq!(with_cc(10, 0).arch(), "sm_100a");
        assert_eq!(with_cc(8, 9).arch(), "sm_89");
    }

    #[test]
    fn opening_a_device_never_panics() {
        // Without a driver this is the typed error; with one, device 999 does not exist.
        let Err(err) = open(999) else { panic!("no machine has 1000 GPUs") };
        assert_eq!(err.kind(), "device");
    }
}
