"""Horovod's rules (adasum_lightning.horovod.support) as pure functions, and as Trainer.fit refuses them."""

import subprocess
import sys

import pytest
import torch

from adasum_lightning.errors import AdasumConfigurationError
from adasum_lightning.horovod.support import (
    check_closure_optimizers,
    check_controller,
    check_cpu_operations,
    check_gradient_clipping,
    check_gradient_predivide_factor,
    check_horovod_dtypes,
    check_launch,
    check_nccl_topology,
    check_precision,
    check_world_size,
)
from adasum_lightning.launch_environment import DetectedLauncher
from adasum_lightning.reference import is_power_of_two
from tests.helpers import ROOT, mpi_env, quick_fit
from tests.workers.lightning import HorovodAdasumStrategy, HorovodStrategy, pl
from tests.workers.tiny import TinyModule


@pytest.mark.parametrize("size", range(1, 70))
def test_world_size_rule(size):
    if is_power_of_two(size):
        check_world_size(size)
        return
    with pytest.raises(AdasumConfigurationError) as info:
        check_world_size(size)
    lower = 1 << (size.bit_length() - 1)
    assert f"power of 2 (1, 2, 4, 8, …) for Adasum over MPI; this job has {size} processes" in str(info.value)
    assert f"Launch {lower} or {2 * lower} processes" in str(info.value)


@pytest.mark.parametrize("nodes", range(1, 10))
@pytest.mark.parametrize("local", range(1, 9))
def test_nccl_topology_rule_homogeneous(nodes, local):
    size = nodes * local
    if not is_power_of_two(local):
        with pytest.raises(
            AdasumConfigurationError, match=f"power-of-2 number of processes per node; found {local}"
        ):
            check_nccl_topology(size, [local] * size)
    elif not is_power_of_two(nodes):
        with pytest.raises(
            AdasumConfigurationError, match=f"power-of-2 number of nodes; found {nodes} nodes"
        ):
            check_nccl_topology(size, [local] * size)
    elif nodes == 1 and local > 1:
        warning = check_nccl_topology(size, [local] * size)
        assert f"averages its {local} GPUs' updates; the learning rate is multiplied by {local}" in warning
    else:
        assert check_nccl_topology(size, [local] * size) is None


@pytest.mark.parametrize("local_sizes", [[4, 4, 4, 4, 2, 2], [2, 2, 1], [4] * 4 + [4] * 3 + [3]])
def test_nccl_topology_rule_heterogeneous(local_sizes):
    with pytest.raises(AdasumConfigurationError, match="same number of processes on every node; found"):
        check_nccl_topology(len(local_sizes), local_sizes)


@pytest.mark.parametrize(
    ("mpi_built", "mpi_enabled", "gloo_enabled", "message"),
    [
        (True, True, False, None),
        (False, False, True, "Horovod built with MPI"),
        (True, False, True, "needs the MPI controller, but this job runs under Gloo"),
        (True, False, False, "needs the MPI controller"),
    ],
)
def test_controller_rule(mpi_built, mpi_enabled, gloo_enabled, message):
    kwargs = dict(mpi_built=mpi_built, mpi_enabled=mpi_enabled, gloo_enabled=gloo_enabled)
    if message is None:
        check_controller(**kwargs)
    else:
        with pytest.raises(AdasumConfigurationError, match=message):
            check_controller(**kwargs)


@pytest.mark.parametrize(
    ("mpi_enabled", "cpu_ops", "refused"),
    [
        (True, None, False),
        (True, "mpi", False),
        (True, "gloo", True),
        (True, " Gloo ", True),
        (False, "gloo", False),
    ],
)
def test_cpu_operations_rule(mpi_enabled, cpu_ops, refused):
    if not refused:
        check_cpu_operations(mpi_enabled=mpi_enabled, cpu_operations=cpu_ops)
        return
    with pytest.raises(
        AdasumConfigurationError, match="HOROVOD_CPU_OPERATIONS=gloo under the MPI controller"
    ):
        check_cpu_operations(mpi_enabled=mpi_enabled, cpu_operations=cpu_ops)


@pytest.mark.parametrize("precision", ["32-true", "64-true", "bf16-mixed", "bf16-true", "16-true"])
def test_precision_rule_accepts(precision):
    check_precision(precision)


@pytest.mark.parametrize("precision", ["16-mixed", "16"])
def test_precision_rule_refuses_fp16_mixed(precision):
    with pytest.raises(
        AdasumConfigurationError, match="cannot use precision='16-mixed': its gradient scaler"
    ):
        check_precision(precision)


def test_clipping_rule():
    check_gradient_clipping(None, None)
    check_gradient_clipping(0, "norm")
    check_gradient_clipping(0.5, "value")
    for algorithm in (None, "norm"):  # Lightning's default algorithm is norm
        with pytest.raises(
            AdasumConfigurationError, match=r"cannot clip gradients by norm \(gradient_clip_val=0.5\)"
        ):
            check_gradient_clipping(0.5, algorithm)


def test_predivide_rule_and_strategy_construction():
    check_gradient_predivide_factor(1.0)
    with pytest.raises(AdasumConfigurationError, match="cannot use gradient_predivide_factor=2.0"):
        check_gradient_predivide_factor(2.0)
    with pytest.raises(AdasumConfigurationError, match="gradient_predivide_factor=0.5"):
        HorovodAdasumStrategy(gradient_predivide_factor=0.5)
    assert (
        HorovodStrategy(gradient_predivide_factor=2.0).gradient_predivide_factor == 2.0
    )  # fine when averaging


def test_missing_horovod_names_the_build_script_of_the_checkout_and_ddp_adasum():
    code = (
        "import sys; sys.modules['horovod.torch'] = None\n"
        "from adasum_lightning.horovod.support import import_horovod\n"
        "try:\n    import_horovod()\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=mpi_env()
    )
    assert out.stdout.strip() == (
        "Horovod with PyTorch support (import of horovod.torch halted; None in sys.modules) is not installed "
        f"in the environment of {sys.executable}. Build Horovod against its torch with `bash "
        f"{ROOT / 'patches' / 'build_horovod.sh'} --python {sys.executable}` (it needs Open MPI: the "
        "Debian/Ubuntu packages openmpi-bin and libopenmpi-dev), or use strategy='ddp_adasum', which needs "
        "no Horovod."
    )


def test_fit_refuses_norm_clipping_before_any_step():
    model = TinyModule()
    with pytest.raises(AdasumConfigurationError, match="cannot clip gradients by norm"):
        quick_fit(model, gradient_clip_val=1.0)
    assert model.record["indices"] == []  # no training step ran


def test_fit_refuses_fp16_mixed_before_any_step():
    model = TinyModule()
    plugin = pl.plugins.precision.MixedPrecision(
        precision="16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu")
    )
    with pytest.raises(AdasumConfigurationError, match="cannot use precision='16-mixed'"):
        quick_fit(model, plugins=[plugin])
    assert model.record["indices"] == []


def test_averaging_strategy_keeps_norm_clipping():
    trainer = quick_fit(TinyModule(), strategy="horovod", gradient_clip_val=1.0)
    assert trainer.global_step == 2


def test_launch_rule_names_the_launcher_and_horovodrun():
    check_launch(4, DetectedLauncher("mpirun / horovodrun (Open MPI)", 4, "OMPI_COMM_WORLD_SIZE", True), 1)
    check_launch(1, None, 1)  # a plain one-process run
    with pytest.raises(AdasumConfigurationError) as info:
        check_launch(1, DetectedLauncher("torchrun", 3, "WORLD_SIZE", False), 1, strategy_name="horovod")
    message = str(info.value)
    assert "horovod needs an MPI launcher" in message
    assert message.startswith("torchrun started 3 processes (WORLD_SIZE=3), but Horovod sees a world of 1")
    assert "`horovodrun -np 3 python SCRIPT ...`" in message and "strategy='ddp_adasum'" in message
    with pytest.raises(
        AdasumConfigurationError, match=r"Trainer\(devices=4\) asks for 4 devices.*horovodrun -np 4"
    ):
        check_launch(1, None, 4)


def test_closure_and_dtype_rules():
    check_closure_optimizers("horovod_adasum", [])
    with pytest.raises(
        AdasumConfigurationError, match=r"horovod_adasum cannot use LBFGS: its step\(\) needs a closure"
    ):
        check_closure_optimizers("horovod_adasum", ["LBFGS", "LBFGS"])
    check_horovod_dtypes("horovod", "cpu", {torch.float32, torch.float16})
    check_horovod_dtypes("horovod", "cuda", {torch.bfloat16})  # not checked on GPU
    with pytest.raises(AdasumConfigurationError, match="horovod cannot reduce bfloat16 parameters on CPU"):
        check_horovod_dtypes("horovod", "cpu", {torch.bfloat16})
