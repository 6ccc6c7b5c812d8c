"""``--local N``: the job's training command on this machine, N CPU processes, started as Azure ML would.

The same code snapshot, command line and environment variables as the job, with ``${{inputs.NAME}}`` /
``${{outputs.NAME}}`` bound to local folders. ``ddp_adasum`` runs N processes with an Azure ML PyTorch job's
variables (:data:`.job.AML_PYTORCH_VARIABLES`), not ``torchrun``, so Lightning takes the cluster's path.
"""

from __future__ import annotations

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

from adasum_lightning.aml.errors import AmlUsageError
from adasum_lightning.aml.job import AML_PYTORCH_VARIABLES, AmlJob, check_process_count
from adasum_lightning.aml.project import bind_placeholders
from adasum_lightning.aml.staging import stage_code
from adasum_lightning.horovod.support import missing_horovod_message

#: Variables of other launchers, removed from a ``ddp_adasum`` local run so that Lightning sees only what an
#: Azure ML PyTorch job sets (``TORCHELASTIC_RUN_ID`` would select ``TorchElasticEnvironment``, and so on).
_OTHER_LAUNCHER_PREFIXES = ("TORCHELASTIC_", "OMPI_COMM_WORLD_", "PMI_", "HOROVOD_", "SLURM_", "LSB_", "JSM_")
_OTHER_LAUNCHER_NAMES = ("GROUP_RANK", "ROLE_RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE")


def local_overrides(
    data_dir: str | os.PathLike | None, output_dir: str | os.PathLike, batches: int
) -> list[str]:
    """Arguments appended to a LightningCLI script's command for a CPU smoke run.

    Args:
        data_dir: the bundled example's MNIST root (``DIR/MNIST/raw``); ``None`` for a user's script.
        output_dir: Lightning's ``default_root_dir``.
        batches: training and validation batches per process (one epoch).
    """
    return [
        "--trainer.accelerator=cpu",
        "--trainer.max_epochs=1",
        f"--trainer.limit_train_batches={batches}",
        f"--trainer.limit_val_batches={batches}",
        *([f"--data.data_dir={data_dir}"] if data_dir is not None else []),
        f"--trainer.default_root_dir={output_dir}",
    ]


def check_local_count(job: AmlJob, np: int) -> None:
    """Refuse a ``--local`` count that is not a positive integer (a power of 2 for ``horovod_adasum``).

    Raises:
        AmlUsageError: naming the fix.
    """
    check_process_count(np, "--local", "--local", job.strategy)


def local_command(
    job: AmlJob,
    np: int,
    data_dir,
    output_dir,
    batches: int,
    python: str | None = None,
) -> list[str]:
    """The local run's command.

    Horovod strategies: ``horovodrun -np N -H localhost:N … python SCRIPT <job args> <local overrides>``.
    ``ddp_adasum``: ``python SCRIPT <job args> <local overrides> --trainer.devices=N --trainer.num_nodes=1``,
    run by each of the N processes. A script without ``--trainer.*`` arguments gets no overrides and reads
    :func:`local_topology`.

    The placeholders ``${{inputs.X}}`` / ``${{outputs.X}}`` stay (:func:`run_local` binds them).

    Raises:
        AmlUsageError: see :func:`check_local_count`; ``batches`` < 1.
    """
    check_local_count(job, np)
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise AmlUsageError(f"--local-batches {batches!r} must be a positive integer")
    python = python or sys.executable
    command = job.training_command(python=python)
    if job.trainer_args:
        command += local_overrides(data_dir, output_dir, batches)
        if not job.is_mpi:
            command += [f"--trainer.devices={np}", "--trainer.num_nodes=1"]
    if not job.is_mpi:
        return command
    horovodrun = Path(python).with_name("horovodrun")
    if not horovodrun.exists():
        found = shutil.which("horovodrun")
        if not found:
            raise AmlUsageError(
                f"--strategy {job.strategy} needs horovodrun: "
                + missing_horovod_message("horovodrun (Horovod's launcher)", "--strategy ddp_adasum", python)
            )
        horovodrun = Path(found)
    launcher = [str(horovodrun), "-np", str(np), "-H", f"localhost:{np}", "--mpi"]
    # More processes than cores: Open MPI busy-polls unless told to yield (about 5× slower otherwise).
    launcher.append("--mpi-args=--mca mpi_yield_when_idle 1")
    return launcher + command


def local_topology(job: AmlJob, np: int) -> dict[str, str]:
    """:meth:`.job.AmlJob.topology_variables` of a local run: the CPU, one node, ``np`` processes."""
    return job.topology_variables(accelerator="cpu", devices=1 if job.is_mpi else np, nodes=1)


def pytorch_job_environment(np: int, rank: int, port: int) -> dict[str, str]:
    """What an Azure ML PyTorch job sets in process ``rank`` of ``np`` on one node, rendezvous on ``port``."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(np),
        "NODE_RANK": "0",
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
    }


def _without_other_launchers(env: Mapping[str, str]) -> dict[str, str]:
    return {
        key: value
        for key, value in env.items()
        if not key.startswith(_OTHER_LAUNCHER_PREFIXES)
        and key not in _OTHER_LAUNCHER_NAMES
        and key not in AML_PYTORCH_VARIABLES
    }


def local_data_paths(job: AmlJob, work_dir: Path) -> dict[tuple[str, str], str]:
    """Absolute local paths of the job's ``--input`` / ``--output`` bindings (outputs created)."""
    paths = {}
    for binding in job.data:
        path = Path(binding.uri).expanduser().resolve()
        if binding.direction == "outputs":
            path.mkdir(parents=True, exist_ok=True)
        paths[(binding.direction, binding.name)] = str(path)
    return paths


def run_local(
    job: AmlJob,
    np: int,
    *,
    work_dir: Path,
    source_dir: Path | None = None,
    data_dir: str | os.PathLike | None = None,
    batches: int = 4,
    timeout: float | None = 900,
) -> int:
    """Stage the code snapshot in ``work_dir/code`` and run the job's command there on ``np`` processes.

    Args:
        job: the job description (its data bindings are local paths here).
        np: processes (a power of 2 for ``horovod_adasum``); each trains on the CPU.
        work_dir: folder for the snapshot and Lightning's outputs (``work_dir/outputs``).
        source_dir: the project's source directory (``None`` for the bundled example).
        data_dir: the bundled example's MNIST root (default ``data``, relative to the current directory).
        batches: training and validation batches per process (LightningCLI scripts).
        timeout: seconds before the run is stopped (``None``: no limit).

    Returns:
        0 on success; else horovodrun's exit code, or for ``ddp_adasum`` the first failing process's (the
        others are stopped); 124 when ``timeout`` expired.

    Raises:
        AmlUsageError: see :func:`local_command`.
    """
    work_dir = Path(work_dir)
    if job.script is None:
        data_dir = Path(data_dir or "data").expanduser().resolve()
    paths = local_data_paths(job, work_dir)
    command = local_command(job, np, data_dir, work_dir.resolve() / "outputs", batches)
    command = bind_placeholders(command, paths)  # the training arguments' and resume's placeholders
    code_dir, _ = stage_code(job, work_dir / "code", source_dir)
    env = dict(os.environ)
    env.update(job.environment_variables)
    env.update(local_topology(job, np))
    env.setdefault("OMP_NUM_THREADS", "1")
    if job.is_mpi:
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            # Open MPI refuses root without these (as in the Makefile).
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        print(f"[adasum-aml] local run in {code_dir}:\n  {shlex.join(command)}", file=sys.stderr, flush=True)
        envs = [env]
    else:
        base = _without_other_launchers(env)
        port = find_free_network_port()
        envs = [{**base, **pytorch_job_environment(np, rank, port)} for rank in range(np)]
        print(
            f"[adasum-aml] local run in {code_dir}: {np} processes started as an Azure ML PyTorch job starts "
            f"them (MASTER_ADDR=127.0.0.1 MASTER_PORT={port} WORLD_SIZE={np} NODE_RANK=0, "
            f"RANK=LOCAL_RANK=0…{np - 1}), each running:\n  {shlex.join(command)}",
            file=sys.stderr,
            flush=True,
        )
    return _run_processes(command, envs, cwd=code_dir, timeout=timeout)


def _stop(procs: Sequence[subprocess.Popen], grace: float = 10) -> None:
    """SIGTERM the process group of every running process, SIGKILL what is left after ``grace`` s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [proc for proc in procs if proc.poll() is None]
        for proc in alive:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        for proc in alive:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()) if sig == signal.SIGTERM else None)
            except subprocess.TimeoutExpired:
                pass
        if all(proc.poll() is not None for proc in procs):
            return


def _run_processes(
    command: list[str], envs: Sequence[Mapping[str, str]], *, cwd: Path, timeout: float | None
) -> int:
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
            if failed:
                if len(procs) > 1 and any(code is None for code in codes):
                    print(
                        "[adasum-aml] a local process failed: stopping the others",
                        file=sys.stderr,
                        flush=True,
                    )
                _stop(procs)
                return failed[0]
            if all(code == 0 for code in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                print(f"[adasum-aml] local run stopped after {timeout:.0f} s", file=sys.stderr, flush=True)
                _stop(procs)
                return 124
            time.sleep(0.2)
    except KeyboardInterrupt:
        _stop(procs, grace=5)
        raise
