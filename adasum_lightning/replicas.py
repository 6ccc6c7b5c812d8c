"""The module every rank holds whole under the strategies that reduce updates themselves: its rules, the
preparation that gives every rank the first rank's values, and the sampler seed all ranks share.
Lightning-free: the strategies of both APIs call it with themselves as ``strategy``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.nn import Module, SyncBatchNorm
from torch.nn.parallel import DistributedDataParallel

from adasum_lightning.errors import AdasumConfigurationError, reported_on_every_rank
from adasum_lightning.step import broadcast_from_rank_zero

__all__ = [
    "check_single_device",
    "check_module_unwrapped",
    "check_sync_batchnorm",
    "sampler_seed",
    "make_parameters_contiguous",
    "prepare_unwrapped_module",
]


def check_single_device(strategy_name: str, tensors: Iterable[torch.Tensor]) -> None:
    """One process drives one device: every parameter and buffer must be on the same device.

    Raises:
        AdasumConfigurationError: naming the devices found.
    """
    devices = sorted({str(t.device) for t in tensors})
    if len(devices) > 1:
        launch = "horovodrun -np N" if strategy_name.startswith("horovod") else "devices=N, or torchrun"
        raise AdasumConfigurationError(
            f"{strategy_name} runs one process per device, but this module's parameters span {devices}. "
            "Keep the whole module on one device (Lightning moves it to cuda:<local rank> or cpu) and start "
            f"one process per GPU ({launch})."
        )


def check_module_unwrapped(strategy_name: str, wrapped_in_ddp: bool) -> None:
    """A module already wrapped in ``DistributedDataParallel`` would average its gradients before Adasum.

    Raises:
        AdasumConfigurationError: when ``wrapped_in_ddp``.
    """
    if wrapped_in_ddp:
        raise AdasumConfigurationError(
            f"{strategy_name} was given a module wrapped in DistributedDataParallel: its gradients would be "
            "averaged in backward before Adasum combines the updates. Pass the module itself "
            "(fabric.setup(model, optimizer) with the plain nn.Module)."
        )


def check_sync_batchnorm(
    device_type: str, requested: bool, sync_layers: Sequence[str], strategy_name: str = "this strategy"
) -> None:
    """Synchronised batch norm (``requested`` by the Trainer, or ``sync_layers`` in the module) needs an
    accelerator: torch's ``SyncBatchNorm`` refuses CPU tensors.

    Raises:
        AdasumConfigurationError: synchronised batch norm on CPU.
    """
    if device_type == "cpu" and (requested or sync_layers):
        what = (
            "Trainer(sync_batchnorm=True)"
            if requested
            else f"SyncBatchNorm layers ({', '.join(sync_layers)})"
        )
        raise AdasumConfigurationError(
            f"{strategy_name} cannot use {what} on CPU: torch's SyncBatchNorm runs on GPUs only (it raises "
            "in the first forward pass). "
            "Train on GPUs (accelerator='gpu') to synchronise the statistics, or leave sync_batchnorm off "
            "and keep plain BatchNorm: then each rank keeps its own running statistics (checkpoints hold "
            "rank 0's)."
        )


def sampler_seed(strategy: Any) -> int:
    """Rank 0's ``seed_everything`` seed for every rank's sampler (a broadcast): no overlapping shards."""
    return int(strategy.broadcast(int(os.environ.get("PL_GLOBAL_SEED", 0)), src=0))


def make_parameters_contiguous(module: Module) -> None:
    """Make each parameter contiguous in place (the same ``Parameter``): the reductions work in place."""
    for param in module.parameters():
        if not param.data.is_contiguous():
            param.data = param.data.contiguous()


def prepare_unwrapped_module(strategy: Any, module: Module) -> None:
    """Check ``module``, then give every rank the first rank's parameters and buffers (``fabric.setup``).

    Raises:
        AdasumConfigurationError: on every rank: a module wrapped in ``DistributedDataParallel``, on several
            devices, or with ``SyncBatchNorm`` layers on CPU.
    """
    name = strategy.strategy_name
    with reported_on_every_rank(strategy.global_rank):
        check_module_unwrapped(name, isinstance(module, DistributedDataParallel))
        check_single_device(name, [*module.parameters(), *module.buffers()])
        sync_layers = [n for n, m in module.named_modules() if isinstance(m, SyncBatchNorm)]
        check_sync_batchnorm(strategy.root_device.type, False, sync_layers, name)
    make_parameters_contiguous(module)
    broadcast_from_rank_zero([*module.parameters(), *module.buffers()])
