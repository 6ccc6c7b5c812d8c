"""``Fabric(strategy="horovod_adasum")`` and ``Fabric(strategy="horovod")``: Horovod's optimizer in Fabric.

The Fabric counterparts of the Trainer's Horovod strategies
(:mod:`adasum_lightning.trainer.horovod`): processes are started by ``horovodrun`` / ``mpirun``,
each optimizer is wrapped in ``hvd.DistributedOptimizer`` (``op=hvd.Adasum`` or ``hvd.Average``), and a
``torch.distributed`` process group over Horovod's ranks carries Fabric's own collectives (``all_gather``,
``all_reduce``, ``broadcast``, ``barrier``) and the ``DistributedSampler``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import torch
from lightning_fabric.accelerators import Accelerator
from lightning_fabric.plugins import CheckpointIO, Precision
from lightning_fabric.strategies import DDPStrategy
from lightning_fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module, SyncBatchNorm
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from adasum_lightning import validation
from adasum_lightning.horovod_support import (
    agree_on_process_group,
    check_adasum_world,
    import_horovod,
    needs_closure,
)
from adasum_lightning.launchers import detect_launcher, launcher_rank
from adasum_lightning.learning_rate import check_lr_scaling, lr_factor, scale_learning_rates
from adasum_lightning.reporting import reported_on_every_rank
from adasum_lightning.step import broadcast_from_rank_zero

from . import _compat
from .environment import HorovodEnvironment

__all__ = ["HorovodStrategy", "HorovodAdasumStrategy"]


class HorovodStrategy(DDPStrategy):
    """Fabric with Horovod's gradient averaging: one process per device, started by ``horovodrun``/``mpirun``.

    ``fabric.setup`` gives every rank the first rank's parameters and buffers (no ``DistributedDataParallel``
    wrapper) and wraps each optimizer in ``hvd.DistributedOptimizer(op=hvd.Average)``: ``fabric.backward``
    starts the gradient allreduce, ``optimizer.step()`` waits for it and steps on the averaged gradients.
    ``fabric.clip_gradients`` waits for it first, so it clips the averaged gradients (and ``optimizer.step()``
    does not reduce them again). An optimizer whose ``step`` takes a closure (LBFGS) gets the gradients of
    each evaluation averaged, and the loss too, so every rank takes the same decisions.

    Learning rate: Fabric has no hook that scales it, so ``setup_optimizer`` does, once per optimizer: with
    ``lr_scaling="auto"`` every param group's ``lr`` is multiplied by the world size (pytorch-lightning 1.x's
    Horovod strategy, PL #2574), as the Trainer's ``horovod`` does. Create learning-rate schedulers after
    ``fabric.setup``, so that they start from the scaled rates.

    ``fabric.no_backward_sync``: Horovod's hooks cannot be paused; they reduce on the
    ``backward_passes_per_step``-th backward pass (or at ``optimizer.step()`` for a shorter window). Set it to
    the number of backward passes per step; skipping more passes than it leaves is refused.

    Beside Horovod, a ``torch.distributed`` process group over the same ranks (Gloo on CPU, NCCL on GPU) runs
    Fabric's collectives. Its address is rank 0's (``127.0.0.1`` on one host; ``MASTER_ADDR`` when set), its
    port a free one rank 0 picks (``MASTER_PORT`` when set); Horovod broadcasts both.

    Args:
        accelerator, parallel_devices, checkpoint_io, precision: as for ``DDPStrategy``; Fabric fills them
            from its arguments.
        process_group_backend, timeout: of the ``torch.distributed`` process group beside Horovod.
        lr_scaling: ``"auto"`` (× world size here), ``"none"`` or a positive factor.
        backward_passes_per_step: backward passes per optimizer step (gradient accumulation), Horovod's.
        compression: ``"none"`` or ``"fp16"``: values are cast to float16 for the allreduce only.
        gradient_predivide_factor: Horovod's averaging split (gradients ÷ factor before the sum, × factor ÷
            size after). Must be 1 for Adasum.

    Raises:
        ValueError: an invalid ``lr_scaling``, ``backward_passes_per_step`` or ``compression``.
        AdasumConfigurationError: on every rank, before the first step — a process Horovod sees alone though
            more were started or ``devices`` > 1, ``HOROVOD_CPU_OPERATIONS=gloo`` under MPI, a module on
            several devices, wrapped in ``DistributedDataParallel`` or with bfloat16 parameters on CPU,
            ``SyncBatchNorm`` on CPU, more backward passes skipped than ``backward_passes_per_step`` leaves.
    """

    strategy_name = "horovod"
    #: Horovod op name used by the optimizer wrapper ("Average" or "Adasum").
    reduction = "Average"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        lr_scaling: str | float = "auto",
        backward_passes_per_step: int = 1,
        compression: str = "none",
        gradient_predivide_factor: float = 1.0,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=HorovodEnvironment(),
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.lr_scaling = check_lr_scaling(lr_scaling)
        passes = backward_passes_per_step
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be a positive int, got {passes!r}")
        if compression not in ("none", "fp16"):
            raise ValueError(f"compression must be 'none' or 'fp16', got {compression!r}")
        self.backward_passes_per_step = backward_passes_per_step
        self.compression = compression
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        #: The learning-rate factor applied to the last optimizer set up (None before).
        self.lr_factor: float | None = None
        self._hvd: Any = None
        self._requested_devices = 1
        self._parameter_names: dict[Tensor, str] = {}
        self._modules_set_up = 0
        self._optimizers_set_up = 0
        self._synchronized: set[int] = set()  # ids of the optimizers whose allreduce has been waited for
        self._skipped_passes = 0  # backward passes under no_backward_sync since the last step
        self._backward_sync_control = _CountedBackwardSyncControl(self)

    # ------------------------------------------------------------------------------------------ properties
    @property
    def hvd(self) -> Any:
        """The ``horovod.torch`` module, imported on first use."""
        if self._hvd is None:
            self._hvd = import_horovod()
        return self._hvd

    @property
    @override
    def root_device(self) -> torch.device:
        devices = self.parallel_devices
        if devices and devices[0].type == "cuda":
            return torch.device("cuda", self.local_rank)
        return torch.device(devices[0].type) if devices else torch.device("cpu")

    @property
    @override
    def parallel_devices(self) -> list[torch.device] | None:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        # One process per device: whatever ``devices`` Fabric was given, this process drives one of that kind
        # (cuda:<local rank>, see root_device). The requested count is kept for the launch check.
        if devices:
            self._requested_devices = len(devices)
            devices = [torch.device(torch.device(devices[0]).type)]
        self._parallel_devices = devices

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every Horovod rank a shard (``DDPStrategy``'s counts processes per node × nodes, and here a node
        runs one device per process), with one shuffling seed for all ranks: rank 0's ``seed_everything``
        seed. Read when ``fabric.setup_dataloaders`` runs, which every rank calls (a broadcast)."""
        seed = self.broadcast(int(os.environ.get("PL_GLOBAL_SEED", 0)), src=0)
        return {"num_replicas": self.world_size, "rank": self.global_rank, "seed": seed}

    # ------------------------------------------------------------------------------------------ lifecycle
    @override
    def _configure_launcher(self) -> None:
        self._launcher = None  # horovodrun / mpirun start the processes

    @override
    def setup_environment(self) -> None:
        """``hvd.init()``, the launch rules, then the ``torch.distributed`` process group at the address the
        ranks agree on through Horovod."""
        hvd = self.hvd
        hvd.init()
        with reported_on_every_rank(hvd.rank()):
            # before the first collective: a bad launch can crash or hang in one
            validation.check_launch(
                hvd.size(),
                detect_launcher(),
                self._requested_devices,
                api="Fabric",
                strategy_name=self.strategy_name,
            )
            self._validate_environment()
        environment = self.cluster_environment
        assert isinstance(environment, HorovodEnvironment)
        self.num_nodes = agree_on_process_group(hvd, environment)
        super().setup_environment()

    def _validate_environment(self) -> None:
        """Rules on the launch (and, under Adasum, the precision), checked right after ``hvd.init()``."""
        validation.check_cpu_operations(
            mpi_enabled=self.hvd.mpi_enabled(),
            cpu_operations=os.environ.get("HOROVOD_CPU_OPERATIONS"),
            strategy_name=self.strategy_name,
        )

    @override
    def setup_module(self, module: Module) -> Module:
        """Give every rank the first rank's parameters and buffers; no ``DistributedDataParallel`` wrapper.

        The parameters' names become the names of their allreduce operations.
        """
        with reported_on_every_rank(self.global_rank):
            validation.check_module_unwrapped(self.strategy_name, isinstance(module, DistributedDataParallel))
            validation.check_single_device(self.strategy_name, [*module.parameters(), *module.buffers()])
            sync_layers = [name for name, m in module.named_modules() if isinstance(m, SyncBatchNorm)]
            validation.check_sync_batchnorm(self.root_device.type, False, sync_layers, self.strategy_name)
            validation.check_horovod_dtypes(
                self.strategy_name,
                self.root_device.type,
                {p.dtype for p in module.parameters() if p.requires_grad},
            )
        for param in module.parameters():
            if not param.data.is_contiguous():
                param.data = param.data.contiguous()  # Horovod reduces parameters and gradients in place
        broadcast_from_rank_zero([*module.parameters(), *module.buffers()])
        prefix = f"module{self._modules_set_up}." if self._modules_set_up else ""
        for name, param in module.named_parameters():
            self._parameter_names.setdefault(param, prefix + name)
        self._modules_set_up += 1
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Scale the learning rates (``lr_scaling``) and wrap the optimizer in ``hvd.DistributedOptimizer``.

        Horovod's optimizer starts with an empty state: set up an optimizer before loading its state
        (``fabric.load``).
        """
        with reported_on_every_rank(self.global_rank):
            self._validate_optimizer(optimizer)
        hvd = self.hvd
        index = self._optimizers_set_up
        self._optimizers_set_up += 1
        compression = hvd.Compression.fp16 if self.compression == "fp16" else hvd.Compression.none
        wrapped = hvd.DistributedOptimizer(
            optimizer,
            named_parameters=self._named_parameters(optimizer, index),
            compression=compression,
            op=getattr(hvd, self.reduction),
            backward_passes_per_step=self.backward_passes_per_step,
            gradient_predivide_factor=self.gradient_predivide_factor,
        )
        _compat.route_horovod_methods_to(wrapped)
        self.lr_factor = self.lr_scale_factor()
        scale_learning_rates([wrapped], [], self.lr_factor)
        rank_zero_info(
            f"{type(self).__name__}: world size {self.world_size}, Horovod {self.reduction} reduction, "
            f"learning-rate factor {self.lr_factor:g} (lr_scaling={self.lr_scaling!r})"
        )
        return wrapped

    def _validate_optimizer(self, optimizer: Optimizer) -> None:
        """Rules on an optimizer, checked before it is wrapped."""

    def _named_parameters(self, optimizer: Optimizer, index: int) -> list[tuple[str, Tensor]]:
        """(name, parameter) for this optimizer's parameters only; names are the allreduce names."""
        named = []
        for g, group in enumerate(optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                named.append((self._parameter_names.get(p, f"optimizer{index}.group{g}.param{j}"), p))
        return named

    def lr_scale_factor(self) -> float:
        """The factor ``setup_optimizer`` applies to the learning rates (see ``lr_scaling``)."""
        return lr_factor(self.lr_scaling, self._auto_lr_factor)

    def _auto_lr_factor(self) -> float:
        return float(self.world_size)

    # ------------------------------------------------------------------------------------------ step
    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Wait for the gradient allreduce, then clip the averaged gradients (as every rank does)."""
        self._synchronize(optimizer)
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Wait for the gradient allreduce, then clip the averaged gradients (as every rank does)."""
        self._synchronize(optimizer)
        return super().clip_gradients_value(module, optimizer, clip_val)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Horovod's reduction of the step (``hvd.DistributedOptimizer``).

        Averaging (``horovod``, and ``horovod_adasum`` at world size 1, where Horovod returns its averaging
        wrapper): wait for the gradient allreduce (unless ``fabric.clip_gradients`` did), then Fabric's step
        without a second one. With a closure (LBFGS), each evaluation's gradients are averaged right after it,
        and the loss the closure returns to the optimizer too, so that every rank takes the same decisions.

        Adasum (``horovod_adasum``): Horovod's ``step()`` waits for the deltas' allreduce and applies the
        reduced delta; it has no ``synchronize()``, so the step goes straight through.
        """
        try:
            if self.reduction == "Adasum" and self.world_size > 1:
                return super().optimizer_step(optimizer, **kwargs)
            closure = kwargs.get("closure")
            if closure is not None:
                kwargs["closure"] = self._closure_then_synchronize(optimizer, closure)
            else:
                self._synchronize(optimizer)
            with optimizer.skip_synchronize():
                return super().optimizer_step(optimizer, **kwargs)
        finally:
            self._synchronized.discard(id(optimizer))
            self._skipped_passes = 0

    def _synchronize(self, optimizer: Optimizer) -> None:
        """Wait for this step's gradient allreduce once (Horovod's ``synchronize()``)."""
        if id(optimizer) not in self._synchronized:
            optimizer.synchronize()
            self._synchronized.add(id(optimizer))

    def _closure_then_synchronize(
        self, optimizer: Optimizer, closure: Callable[[], Any]
    ) -> Callable[[], Any]:
        def evaluate() -> Any:
            result = closure()
            optimizer.synchronize()
            if isinstance(result, Tensor):
                result = self.all_reduce(result.detach().clone(), reduce_op="mean")
            return result

        return evaluate

    def _skip_backward_pass(self) -> None:
        """Count one backward pass under ``fabric.no_backward_sync``; refuse one that Horovod would reduce."""
        self._skipped_passes += 1
        with reported_on_every_rank(self.global_rank):
            validation.check_skipped_backward_passes(
                self.strategy_name, type(self).__name__, self._skipped_passes, self.backward_passes_per_step
            )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description=(cls.__doc__ or "").splitlines()[0], override=True
        )


class HorovodAdasumStrategy(HorovodStrategy):
    """Fabric with Horovod's Adasum of parameter deltas: one process per device, started by ``horovodrun``.

    Each optimizer is wrapped in ``hvd.DistributedOptimizer(op=hvd.Adasum)``. With world size > 1 that is
    Horovod's ``_DistributedAdasumOptimizer``: in ``fabric.backward``, on the ``backward_passes_per_step``-th
    pass, each parameter's hook runs the wrapped optimizer's step on that parameter alone and starts the
    Adasum allreduce of its delta; ``optimizer.step()`` waits and sets the parameter to its start + the
    reduced delta (the Trainer's ``horovod_adasum``). Each rank keeps its own optimizer state.

    Learning rate, ``lr_scaling="auto"``: no world-size scaling (Horovod's ``docs/adasum_user_guide.rst``).
    Factor 1 on CPU; ``hvd.local_size()`` when Horovod is NCCL-built and the model is on GPU, because NCCL
    Adasum averages inside a node and applies Adasum across nodes.

    Since the local step runs inside backward, what must act before it cannot: ``fabric.clip_gradients`` (by
    norm or by value), fp16 with a gradient scaler (``"16-mixed"``) and optimizers whose ``step`` needs a
    closure (LBFGS) are refused, on every rank and before the first step. ``fabric.no_backward_sync`` works as
    under :class:`HorovodStrategy`, with ``backward_passes_per_step``.

    Args: as :class:`HorovodStrategy`.

    Raises:
        AdasumConfigurationError: on every rank, before the first step — the refusals above,
            ``gradient_predivide_factor`` ≠ 1, a world size that is not a power of 2 on CPU, Horovod without
            MPI or under the Gloo controller (``horovodrun --gloo``), and those of :class:`HorovodStrategy`.
    """

    strategy_name = "horovod_adasum"
    reduction = "Adasum"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        with reported_on_every_rank(launcher_rank()):
            validation.check_gradient_predivide_factor(self.gradient_predivide_factor)

    # ------------------------------------------------------------------------------------------ lifecycle
    @override
    def _validate_environment(self) -> None:
        super()._validate_environment()
        validation.check_precision(self.precision.precision)
        warning = check_adasum_world(self.hvd, self.root_device.type)
        if warning:
            rank_zero_warn(warning)

    @override
    def _validate_optimizer(self, optimizer: Optimizer) -> None:
        names = [type(optimizer).__name__] if needs_closure(optimizer) else []
        validation.check_closure_optimizers(self.strategy_name, names)

    @override
    def _auto_lr_factor(self) -> float:
        """1 on CPU; ``hvd.local_size()`` on GPU with a NCCL build (``lr_scaling="auto"``)."""
        hvd = self.hvd
        on_gpu = self.root_device.type == "cuda"
        return float(hvd.local_size()) if on_gpu and hvd.nccl_built() else 1.0

    # ------------------------------------------------------------------------------------------ step
    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Refused: the local step ran inside backward (see the class).

        Raises:
            AdasumConfigurationError: on every rank, naming the strategies that can clip.
        """
        with reported_on_every_rank(self.global_rank):
            raise validation.clipping_refused(self.strategy_name, "norm", max_norm)

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Refused: the local step ran inside backward (see the class).

        Raises:
            AdasumConfigurationError: on every rank, naming the strategies that can clip.
        """
        with reported_on_every_rank(self.global_rank):
            raise validation.clipping_refused(self.strategy_name, "value", clip_val)


class _CountedBackwardSyncControl(_compat.BackwardSyncControl):
    """``fabric.no_backward_sync`` under Horovod: its hooks cannot be paused, but reduce only on the
    ``backward_passes_per_step``-th pass (or at ``optimizer.step()``); each skipped pass is counted against
    that window."""

    def __init__(self, strategy: HorovodStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        if enabled:
            self._strategy._skip_backward_pass()
        return nullcontext()
