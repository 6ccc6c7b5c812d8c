"""``--local N``: the job's code snapshot, command and variables on this machine, N CPU processes, the data
bound to local folders. ``ddp_adasum`` starts its processes with an Azure ML PyTorch job's variables (not
``torchrun``), so that Lightning takes the cluster's path.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from lightning_fabric.plugins.environments.lightning import find_free_network_port

from adasum_lightning.aml.errors import AmlUsageError, say
from adasum_lightning.aml.job import AML_PYTORCH_VARIABLES, AmlJob, check_process_count
from adasum_lightning.aml.project import bind_placeholders
from adasum_lightning.aml.staging import stage_code
from adasum_lightning.horovod.support import missing_horovod_message

#: Variables of other launchers, removed from a ``ddp_adasum`` local run so that Lightning sees only what an
#: Azure ML PyTorch job sets (``TORCHELASTIC_RUN_ID`` would select ``TorchElasticEnvironment``, and so on).
_OTHER_LAUNCHER_PREFIXES = ("TORCHELASTIC_", "OMPI_COMM_WORLD_", "PMI_", "HOROVOD_", "SLURM_", "LSB_", "JSM_")
_OTHER_LAUNCHER_NAMES = ("GROUP_RANK", "ROLE_RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE")
LOCAL_TIMEOUT = 900  # seconds before a local run is stopped


def local_command(
    job: AmlJob, np: int, data_dir, output_dir, batches: int, python: str | None = None
) -> list:
    """The local run's command, its ``${{…}}`` placeholders unbound (:func:`run_local` binds them).

    Horovod strategies: ``horovodrun -np N -H localhost:N … python SCRIPT <job args> <CPU overrides>``.
    ``ddp_adasum``: ``python SCRIPT <job args> <CPU overrides> --trainer.devices=N --trainer.num_nodes=1``,
    run by each of the N processes. A script without ``--trainer.*`` arguments gets no overrides; it reads
    :meth:`.job.AmlJob.topology_variables`.

    ``data_dir`` is the bundled example's MNIST root (``None`` for a user's script), ``output_dir``
    Lightning's ``default_root_dir``, ``batches`` the training and validation batches per process.

    Raises:
        AmlUsageError: ``np`` or ``batches`` is not a positive integer, ``np`` not a power of 2 for
            ``horovod_adasum``, or horovodrun is missing.
    """
    check_process_count(np, "--local", "--local", job.strategy)
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise AmlUsageError(f"--local-batches {batches!r} must be a positive integer")
    python = python or sys.executable
    command = job.training_command(python=python)
    if job.trainer_args:
        command += ["--trainer.accelerator=cpu", "--trainer.max_epochs=1"]
        command += [f"--trainer.limit_train_batches={batches}", f"--trainer.limit_val_batches={batches}"]
        command += [f"--data.data_dir={data_dir}"] if data_dir is not None else []
        command += [f"--trainer.default_root_dir={output_dir}"]
        command += [] if job.is_mpi else [f"--trainer.devices={np}", "--trainer.num_nodes=1"]
    if not job.is_mpi:
        return command
    horovodrun = Path(python).with_name("horovodrun")
    horovodrun = str(horovodrun) if horovodrun.exists() else shutil.which("horovodrun")
    if not horovodrun:
        raise AmlUsageError(
            f"--strategy {job.strategy} needs horovodrun: "
            + missing_horovod_message("horovodrun (Horovod's launcher)", "--strategy ddp_adasum", python)
        )
    yield_when_idle = "--mpi-args=--mca mpi_yield_when_idle 1"  # more processes than cores: no busy polling
    return [horovodrun, "-np", str(np), "-H", f"localhost:{np}", "--mpi", yield_when_idle, *command]


def pytorch_job_environment(np: int, rank: int, port: int) -> dict[str, str]:
    """What an Azure ML PyTorch job sets in process ``rank`` of ``np`` on one node, rendezvous on ``port``."""
    values = ("127.0.0.1", port, np, 0, rank, rank)
    return {name: str(value) for name, value in zip(AML_PYTORCH_VARIABLES, values, strict=True)}


def _without_other_launchers(env: Mapping[str, str]) -> dict[str, str]:
    others = (*_OTHER_LAUNCHER_NAMES, *AML_PYTORCH_VARIABLES)
    return {k: v for k, v in env.items() if not k.startswith(_OTHER_LAUNCHER_PREFIXES) and k not in others}


def run_local(
    job: AmlJob, np: int, work_dir: Path, source_dir: Path | None = None, data_dir=None, batches: int = 4
) -> int:
    """Stage the code snapshot in ``work_dir/code`` and run the job's command there on ``np`` CPU processes,
    its data bindings local paths, Lightning's outputs in ``work_dir/outputs``.

    Returns:
        0 on success; else horovodrun's exit code, or for ``ddp_adasum`` the first failing process's (the
        others are stopped); 124 after :data:`LOCAL_TIMEOUT` seconds.
    """
    work_dir = Path(work_dir)
    if job.script is None:
        data_dir = Path(data_dir or "data").expanduser().resolve()
    command = local_command(job, np, data_dir, work_dir.resolve() / "outputs", batches)
    paths = {}
    for binding in job.data:
        path = Path(binding.uri).expanduser().resolve()
        if binding.direction == "outputs":
            path.mkdir(parents=True, exist_ok=True)
        paths[(binding.direction, binding.name)] = str(path)
    command = bind_placeholders(command, paths)  # the training arguments' and resume's placeholders
    code_dir, _ = stage_code(job, work_dir / "code", source_dir)
    env = {**os.environ, **job.environment_variables}
    env.update(job.topology_variables(accelerator="cpu", devices=1 if job.is_mpi else np, nodes=1))
    env.setdefault("OMP_NUM_THREADS", "1")
    if not job.is_mpi:
        port = find_free_network_port()
        say(
            f"local run in {code_dir}: {np} processes started as an Azure ML PyTorch job starts them "
            f"(MASTER_ADDR=127.0.0.1 MASTER_PORT={port} WORLD_SIZE={np} NODE_RANK=0, "
            f"RANK=LOCAL_RANK=0…{np - 1}), each running:\n  {shlex.join(command)}",
            sys.stderr,
        )
        env = _without_other_launchers(env)
        envs = [{**env, **pytorch_job_environment(np, rank, port)} for rank in range(np)]
        return _run_processes(command, envs, cwd=code_dir, timeout=LOCAL_TIMEOUT)
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI refuses root without these (as the Makefile)
        env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **env}
    say(f"local run in {code_dir}:\n  {shlex.join(command)}", sys.stderr)
    return _run_processes(command, [env], cwd=code_dir, timeout=LOCAL_TIMEOUT)


def _stop(procs: Sequence[subprocess.Popen], grace: float = 10) -> None:
    """SIGTERM the process group of every running process, SIGKILL what is left after ``grace`` s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [proc for proc in procs if proc.poll() is None]
        for proc in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        deadline = time.monotonic() + grace
        for proc in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()) if sig == signal.SIGTERM else None)
        if all(proc.poll() is not None for proc in procs):
            return


def _run_processes(command: list[str], envs: Sequence[Mapping], *, cwd: Path, timeout: float | None) -> int:
    """Run ``command`` once per environment of ``envs``, each in its own process group.

    Returns 0 when all succeed, else the first non-zero exit code (the others are stopped), or 124 after
    ``timeout`` s.
    """
    procs = [subprocess.Popen(command, cwd=cwd, env=dict(e), start_new_session=True) for e in envs]
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            codes = [proc.poll() for proc in procs]
            failed = [code for code in codes if code not in (None, 0)]
            if failed and len(procs) > 1 and None in codes:
                say("a local process failed: stopping the others", sys.stderr)
            if failed or all(code == 0 for code in codes):
                _stop(procs)
                return failed[0] if failed else 0
            if deadline is not None and time.monotonic() > deadline:
                say(f"local run stopped after {timeout:.0f} s", sys.stderr)
                _stop(procs)
                return 124
            time.sleep(0.2)
    except KeyboardInterrupt:
        _stop(procs, grace=5)
        raise
