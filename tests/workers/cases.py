"""Case runner: many named cases of the workers in one launch (horovodrun, torchrun or Lightning's launcher).

usage: python -m tests.workers.cases SPEC.json

SPEC is ``{"cases": [{"name", "worker", "argv", "timeout"}, ...]}`` (written by ``tests/cases.py``). Each case
runs a worker module (``tests.workers.<worker>``) as ``__main__`` with its own argv, in order, on every rank;
the worker builds its own Trainer / Fabric / optimizer and seeds itself. Around each case this process:

- writes ``<OUT>/case.rank<r>.json`` before (``running``) and after it (``ok``, or ``error`` with the
  exception's type, message and traceback): a refusal is a result, a hang or a crash names its case;
- arms a watchdog (``faulthandler``) that ends the process with every thread's traceback when the case runs
  past its timeout: a hang fails that case instead of holding the job until the launcher's timeout;
- resets the warning registries (a case sees its warnings as a new process would), destroys the process
  groups the case created and clears DTensor's cached plans (keyed by mesh layout, they would name them).
  The default group is kept: the launcher's rendezvous is once per launch (Lightning's launcher starts the
  other processes at the first case's fit, with this runner's argv; a plain loop's
  :func:`init_process_group` makes it once, with a collective timeout of ``COLLECTIVE_TIMEOUT``).
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import runpy
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

#: Rank variables of horovodrun/mpirun, Horovod's Gloo launcher, torchrun and Lightning's launcher.
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "RANK", "LOCAL_RANK")

#: A collective that waits longer than this fails its case (plain loops' default group; seconds).
COLLECTIVE_TIMEOUT = 90

#: The argv of the case being run; :func:`argv` hands it to the worker.
_current: list[str] | None = None


def argv() -> list[str]:
    """The worker's arguments: the running case's, or the command line's when the worker runs on its own."""
    return list(_current) if _current is not None else sys.argv[1:]


def init_process_group(backend: str = "gloo") -> None:
    """A plain loop's ``torch.distributed.init_process_group(backend)``; under the runner the launch's default
    group is made once (re-making it at the same rendezvous would meet the first group's keys) and kept."""
    import torch.distributed as dist

    if _current is None:
        dist.init_process_group(backend)
    elif not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT))


def destroy_process_group() -> None:
    """A plain loop's ``torch.distributed.destroy_process_group()``; the runner keeps the default group."""
    import torch.distributed as dist

    if _current is None:
        dist.destroy_process_group()


def rank() -> int:
    return int(next((os.environ[v] for v in RANK_VARIABLES if os.environ.get(v)), "0"))


def _process_groups() -> set:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return set()
    return set(dist.distributed_c10d._world.pg_map)


def _destroy_new_groups(before: set) -> None:
    import torch.distributed as dist

    default = dist.group.WORLD if dist.is_initialized() else None
    for group in _process_groups() - before:
        if group is not default:
            dist.destroy_process_group(group)
    _clear_dtensor_caches()


def _clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding and redistribution plans: they are keyed by mesh layout, so the next
    case's mesh of the same layout would reuse plans that name the groups just destroyed."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import _redistribute, debug

    debug._clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()


def _write(path: Path, status: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(status))
    tmp.replace(path)


def _say(name: str, text: str) -> None:
    """A line of the runner's, on stderr where the strategies print their refusals (a launcher forwards each
    stream in order)."""
    print(f"[case {name}] {text}", file=sys.stderr, flush=True)


def run_case(case: dict, filters: list) -> None:
    global _current
    out = Path(case["out"])
    out.mkdir(parents=True, exist_ok=True)
    status_path = out / f"case.rank{rank()}.json"  # Lightning's launcher sets no rank variable on rank 0
    _write(status_path, {"status": "running", "pid": os.getpid()})
    warnings.resetwarnings()
    warnings.filters[:] = filters
    groups = _process_groups()
    say = functools.partial(_say, case["name"])
    say(f"begin on rank {rank()}")
    faulthandler.dump_traceback_later(case["timeout"], exit=True)
    _current, start = case["argv"], time.monotonic()
    try:
        runpy.run_module(f"tests.workers.{case['worker']}", run_name="__main__")
        status = {"status": "ok"}
    except BaseException as err:  # SystemExit and refusals are results too
        status = {
            "status": "error",
            "type": type(err).__name__,
            "message": str(err) if not isinstance(err, SystemExit) else f"exit {err.code}",
            "traceback": traceback.format_exc(),
        }
    finally:
        faulthandler.cancel_dump_traceback_later()
        _current = None
    status["seconds"] = round(time.monotonic() - start, 3)
    try:
        _destroy_new_groups(groups)
    except Exception as err:  # the case's result stands; the next case starts without its groups
        say(f"could not destroy its process groups: {err!r}")
    _write(status_path, status)
    say(f"{status['status']} on rank {rank()} in {status['seconds']} s")
    if status["status"] == "error":
        print(status["traceback"], file=sys.stderr, flush=True)


def main() -> None:
    sys.modules.setdefault(
        "tests.workers.cases", sys.modules[__name__]
    )  # the workers' `argv()` is this one's
    spec = json.loads(Path(sys.argv[1]).read_text())
    filters = list(warnings.filters)
    for case in spec["cases"]:
        run_case(case, filters)
    _end_launch()


def _end_launch() -> None:
    """Leave the launch together: a barrier on the default group, then its destruction, so that no rank closes
    its connections while a peer still uses them (a crash at exit would fail every case of the launch)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
