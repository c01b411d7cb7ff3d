# Sourced by run_h200.sh and ab_h200.sh on the GPU machine: `. kernels/bench/device_env.sh DIR ...`.
# Sets up the environment the staged binaries need there:
# - SPARKD_KERNEL_CACHE=/tmp/kc, holding the CUBINs of every named build's kc/ (filled by kernels/bench/stage.sh);
# - SPARKD_CUDA_INCLUDE: a CUBIN's cache key includes the include path it was compiled with, so the path the
#   caches were filled with (/work/nvrtc-wheels/nvidia/cu13/include) is pointed at the device's real headers;
# - LD_LIBRARY_PATH: NVRTC and cuBLAS from the image's Python wheels, after the system's.
export SPARKD_KERNEL_CACHE=/tmp/kc PYTHONUNBUFFERED=1
mkdir -p /tmp/kc
for build in "$@"; do cp "$build"/kc/*.cubin /tmp/kc/ 2>/dev/null; done
mkdir -p /work/nvrtc-wheels/nvidia/cu13 2>/dev/null && ln -sfn /usr/local/cuda/include /work/nvrtc-wheels/nvidia/cu13/include \
  2>/dev/null && export SPARKD_CUDA_INCLUDE=/work/nvrtc-wheels/nvidia/cu13/include
for d in $(python3 -c 'import nvidia, os; p=nvidia.__path__[0]; print(" ".join(os.path.join(p, x, "lib") for x in os.listdir(p)))' 2>/dev/null); do
  LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:$d"
done
export LD_LIBRARY_PATH
