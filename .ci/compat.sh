#!/usr/bin/env bash
# make test-compat: the strategy, validation and multi-process tests in an environment of their own, against
# another supported Lightning release, reusing the cached Horovod wheel.
#   bash .ci/compat.sh [--prepare] NAME "LIGHTNING PIP SPEC" PACKAGE [PYTHON [MARKERS [TEST FILES...]]]
#     --prepare  only create (or refresh) the environment; no tests
#     NAME       environment .venv-compat-NAME
#     SPEC       e.g. "pytorch-lightning==2.4.0" or "lightning==2.6.6"
#     PACKAGE    the package the tests import: pytorch_lightning or lightning.pytorch (ADASUM_TEST_PACKAGE)
#     MARKERS    pytest's -m expression (default: every single-process test and the tests marked `compat`)
#     TEST FILES the test files to run (default: the strategy, validation and multi-process ones below)
# The project is installed with `pip install .` and no extras (torchvision and jsonargparse stay out), so this
# pass also shows that the strategies import and train with the package's install_requires alone.
set -euo pipefail
prepare_only=0
if [ "${1:-}" = --prepare ]; then prepare_only=1; shift; fi
name=$1 spec=$2 package=$3 py=${4:-python3} markers=${5:-"not mpi or compat"}
shift $(( $# < 5 ? $# : 5 ))
venv=".venv-compat-$name"
lock=".venv-compat.lock"  # shared by every compat environment
step() { echo "[compat:$name] $*"; }
SECONDS=0

constraints=adasum_lightning/constraints.txt  # the torch pin, as make setup installs it
stamp="$venv/.compat-$(printf '%s' "$spec" | cat - setup.cfg pyproject.toml "$constraints" "$0" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  rm -rf "$venv"
  step "creating $venv: $(grep '^torch==' "$constraints"), $spec, the project without extras, pytest"
  "$py" -m venv "$venv"
  .venv/bin/python .ci/seed_venv.py "$venv" torch  # torch's files hard-linked from make setup's .venv (no disk of its own)
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-compile -c "$constraints" torch "$spec" \
    "pytest>=8,<9.2" pytest-timeout "pytest-xdist>=3.5" \
    2> >(grep -v -e "^WARNING: Location" >&2)
  # The project is built in the checkout (build/, *.egg-info): one environment at a time (make test-compat
  # prepares both side by side).
  flock "$lock" "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-compile -c "$constraints" . \
    2> >(grep -v -e "^WARNING: Location" -e "BuildBackendWarning" >&2)
  bash patches/build_horovod.sh --python "$venv/bin/python" 2> >(grep -v "^WARNING: Location" >&2)
  # byte code, as make setup writes it (torch's came linked from .venv): Python writes none on CI machines
  "$venv/bin/python" -m compileall -q -j 0 "$("$venv/bin/python" -c \
    'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
  touch "$stamp"
else
  # the project itself may have changed since: reinstall it alone (seconds)
  flock "$lock" "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall . \
    2> >(grep -v -e "^WARNING: Location" -e "BuildBackendWarning" >&2)
fi
step "environment ready in ${SECONDS}s:" $("$venv/bin/python" -m pip list --disable-pip-version-check 2>/dev/null |
  awk 'tolower($1) ~ /^(torch|pytorch-lightning|lightning|horovod|adasum-lightning)$/ {printf "%s %s; ", $1, $2}')
[ "$prepare_only" = 1 ] && exit 0

# The tests import the checkout (its root is on sys.path); tests/test_packages.py::test_plain_install_* imports
# the installed copy from outside the checkout.
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(
  tests/test_strategy.py tests/test_replicas.py tests/test_launch_environment.py tests/test_checkpoint.py
  tests/test_horovod_support.py tests/test_compat.py
  tests/test_packages.py tests/test_mpi.py tests/test_mpi_edge_cases.py tests/test_crossrank.py
  tests/test_ddp_adasum.py tests/test_forms.py tests/test_optimizer.py tests/test_fabric_horovod.py
  tests/test_uneven.py tests/test_resume.py)
# As make test runs them: two workers (the files that share launches on one), then the tests that assert a
# wall-clock limit alone; pytest's 5 (nothing selected) is no failure there.
run_tests() {
  ADASUM_TEST_PACKAGE=$package ADASUM_PLAIN_INSTALL=1 "$venv/bin/python" -m pytest -ra -p no:cacheprovider "$@" \
    "${files[@]}"
}
rc=0
run_tests --durations=15 -n "${TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder \
  -m "($markers) and not walltime" || rc=$?
run_tests --durations=5 -m "($markers) and walltime" || { r=$?; [ "$r" = 5 ] || rc=$r; }
step "done in ${SECONDS}s"
exit "$rc"
