"""The setup rules (adasum_lightning.validation) as pure functions, and as Trainer.fit refuses them."""

import re
import subprocess
import sys

import pytest
import torch

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
from adasum_lightning.launchers import DetectedLauncher, detect_launcher
from adasum_lightning.ops import is_power_of_two
from adasum_lightning.validation import (
    AdasumConfigurationError,
    check_launcher_world_size,
    check_module_unwrapped,
    check_overlap_backward,
    check_single_device,
    check_sync_batchnorm,
    overlap_fallback_reason,
)
from tests.helpers import ROOT, mpi_env, quick_fit
from tests.workers.lightning import HorovodAdasumStrategy, HorovodStrategy, pl
from tests.workers.tiny import TinyModule  # noqa: E402


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


def test_single_device_rule_names_the_strategy_and_its_launcher():
    check_single_device("ddp_adasum", [torch.zeros(2), torch.ones(3)])
    two = [torch.zeros(2), torch.zeros(2, device="meta")]
    with pytest.raises(AdasumConfigurationError) as info:
        check_single_device("ddp_adasum", two)
    assert str(info.value).startswith("ddp_adasum runs one process per device, but this module's parameters "
                                      "span ['cpu', 'meta']")  # fmt: skip
    assert str(info.value).endswith("(devices=N, or torchrun).") and "horovodrun" not in str(info.value)
    with pytest.raises(AdasumConfigurationError, match=r"one process per GPU \(horovodrun -np N\)"):
        check_single_device("horovod_adasum", two)


def test_module_wrapped_in_ddp_is_refused_naming_the_fix():
    check_module_unwrapped("ddp_adasum", False)
    with pytest.raises(AdasumConfigurationError, match=r"fabric.setup\(model, optimizer\) with the plain"):
        check_module_unwrapped("ddp_adasum", True)


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


def test_missing_checkpoint_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist on rank 0\. Pass the path of a checkpoint"):
        pl.Trainer(strategy="horovod_adasum", accelerator="cpu", logger=False, enable_progress_bar=False).fit(
            TinyModule(), ckpt_path=str(tmp_path / "nope.ckpt")
        )


@pytest.mark.parametrize("content", [b"garbage", b"", b"junk\n"])  # "junk": a KeyError in the unpickler
def test_corrupt_checkpoint_names_the_fix(tmp_path, content):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(content)
    model = TinyModule()
    with pytest.raises(
        RuntimeError, match=r"could not be read on rank 0 .*truncated, corrupt or not a Lightning"
    ):
        pl.Trainer(strategy="horovod_adasum", accelerator="cpu", logger=False, enable_progress_bar=False).fit(
            model, ckpt_path=str(bad)
        )
    assert model.record["indices"] == []


def test_checkpoint_without_state_dict_is_refused(tmp_path):
    other = tmp_path / "weights.pt"
    torch.save({"weights": torch.ones(2)}, other)
    with pytest.raises(RuntimeError, match="holds no 'state_dict': it is not a Lightning checkpoint"):
        pl.Trainer(strategy="horovod_adasum", accelerator="cpu", logger=False, enable_progress_bar=False).fit(
            TinyModule(), ckpt_path=str(other)
        )


# ---------------------------------------------------------------- launch and step rules (issues E and F)
@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"OMPI_COMM_WORLD_SIZE": "4"}, ("mpirun / horovodrun (Open MPI)", 4, True)),
        ({"HOROVOD_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "2"}, ("horovodrun --gloo", 2, True)),
        ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "RANK": "1"}, ("torchrun", 2, False)),
        ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8"}, ("srun (SLURM)", 8, False)),
        ({"SLURM_NTASKS": "8"}, None),  # an sbatch script itself, not a step: nothing was launched
        ({"WORLD_SIZE": "3", "LOCAL_RANK": "0"}, ("a torch.distributed launcher", 3, False)),
    ],
)
def test_detect_launcher(environ, expected):
    seen = detect_launcher(environ)
    if expected is None:
        assert seen is None
    else:
        assert (seen.name.split(" (Lightning")[0], seen.processes, seen.horovod) == expected


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


def test_closure_dtype_batchnorm_and_world_size_rules():
    check_closure_optimizers("horovod_adasum", [])
    with pytest.raises(
        AdasumConfigurationError, match=r"horovod_adasum cannot use LBFGS: its step\(\) needs a closure"
    ):
        check_closure_optimizers("horovod_adasum", ["LBFGS", "LBFGS"])
    check_horovod_dtypes("horovod", "cpu", {torch.float32, torch.float16})
    check_horovod_dtypes("horovod", "cuda", {torch.bfloat16})  # not checked on GPU
    with pytest.raises(AdasumConfigurationError, match="horovod cannot reduce bfloat16 parameters on CPU"):
        check_horovod_dtypes("horovod", "cpu", {torch.bfloat16})
    check_sync_batchnorm("cuda", True, ["bn"])
    check_sync_batchnorm("cpu", False, [])
    with pytest.raises(
        AdasumConfigurationError, match=r"^ddp_adasum cannot use SyncBatchNorm layers \(bn, head.bn\) on CPU"
    ):
        check_sync_batchnorm("cpu", False, ["bn", "head.bn"], "ddp_adasum")
    check_launcher_world_size(8, 4, 2)
    with pytest.raises(
        AdasumConfigurationError, match=r"WORLD_SIZE=8\), but the Trainer describes devices=4 × num_nodes=1"
    ):
        check_launcher_world_size(8, 4, 1)
    with pytest.raises(AdasumConfigurationError, match=r"^ddp_adasum: .* Set Fabric\(devices=<processes per"):
        check_launcher_world_size(8, 4, 1, api="Fabric")


# ---------------------------------------------------------------- ddp_adasum(overlap_backward=True)
OVERLAP_OK = dict(
    automatic_optimization=True,
    optimizer="SGD",
    per_parameter=True,
    gradient_clipping=None,
    gradient_scaler=False,
    precision_plugin=None,
    before_step_hooks=[],
)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({}, None),
        ({"automatic_optimization": False}, "manual optimization calls backward and step itself"),
        (
            {"optimizer": "LBFGS", "per_parameter": False},
            "LBFGS is not one of the per-parameter torch.optim optimizers (SGD, Adam, AdamW, Adagrad, "
            "Adamax, NAdam, RAdam, RMSprop)",
        ),
        (
            {"gradient_clipping": "gradient_clip_val=0.5"},
            "gradient clipping (gradient_clip_val=0.5) needs every gradient before the first bucket steps",
        ),
        (
            {"gradient_scaler": True},
            "fp16 mixed precision's GradScaler checks every gradient before the step (bf16 has no scaler)",
        ),
        (
            {"precision_plugin": "FSDPPrecision"},
            "the precision plugin FSDPPrecision runs the optimizer step its own way",
        ),
        (
            {"before_step_hooks": ["GradNormLogger.on_before_optimizer_step", "Net.on_after_backward"]},
            "GradNormLogger.on_before_optimizer_step, Net.on_after_backward run between backward and the "
            "step (they may change gradients or read parameters)",
        ),
    ],
)
def test_overlap_fallback_rule(change, reason):
    assert overlap_fallback_reason(**{**OVERLAP_OK, **change}) == reason


@pytest.mark.parametrize(
    ("overlap", "cap", "message"),
    [
        ("yes", 25, "ddp_adasum's overlap_backward is True (step and reduce bucket by bucket during the "
                    "backward pass) or False (the whole step after it), got 'yes'"),
        (True, 0, "ddp_adasum's bucket_cap_mb is the bucket size in MiB, a positive number such as 25 "
                  "(DDP's default), got 0"),
        (True, "25", "got '25'"),
        (True, True, "got True"),
    ],
)  # fmt: skip
def test_overlap_options_rule(overlap, cap, message):
    check_overlap_backward(False, 0.5, "ddp_adasum")
    with pytest.raises(ValueError, match=re.escape(message)):
        check_overlap_backward(overlap, cap, "ddp_adasum")
