"""The rules and preparation of the module each rank holds whole (adasum_lightning.replicas) as pure
functions."""

import pytest
import torch

from adasum_lightning.errors import AdasumConfigurationError
from adasum_lightning.replicas import check_module_unwrapped, check_single_device, check_sync_batchnorm


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


def test_sync_batchnorm_rule():
    check_sync_batchnorm("cuda", True, ["bn"])
    check_sync_batchnorm("cpu", False, [])
    with pytest.raises(
        AdasumConfigurationError, match=r"^ddp_adasum cannot use SyncBatchNorm layers \(bn, head.bn\) on CPU"
    ):
        check_sync_batchnorm("cpu", False, ["bn", "head.bn"], "ddp_adasum")
