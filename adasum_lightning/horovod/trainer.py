"""Horovod strategies for PyTorch Lightning 2.x: Adasum (``horovod_adasum``) and averaging (``horovod``).

Horovod reduces the update; a ``torch.distributed`` process group over the same ranks carries the rest.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.strategies import StrategyRegistry
from pytorch_lightning.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from adasum_lightning.horovod import _compat, support
from adasum_lightning.horovod.fabric import HorovodEnvironment
from adasum_lightning.horovod.process import HorovodProcess
from adasum_lightning.trainer._base import UpdateReducingDDPStrategy
from adasum_lightning.trainer._compat import mark_step_for_schedulers

__all__ = ["HorovodStrategy", "HorovodAdasumStrategy"]


class HorovodStrategy(HorovodProcess, UpdateReducingDDPStrategy):
    """Data-parallel training with Horovod: one process per device, gradients averaged by allreduce.

    pytorch-lightning 1.x's ``strategy="horovod"``: ``hvd.DistributedOptimizer(op=hvd.Average)``;
    ``lr_scaling="auto"`` multiplies the learning rates by the world size.

    Args:
        compression, gradient_predivide_factor: Horovod's (see :class:`~.process.HorovodProcess`).
        **kwargs: :class:`~adasum_lightning.trainer._base.UpdateReducingDDPStrategy`'s but
            ``cluster_environment`` (``process_group_backend`` and ``timeout``: the process group's).

    Raises:
        ValueError: an unknown ``lr_scaling`` or ``compression``.
    """

    strategy_name = "horovod"
    reduction = "Average"

    def __init__(
        self, compression: str = "none", gradient_predivide_factor: float = 1.0, **kwargs: Any
    ) -> None:
        support.check_no_local_sgd(kwargs, self.strategy_name)
        super().__init__(cluster_environment=HorovodEnvironment(), **kwargs)
        self._set_options(compression, gradient_predivide_factor)
        self._hook_handles: list[Any] = []

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
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """Adasum: Horovod's ``step()`` (the closure's hooks ran the local steps). Averaging (also Adasum at
        world size 1): wait for the gradient allreduce after backward, before clipping, then step."""
        if _compat.is_horovod_adasum_optimizer(optimizer):
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        else:  # the loss averaged only for an optimizer that decides by it
            average = support.needs_closure(optimizer)
            evaluate = self._closure_then_synchronize(optimizer, closure, average, self.reduce)
            with optimizer.skip_synchronize():
                output = super().optimizer_step(optimizer, evaluate, model, **kwargs)
        self._deliver_pending_sigterm()
        return output

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

    ``hvd.DistributedOptimizer(op=hvd.Adasum)``: each parameter's hook runs its local step and starts the
    Adasum of its delta; ``step()`` applies it. ``lr_scaling="auto"``: 1, or ``hvd.local_size()`` with NCCL.

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
        """Clamp each gradient before Horovod's hook runs Adasum's local step in the last backward pass."""
        for optimizer in self.optimizers:
            if not _compat.is_horovod_adasum_optimizer(optimizer):
                continue  # world size 1: Lightning's clipping acts before the step as usual
            clamp = functools.partial(_clamp_on_last_pass, optimizer, clip_value)
            for p in _compat.horovod_requires_update(optimizer):
                self._hook_handles.append(p.register_post_accumulate_grad_hook(clamp))


def _clamp_on_last_pass(optimizer: Optimizer, clip_value: float, param: Tensor) -> None:
    # Horovod counts the pass down in its own hook, after this one
    if _compat.horovod_completes_window(optimizer, param) and param.grad is not None:
        param.grad.clamp_(-clip_value, clip_value)


for _strategy in (HorovodAdasumStrategy, HorovodStrategy):
    _strategy.register_strategies(StrategyRegistry)
