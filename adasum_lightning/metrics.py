"""torchmetrics under the Horovod strategies: nothing to do any more.

The strategies run a ``torch.distributed`` process group beside Horovod, so torchmetrics synchronises metric
states the way it does under DDP (its default ``gather_all_tensors``, which also pads states whose sizes
differ per rank, e.g. ``CatMetric`` or ``BinaryAUROC``). Plain metrics work::

    self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)

:func:`horovod_sync_kwargs` is kept for code written for adasum-lightning 0.1, which had to pass it.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["horovod_sync_kwargs"]


def horovod_sync_kwargs() -> dict[str, Any]:
    """Deprecated: returns ``{}`` (torchmetrics' default sync is right under every strategy of this project).

    Emits a ``DeprecationWarning``; passing the result to a metric changes nothing.
    """
    warnings.warn(
        "adasum_lightning.metrics.horovod_sync_kwargs() is no longer needed: torchmetrics synchronises over "
        "the torch.distributed process group the Horovod strategies create. Drop **horovod_sync_kwargs().",
        DeprecationWarning,
        stacklevel=2,
    )
    return {}
