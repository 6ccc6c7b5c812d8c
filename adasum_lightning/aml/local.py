"""``--local N``: the job's training command under ``horovodrun`` on this machine, N CPU processes.

A smoke test before paying for a cluster: the same code snapshot and the same command line as the job
(:meth:`.job.AmlJob.training_command`), followed by overrides for a CPU run of a few batches (LightningCLI
keeps the last value of an option). The job's environment variables are set too.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from adasum_lightning.aml.job import AmlJob, AmlUsageError, is_power_of_two
from adasum_lightning.aml.staging import stage_code


def local_overrides(data_dir: str | os.PathLike, output_dir: str | os.PathLike, batches: int) -> list[str]:
    """Arguments appended to the job's command for a CPU smoke run.

    Args:
        data_dir: torchvision MNIST root (``DIR/MNIST/raw``); downloaded when absent.
        output_dir: Lightning's ``default_root_dir``.
        batches: training and validation batches per process (one epoch).
    """
    return [
        "--trainer.accelerator=cpu",
        "--trainer.max_epochs=1",
        f"--trainer.limit_train_batches={batches}",
        f"--trainer.limit_val_batches={batches}",
        f"--data.data_dir={data_dir}",
        f"--trainer.default_root_dir={output_dir}",
    ]


def local_command(
    job: AmlJob, np: int, data_dir, output_dir, batches: int, python: str | None = None
) -> list[str]:
    """``horovodrun -np N -H localhost:N … python mnist.py <job args> <local overrides>``.

    Raises:
        AmlUsageError: ``np`` not a power of 2 (Adasum), or ``batches`` < 1.
    """
    if isinstance(np, bool) or not isinstance(np, int) or not is_power_of_two(np):
        raise AmlUsageError(f"--local {np!r}: the process count must be a power of 2 (1, 2, 4, …) for Adasum")
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise AmlUsageError(f"--local-batches {batches!r} must be a positive integer")
    python = python or sys.executable
    horovodrun = Path(python).with_name("horovodrun")
    if not horovodrun.exists():
        found = shutil.which("horovodrun")
        if not found:
            raise AmlUsageError(
                "horovodrun is not installed in this environment: run `make setup` (it builds Horovod)"
            )
        horovodrun = Path(found)
    launcher = [str(horovodrun), "-np", str(np), "-H", f"localhost:{np}", "--mpi"]
    # More processes than cores: Open MPI busy-polls unless told to yield (about 5× slower otherwise).
    launcher.append("--mpi-args=--mca mpi_yield_when_idle 1")
    command = job.training_command(python=python)
    return launcher + command + local_overrides(data_dir, output_dir, batches)


def run_local(
    job: AmlJob,
    np: int,
    *,
    work_dir: Path,
    data_dir: str | os.PathLike = "data",
    batches: int = 4,
    timeout: float | None = 900,
) -> int:
    """Stage the code snapshot in ``work_dir/code`` and run the job's command there on ``np`` processes.

    Args:
        job: the job description (its training arguments and environment variables are used).
        np: processes (power of 2); each trains ``batches`` batches of its shard on the CPU.
        work_dir: folder for the snapshot and Lightning's outputs (``work_dir/outputs``).
        data_dir: MNIST root, made absolute against the current directory.
        batches: training and validation batches per process.
        timeout: seconds before the run is stopped (``None``: no limit).

    Returns:
        horovodrun's exit code (0 on success; 124 when ``timeout`` expired).

    Raises:
        AmlUsageError: see :func:`local_command`.
    """
    work_dir = Path(work_dir)
    data_dir = Path(data_dir).expanduser().resolve()
    command = local_command(job, np, data_dir, work_dir.resolve() / "outputs", batches)
    code_dir = stage_code(work_dir / "code")
    env = dict(os.environ)
    env.update(job.environment_variables)
    env.setdefault("OMP_NUM_THREADS", "1")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # Open MPI refuses root without these (as in the Makefile).
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    print(f"[adasum-aml] local run in {code_dir}:\n  {shlex.join(command)}", file=sys.stderr, flush=True)
    # Own process group: on timeout horovodrun and every MPI rank it started are stopped together.
    proc = subprocess.Popen(command, cwd=code_dir, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"[adasum-aml] local run stopped after {timeout:.0f} s", file=sys.stderr, flush=True)
        for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=grace)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        return 124
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        raise
