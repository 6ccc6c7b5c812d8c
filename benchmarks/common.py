"""Shared pieces of the benchmarks: the study's model and data, environment facts, JSON output.

The model is the example's standard CNN (:class:`examples.mnist.MNISTNet`) **without dropout** (so that a
simulated run can match a real one bit for bit in data order and arithmetic) and with an optional
one-cycle schedule; the data are the example's MNIST splits, normalised once into tensors so that an
epoch does not spend seconds in per-image PIL transforms (values identical to ``MNISTDataModule``'s).
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from examples.mnist import MNIST_MEAN, MNIST_STD, MNISTDataModule, MNISTNet

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_DATA = ROOT.parent / "shared" / "data"
N_TRAIN = 60_000


def data_dir() -> str:
    """The MNIST torchvision root: ``$MNIST_DIR``, else ``../shared/data`` when present, else ``data``."""
    if os.environ.get("MNIST_DIR"):
        return os.environ["MNIST_DIR"]
    if (DEFAULT_DATA / "MNIST" / "raw" / "train-images-idx3-ubyte.gz").exists():
        return str(DEFAULT_DATA)
    return str(ROOT / "data")


class BenchNet(MNISTNet):
    """:class:`MNISTNet` (conv 1→10 k5, conv 10→20 k5, fc 320→50→10, log-softmax; ≈21.8k parameters)
    without dropout, trained by SGD with momentum and, optionally, a linear one-cycle schedule.

    Args:
        lr: peak learning rate (per process, before any world-size factor).
        momentum: SGD momentum.
        schedule: ``"onecycle"`` (``torch.optim.lr_scheduler.OneCycleLR``, linear, no momentum cycling,
            stepped every optimizer step over ``total_steps``) or ``"constant"``.
        total_steps: the one-cycle length in optimizer steps (required for ``"onecycle"``).
        pct_start: warm-up fraction of the cycle.
        div_factor: the cycle starts at ``lr / div_factor`` and ends at ``lr / div_factor /
            final_div_factor``.
        final_div_factor: see ``div_factor``.
    """

    def __init__(
        self,
        lr: float = 0.05,
        momentum: float = 0.9,
        schedule: str = "onecycle",
        total_steps: int = 0,
        pct_start: float = 0.18,
        div_factor: float = 25.0,
        final_div_factor: float = 1e3,
    ) -> None:
        super().__init__(lr=lr, momentum=momentum)
        self.save_hyperparameters()
        del self.conv2_drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)

    def configure_optimizers(self):
        hp = self.hparams
        opt = torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=hp.momentum)
        if hp.schedule == "constant":
            return opt
        if hp.schedule != "onecycle" or hp.total_steps <= 0:
            raise ValueError(f"schedule {hp.schedule!r} with total_steps {hp.total_steps} is not supported")
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt,
            max_lr=hp.lr,
            total_steps=hp.total_steps,
            pct_start=hp.pct_start,
            anneal_strategy="linear",
            cycle_momentum=False,
            div_factor=hp.div_factor,
            final_div_factor=hp.final_div_factor,
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def tensor_split(root: str, train: bool) -> TensorDataset:
    """One MNIST split as ``TensorDataset(x (n, 1, 28, 28) float32 normalised, y (n,) int64)``.

    Same values as the example's ``ToTensor()`` + ``Normalize(0.1307, 0.3081)`` per image.
    """
    from torchvision import datasets

    ds = datasets.MNIST(root, train=train)
    x = ds.data.unsqueeze(1).to(torch.float32).div(255)
    x = x.sub(MNIST_MEAN).div(MNIST_STD)
    return TensorDataset(x, ds.targets.clone())


class TensorMNISTDataModule(MNISTDataModule):
    """The example's :class:`MNISTDataModule` with both splits held as normalised tensors."""

    def setup(self, stage: str) -> None:
        root = str(self.root())
        self.train_set = tensor_split(root, train=True)
        self.val_set = tensor_split(root, train=False)


def prepared_root(directory: str | None = None) -> str:
    """Prepare MNIST (copy a read-only folder into the cache and extract) and return the usable root."""
    dm = MNISTDataModule(data_dir=directory or data_dir())
    dm.prepare_data()
    return str(dm.root())


def onecycle_steps(epochs: int, world_size: int, batch_size: int, n: int = N_TRAIN) -> int:
    """Optimizer steps in ``epochs`` epochs at ``world_size`` ranks (DistributedSampler shards)."""
    from benchmarks.simulate import steps_per_epoch

    return epochs * steps_per_epoch(n, world_size, batch_size)


def environment() -> dict:
    """Versions and machine facts recorded in every results file."""
    import numpy
    import pytorch_lightning

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pytorch_lightning": pytorch_lightning.__version__,
        "numpy": numpy.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }
    try:
        import horovod

        info["horovod"] = horovod.__version__
    except ImportError:
        info["horovod"] = None
    try:
        info["mpirun"] = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout.split(
            "\n"
        )[0]
    except OSError:
        info["mpirun"] = None
    try:
        info["cpu_model"] = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
        info["mem_total_kb"] = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, StopIteration):
        pass
    try:
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        pass
    return info


def write_results(name: str, payload: dict) -> Path:
    """Write ``benchmarks/results/<name>.json`` with the environment and the command line added."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "command": " ".join([sys.executable, *sys.argv]), **payload}
    payload.setdefault("environment", environment())
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return path


def _job_env() -> dict[str, str]:
    """The environment of a benchmark job: Open MPI as root, one intra-op thread per process, this checkout
    first on ``PYTHONPATH``, no inherited ``torch.distributed`` rendezvous variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")
    }
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        PYTHONWARNINGS="ignore",
    )
    return env


def _run_job(cmd: list[str], *, timeout: float, log: Path | None, retries: int) -> float:
    """Run ``cmd`` in a session of its own (killed whole on a timeout), retried ``retries`` times after a
    20 s pause; returns the wall time in seconds of the successful attempt.

    Raises:
        RuntimeError: the last attempt exited non-zero or timed out (with the end of its output).
    """
    outputs = []
    for attempt in range(retries + 1):
        start = time.perf_counter()
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=_job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            stderr += f"\n[bench] killed after {timeout:.0f} s"
        wall = time.perf_counter() - start
        outputs.append(f"### attempt {attempt + 1}: exit {proc.returncode}\n{stdout}{stderr}")
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text("\n".join(outputs))
        if proc.returncode == 0:
            return wall
        print(f"[bench] attempt {attempt + 1} failed: {' '.join(cmd)}", file=sys.stderr, flush=True)
        if attempt < retries:
            time.sleep(20)
    raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{(stdout + stderr)[-4000:]}")


def horovodrun(
    np: int, args: list[str], *, timeout: float = 1800, log: Path | None = None, retries: int = 2
) -> float:
    """Run ``python -m <args>`` on ``np`` ranks with ``horovodrun`` (Open MPI yielding when idle, one
    intra-op thread per process); returns the wall time in seconds of the successful attempt.

    A failed job is retried ``retries`` times after a 20 s pause (the working tree is shared with other
    work that may be mid-edit); every attempt's output is kept in ``log``.

    Raises:
        RuntimeError: the last attempt failed (with the end of its output).
    """
    bin_dir = Path(sys.executable).parent
    cmd = [str(bin_dir / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}",
           "--mpi-args=--mca mpi_yield_when_idle 1", sys.executable, "-m", *args]  # fmt: skip
    return _run_job(cmd, timeout=timeout, log=log, retries=retries)


def lightning_launch(
    args: list[str],
    *,
    timeout: float = 1800,
    log: Path | None = None,
    retries: int = 2,
    prefix: Sequence[str] = (),
    python: str = sys.executable,
) -> float:
    """Run ``python -m <args>`` as one plain process (after ``prefix``, e.g. ``ip netns exec NS``); the
    script's ``Trainer(devices=N)`` makes Lightning start the other N − 1 processes (its subprocess launcher:
    how users launch ``ddp_adasum``). One intra-op thread per process; returns the wall time in seconds of
    the successful attempt (retries as :func:`horovodrun`).

    Raises:
        RuntimeError: the last attempt failed (with the end of its output).
    """
    return _run_job([*prefix, python, "-m", *args], timeout=timeout, log=log, retries=retries)


def torchrun(
    np: int, args: list[str], *, timeout: float = 1800, log: Path | None = None, retries: int = 2
) -> float:
    """Run ``python -m <args>`` on ``np`` processes with ``torchrun --standalone`` (plain torch.distributed
    loops); returns the wall time in seconds of the successful attempt (retries as :func:`horovodrun`).

    Raises:
        RuntimeError: the last attempt failed (with the end of its output).
    """
    cmd = [
        str(Path(sys.executable).parent / "torchrun"),
        "--standalone",
        "--nproc-per-node",
        str(np),
        "-m",
        *args,
    ]
    return _run_job(cmd, timeout=timeout, log=log, retries=retries)


def logs_for(results_dir: Path) -> Path:
    """Where the jobs' console output goes (git-ignored ``runs/``): ``runs/bench-logs`` for the full
    results, ``runs/bench-logs-quick`` for ``benchmarks/results/quick``."""
    return ROOT / "runs" / ("bench-logs" if results_dir == RESULTS else f"bench-logs-{results_dir.name}")


def command_line(np: int, args: list[str], launcher: str = "horovodrun") -> str:
    """The shell form of :func:`horovodrun`'s (or, ``launcher="lightning"``, :func:`lightning_launch`'s, or
    ``launcher="torchrun"``, :func:`torchrun`'s) command, for the results files."""
    if launcher == "lightning":
        return "python -m " + " ".join(args)
    if launcher == "torchrun":
        return f"torchrun --standalone --nproc-per-node {np} -m " + " ".join(args)
    return (
        f'horovodrun -np {np} -H localhost:{np} --mpi-args="--mca mpi_yield_when_idle 1" python -m '
        + " ".join(args)
    )
