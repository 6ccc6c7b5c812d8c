#!/usr/bin/env bash
# make setup: idempotent environment for adasum-lightning (OpenMPI, .venv, torch, the project, Horovod).
#   bash .ci/setup.sh [PYTHON] [VENV]
# Every step prints its seconds; the last line sums them up. The torch/torchvision pins are read from
# adasum_lightning/constraints.txt (pip -c), the one place that pins them.
set -euo pipefail
py=${1:-python3}
venv=${2:-.venv}
constraints=adasum_lightning/constraints.txt
# --no-compile: pip does not byte-compile at install time; the last step byte-compiles the environment once
# (below).
pip_install=(-m pip install -q --disable-pip-version-check --no-compile)
step() { echo "[setup] $*"; }
SECONDS=0
summary=()
timed() {  # timed LABEL COMMAND...: run, then print and record its seconds
  local label=$1 t=$SECONDS
  shift
  "$@"
  step "$label: $((SECONDS - t)) s"
  summary+=("$label $((SECONDS - t)) s")
}
quiet_pip() { grep -v -e "^WARNING: Location" -e "BuildBackendWarning" -e "return '\\\\n'.join" >&2 || true; }

install_mpi() {
  if ! command -v mpirun >/dev/null || ! command -v mpicxx >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      step "installing OpenMPI (Debian openmpi-bin libopenmpi-dev)"
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
    else
      echo "[setup] error: OpenMPI is missing. Install the Debian/Ubuntu packages openmpi-bin and" \
           "libopenmpi-dev (sudo apt-get install openmpi-bin libopenmpi-dev), then rerun make setup." >&2
      exit 1
    fi
  fi
  step "OpenMPI: $(mpirun --version 2>/dev/null | head -n1)"
}
timed openmpi install_mpi

if [ ! -x "$venv/bin/python" ]; then
  timed venv "$py" -m venv "$venv"
fi
vpy="$venv/bin/python"

horovod_ok() { "$vpy" -c 'import horovod.torch as h, sys; sys.exit(not h.mpi_built())' 2>/dev/null; }

# The registry's torch is a CUDA build (~5.5 GB): installed once, then pip only checks it.
# A stamp keyed by the package metadata and the pins skips pip when nothing changed (a re-run takes seconds).
stamp="$venv/.setup-$(cat setup.cfg pyproject.toml "$constraints" | sha256sum | cut -c1-16)"
build_pid=
if [ -f "$stamp" ] && "$vpy" -c 'import torchvision, adasum_lightning' 2>/dev/null; then
  step "torch $("$vpy" -c 'import torch; print(torch.__version__)') and the project already installed"
else
  # torch first, with Horovod's build dependencies: when no Horovod wheel is cached, it is compiled
  # (patches/build_horovod.sh, against this torch) while the project and its extras install.
  step "installing torch and torchvision ($(paste -sd' ' <(grep -v '^#' "$constraints")))"
  timed torch "$vpy" "${pip_install[@]}" -c adasum_lightning/constraints.txt torch torchvision \
    cloudpickle psutil pyyaml packaging cmake cffi 2> >(quiet_pip)
  if ! horovod_ok && ! bash patches/build_horovod.sh --cached-only --python "$vpy" >/dev/null 2>&1; then
    step "no cached Horovod wheel: building it in the background while the project installs"
    log="$venv/.horovod-build.log"
    (t=$SECONDS; HOROVOD_SKIP_BUILD_DEPS=1 bash patches/build_horovod.sh --no-install --python "$vpy" >"$log" 2>&1 &&
      echo "[setup] horovod build (background): $((SECONDS - t)) s" >>"$log") &
    build_pid=$!
  fi
  step "installing the project with its dev, examples and Azure ML (aml, aml-v2) extras"
  timed project "$vpy" "${pip_install[@]}" -c adasum_lightning/constraints.txt -e ".[dev,examples,aml,aml-v2]" 2> >(quiet_pip)
  rm -f "$venv"/.setup-*
  touch "$stamp"
fi

if [ -n "$build_pid" ]; then
  t=$SECONDS
  if ! wait "$build_pid"; then
    cat "$log" >&2
    echo "[setup] error: the Horovod build failed (log above)" >&2
    exit 1
  fi
  grep "^\[" "$log"
  step "horovod build: waited $((SECONDS - t)) s after the project install"
  summary+=("horovod-build-wait $((SECONDS - t)) s")
fi
if horovod_ok; then
  step "Horovod already installed: $("$vpy" -c 'import horovod; print(horovod.__version__)') with PyTorch and MPI"
else
  timed horovod bash patches/build_horovod.sh --python "$vpy" 2> >(grep -v "^WARNING: Location" >&2 || true)
fi
# Byte-compiled once, in parallel: where PYTHONDONTWRITEBYTECODE is set, as on this project's CI machines,
# every process would otherwise compile each module it imports again (docs/development.md, "The two
# commands"). torch's Python-3.12-only test helper does not compile on 3.11: compileall's failures are ignored.
bytecode="$venv/.bytecode"
site=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
compile_all() {
  "$vpy" -m compileall -q -j 0 "$site" adasum_lightning examples tests benchmarks >/dev/null 2>&1 || true
  touch "$bytecode"
}
if [ ! -f "$bytecode" ] || [ "$stamp" -nt "$bytecode" ] || [ "$site/horovod" -nt "$bytecode" ]; then
  timed bytecode compile_all
fi
step "done in ${SECONDS} s (${summary[*]/%/;})"
