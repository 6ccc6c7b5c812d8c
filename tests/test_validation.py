"""The setup rules (adasum_lightning.validation) as pure functions, and as Trainer.fit refuses them."""

import re

import pytest
import torch

from adasum_lightning.horovod.support import check_closure_optimizers, check_horovod_dtypes
from adasum_lightning.launchers import detect_launcher
from adasum_lightning.validation import (
    AdasumConfigurationError,
    check_launcher_world_size,
    check_module_unwrapped,
    check_overlap_backward,
    check_single_device,
    check_sync_batchnorm,
    overlap_fallback_reason,
)
from tests.workers.lightning import pl
from tests.workers.tiny import TinyModule  # noqa: E402


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
