"""Horovod strategies for PyTorch Lightning 2.x: Adasum (``horovod_adasum``) and averaging (``horovod``).

Lightning 2.0 removed its Horovod strategy (PR #16150). These two strategies share one implementation and
differ only in the reduction op and the learning-rate policy:

======================  ==============================  ===========================================
name                    reduction (Horovod op)          learning rate, ``lr_scaling="auto"``
======================  ==============================  ===========================================
``horovod_adasum``      Adasum of parameter deltas      × 1 on CPU; × ``hvd.local_size()`` on GPU
                                                        with a NCCL-built Horovod
``horovod``             average of gradients            × world size (pytorch-lightning 1.x)
======================  ==============================  ===========================================

Processes are started by ``horovodrun`` / ``mpirun`` (one per device); Lightning never spawns them. Horovod
does what it is there for — the optimizer's reduction — and a ``torch.distributed`` process group created in
the same processes from Horovod's rank and size carries everything else (see :mod:`._base`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.accelerators import CUDAAccelerator
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_only, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from adasum_lightning import reporting, validation
from adasum_lightning.fabric.environment import HorovodEnvironment
from adasum_lightning.horovod_support import (
    agree_on_process_group,
    check_adasum_world,
    import_horovod,
    needs_closure,
)
from adasum_lightning.launchers import detect_launcher

from . import _compat
from ._base import UpdateReducingDDPStrategy

__all__ = ["HorovodStrategy", "HorovodAdasumStrategy", "import_horovod"]


class HorovodStrategy(UpdateReducingDDPStrategy):
    """Data-parallel training with Horovod: one process per device, gradients averaged by allreduce.

    This is pytorch-lightning 1.x's ``strategy="horovod"`` for Lightning 2.x: each optimizer is wrapped in
    ``hvd.DistributedOptimizer(op=hvd.Average)`` and, with ``lr_scaling="auto"``, every learning rate is
    multiplied by the world size (PL #2574). :class:`HorovodAdasumStrategy` is the Adasum variant.

    Beside Horovod, a ``torch.distributed`` process group over the same ranks (Gloo on CPU, NCCL on GPU)
    carries Lightning's own collectives (see :class:`._base.UpdateReducingDDPStrategy`). Its address is
    rank 0's (``127.0.0.1`` when every rank runs on one host; ``MASTER_ADDR`` when set), its port a free one
    rank 0 picks (``MASTER_PORT`` when set); Horovod broadcasts both.

    Args:
        accelerator, parallel_devices, checkpoint_io, precision_plugin: as for any Lightning strategy.
        lr_scaling: ``"auto"`` (× world size here), ``"none"`` or a positive factor.
        compression: ``"none"`` or ``"fp16"``: values are cast to float16 for the allreduce only (Horovod's
            ``Compression.fp16``).
        gradient_predivide_factor: Horovod's averaging split (gradients ÷ factor before the sum, × factor ÷
            size after). Must be 1 for Adasum.
        process_group_backend, timeout: of the ``torch.distributed`` process group beside Horovod.

    Raises:
        ValueError: an unknown ``lr_scaling`` or ``compression``.
    """

    strategy_name = "horovod"
    #: Horovod op name used by the optimizer wrapper ("Average" or "Adasum").
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
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=HorovodEnvironment(),
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            lr_scaling=lr_scaling,
            **kwargs,
        )
        if compression not in ("none", "fp16"):
            raise ValueError(f"compression must be 'none' or 'fp16', got {compression!r}")
        self.compression = compression
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self._hvd: Any = None
        self._requested_devices = 1
        self._hook_handles: list[Any] = []

    # ------------------------------------------------------------------------------------------ properties
    @property
    def hvd(self) -> Any:
        """The ``horovod.torch`` module, imported on first use (see :func:`import_horovod`)."""
        if self._hvd is None:
            self._hvd = import_horovod()
        return self._hvd

    @property
    @override
    def root_device(self) -> torch.device:
        if isinstance(self.accelerator, CUDAAccelerator):
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    @property
    @override
    def parallel_devices(self) -> list[torch.device] | None:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        # One process per device: whatever ``devices`` the Trainer was given (e.g. "auto" = every GPU of the
        # node), this process drives cuda:<local rank> (or the CPU). The requested count is kept for the
        # launch check (devices=2 in a process Horovod sees alone).
        if devices:
            self._requested_devices = len(devices)
            kind = torch.device(devices[0]).type
            devices = [torch.device("cuda", self.local_rank)] if kind == "cuda" else [torch.device(kind)]
        self._parallel_devices = devices

    @property
    @override
    def optimizers(self) -> list[Optimizer]:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list[Optimizer]) -> None:
        super(HorovodStrategy, type(self)).optimizers.fset(self, optimizers)
        # Lightning's LightningOptimizer subclasses the optimizer's class; Horovod's wrapper methods call
        # super(self.__class__, self), which then recurses forever (manual optimisation's opt.zero_grad()).
        # Route those methods to the wrapper itself.
        for lightning_optimizer in _compat.lightning_optimizers(self):
            wrapped = _compat.unwrap_lightning_optimizer(lightning_optimizer)
            for name in ("zero_grad", "synchronize", "skip_synchronize"):
                if name in vars(type(wrapped)):
                    setattr(lightning_optimizer, name, getattr(wrapped, name))

    # ------------------------------------------------------------------------------------------ lifecycle
    @override
    def _configure_launcher(self) -> None:
        self._launcher = None  # horovodrun / mpirun start the processes

    @override
    def setup_environment(self) -> None:
        hvd = self.hvd
        hvd.init()
        rank_zero_only.rank = hvd.rank()
        with reporting.reported_on_every_rank(hvd.rank()):
            # before the first collective: a bad launch can crash or hang in one
            validation.check_launch(
                hvd.size(), detect_launcher(), self._requested_devices, strategy_name=self.strategy_name
            )
            self._validate_environment()
        self._agree_on_process_group()
        super().setup_environment()

    def _validate_environment(self) -> None:
        """Rules on the launch (controller, world size, topology), checked right after ``hvd.init()``."""
        hvd = self.hvd
        validation.check_cpu_operations(
            mpi_enabled=hvd.mpi_enabled(),
            cpu_operations=os.environ.get("HOROVOD_CPU_OPERATIONS"),
            strategy_name=self.strategy_name,
        )

    def _agree_on_process_group(self) -> None:
        """Rank 0 picks the address and port of the ``torch.distributed`` process group; Horovod broadcasts
        them (:func:`adasum_lightning.horovod_support.agree_on_process_group`, which also sets each rank's
        node rank).

        Raises:
            AdasumConfigurationError: on every rank, when the job spans several hosts and the address would be
                a loopback one; the message names ``MASTER_ADDR``.
        """
        environment = self.cluster_environment
        assert isinstance(environment, HorovodEnvironment)
        self.num_nodes = agree_on_process_group(self.hvd, environment)

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()
        assert self.model is not None
        with reporting.reported_on_every_rank(self.global_rank):
            validation.check_horovod_dtypes(
                self.strategy_name,
                self.root_device.type,
                {p.dtype for p in self.model.parameters() if p.requires_grad},
            )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        originals = list(self.optimizers)
        with reporting.reported_on_every_rank(self.global_rank):
            self._validate_optimizers(originals)
        self.optimizers = [
            self._wrap_optimizer(optimizer, index, trainer.accumulate_grad_batches)
            for index, optimizer in enumerate(originals)
        ]
        # Schedulers must follow the wrapper: a checkpoint restore replaces its param groups.
        for config in self.lr_scheduler_configs:
            for original, wrapper in zip(originals, self.optimizers, strict=True):
                if getattr(config.scheduler, "optimizer", None) is original:
                    config.scheduler.optimizer = wrapper
                    _compat.mark_step_for_schedulers(wrapper)

    def _validate_optimizers(self, optimizers: list[Optimizer]) -> None:
        """Rules on the optimizers, checked before they are wrapped."""

    @override
    def _auto_lr_factor(self) -> float:
        return float(self.world_size)

    @override
    def _describe_reduction(self) -> str:
        return f"Horovod {self.reduction} reduction"

    def _named_parameters(self, optimizer: Optimizer, index: int) -> list[tuple[str, Tensor]]:
        """(name, parameter) for this optimizer's parameters only; names are the allreduce names."""
        assert self.lightning_module is not None
        names = {p: name for name, p in self.lightning_module.named_parameters()}
        named = []
        for g, group in enumerate(optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                named.append((names.get(p, f"optimizer{index}.group{g}.param{j}"), p))
        return named

    def _wrap_optimizer(self, optimizer: Optimizer, index: int, backward_passes_per_step: int) -> Optimizer:
        hvd = self.hvd
        compression = hvd.Compression.fp16 if self.compression == "fp16" else hvd.Compression.none
        return hvd.DistributedOptimizer(
            optimizer,
            named_parameters=self._named_parameters(optimizer, index),
            compression=compression,
            op=getattr(hvd, self.reduction),
            backward_passes_per_step=backward_passes_per_step,
            gradient_predivide_factor=self.gradient_predivide_factor,
        )

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Horovod's reduction of the step (``hvd.DistributedOptimizer``), then any SIGTERM deferred to here.

        Averaging (``horovod``, and ``horovod_adasum`` at world size 1, where Horovod returns its averaging
        wrapper): wait for the gradient allreduce right after backward (before clipping and before Lightning's
        ``on_before_optimizer_step``), then step without a second synchronisation. For an optimizer whose
        ``step`` needs a closure (LBFGS, which evaluates it several times per step), the loss the closure
        returns to the optimizer is averaged over the ranks too, so that every rank takes the same decisions
        on the same averaged gradients and stays identical.

        Adasum (``horovod_adasum``): Horovod's ``step()`` runs the closure (forward and backward, whose hooks
        already ran the local step and started the delta allreduce), then waits and applies the reduced
        delta. It has no ``synchronize()`` and its ``skip_synchronize()`` raises, so the step goes straight
        through.
        """
        hvd_optimizer = _compat.unwrap_lightning_optimizer(optimizer)
        if _compat.is_horovod_adasum_optimizer(hvd_optimizer):
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        else:
            output = self._averaging_step(hvd_optimizer, optimizer, closure, model, **kwargs)
        self._deliver_pending_sigterm()
        return output

    def _averaging_step(
        self,
        hvd_optimizer: Optimizer,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None,
        **kwargs: Any,
    ) -> Any:
        average_loss = needs_closure(hvd_optimizer)

        def closure_then_synchronize() -> Any:
            result = closure()
            hvd_optimizer.synchronize()
            if average_loss and isinstance(result, Tensor):
                result = self.reduce(result.detach().clone(), reduce_op="mean")  # Lightning's loss stays
            return result

        with hvd_optimizer.skip_synchronize():
            return super().optimizer_step(optimizer, closure_then_synchronize, model, **kwargs)

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
    :func:`adasum_lightning.ops.adasum`).

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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        validation.check_gradient_predivide_factor(self.gradient_predivide_factor)

    @override
    def _validate_environment(self) -> None:
        super()._validate_environment()
        warning = check_adasum_world(self.hvd, self.root_device.type)
        if warning:
            rank_zero_warn(warning)

    @override
    def _validate_trainer(self, trainer: pl.Trainer) -> None:
        super()._validate_trainer(trainer)
        validation.check_precision(self.precision_plugin.precision)
        algorithm = getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm)
        validation.check_gradient_clipping(trainer.gradient_clip_val, algorithm)

    @override
    def _validate_optimizers(self, optimizers: list[Optimizer]) -> None:
        validation.check_closure_optimizers(
            self.strategy_name, [type(opt).__name__ for opt in optimizers if needs_closure(opt)]
        )

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

    @override
    def _auto_lr_factor(self) -> float:
        """1 on CPU; ``hvd.local_size()`` on GPU with a NCCL build (``lr_scaling="auto"``)."""
        hvd = self.hvd
        on_gpu = self.root_device.type == "cuda"
        return float(hvd.local_size()) if on_gpu and hvd.nccl_built() else 1.0


def _clamp_on_last_pass(optimizer: Optimizer, clip_value: float, param: Tensor) -> None:
    # Horovod decrements its per-parameter countdown in its own hook, after this one.
    if _compat.horovod_completes_window(optimizer, param) and param.grad is not None:
        param.grad.clamp_(-clip_value, clip_value)
