#!/usr/bin/env bash
# make setup: idempotent environment for adasum-lightning (OpenMPI, .venv, torch, the project, Horovod).
#   bash .ci/setup.sh [PYTHON] [VENV]
set -euo pipefail
py=${1:-python3}
venv=${2:-.venv}
step() { echo "[setup] $*"; }
SECONDS=0

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

if [ ! -x "$venv/bin/python" ]; then
  step "creating $venv with $("$py" --version)"
  "$py" -m venv "$venv"
fi
vpy="$venv/bin/python"

# The registry's torch is a CUDA build (~5.5 GB): installed once, then pip only checks it.
# A stamp keyed by the package metadata skips pip when nothing changed (a re-run takes seconds).
stamp="$venv/.setup-$(cat setup.cfg pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && "$vpy" -c 'import torchvision, adasum_lightning' 2>/dev/null; then
  step "torch $("$vpy" -c 'import torch; print(torch.__version__)') and the project already installed"
else
  step "installing torch==2.14.1 torchvision==0.29.1 and the project with its dev, examples and Azure ML (aml, aml-v2) extras"
  "$vpy" -m pip install -q --disable-pip-version-check torch==2.14.1 torchvision==0.29.1 -e ".[dev,examples,aml,aml-v2]" \
    2> >(grep -v -e "^WARNING: Location" -e "BuildBackendWarning" -e "return '\\\\n'.join" >&2)
  rm -f "$venv"/.setup-*
  touch "$stamp"
fi

if "$vpy" -c 'import horovod.torch as h, sys; sys.exit(not h.mpi_built())' 2>/dev/null; then
  step "Horovod already installed: $("$vpy" -c 'import horovod; print(horovod.__version__)') with PyTorch and MPI"
else
  bash patches/build_horovod.sh --python "$vpy" 2> >(grep -v "^WARNING: Location" >&2)
fi
step "done in ${SECONDS}s"
