"""torchmetrics over Horovod.

torchmetrics synchronises metric states with ``torch.distributed``, which Horovod does not initialise;
without help each rank would report the metric of its own shard only. Pass these keyword arguments to a
metric to gather its states with Horovod instead::

    from adasum_lightning.metrics import horovod_sync_kwargs
    self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10, **horovod_sync_kwargs())
"""

from __future__ import annotations

from typing import Any

import torch


def _horovod_ready():
    try:
        import horovod.torch as hvd
    except ImportError:
        return None
    return hvd if hvd.is_initialized() and hvd.size() > 1 else None


def horovod_gather(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Gather one tensor of shape ``S`` from every rank: a list of ``world_size`` tensors of shape ``S``.

    The signature is torchmetrics' ``dist_sync_fn``; ``group`` must be None (the global process set).
    Shapes must match across ranks (true for states of fixed size such as Accuracy's counts).
    """
    hvd = _horovod_ready()
    if hvd is None:
        return [tensor]
    if group is not None:
        raise ValueError("horovod_gather supports the global process set only (group=None)")
    return list(hvd.allgather(tensor.unsqueeze(0)).unbind(0))


def horovod_sync_kwargs() -> dict[str, Any]:
    """``dist_sync_fn`` and ``distributed_available_fn`` for a torchmetrics ``Metric`` under Horovod."""
    return {
        "dist_sync_fn": horovod_gather,
        "distributed_available_fn": lambda: _horovod_ready() is not None,
    }
