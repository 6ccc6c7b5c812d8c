"""The guard on the private Horovod, Lightning and torch APIs the project uses (``_compat``)."""

from __future__ import annotations

import importlib

from adasum_lightning import _private_apis
from adasum_lightning._private_apis import PrivateApi, _check
from tests.workers.lightning import PACKAGE, adasum_strategies

compat = adasum_strategies._compat


def test_every_private_api_used_is_still_there():
    assert _private_apis.missing(PACKAGE) == [], "an installed version dropped a private API the project uses"


def test_the_guard_names_what_is_gone_and_where_it_was_read():
    gone = PrivateApi("torch.optim.lr_scheduler", "NoSuchScheduler", "torch 2.14.1")
    assert _check(gone) == "torch.optim.lr_scheduler.NoSuchScheduler is gone (read from torch 2.14.1)"
    renamed = PrivateApi("torch.optim.lr_scheduler", "LRScheduler", "torch 2.14.1", ("_no_such_marker",))
    assert _check(renamed) == (
        "torch.optim.lr_scheduler.LRScheduler no longer uses ['_no_such_marker'] (read from torch 2.14.1)"
    )
    assert _check(PrivateApi("no_such_module_xyz", "X", "-")).startswith("no_such_module_xyz cannot")


def test_the_guard_checks_the_lightning_package_in_use():
    # both lists: the Trainer strategies' and the Fabric strategies', of that package
    trainer, fabric = (importlib.import_module(m) for m in _private_apis.COMPAT_MODULES[PACKAGE])
    assert trainer is compat
    fabric_package = "lightning_fabric" if PACKAGE == "pytorch_lightning" else "lightning.fabric"
    assert f"{fabric_package}.strategies.strategy" in {api.module for api in fabric.PRIVATE_APIS}
    modules = {api.module for api in compat.PRIVATE_APIS}
    assert f"{PACKAGE}.overrides.distributed" in modules
    other = "lightning.pytorch" if PACKAGE == "pytorch_lightning" else "pytorch_lightning"
    assert not any(module.startswith(other + ".") for module in modules)


def test_sigterm_agreement_is_detected_from_the_installed_lightning():
    loop = __import__(
        f"{PACKAGE}.loops.training_epoch_loop", fromlist=["_TrainingEpochLoop"]
    )._TrainingEpochLoop
    assert compat.has_sigterm_agreement() is hasattr(loop, "_broadcast_sigterm_tensor")
