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

.PHONY: setup demo demo-ddp test test-compat test-compat-prepare lint docs bench bench-quick clean

setup:
	@bash .ci/setup.sh "$(PYTHON)" "$(VENV)"

# adasum-horovodrun: horovodrun plus the Open MPI settings that end a job whose host is lost, and SIGTERM
# passed on to the ranks (adasum_lightning/horovod/horovodrun.py, adasum_lightning/failure_detection.py).
demo: setup
	@echo "[demo] $(NP) MPI processes, horovod_adasum, 3 epochs on MNIST from $(DATA_DIR)"
	@set -o pipefail; $(VENV)/bin/adasum-horovodrun -np $(NP) -H localhost:$(NP) \
	    --mpi-args="--mca mpi_yield_when_idle 1" \
	    $(PY) examples/mnist.py fit --config examples/mnist.yaml \
	    --data.data_dir=$(DATA_DIR) --trainer.default_root_dir=runs/demo 2>&1 | tee runs-demo.log
	@grep -o 'val_acc=[0-9.]*' runs-demo.log | tail -n 1

# The same job with ddp_adasum (Adasum on torch.distributed): a plain python command, Lightning starts the processes.
demo-ddp: setup
	@echo "[demo-ddp] ddp_adasum, $(NP) processes started by Lightning, 3 epochs on MNIST from $(DATA_DIR)"
	@set -o pipefail; $(PY) examples/mnist.py fit --config examples/mnist.yaml --trainer.strategy=ddp_adasum \
	    --trainer.devices=$(NP) --data.data_dir=$(DATA_DIR) --trainer.default_root_dir=runs/demo-ddp 2>&1 \
	    | tee runs-demo-ddp.log
	@grep -o 'val_acc=[0-9.]*' runs-demo-ddp.log | tail -n 1

# Two passes: the tests in TEST_WORKERS pytest-xdist processes (a file, and the files whose tests read cases of
# the same launches, stay on one worker: tests/cases.py's worker_groups), then those marked `walltime` (they
# assert a wall-clock limit) alone on the machine. Each pass prints its slowest tests and its time on the last
# line (a failure in the first does not skip the second); ADASUM_JUNIT=FILE also writes each test's time to FILE
# and FILE.walltime (docs/development.md).
TEST_WORKERS ?= 2
test: setup
	@rc=0; $(PY) -m pytest -ra --durations=25 -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder -m "not walltime" \
	    $(if $(ADASUM_JUNIT),--junitxml=$(ADASUM_JUNIT)) || rc=$$?; \
	$(PY) -m pytest -ra --durations=10 -m walltime $(if $(ADASUM_JUNIT),--junitxml=$(ADASUM_JUNIT).walltime) || rc=$$?; \
	exit $$rc

# The strategy, validation and multi-process tests against the oldest supported pytorch-lightning, in an
# environment of its own (.venv-compat-pl24) that reuses the cached Horovod wheel; its multi-process tests are
# those marked `compat`/`compat_oldest`, run as the same folded cases (tests/cases.py) as in `make test`.
# lightning 2.6.6 is `make test`'s own release; its pass (.venv-compat-lightning, the unified package alone:
# no pytorch-lightning installed) runs only what `make test` cannot: the single-process tests without the
# other package (`make test` runs every multi-process test with 2.6.6, each package's fits included).
COMPAT_PL24 := pl24 "pytorch-lightning==2.4.0" pytorch_lightning "$(PYTHON)"
COMPAT_LIGHTNING := lightning "lightning==2.6.6" lightning.pytorch "$(PYTHON)"
test-compat: test-compat-prepare
	@bash .ci/compat.sh $(COMPAT_PL24) "not mpi or compat or compat_oldest"
	@bash .ci/compat.sh $(COMPAT_LIGHTNING) "not mpi"

# The two environments alone, side by side (.ci/run installs them while `make test` runs).
test-compat-prepare: setup
	@bash .ci/compat.sh --prepare $(COMPAT_PL24) & a=$$!; bash .ci/compat.sh --prepare $(COMPAT_LIGHTNING) & b=$$!; \
	    wait $$a; ra=$$?; wait $$b; rb=$$?; [ $$ra = 0 ] && [ $$rb = 0 ]

.PHONY: gpu-wheel gpu-wheel-build test-gpu-wheel gpu-check

# Horovod 0.28.1 with NCCL (the Azure ML image's build), compiled on this machine without a GPU or a CUDA
# toolkit: nvcc, CCCL and the CUDA runtime from the registry's wheels at torch's CUDA release, into a scratch
# folder; cached like the CPU wheel (about 3 minutes on 2 cores when not cached). Not installed into .venv:
# tests/gpu_wheel.py installs it into a scratch venv and checks it; last line `nccl_built=True <wheel>`.
gpu-wheel: gpu-wheel-build
	@$(PY) tests/gpu_wheel.py

# The build alone (.ci/run: `make test`'s tests/test_gpu_wheel.py then checks the wheel, once).
gpu-wheel-build: setup
	@bash patches/build_horovod.sh --gpu --no-install --python $(PY)

# The build, then its tests (tests/test_gpu_wheel.py; they also run in `make test` once the wheel is cached).
test-gpu-wheel: gpu-wheel-build
	@ADASUM_REQUIRE_GPU_WHEEL=1 $(PY) -m pytest -ra -p no:cacheprovider tests/test_gpu_wheel.py tests/test_gpu_check.py

# What one GPU can check (tests/gpu_check.py): the NCCL wheel's import and ops on cuda:0, the strategies at
# world size 1 on cuda:0, adasum_allreduce on CUDA tensors, sync_batchnorm, bf16/fp16. One line per check;
# without a GPU each says `skipped: no GPU`. Under 10 minutes on one GPU.
gpu-check: gpu-wheel
	@$(PY) -m tests.gpu_check

lint: setup
	@$(VENV)/bin/ruff check adasum_lightning examples tests benchmarks
	@$(VENV)/bin/ruff format --check adasum_lightning examples tests benchmarks

# The documentation site (Sphinx + MyST: the pages are docs/*.md, the API reference comes from the
# docstrings) -> docs/_build/html/index.html; warnings are errors. Installs the `docs` extra when missing.
docs: setup
	@$(PY) -c "import sphinx, myst_parser, furo" 2>/dev/null || $(PY) -m pip install -q -e '.[docs]'
	@start=$$(date +%s); $(PY) -m sphinx -b html -E -W --keep-going -q docs docs/_build/html && \
	    echo "[docs] built in $$(( $$(date +%s) - start )) s: docs/_build/html/index.html"

# Scaling study + overhead benchmarks -> benchmarks/results/*.json, docs/benchmarks.md (+ PNGs).
# `bench`: about 75 min on 2 shared cores (docs/benchmarks.md, "Cost of make bench"); `bench-quick`: reduced, under 10 min, into benchmarks/results/quick/.
bench: setup
	@$(PY) -c "import matplotlib, tqdm" 2>/dev/null || $(PY) -m pip install -q -e '.[bench]'
	@mkdir -p runs; start=$$(date +%s); set -o pipefail; $(PY) -m benchmarks 2>&1 | tee runs/bench.log && \
	    echo "[bench] took $$(( ($$(date +%s) - start) / 60 )) min; report: docs/benchmarks.md"

bench-quick: setup
	@$(PY) -c "import matplotlib, tqdm" 2>/dev/null || $(PY) -m pip install -q -e '.[bench]'
	@mkdir -p runs; start=$$(date +%s); set -o pipefail; $(PY) -m benchmarks --quick 2>&1 | tee runs/bench-quick.log && \
	    echo "[bench-quick] took $$(( ($$(date +%s) - start) / 60 )) min; report: benchmarks/results/quick/report.md"

clean:
	rm -rf runs runs-demo.log runs-demo-ddp.log .pytest_cache docs/_build
