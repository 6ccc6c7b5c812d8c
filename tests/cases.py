"""Many cases in one launch: what the tests declare, and the results every rank recorded.

A test names the cases it reads with ``@pytest.mark.cases(CASE, ...)`` and takes the ``cases`` fixture
(``tests/conftest.py``). The first test that needs a launch (``Launch``) starts it once, with
every case of that launch that the *collected* tests declare (``-k`` runs only what it selects), under
``tests/workers/cases.py``; each test then asserts its own property from what its cases recorded. A case whose
arguments read another case's folder (``{NAME}``) runs after it: in the same launch when it comes later in the
collected order, or in a launch of a later phase.
"""

from __future__ import annotations

import json
import re
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
    one Lightning package only). A launch of a later ``phase`` may read the folders of earlier ones (e.g. a
    resume at another world size of a 2-rank fit)."""

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
    timeout: float = 240

    @property
    def reads(self) -> set[str]:
        """The cases whose folders this case's arguments name."""
        return {name for arg in self.args for name in FOLDER.findall(arg)}

    def argv(self, base: Path) -> list[str]:
        resolved = [FOLDER.sub(lambda m: str(base / m.group(1)), arg) for arg in self.args]
        devices = ["--devices", str(self.launch.np)] if self.launch.launcher == "lightning" else []
        return [str(base / self.name), *resolved, *devices]


#: A case's first line on each rank (``tests/workers/cases.py``).
BEGIN = re.compile(r"\[case (\S+)\] begin")

#: ``{NAME}`` in a case's argument: case NAME's folder.
FOLDER = re.compile(r"\{([^{}]+)\}")


def case(launch: Launch, name: str, worker: str, *args: str, timeout: float = 240) -> Case:
    return Case(launch, name, worker, tuple(args), timeout)


@dataclass
class CaseResult:
    """What every rank of one case recorded: its status file, its ``rank<r>.pt`` and the launch's output."""

    case: Case
    out: Path
    output: str
    statuses: list[dict] = field(default_factory=list)
    #: Why the launch itself failed although every case ended (a crash at exit), or "".
    launch_problem: str = ""

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
        """Every rank's ``rank<r>.pt``; fails naming the case and the rank when one did not end well, or when
        the launch failed after its cases ended."""
        for r, status in enumerate(self.statuses):
            if status.get("status") != "ok":
                pytest.fail(self._describe(r))
        if self.launch_problem:
            pytest.fail(self.launch_problem)
        return load_ranks(self.out, self.case.launch.np)

    @property
    def case_output(self) -> str:
        """Every rank's output of this case: from its first ``begin`` line to the next case's first ``begin``
        line after its last ``ok``/``error`` line (a launcher may forward a rank's stderr after its stdout;
        a neighbouring case's first or last lines may fall inside)."""
        name = f"[case {self.case.name}]"
        start = max(self.output.find(f"{name} begin"), 0)
        end = max(self.output.rfind(f"{name} {word}") for word in ("ok", "error"))
        after = BEGIN.search(self.output, max(end, start)) if end > start else None
        while after and after.group(1) == self.case.name:
            after = BEGIN.search(self.output, after.end())
        return self.output[start : after.start() if after else len(self.output)]

    def errors(self) -> list[tuple[str, str]]:
        """``(exception type, message)`` of every rank; fails when a rank did not raise."""
        for r, status in enumerate(self.statuses):
            if status.get("status") != "error":
                pytest.fail(f"expected an exception on every rank\n{self._describe(r)}")
        return [(s["type"], s["message"]) for s in self.statuses]


class CaseLaunches:
    """The session's launches: each started once, on first need, with the collected tests' cases; a launch
    whose cases read other launches' folders starts after those."""

    #: The longest a launch may run (seconds): below pytest's timeout, so that a stuck launcher fails here.
    LONGEST = 1500

    def __init__(self, base: Path, items: list[pytest.Item]) -> None:
        self.base = base
        self.declared: dict[Launch, dict[str, Case]] = {}
        self.named: dict[str, Case] = {}
        for item in items:
            for marker in item.iter_markers("cases"):
                for c in marker.args:
                    known = self.named.setdefault(c.name, c)
                    assert known == c, f"two different cases are named {c.name!r}"
                    self.declared.setdefault(c.launch, {})[c.name] = c
        for c in self.named.values():
            for name in c.reads:
                read = self.named.get(name)
                assert read is not None, f"case {c.name!r} reads {name!r}, which no collected test declares"
                order = list(self.declared[c.launch])
                assert (read.launch.phase < c.launch.phase) or (
                    read.launch == c.launch and order.index(name) < order.index(c.name)
                ), f"case {c.name!r} reads {name!r}: it must come later in its launch, or in a later phase"
        self.outputs: dict[Launch, tuple[int | None, str]] = {}

    def run(self, launch: Launch) -> None:
        if launch in self.outputs:
            return
        cases = list(self.declared[launch].values())
        for before in {self.named[name].launch for c in cases for name in c.reads} - {launch}:
            self.run(before)
        spec = self.base / f"{launch.key}.json"
        entries = [
            {"name": c.name, "worker": c.worker, "argv": c.argv(self.base), "timeout": c.timeout,
             "out": str(self.base / c.name)}
            for c in cases
        ]  # fmt: skip
        spec.write_text(json.dumps({"cases": entries}, indent=1))
        cmd, env = launch.command(spec)
        timeout = min(sum(c.timeout for c in cases) + 60, self.LONGEST)
        proc = run_job(cmd, env, timeout=timeout, check=False, merged=True, fail_on_timeout=False)
        exit_line = f"timed out after {timeout} s" if proc.returncode is None else f"exit {proc.returncode}"
        self.outputs[launch] = (proc.returncode, f"{' '.join(cmd)}: {exit_line}\n{proc.stdout}")

    def result(self, c: Case) -> CaseResult:
        self.run(c.launch)
        returncode, output = self.outputs[c.launch]
        statuses = [
            self._status(other, r)
            for other in self.declared[c.launch].values()
            for r in range(other.launch.np)
        ]
        ended = all(s["status"] in ("ok", "error") for s in statuses)
        problem = (
            f"every case ended, but {output.splitlines()[0]}\n--- the launch's last output\n{output[-4000:]}"
            if ended and returncode != 0
            else ""
        )
        return CaseResult(
            c, self.base / c.name, output, [self._status(c, r) for r in range(c.launch.np)], problem
        )

    def _status(self, c: Case, r: int) -> dict:
        path = self.base / c.name / f"case.rank{r}.json"
        return json.loads(path.read_text()) if path.exists() else {"status": "not run"}


class Cases:
    """The ``cases`` fixture: ``cases[CASE]`` is that case's :class:`CaseResult`."""

    def __init__(self, launches: CaseLaunches, declared: list[Case]) -> None:
        self.launches = launches
        self.declared = declared
        for launch in {c.launch for c in declared}:
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


def worker_groups(items: list[pytest.Item]) -> dict[str, list[pytest.Item]]:
    """The items in groups that one pytest-xdist worker must run together: a test file (its module fixtures,
    its network namespaces) together with every file whose tests read cases of the same launches, or of
    launches those read (``{NAME}``), so that each launch starts once in the session. Named by the group's
    first file; in collection order."""
    parent: dict[str, str] = {}

    def root(node: str) -> str:
        while parent.setdefault(node, node) != node:
            node = parent[node]
        return node

    def join(a: str, b: str) -> None:
        parent[root(a)] = root(b)

    named = {c.name: c for item in items for marker in item.iter_markers("cases") for c in marker.args}
    for item in items:
        root(item.path.name)
        for c in (c for marker in item.iter_markers("cases") for c in marker.args):
            join(f"launch {c.launch.key}", item.path.name)
            for name in c.reads:
                join(f"launch {named[name].launch.key}", item.path.name)
    groups: dict[str, list[pytest.Item]] = {}
    names: dict[str, str] = {}
    for item in items:
        name = names.setdefault(root(item.path.name), item.path.stem)
        groups.setdefault(name, []).append(item)
    return groups
