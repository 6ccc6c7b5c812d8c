"""``adasum-horovodrun``: ``horovodrun`` that passes SIGTERM, SIGINT and SIGHUP on to the job's ``mpirun``,
with the Open MPI settings of :mod:`adasum_lightning.failure_detection`.

``horovodrun`` ends as ``/bin/sh -c "mpirun …"``; where ``/bin/sh`` is dash a SIGTERM kills only that shell
(docs/launching.md).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

__all__ = ["main", "find_horovodrun"]

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def find_horovodrun() -> str:
    """``horovodrun`` next to this Python, else on ``PATH``; FileNotFoundError naming the build command."""
    beside = Path(sys.executable).with_name("horovodrun")
    if beside.exists():
        return str(beside)
    found = shutil.which("horovodrun")
    if found:
        return found
    from adasum_lightning.horovod.support import missing_horovod_message

    raise FileNotFoundError(missing_horovod_message("horovodrun (Horovod's launcher)"))


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(child) for child in text.split()]


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _signal_targets(child: int) -> list[int]:
    """``mpirun`` once the child's shell has started it (or when the child is ``mpirun``), else the child."""
    if _name(child) == "mpirun":
        return [child]
    return [pid for pid in _children(child) if _name(pid) == "mpirun"] or [child]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``horovodrun`` with ``argv``, forwarding termination signals; returns its exit status (128 + N for
    signal N; 2 when Horovod is missing)."""
    from adasum_lightning.failure_detection import mpi_env

    args = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ)
    added = {name: value for name, value in mpi_env().items() if name not in env}
    env.update(added)
    if added:
        settings = " ".join(f"{name.removeprefix('OMPI_MCA_')}={value}" for name, value in added.items())
        print(f"[adasum-horovodrun] Open MPI settings: {settings}", file=sys.stderr, flush=True)
    try:
        horovodrun = find_horovodrun()
    except FileNotFoundError as err:
        print(f"adasum-horovodrun: error: {err}", file=sys.stderr)
        return 2
    child = subprocess.Popen([horovodrun, *args], env=env)

    def forward(signum: int, frame: FrameType | None) -> None:
        for pid in _signal_targets(child.pid):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    try:
        status = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main())
