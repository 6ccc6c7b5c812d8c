"""Many cases in one launch: what the tests declare, and the results every rank recorded.

A test names the cases it reads with ``@pytest.mark.cases(CASE, ...)`` and takes the ``cases`` fixture
(``tests/conftest.py``). The first test that needs a launch (launcher, world size, phase) starts it once, with
every case of that launch that the *collected* tests declare (``-k`` runs only what it selects), under
``tests/workers/cases.py``; each test then asserts its own property from what its cases recorded. A case whose
arguments read another case's folder (``{NAME}``) runs after it: in the same launch when it comes later in the
collected order, or in a launch of a later phase.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import pytest

from tests.helpers import TAG, horovodrun_cmd, load_ranks, mpi_env, plain_env, run_job

LAUNCHERS = ("horovodrun", "horovodrun --gloo", "torchrun", "lightning", "python")


@dataclass(frozen=True)
class Launch:
    """One job: ``launcher`` (horovodrun with MPI or Gloo, torchrun, Lightning's own from a plain ``python``
    that adds ``--devices np`` to each case, or a plain ``python`` alone) at world size ``np``, with ``env``
    added to the environment; a ``group`` keeps its cases in a launch of their own (e.g. those that import
    one Lightning package only). A launch of a later ``phase``
    starts after the earlier ones a test reads (e.g. a resume at another world size of a 2-rank fit)."""

    launcher: str
    np: int
    phase: int = 0
    env: tuple[tuple[str, str], ...] = ()
    group: str = ""

    def __post_init__(self) -> None:
        assert self.launcher in LAUNCHERS, self.launcher

    @property
    def key(self) -> str:
        parts = [self.launcher.replace(" --", "-"), str(self.np), *(f"{k}={v}" for k, v in self.env)]
        parts += [self.group] if self.group else []
        return "-".join(parts + ([f"phase{self.phase}"] if self.phase else []))

    def command(self, spec: Path) -> tuple[list[str], dict[str, str]]:
        runner = [sys.executable, "-m", "tests.workers.cases", str(spec)]
        if self.launcher.startswith("horovodrun"):
            cmd, env = horovodrun_cmd(self.np, gloo=self.launcher.endswith("--gloo")) + runner, mpi_env()
        elif self.launcher == "torchrun":
            torchrun = str(Path(sys.executable).with_name("torchrun"))
            cmd, env = [torchrun, "--standalone", "--nproc-per-node", str(self.np), *runner[1:]], mpi_env()
        else:
            cmd, env = runner, plain_env()
        return cmd, {**env, "PYTHONUNBUFFERED": "1", **dict(self.env)}  # the output in the order written


@dataclass(frozen=True)
class Case:
    """A worker (``tests/workers/<worker>.py``) run with ``args`` in ``launch``; ``name`` is unique in the
    session and names its folder. ``{NAME}`` in an argument is replaced by case NAME's folder."""

    launch: Launch
    name: str
    worker: str
    args: tuple[str, ...] = ()
    timeout: float = 120

    def argv(self, base: Path) -> list[str]:
        resolved = [arg.format_map(_Folders(base)) if "{" in arg else arg for arg in self.args]
        devices = ["--devices", str(self.launch.np)] if self.launch.launcher == "lightning" else []
        return [str(base / self.name), *resolved, *devices]


def case(launch: Launch, name: str, worker: str, *args: str, timeout: float = 120) -> Case:
    return Case(launch, name, worker, tuple(args), timeout)


class _Folders(dict):
    def __init__(self, base: Path) -> None:
        super().__init__()
        self.base = base

    def __missing__(self, name: str) -> str:
        return str(self.base / name)


@dataclass
class CaseResult:
    """What every rank of one case recorded: its status file, its ``rank<r>.pt`` and the launch's output."""

    case: Case
    out: Path
    output: str
    statuses: list[dict] = field(default_factory=list)

    def _describe(self, r: int) -> str:
        status = self.statuses[r]
        marker = f"[case {self.case.name}] begin"
        start = self.output.find(marker)
        tail = self.output[start if start >= 0 else -6000 :][:6000]
        return (
            f"case {self.case.name!r} ({self.case.launch.key}) rank {r}: {status.get('status')}"
            f" {status.get('type', '')} {status.get('message', '')}\n{status.get('traceback', '')}"
            f"\n--- launch output from the case's start\n{tail}"
        )

    @cached_property
    def ranks(self) -> list[dict]:
        """Every rank's ``rank<r>.pt``; fails naming the case and the rank when one did not end well."""
        for r, status in enumerate(self.statuses):
            if status.get("status") != "ok":
                pytest.fail(self._describe(r))
        return load_ranks(self.out, self.case.launch.np)

    @property
    def case_output(self) -> str:
        """The launch's output from this case's first ``begin`` line to its last ``ok``/``error`` line (every
        rank's; a neighbouring case's first or last lines may fall inside)."""
        name = f"[case {self.case.name}]"
        start = self.output.find(f"{name} begin")
        ends = [self.output.rfind(f"{name} {word}") for word in ("ok", "error")]
        return self.output[max(start, 0) : max(ends) if max(ends) > start else len(self.output)]

    def errors(self) -> list[tuple[str, str]]:
        """``(exception type, message)`` of every rank; fails when a rank did not raise."""
        for r, status in enumerate(self.statuses):
            if status.get("status") != "error":
                pytest.fail(f"expected an exception on every rank\n{self._describe(r)}")
        return [(s["type"], s["message"]) for s in self.statuses]


class CaseLaunches:
    """The session's launches: each started once, on first need, with the collected tests' cases."""

    def __init__(self, base: Path, items: list[pytest.Item]) -> None:
        self.base = base
        self.declared: dict[Launch, dict[str, Case]] = {}
        for item in items:
            for marker in item.iter_markers("cases"):
                for c in marker.args:
                    known = self.declared.setdefault(c.launch, {}).setdefault(c.name, c)
                    assert known == c, f"two different cases are named {c.name!r}"
        self.outputs: dict[Launch, str] = {}

    def run(self, launch: Launch) -> str:
        if launch not in self.outputs:
            cases = list(self.declared[launch].values())
            spec = self.base / f"{launch.key}.json"
            entries = [
                {"name": c.name, "worker": c.worker, "argv": c.argv(self.base), "timeout": c.timeout,
                 "out": str(self.base / c.name)}
                for c in cases
            ]  # fmt: skip
            spec.write_text(json.dumps({"cases": entries}, indent=1))
            cmd, env = launch.command(spec)
            try:
                proc = run_job(cmd, env, timeout=sum(c.timeout for c in cases) + 60, check=False, merged=True)
                self.outputs[launch] = f"exit {proc.returncode}\n{proc.stdout}"
            except pytest.fail.Exception as timed_out:  # every case not ended reads as hung or not run
                self.outputs[launch] = str(timed_out)
        return self.outputs[launch]

    def result(self, c: Case) -> CaseResult:
        output = self.run(c.launch)
        out = self.base / c.name
        statuses = []
        for r in range(c.launch.np):
            path = out / f"case.rank{r}.json"
            statuses.append(json.loads(path.read_text()) if path.exists() else {"status": "not run"})
        return CaseResult(c, out, output, statuses)


class Cases:
    """The ``cases`` fixture: ``cases[CASE]`` is that case's :class:`CaseResult`."""

    def __init__(self, launches: CaseLaunches, declared: list[Case]) -> None:
        self.launches = launches
        self.declared = declared
        for launch in sorted({c.launch for c in declared}, key=lambda launch: launch.phase):
            launches.run(launch)

    def __getitem__(self, c: Case) -> CaseResult:
        assert c in self.declared, (
            f"the test reads case {c.name!r} without declaring it in @pytest.mark.cases"
        )
        return self.launches.result(c)


def assert_refused_on_every_rank(result: CaseResult, message: str, wrote_nothing: bool = True) -> None:
    """Every rank raised AdasumConfigurationError with exactly ``message`` and printed it; with
    ``wrote_nothing``, no rank wrote a result (the workers write theirs after training)."""
    output = TAG.sub("", result.case_output)
    for r, (kind, text) in enumerate(result.errors()):
        assert (kind, text) == ("AdasumConfigurationError", message), f"rank {r}: {kind}: {text}"
        assert f"AdasumConfigurationError on rank {r}: {message}" in output, f"rank {r} printed nothing"
    if wrote_nothing:
        assert not list(result.out.glob("rank*.pt")), "a refused case trained"
