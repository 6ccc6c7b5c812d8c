"""``ddp_adasum``: Adasum of parameter deltas on ``torch.distributed``, launched like a Lightning DDP job."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
from torch.optim import Optimizer
from typing_extensions import override

from adasum_lightning import validation
from adasum_lightning.allreduce import release_workspace
from adasum_lightning.step import adasum_step, optimizer_parameters

from . import _compat
from ._base import UpdateReducingDDPStrategy

__all__ = ["DDPAdasumStrategy"]


class DDPAdasumStrategy(UpdateReducingDDPStrategy):
    """Data-parallel training with Adasum on ``torch.distributed``: parameter deltas combined adaptively.

    **Step semantics.** At each optimizer step every rank first runs Lightning's normal local step — the
    closure (forward and backward), the precision plugin (including fp16's ``GradScaler``: unscaling, and
    skipping a step whose gradients overflowed), gradient clipping by norm or by value, the accumulation
    window (``accumulate_grad_batches``: Lightning steps once per window, and on an epoch's last batch for a
    partial window), manual optimisation's ``opt.step()``, and any closure optimizer such as LBFGS. Then the
    parameter **deltas** ``d_r = θ_after − θ_before`` of that optimizer's parameters are combined by Adasum
    over all ranks (:func:`adasum_lightning.adasum_allreduce`) and every rank sets
    ``θ = θ_before + Adasum(d_0, …, d_{N−1})``, so every rank holds the same parameters after every step. Each
    rank keeps its own optimizer state (momentum, Adam moments from its local gradients), as under Horovod's
    Adasum optimizer. Buffers (e.g. BatchNorm running statistics) are not combined: each rank keeps its own.

    Adasum of two deltas ``a``, ``b`` is ``(1 − a·b/2‖a‖²)·a + (1 − a·b/2‖b‖²)·b`` per parameter tensor
    (Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021), combined over the
    ranks in Horovod's pairing (``horovod/common/ops/adasum/adasum.h``); any world size works (the ranks above
    the largest power of 2 are folded into partners first). Orthogonal deltas add, parallel ones average, so
    the learning rate needs **no world-size scaling** (``lr_scaling="auto"`` is factor 1).

    Lightning starts the processes (``Trainer(devices=N)``), or ``torchrun``, SLURM or an Azure ML PyTorch
    job does (Lightning's cluster environments); Gloo on CPU, NCCL on GPU. Horovod is not used. Everything
    else across ranks is Lightning's ``DDPStrategy`` (see :class:`._base.UpdateReducingDDPStrategy`).

    The step is :func:`adasum_lightning.step.adasum_step`, shared with ``Fabric(strategy="ddp_adasum")`` and
    :class:`adasum_lightning.AdasumOptimizer`. Memory: one extra copy of the parameters of the optimizer that
    steps (``θ_before``), held during the step.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for
            ``DDPStrategy``; Lightning fills them from the ``Trainer`` arguments.
        process_group_backend: ``"gloo"`` (CPU default) or ``"nccl"`` (GPU default).
        timeout: how long a collective may wait for the other ranks before this rank fails
            (``torch.distributed``'s process-group timeout, default 30 minutes). A lost host is noticed after
            at most this long; see docs/launching.md (several hosts).
        start_method: how Lightning starts the processes when it launches them (``"popen"``, ``"spawn"``,
            ``"fork"``, ``"forkserver"``), as for ``DDPStrategy``.
        lr_scaling: ``"auto"`` (factor 1), ``"none"`` or a positive factor.

    Raises:
        ValueError: an invalid ``lr_scaling``.
    """

    strategy_name = "ddp_adasum"
    # __init__: UpdateReducingDDPStrategy's (the arguments above)

    # ------------------------------------------------------------------------------------------ lifecycle
    @override
    def setup_environment(self) -> None:
        environment = self.cluster_environment
        launched_outside = environment is not None and environment.creates_processes_externally
        if launched_outside and os.environ.get("WORLD_SIZE", "").isdigit():
            with validation.reported_on_every_rank(self.global_rank):
                # before the rendezvous, which a mismatch would leave waiting
                validation.check_launcher_world_size(
                    int(os.environ["WORLD_SIZE"]),
                    self.num_processes,
                    self.num_nodes,
                    strategy_name=self.strategy_name,
                )
        super().setup_environment()

    @override
    def _describe_reduction(self) -> str:
        return f"Adasum of parameter deltas over {self.process_group_backend}"

    # ------------------------------------------------------------------------------------------ step
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Lightning's local step, then the Adasum of the parameter deltas over all ranks (see the class)."""
        local_step = functools.partial(super().optimizer_step, optimizer, closure, model, **kwargs)
        params = optimizer_parameters(_compat.unwrap_lightning_optimizer(optimizer))
        output = adasum_step(params, local_step, timeout=_compat.process_group_timeout(self))
        self._deliver_pending_sigterm()
        return output

    # ------------------------------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        release_workspace()  # the reduction's buffers, kept between steps
        super().teardown()
