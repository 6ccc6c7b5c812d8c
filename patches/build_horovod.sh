#!/usr/bin/env bash
# Build Horovod 0.28.1 from the package registry's source distribution, patched for current PyTorch,
# and install it into a Python environment that already has torch.
#
#   patches/build_horovod.sh [--python PY] [--gpu] [--cache DIR] [--no-install]
#
#   --python PY   interpreter of the target environment (default: python3 on PATH)
#   --gpu         GPU image build: NCCL GPU operations (HOROVOD_GPU_OPERATIONS=NCCL), CUDA as torch
#                 reports it. Needs nvcc and the NCCL headers (HOROVOD_NCCL_HOME if not in /usr).
#                 Default: CPU build (MPI CPU operations, torch extension forced CPU-only).
#   --cache DIR   wheel cache (default: ${XDG_CACHE_HOME:-~/.cache}/adasum-lightning/horovod).
#                 The wheel is cached per Horovod, torch, Python, build kind and patch: a second run
#                 with the same key installs in seconds.
#   --no-install  build (or find) the wheel and print its path, install nothing.
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

while [ $# -gt 0 ]; do
  case "$1" in
    --python) py="$2"; shift 2 ;;
    --gpu) kind=nccl; shift ;;
    --cache) cache="$2"; shift 2 ;;
    --no-install) install=0; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
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
wheel_dir="$cache/$key"

wheel=$(ls "$wheel_dir"/horovod-*.whl 2>/dev/null | head -n1 || true)
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
  "$py" -m pip install -q cloudpickle psutil pyyaml packaging cmake
  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1
  export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
  if [ "$kind" = nccl ]; then
    export HOROVOD_GPU_OPERATIONS=NCCL
    unset HOROVOD_TORCH_FORCE_CPU
  else
    export HOROVOD_CPU_OPERATIONS=MPI HOROVOD_TORCH_FORCE_CPU=1 HOROVOD_WITHOUT_GPU=1
  fi
  # Not nproc: it follows OMP_NUM_THREADS, which `make setup` sets to 1 for the training processes.
  export MAKEFLAGS="-j${HOROVOD_BUILD_JOBS:-$(getconf _NPROCESSORS_ONLN)}"
  step "building the $kind wheel against torch $torch_version ($MAKEFLAGS; about 2 minutes on 2 cores)"
  mkdir -p "$wheel_dir"
  if ! "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$src" >"$work/build.log" 2>&1; then
    tail -n 40 "$work/build.log" >&2
    die "the Horovod build failed (last lines above)"
  fi
  cp "$work"/dist/horovod-*.whl "$wheel_dir/"
  wheel=$(ls "$wheel_dir"/horovod-*.whl | head -n1)
  step "built and cached: $wheel"
fi

if [ "$install" = 0 ]; then echo "$wheel"; exit 0; fi

step "installing $(basename "$wheel")"
"$py" -m pip install -q --force-reinstall --no-deps "$wheel"
"$py" -m pip install -q cloudpickle psutil pyyaml packaging cffi
bindir=$(dirname "$("$py" -c 'import sys; print(sys.executable)')")
check=$("$bindir/horovodrun" --check-build)
echo "$check" | grep -q '\[X\] PyTorch' || die "Horovod was built without PyTorch:\n$check"
echo "$check" | grep -q '\[X\] MPI' || die "Horovod was built without MPI:\n$check"
step "horovodrun --check-build: PyTorch and MPI present"
