"""What one GPU can check, in one script (``make gpu-check``): one line per check, under 10 minutes.

    python -m tests.gpu_check [--only NAME ...] [--timeout S]     # from the repository root

Each check runs in a process of its own (a timeout each; a crash fails that line only) and prints
``ok: NAME: detail (N s)``, ``FAILED: NAME: reason`` or, on a machine without a CUDA device,
``skipped: no GPU: NAME``. Exit status 1 when a check failed (skipped ones do not count).

- ``horovod_nccl``: the GPU wheel of ``make gpu-wheel`` (installed into a scratch venv, see
  ``tests/gpu_wheel.py``) imports, ``hvd.init()``, ``nccl_built()``; allreduce of a ``cuda:0`` tensor with
  Adasum (Horovod's AdasumGpuAllreduceOp), Average and Sum.
- ``horovod_adasum_trainer``: the Trainer with ``strategy="horovod_adasum"`` (that wheel) on ``cuda:0``,
  world size 1, a few steps.
- ``ddp_adasum_trainer``, ``ddp_adasum_fabric``: ``ddp_adasum`` on ``cuda:0`` (NCCL process group of one),
  the Trainer and Fabric.
- ``adasum_allreduce_cuda``: ``adasum_allreduce`` on CUDA tensors through an NCCL group of one, and its
  device code path (the per-tensor Gram sums and scaled add that every level of the reduction runs,
  ``adasum_lightning.allreduce._local_pair``) on ``cuda:0`` against the reference ``adasum`` on the CPU,
  float32 and float64. (Two ranks cannot share one GPU under NCCL, so the exchange itself needs 2 GPUs.)
- ``sync_batchnorm``: ``ddp_adasum`` with ``sync_batchnorm=True`` on one GPU: the BatchNorm layers become
  SyncBatchNorm and training runs.
- ``bf16_mixed``, ``fp16_mixed``: ``ddp_adasum`` with ``precision="bf16-mixed"`` / ``"16-mixed"`` (GradScaler)
  on ``cuda:0``; the loss stays finite and the parameters move.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Self-test only (tests/test_gpu_check.py): "cpu" runs the checks' code on the CPU (Gloo instead of NCCL).
SELFTEST_CPU = os.environ.get("ADASUM_GPU_CHECK_SELFTEST") == "cpu"
DEVICE = "cpu" if SELFTEST_CPU else "cuda"

#: (name, needs the GPU Horovod wheel)
CHECKS = (
    ("horovod_nccl", True),
    ("horovod_adasum_trainer", True),
    ("ddp_adasum_trainer", False),
    ("ddp_adasum_fabric", False),
    ("adasum_allreduce_cuda", False),
    ("sync_batchnorm", False),
    ("bf16_mixed", False),
    ("fp16_mixed", False),
)


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


# ---------------------------------------------------------------- the checks (each runs in its own process)


def _module(batchnorm: bool = False):
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            layers = (
                [nn.Linear(16, 32)]
                + ([nn.BatchNorm1d(32)] if batchnorm else [])
                + [nn.ReLU(), nn.Linear(32, 4)]
            )
            self.net = nn.Sequential(*layers)
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.5)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(256, 16, generator=g)
            return DataLoader(TensorDataset(x, (x[:, :4].argmax(1))), batch_size=32)

    return Module()


def _fit(strategy: str, **trainer_kwargs) -> str:
    import pytorch_lightning as pl
    import torch

    import adasum_lightning  # noqa: F401  (registers the strategy names)

    pl.seed_everything(0)
    model = _module(batchnorm=trainer_kwargs.pop("batchnorm", False))
    start = [p.detach().clone() for p in model.parameters()]
    with tempfile.TemporaryDirectory(prefix="adasum-gpu-check-") as root:
        trainer = pl.Trainer(
            strategy=strategy,
            accelerator="cpu" if SELFTEST_CPU else "gpu",
            devices=1,
            max_steps=8,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
            **trainer_kwargs,
        )
        trainer.fit(model)
    device = next(model.parameters()).device
    assert device.type == DEVICE, f"the model ended on {device}"
    assert len(model.losses) == 8 and all(torch.isfinite(torch.tensor(model.losses))), model.losses
    moved = max(
        float((p.detach().cpu() - s).abs().max()) for p, s in zip(model.parameters(), start, strict=True)
    )
    assert moved > 0, "the parameters did not move"
    syncbn = sum(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules())
    return (
        f"{type(trainer.strategy).__name__} on {_device_name(device)}, 8 steps, loss "
        f"{model.losses[0]:.3f} -> {model.losses[-1]:.3f}, SyncBatchNorm layers {syncbn}"
    )


def _device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)


def check_horovod_nccl() -> str:
    import horovod.torch as hvd
    import torch

    hvd.init()
    if not SELFTEST_CPU:
        torch.cuda.set_device(hvd.local_rank())
    assert hvd.nccl_built() > 0, "nccl_built() = 0"
    x = torch.arange(1.0, 1025.0, device=DEVICE)
    out = {op: hvd.allreduce(x.clone(), op=getattr(hvd, op), name=op) for op in ("Adasum", "Average", "Sum")}
    for op, y in out.items():
        assert y.device.type == DEVICE and torch.equal(y, x), f"{op}: {y[:4].tolist()} (expected x at size 1)"
    return f"nccl_built()={hvd.nccl_built()}, size {hvd.size()}, Adasum/Average/Sum of a {x.device} tensor: x"


def check_horovod_adasum_trainer() -> str:
    return _fit("horovod_adasum")


def check_ddp_adasum_trainer() -> str:
    return _fit("ddp_adasum")


def check_ddp_adasum_fabric() -> str:
    import torch
    from lightning_fabric import Fabric

    import adasum_lightning  # noqa: F401

    fabric = Fabric(strategy="ddp_adasum", accelerator=DEVICE, devices=1)
    fabric.launch()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    losses = []
    for _ in range(8):
        x = torch.randn(32, 16, device=fabric.device)
        loss = torch.nn.functional.cross_entropy(model(x), x[:, :4].argmax(1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    assert fabric.device.type == DEVICE and all(torch.isfinite(torch.tensor(losses))), losses
    name = type(fabric.strategy).__name__
    return f"{name} on {fabric.device}, 8 steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def check_adasum_allreduce_cuda() -> str:
    import torch
    import torch.distributed as dist

    from adasum_lightning import adasum, adasum_allreduce
    from adasum_lightning.allreduce import _local_pair

    if SELFTEST_CPU:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        torch.cuda.set_device(0)
        dist.init_process_group(
            "nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda:0")
        )
    try:
        tensors = [torch.randn(1000, device=DEVICE), torch.randn(7, 3, device=DEVICE, dtype=torch.float64)]
        before = [t.clone() for t in tensors]
        adasum_allreduce(tensors)
        assert all(torch.equal(a, b) for a, b in zip(tensors, before, strict=True)), (
            "world size 1 changed the tensors"
        )
    finally:
        dist.destroy_process_group()
    worst = 0.0
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        sizes = [1, 5, 1000, 70_000]
        a = [torch.randn(n, generator=g, dtype=dtype) for n in sizes]
        b = [torch.randn(n, generator=g, dtype=dtype) for n in sizes]
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        low, high = torch.cat(a).to(DEVICE), torch.cat(b).to(DEVICE)
        _local_pair(low, high, offsets)
        expected = torch.cat([adasum(x, y) for x, y in zip(a, b, strict=True)])
        err = float((low.cpu() - expected).abs().max() / expected.abs().max())
        tol = 1e-6 if dtype == torch.float32 else 1e-13
        assert err < tol, f"{dtype}: relative error {err:.2e} against the CPU reference"
        worst = max(worst, err)
    group = "Gloo" if SELFTEST_CPU else "NCCL"
    return f"{group} group of 1: tensors unchanged; device pair step vs CPU reference: rel. error {worst:.1e}"


def check_sync_batchnorm() -> str:
    out = _fit("ddp_adasum", sync_batchnorm=True, batchnorm=True)
    assert "SyncBatchNorm layers 1" in out, out
    return out


def check_bf16_mixed() -> str:
    return _fit("ddp_adasum", precision="bf16-mixed")


def check_fp16_mixed() -> str:
    return _fit("ddp_adasum", precision="16-mixed")


# ---------------------------------------------------------------- the driver


def _horovod_python(workdir: Path) -> Path:
    """A scratch venv with the cached GPU wheel (``make gpu-wheel`` builds it)."""
    from tests import gpu_wheel

    wheel = gpu_wheel.cached_wheel()
    if wheel is None:
        raise RuntimeError("no cached GPU wheel: run `make gpu-wheel` first")
    return gpu_wheel.scratch_env(wheel, workdir / "venv")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    )
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    return env


def run(names: list[str], timeout: float) -> int:
    if not gpu_available() and not SELFTEST_CPU:
        for name in names:
            print(f"skipped: no GPU: {name}", flush=True)
        return 0
    failed = 0
    horovod_python: Path | str | None = None
    with tempfile.TemporaryDirectory(prefix="adasum-gpu-check-") as tmp:
        for name in names:
            needs_horovod = dict(CHECKS)[name]
            start = time.monotonic()
            if needs_horovod and horovod_python is None:
                try:
                    horovod_python = _horovod_python(Path(tmp))
                except Exception as err:  # no wheel: those checks fail, the others still run
                    horovod_python = f"{err}"
            if needs_horovod and isinstance(horovod_python, str):
                print(f"FAILED: {name}: {horovod_python}", flush=True)
                failed += 1
                continue
            python = str(horovod_python) if needs_horovod else sys.executable
            try:
                proc = subprocess.run(
                    [python, "-m", "tests.gpu_check", "--run-one", name],
                    capture_output=True,
                    text=True,
                    env=_env(),
                    cwd=tmp,
                    timeout=timeout,
                )
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                ok = proc.returncode == 0 and lines
                detail = (
                    lines[-1][len("RESULT ") :] if ok else (proc.stderr.strip().splitlines() or ["?"])[-1]
                )
            except subprocess.TimeoutExpired:
                ok, detail = False, f"timed out after {timeout:.0f} s"
            took = time.monotonic() - start
            print(f"{'ok' if ok else 'FAILED'}: {name}: {detail} ({took:.0f} s)", flush=True)
            failed += not ok
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=[n for n, _ in CHECKS], help="run these checks only")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per check (default 120)")
    parser.add_argument("--run-one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_one:
        print("RESULT " + globals()[f"check_{args.run_one}"](), flush=True)
        return 0
    return run(args.only or [n for n, _ in CHECKS], args.timeout)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
