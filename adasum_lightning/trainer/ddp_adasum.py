"""``ddp_adasum``: Adasum of parameter deltas on ``torch.distributed``, launched like a Lightning DDP job."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from pytorch_lightning.accelerators import Accelerator
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.plugins.precision import MixedPrecision, Precision
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.model_helpers import is_overridden
from pytorch_lightning.utilities.rank_zero import rank_zero_info
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer
from typing_extensions import override

from adasum_lightning import reporting, validation
from adasum_lightning.allreduce import release_workspace
from adasum_lightning.step import (
    PER_PARAMETER_OPTIMIZERS,
    BackwardAdasumStep,
    adasum_step,
    optimizer_parameters,
)

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
    :class:`adasum_lightning.AdasumOptimizer`. Memory: one flat copy of the parameters of the optimizer that
    steps, in which the local step runs and the deltas are reduced, and the reduction's receive buffer (half
    a copy), kept between steps.

    **Overlap with backward** (``overlap_backward=True``): each bucket of parameters steps and is reduced as
    soon as backward has accumulated its gradients, while backward goes on — the same parameters, bitwise
    (:class:`adasum_lightning.step.BackwardAdasumStep`). It needs a per-parameter optimizer (SGD, Adam,
    AdamW, …), no gradient clipping, no fp16 ``GradScaler``, automatic optimization and no override of
    ``on_after_backward`` or ``on_before_optimizer_step`` (callbacks or module) or of the module's
    ``backward``; otherwise that optimizer takes the whole step, and rank 0 logs why, once per fit. Gradient
    accumulation works (only the window's last backward steps). Measured in docs/benchmarks.md.

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
        uneven_inputs: ``"truncate"`` or ``"error"`` (see :class:`._base.UpdateReducingDDPStrategy`).
        overlap_backward: step and reduce bucket by bucket during the backward pass (see above).
        bucket_cap_mb: ``overlap_backward``'s bucket size in MiB: a bucket is closed once it holds this much
            or more (as DDP's ``bucket_cap_mb``).

    Raises:
        ValueError: an invalid ``lr_scaling``, ``uneven_inputs``, ``overlap_backward`` or ``bucket_cap_mb``.
    """

    strategy_name = "ddp_adasum"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        lr_scaling: str | float = "auto",
        uneven_inputs: str = "truncate",
        overlap_backward: bool = False,
        bucket_cap_mb: float = 25,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            lr_scaling=lr_scaling,
            uneven_inputs=uneven_inputs,
        )
        validation.check_overlap_backward(overlap_backward, bucket_cap_mb, self.strategy_name)
        self.overlap_backward = overlap_backward
        self.bucket_cap_mb = bucket_cap_mb
        self._overlap_group: dist.ProcessGroup | None = None
        # per optimizer (by id): its bucketed step, or None (the whole step)
        self._backward_steps: dict[int, BackwardAdasumStep | None] = {}

    # ------------------------------------------------------------------------------------------ lifecycle
    @override
    def setup_environment(self) -> None:
        environment = self.cluster_environment
        launched_outside = environment is not None and environment.creates_processes_externally
        if launched_outside and os.environ.get("WORLD_SIZE", "").isdigit():
            with reporting.reported_on_every_rank(self.global_rank):
                # before the rendezvous, which a mismatch would leave waiting
                validation.check_launcher_world_size(
                    int(os.environ["WORLD_SIZE"]),
                    self.num_processes,
                    self.num_nodes,
                    strategy_name=self.strategy_name,
                )
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if self.overlap_backward and self.world_size > 1 and trainer.state.fn == TrainerFn.FITTING:
            # the worker thread's own process group (a collective: every rank builds it here)
            self._overlap_group = dist.new_group(
                backend=dist.get_backend(), timeout=_compat.process_group_timeout(self)
            )

    @override
    def _describe_reduction(self) -> str:
        overlap = ", bucket by bucket during backward" if self.overlap_backward else ""
        return f"Adasum of parameter deltas over {self.process_group_backend}{overlap}"

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
        local_optimizer = _compat.unwrap_lightning_optimizer(optimizer)
        backward_step = self._backward_step(local_optimizer) if self._overlap_group is not None else None
        if backward_step is not None and not kwargs:
            # the closure's backward steps and reduces the buckets (the optimizer's own step is not called)
            backward_step.armed = True
            try:
                output = _compat.run_closure(
                    self.precision_plugin, model or self.lightning_module, optimizer, closure
                )
            finally:
                backward_step.armed = False
            backward_step.finish()
        else:
            local_step = functools.partial(super().optimizer_step, optimizer, closure, model, **kwargs)
            params = optimizer_parameters(local_optimizer)
            output = adasum_step(params, local_step, timeout=_compat.process_group_timeout(self))
        self._deliver_pending_sigterm()
        return output

    def _backward_step(self, optimizer: Optimizer) -> BackwardAdasumStep | None:
        """``optimizer``'s bucketed step (built at its first step, again when its trainable parameters
        change), or None when it must take the whole step (the reason logged once)."""
        key = id(optimizer)
        if key in self._backward_steps and self._backward_steps[key] is None:
            return None
        built = self._backward_steps.get(key)
        if built is not None and built.is_current():
            return built
        if built is not None:
            built.close()
        reason = self._overlap_fallback_reason(optimizer)
        if reason is not None:
            rank_zero_info(
                f"{type(self).__name__}: overlap_backward: {type(optimizer).__name__} takes the whole step "
                f"after backward, because {reason} (the same parameters; the reduction does not overlap "
                "backward)"
            )
            self._backward_steps[key] = None
            return None
        assert self._overlap_group is not None
        bucket_bytes = int(self.bucket_cap_mb * 2**20)
        step = BackwardAdasumStep(
            optimizer, self._overlap_group, bucket_bytes, _compat.process_group_timeout(self)
        )
        step.armed = False  # only the backward inside optimizer_step steps (not an accumulation window's)
        self._backward_steps[key] = step
        return step

    def _overlap_fallback_reason(self, optimizer: Optimizer) -> str | None:
        module = self.lightning_module
        assert module is not None
        trainer = module.trainer
        clipping = None
        if trainer.gradient_clip_val:
            clipping = f"gradient_clip_val={trainer.gradient_clip_val}"
        elif is_overridden("configure_gradient_clipping", module, pl.LightningModule):
            clipping = f"{type(module).__name__}.configure_gradient_clipping"
        plugin = self.precision_plugin
        own_step = type(plugin).optimizer_step not in (
            Precision.optimizer_step,
            MixedPrecision.optimizer_step,
        )
        # hooks that see or change the gradients between backward and the step
        hooks = [
            f"{type(c).__name__}.{hook}"
            for c in trainer.callbacks
            for hook in ("on_after_backward", "on_before_optimizer_step")
            if is_overridden(hook, c, Callback)
        ]
        hooks += [
            f"{type(module).__name__}.{hook}"
            for hook in ("backward", "on_after_backward", "on_before_optimizer_step")
            if is_overridden(hook, module, pl.LightningModule)
        ]
        return validation.overlap_fallback_reason(
            automatic_optimization=module.automatic_optimization,
            optimizer=type(optimizer).__name__,
            per_parameter=type(optimizer) in PER_PARAMETER_OPTIMIZERS,
            gradient_clipping=clipping,
            gradient_scaler=getattr(plugin, "scaler", None) is not None,
            precision_plugin=type(plugin).__name__ if own_step else None,
            before_step_hooks=hooks,
        )

    # ------------------------------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        release_workspace()  # the reduction's buffers, kept between steps
        for built in self._backward_steps.values():
            if built is not None:
                built.close()
        self._backward_steps.clear()
        if self._overlap_group is not None:
            dist.destroy_process_group(self._overlap_group)
            self._overlap_group = None
        super().teardown()
