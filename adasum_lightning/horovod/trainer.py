"""Horovod strategies for PyTorch Lightning 2.x: Adasum (``horovod_adasum``) and averaging (``horovod``).

Lightning 2.0 removed its Horovod strategy (`#16150
<https://github.com/Lightning-AI/pytorch-lightning/pull/16150>`_). The two differ in the reduction op and
the learning-rate policy (``lr_scaling="auto"``): Adasum of parameter deltas, factor 1 (``hvd.local_size()``
on GPU with a NCCL-built Horovod); or the average of gradients, factor world size. ``horovodrun``/``mpirun``
start the processes; Horovod reduces the update and a ``torch.distributed`` process group over the same
ranks carries everything else (:mod:`adasum_lightning.trainer._base`). Importing it registers them; its copy
for ``lightning.pytorch`` is this file with the package names renamed (:mod:`adasum_lightning._namespaces`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import StrategyRegistry
from pytorch_lightning.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from adasum_lightning.horovod import _compat, support
from adasum_lightning.horovod.fabric import HorovodEnvironment
from adasum_lightning.horovod.process import HorovodProcess
from adasum_lightning.trainer._base import UpdateReducingDDPStrategy
from adasum_lightning.trainer._compat import (
    mark_step_for_schedulers,
)

__all__ = ["HorovodStrategy", "HorovodAdasumStrategy"]


class HorovodStrategy(HorovodProcess, UpdateReducingDDPStrategy):
    """Data-parallel training with Horovod: one process per device, gradients averaged by allreduce.

    pytorch-lightning 1.x's ``strategy="horovod"``: each optimizer is wrapped in
    ``hvd.DistributedOptimizer(op=hvd.Average)`` and ``lr_scaling="auto"`` multiplies every learning rate by
    the world size (`#2574 <https://github.com/Lightning-AI/pytorch-lightning/issues/2574>`_). The launch
    rules, the process group beside Horovod and the wrapper: :class:`~adasum_lightning.horovod.process.
    HorovodProcess`.

    Args:
        accelerator, parallel_devices, checkpoint_io, precision_plugin: as for any Lightning strategy.
        lr_scaling: ``"auto"`` (× world size here), ``"none"`` or a positive factor.
        compression, gradient_predivide_factor: Horovod's (see :class:`~.process.HorovodProcess`).
        process_group_backend, timeout: of the ``torch.distributed`` process group beside Horovod.

    Raises:
        ValueError: an unknown ``lr_scaling`` or ``compression``.
    """

    strategy_name = "horovod"
    reduction = "Average"

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any | None = None,
        precision_plugin: pl.plugins.precision.Precision | None = None,
        lr_scaling: str | float = "auto",
        compression: str = "none",
        gradient_predivide_factor: float = 1.0,
        **kwargs: Any,
    ) -> None:
        support.check_no_local_sgd(kwargs, self.strategy_name)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=HorovodEnvironment(),
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            lr_scaling=lr_scaling,
            **kwargs,
        )
        self._set_options(compression, gradient_predivide_factor)
        self._hook_handles: list[Any] = []

    # ------------------------------------------------------------------------------------------ lifecycle
    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()
        assert self.model is not None
        self._check_module(self.model)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        originals = list(self.optimizers)
        self._check_optimizers(originals)
        assert self.lightning_module is not None
        names = {p: name for name, p in self.lightning_module.named_parameters()}
        self.optimizers = [
            self._horovod_optimizer(optimizer, index, names, trainer.accumulate_grad_batches)
            for index, optimizer in enumerate(originals)
        ]
        # Schedulers must follow the wrapper: a checkpoint restore replaces its param groups.
        for config in self.lr_scheduler_configs:
            for original, wrapper in zip(originals, self.optimizers, strict=True):
                if getattr(config.scheduler, "optimizer", None) is original:
                    config.scheduler.optimizer = wrapper
                    mark_step_for_schedulers(wrapper)

    @override
    def _describe_reduction(self) -> str:
        return f"Horovod {self.reduction} reduction"

    @override
    def _reduced_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any, kwargs: dict[str, Any]
    ) -> Any:
        """Horovod's reduction of the step (``hvd.DistributedOptimizer``).

        Averaging (also ``horovod_adasum`` at world size 1, where Horovod averages): wait for the gradient
        allreduce right after backward, before clipping and ``on_before_optimizer_step``, then step without a
        second one; a closure optimizer's loss (LBFGS) is averaged too, so every rank decides alike.
        Adasum: Horovod's ``step()`` runs the closure, whose backward hooks ran the local steps and started
        the delta allreduce, then applies the reduced deltas.
        """
        if _compat.is_horovod_adasum_optimizer(optimizer):
            return self._local_step(optimizer, closure, model, kwargs)
        # Lightning's own closure returns the loss it logs: averaged only for an optimizer that decides by it
        average = support.needs_closure(optimizer)
        evaluate = self._closure_then_synchronize(optimizer, closure, average, self.reduce)
        with optimizer.skip_synchronize():
            return self._local_step(optimizer, evaluate, model, kwargs)

    @override
    def teardown(self) -> None:
        for optimizer in self.optimizers:
            _compat.release_horovod_hooks(optimizer)
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        super().teardown()


class HorovodAdasumStrategy(HorovodStrategy):
    """Data-parallel training with Horovod's Adasum: parameter deltas combined adaptively.

    Each optimizer is wrapped in ``hvd.DistributedOptimizer(op=hvd.Adasum)``. With world size > 1 that is
    Horovod's ``_DistributedAdasumOptimizer`` (``horovod/torch/optimizer.py``): on the
    ``backward_passes_per_step``-th backward of a parameter its hook runs the wrapped optimizer's step on that
    parameter alone, turns it into the delta (new − start) and starts an Adasum allreduce of the delta;
    ``step()`` waits and sets the parameter to start + reduced delta. Each rank keeps its own optimizer state
    (e.g. momentum from its local gradients). Adasum of two deltas ``a``, ``b`` is
    ``(1 − a·b/2‖a‖²)·a + (1 − a·b/2‖b‖²)·b`` (Maleki et al., MLSys 2021;
    :func:`adasum_lightning.reference.adasum`).

    Learning rate, ``lr_scaling="auto"`` (Horovod's ``docs/adasum_user_guide.rst``): no world-size scaling.
    Factor 1 on CPU; ``hvd.local_size()`` when Horovod is NCCL-built and the model is on GPU, because NCCL
    Adasum averages inside a node and applies Adasum across nodes.

    ``backward_passes_per_step`` is the Trainer's ``accumulate_grad_batches``.

    Args: as :class:`HorovodStrategy`.

    Raises:
        AdasumConfigurationError: ``gradient_predivide_factor`` ≠ 1.
    """

    strategy_name = "horovod_adasum"
    reduction = "Adasum"

    @override
    def _validate_trainer(self, trainer: pl.Trainer) -> None:
        super()._validate_trainer(trainer)
        support.check_precision(self.precision_plugin.precision)
        algorithm = getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm)
        support.check_gradient_clipping(trainer.gradient_clip_val, algorithm)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        algorithm = getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm)
        if trainer.state.fn == TrainerFn.FITTING and trainer.gradient_clip_val and algorithm == "value":
            self._clip_values_before_local_step(float(trainer.gradient_clip_val))

    def _clip_values_before_local_step(self, clip_value: float) -> None:
        """Clamp each gradient to ``[-clip_value, clip_value]`` right before Adasum's local step.

        Horovod's hook (on the gradient accumulator) runs the local step on the last backward pass of a
        window; a post-accumulate-grad hook runs before it, so the clamp takes effect there. Lightning's own
        clipping after backward still covers parameters whose step runs inside ``step()`` (the partial window
        at an epoch's end, parameters without a gradient).
        """
        for optimizer in self.optimizers:
            if not _compat.is_horovod_adasum_optimizer(optimizer):
                continue  # world size 1: Lightning's clipping acts before the step as usual
            for p in _compat.horovod_requires_update(optimizer):
                self._hook_handles.append(
                    p.register_post_accumulate_grad_hook(
                        functools.partial(_clamp_on_last_pass, optimizer, clip_value)
                    )
                )


def _clamp_on_last_pass(optimizer: Optimizer, clip_value: float, param: Tensor) -> None:
    # Horovod decrements its per-parameter countdown in its own hook, after this one.
    if _compat.horovod_completes_window(optimizer, param) and param.grad is not None:
        param.grad.clamp_(-clip_value, clip_value)


# Registered by name with the StrategyRegistry on import: Trainer(strategy="horovod_adasum").
for _strategy in (HorovodAdasumStrategy, HorovodStrategy):
    _strategy.register_strategies(StrategyRegistry)
