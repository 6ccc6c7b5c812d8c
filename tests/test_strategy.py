"""The strategies in one process: registration, construction without side effects, size-1 training."""

import subprocess
import sys

import pytest
import torch

import adasum_lightning
from tests.helpers import mpi_env, quick_fit
from tests.workers.lightning import (
    PACKAGE,
    HorovodAdasumStrategy,
    HorovodStrategy,
    pl,
    strategies,
)
from tests.workers.tiny import TinyModule  # noqa: E402


def test_import_registers_both_names():
    StrategyRegistry = strategies.StrategyRegistry
    assert StrategyRegistry["horovod_adasum"]["strategy"] is HorovodAdasumStrategy
    assert StrategyRegistry["horovod"]["strategy"] is HorovodStrategy
    assert adasum_lightning.__version__ == "0.2.0"


def test_building_a_trainer_does_not_initialise_horovod():
    # A fresh interpreter: the notebook case. Building the Trainer must not call hvd.init().
    code = (
        f"import adasum_lightning, {PACKAGE} as pl, horovod.torch as hvd\n"
        "t = pl.Trainer(strategy='horovod_adasum', accelerator='cpu', logger=False)\n"
        "print(type(t.strategy).__name__, hvd.is_initialized(), t.world_size, t.global_rank)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["HorovodAdasumStrategy", "False", "1", "0"]


@pytest.mark.parametrize("bad", ["double", -1, 0, True])
def test_lr_scaling_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="lr_scaling must be 'auto', 'none' or a positive number"):
        HorovodAdasumStrategy(lr_scaling=bad)


def test_compression_rejects_unknown():
    with pytest.raises(ValueError, match="compression must be 'none' or 'fp16'"):
        HorovodStrategy(compression="int8")


def test_environment_reads_the_launcher_before_init():
    # A fresh interpreter, so that no test before this one has initialised Horovod in it.
    code = (
        "from tests.workers.lightning import HorovodEnvironment as E\n"
        "e = E()\n"
        "print(e.global_rank(), e.world_size(), e.local_rank(), e.node_rank(), E.detect(),"
        " e.creates_processes_externally)\n"
    )
    env = {k: v for k, v in mpi_env().items() if not k.startswith("HOROVOD_")}
    env.update(
        OMPI_COMM_WORLD_RANK="5",
        OMPI_COMM_WORLD_SIZE="8",
        OMPI_COMM_WORLD_LOCAL_RANK="1",
        OMPI_COMM_WORLD_LOCAL_SIZE="4",
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["5", "8", "1", "1", "True", "True"]


def test_only_rank_zero_writes_checkpoints(tmp_path):
    # Rank taken from the launcher's variable (Horovod not initialised in that process).
    code = (
        f"import torch, adasum_lightning, {PACKAGE}\n"
        "s = adasum_lightning.HorovodAdasumStrategy()\n"
        f"s.save_checkpoint({{'x': torch.ones(1)}}, r'{tmp_path}/ckpt.pt')\n"
        "print(s.global_rank)\n"
    )
    for rank, exists in (("1", False), ("0", True)):
        env = dict(mpi_env(), OMPI_COMM_WORLD_RANK=rank, OMPI_COMM_WORLD_SIZE="2")
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip() == rank
        assert (tmp_path / "ckpt.pt").exists() is exists


@pytest.mark.parametrize(
    ("strategy", "expected_lr"),
    [("horovod_adasum", 0.1), ("horovod", 0.1), (HorovodAdasumStrategy(lr_scaling=2.5), 0.25)],
)
def test_size_one_fit_trains_with_the_expected_lr(strategy, expected_lr):
    pl.seed_everything(7)
    model = TinyModule(lr=0.1, scheduler="step")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = quick_fit(model, strategy, limit_train_batches=3)
    assert trainer.world_size == 1 and trainer.global_step == 3
    assert model.record["start_lr"] == pytest.approx(expected_lr)
    assert model.record["base_lrs"] == [pytest.approx(expected_lr)]
    assert model.record["lrs"] == [pytest.approx(expected_lr)] * 3  # StepLR steps at the epoch end
    changed = [k for k in before if not torch.equal(before[k], model.state_dict()[k])]
    assert sorted(changed) == sorted(before)  # every parameter moved


def test_one_device_per_process_whatever_devices_says():
    # Before hvd.init() the local rank comes from the launcher (a fresh interpreter: Horovod not initialised).
    code = (
        f"import torch, adasum_lightning, {PACKAGE} as pl\n"
        "t = pl.Trainer(strategy='horovod_adasum', accelerator='cpu', devices=4, logger=False)\n"
        "s = adasum_lightning.HorovodAdasumStrategy()\n"
        "s.parallel_devices = [torch.device('cuda', i) for i in range(4)]\n"
        "print(t.num_devices, t.strategy.parallel_devices, s.parallel_devices)\n"
    )
    env = dict(mpi_env(), OMPI_COMM_WORLD_LOCAL_RANK="3", OMPI_COMM_WORLD_RANK="3", OMPI_COMM_WORLD_SIZE="4")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "1 [device(type='cpu')] [device(type='cuda', index=3)]"
