#!/usr/bin/env bash
# Build Horovod 0.28.1 from the package registry's source distribution, patched for current PyTorch,
# and install it into a Python environment that already has torch.
#
#   patches/build_horovod.sh [--python PY] [--gpu] [--cache DIR] [--no-install | --cached-only]
#
#   --python PY   interpreter of the target environment (default: python3 on PATH)
#   --gpu         NCCL build (HOROVOD_GPU_OPERATIONS=NCCL; Adasum on GPUs = NCCL in a node, MPI
#                 across). Needs no GPU and no CUDA toolkit: nvcc, its crt/nvvm, CCCL and the CUDA
#                 runtime come from the registry's wheels (cuda-toolkit[nvcc,cccl,cudart] at the
#                 version torch depends on), installed into a scratch folder for the build only; NCCL
#                 is the nvidia-nccl-cu13 wheel torch already installed. /usr/local/cuda and any other
#                 nvcc on PATH are kept out. CUDA kernels for HOROVOD_BUILD_CUDA_CC_LIST (default
#                 75,80,86,89,90: T4, A100, A10/A40, L4, H100). When it installs, the last line
#                 is `nccl_built=True <wheel>` (tests/gpu_wheel.py checks an uninstalled wheel).
#                 Default: CPU build (MPI CPU operations, torch extension forced CPU-only).
#   --cache DIR   wheel cache (default: ${XDG_CACHE_HOME:-~/.cache}/adasum-lightning/horovod).
#                 The wheel is cached per Horovod, torch, Python, build kind and patch: a second run
#                 with the same key installs in seconds.
#   --no-install  build (or find) the wheel and print its path, install nothing.
#   --cached-only print the cached wheel's path and exit 0, or exit 3 when it is not cached (builds nothing).
#   HOROVOD_BUILD_JOBS=N  parallel compile jobs (default: the online CPU count).
#
# Both builds: PyTorch + MPI + Gloo, no TensorFlow or MXNet, --no-build-isolation against the
# installed torch. Used by `make setup` here and by the Azure ML job image (with --gpu).
set -euo pipefail

HOROVOD_VERSION=0.28.1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
patch_file="$here/horovod-$HOROVOD_VERSION-torch2.patch"
py=python3
kind=cpu
cache="${XDG_CACHE_HOME:-$HOME/.cache}/adasum-lightning/horovod"
install=1
cached_only=0

while [ $# -gt 0 ]; do
  case "$1" in
    --python) py="$2"; shift 2 ;;
    --gpu) kind=nccl; shift ;;
    --cache) cache="$2"; shift 2 ;;
    --no-install) install=0; shift ;;
    --cached-only) cached_only=1; shift ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "build_horovod.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

step() { echo "[build_horovod] $*"; }
die() { echo "[build_horovod] error: $*" >&2; exit 1; }

torch_version=$("$py" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null) ||
  die "torch is not importable with $py; install torch first (make setup does)"
py_tag=$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
command -v mpicxx >/dev/null || die "no MPI compiler wrapper (mpicxx): install openmpi-bin and libopenmpi-dev"
patch_sum=$(sha256sum "$patch_file" | cut -c1-12)
key="horovod$HOROVOD_VERSION-torch$torch_version-$py_tag-$kind-$patch_sum"
if [ "$kind" = nccl ]; then
  # The CUDA toolkit and NCCL releases torch was built with (torch 2.14.1+cu130: cuda-toolkit 13.0.3,
  # nvidia-nccl-cu13 2.30.7); the build uses the same ones.
  read -r cuda_version nccl_version nccl_dir < <("$py" - <<'PY'
import importlib.metadata as md, importlib.util, os
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "-"
spec = importlib.util.find_spec("nvidia.nccl")
print(version("cuda-toolkit"), version("nvidia-nccl-cu13"), list(spec.submodule_search_locations)[0] if spec else "-")
PY
  )
  [ "$cuda_version" != - ] || die "torch's environment has no cuda-toolkit package: --gpu needs a CUDA 13 build of torch from the registry"
  [ "$nccl_version" != - ] && [ -f "$nccl_dir/include/nccl.h" ] ||
    die "torch's environment has no nvidia-nccl-cu13 with nccl.h: --gpu needs a CUDA 13 build of torch from the registry"
  cc_list=${HOROVOD_BUILD_CUDA_CC_LIST:-75,80,86,89,90}
  key="$key-cuda$cuda_version-nccl$nccl_version-cc${cc_list//,/.}"
fi
wheel_dir="$cache/$key"

wheel=$(ls "$wheel_dir"/horovod-*.whl 2>/dev/null | head -n1 || true)
if [ "$cached_only" = 1 ]; then
  [ -n "$wheel" ] || { step "no cached wheel in $wheel_dir"; exit 3; }
  echo "$wheel"; exit 0
fi
if [ -n "$wheel" ]; then
  step "cached wheel found: $wheel"
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  step "downloading the horovod==$HOROVOD_VERSION source distribution"
  "$py" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work"
  tar xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
  src="$work/horovod-$HOROVOD_VERSION"
  step "applying $(basename "$patch_file")"
  patch -p1 -s -d "$src" <"$patch_file"
  # (make setup installs them with torch and sets HOROVOD_SKIP_BUILD_DEPS=1: it builds while pip installs
  # the project into the same environment)
  [ "${HOROVOD_SKIP_BUILD_DEPS:-0}" = 1 ] || "$py" -m pip install -q --no-compile cloudpickle psutil pyyaml packaging cmake
  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1
  export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
  if [ "$kind" = nccl ]; then
    step "installing the CUDA $cuda_version compiler wheels into a scratch folder (cuda-toolkit[nvcc,cccl,cudart])"
    "$py" -m pip install -q --no-warn-script-location --target "$work/cuda" "cuda-toolkit[nvcc,cccl,cudart]==$cuda_version"
    cuda_home="$work/cuda/nvidia/cu13"
    [ -x "$cuda_home/bin/nvcc" ] || die "no nvcc in $cuda_home/bin after installing cuda-toolkit[nvcc]==$cuda_version"
    # nvcc links from lib64/ (nvcc.profile), the wheels install lib/; CMake looks for libcudart.so and
    # Horovod for libnccl.so, the wheels ship only the versioned names.
    ln -sfn lib "$cuda_home/lib64"
    ln -sf libcudart.so.13 "$cuda_home/lib/libcudart.so"
    mkdir -p "$work/nccl/lib"
    ln -sf "$(ls "$nccl_dir"/lib/libnccl.so.* | head -n1)" "$work/nccl/lib/libnccl.so"
    export HOROVOD_CUDA_HOME="$cuda_home" CUDA_HOME="$cuda_home" CUDA_PATH="$cuda_home" CUDAToolkit_ROOT="$cuda_home"
    export CUDACXX="$cuda_home/bin/nvcc" HOROVOD_BUILD_CUDA_CC_LIST="$cc_list"
    export HOROVOD_NCCL_INCLUDE="$nccl_dir/include" HOROVOD_NCCL_LIB="$work/nccl/lib" HOROVOD_NCCL_LINK=SHARED
    # Only the wheels' nvcc: drop every other folder with an nvcc (e.g. /usr/local/cuda/bin) from PATH.
    clean_path="$cuda_home/bin"
    IFS=: read -ra path_dirs <<<"$PATH"
    for d in "${path_dirs[@]}"; do [ -e "$d/nvcc" ] || clean_path="$clean_path:$d"; done
    export PATH="$clean_path"
    unset LD_LIBRARY_PATH CPATH LIBRARY_PATH
    export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_CPU_OPERATIONS=MPI
    unset HOROVOD_TORCH_FORCE_CPU HOROVOD_WITHOUT_GPU
  else
    export HOROVOD_CPU_OPERATIONS=MPI HOROVOD_TORCH_FORCE_CPU=1 HOROVOD_WITHOUT_GPU=1
  fi
  # Not nproc: it follows OMP_NUM_THREADS, which `make setup` sets to 1 for the training processes.
  export MAKEFLAGS="-j${HOROVOD_BUILD_JOBS:-$(getconf _NPROCESSORS_ONLN)}"
  if [ "$kind" = nccl ]; then
    step "building the $kind wheel against torch $torch_version, CUDA $cuda_version, NCCL $nccl_version, compute capabilities $cc_list ($MAKEFLAGS)"
  else
    step "building the $kind wheel against torch $torch_version ($MAKEFLAGS; about 2 minutes on 2 cores)"
  fi
  build_start=$SECONDS
  if ! "$py" -m pip wheel -v --no-deps --no-build-isolation -w "$work/dist" "$src" >"$work/build.log" 2>&1; then
    mkdir -p "$cache" && cp "$work/build.log" "$cache/$key.failed.log"
    grep -E "CMake Error|error:|Error [0-9]" "$work/build.log" | head -n 20 >&2
    tail -n 20 "$work/build.log" >&2
    die "the Horovod build failed (errors above; whole log: $cache/$key.failed.log)"
  fi
  if [ "$kind" = nccl ]; then
    # Proof that the build saw only the wheels' CUDA: neither the CMake caches nor the compile and link
    # commands (pip -v) name another toolkit.
    caches=$(find "$src" -name CMakeCache.txt)
    [ -n "$caches" ] || die "no CMakeCache.txt left by the build"
    # shellcheck disable=SC2086
    if grep -l -E "/usr/local/cuda|/usr/lib/cuda|/opt/cuda" $caches "$work/build.log" >&2; then
      die "the build used a CUDA toolkit outside the wheels (the files above name it)"
    fi
    # shellcheck disable=SC2086
    grep -h -E "^CMAKE_CUDA_COMPILER:|^CUDAToolkit_NVCC_EXECUTABLE:|^NCCL_LIBRARY:" $caches | sort -u | sed 's/^/[build_horovod]   /'
  fi
  step "compiled in $((SECONDS - build_start)) s"
  mkdir -p "$wheel_dir"
  cp "$work/build.log" "$wheel_dir/build.log"
  cp "$work"/dist/horovod-*.whl "$wheel_dir/"
  wheel=$(ls "$wheel_dir"/horovod-*.whl | head -n1)
  step "built and cached: $wheel"
fi

if [ "$install" = 0 ]; then echo "$wheel"; exit 0; fi

step "installing $(basename "$wheel")"
"$py" -m pip install -q --no-compile --force-reinstall --no-deps "$wheel"
"$py" -m pip install -q --no-compile cloudpickle psutil pyyaml packaging cffi
bindir=$(dirname "$("$py" -c 'import sys; print(sys.executable)')")
check=$("$bindir/horovodrun" --check-build)
echo "$check" | grep -q '\[X\] PyTorch' || die "Horovod was built without PyTorch:\n$check"
echo "$check" | grep -q '\[X\] MPI' || die "Horovod was built without MPI:\n$check"
step "horovodrun --check-build: PyTorch and MPI present"
if [ "$kind" = nccl ]; then
  nccl=$("$py" -c 'import torch, horovod.torch as hvd; print(hvd.nccl_built())') || die "import horovod.torch failed"
  [ "$nccl" -gt 0 ] || die "Horovod was built without NCCL (nccl_built() = $nccl)"
  echo "nccl_built=True $wheel"
fi
