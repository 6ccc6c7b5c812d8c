# adasum-lightning — `make demo` and `make test` do all set-up themselves (see README.md).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Real MNIST beside the checkout when present (read-only is fine), else ./data (downloaded if absent).
DATA_DIR ?= $(if $(wildcard ../shared/data/MNIST/raw/train-images-idx3-ubyte.gz),../shared/data,data)
NP ?= 2

# Open MPI refuses to run as root without these; one intra-op thread per process.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMP_NUM_THREADS ?= 1

.PHONY: setup demo test lint bench bench-quick clean

setup:
	@bash .ci/setup.sh "$(PYTHON)" "$(VENV)"

demo: setup
	@echo "[demo] $(NP) MPI processes, horovod_adasum, 3 epochs on MNIST from $(DATA_DIR)"
	@set -o pipefail; $(VENV)/bin/horovodrun -np $(NP) -H localhost:$(NP) \
	    --mpi-args="--mca mpi_yield_when_idle 1" \
	    $(PY) examples/mnist.py fit --config examples/mnist.yaml \
	    --data.data_dir=$(DATA_DIR) --trainer.default_root_dir=runs/demo 2>&1 | tee runs-demo.log
	@grep -o 'val_acc=[0-9.]*' runs-demo.log | tail -n 1

test: setup
	@$(PY) -m pytest -ra

lint: setup
	@$(VENV)/bin/ruff check adasum_lightning examples tests benchmarks
	@$(VENV)/bin/ruff format --check adasum_lightning examples tests benchmarks

clean:
	rm -rf runs runs-demo.log .pytest_cache
