"""Horovod strategies for PyTorch Lightning 2.x: Adasum (``horovod_adasum``) and averaging (``horovod``).

Lightning 2.0 removed its Horovod strategy (PR #16150). These two strategies share one
implementation and differ only in the reduction op and the learning-rate policy:

======================  ==============================  ===========================================
name                    reduction (Horovod op)          learning rate, ``lr_scaling="auto"``
======================  ==============================  ===========================================
``horovod_adasum``      Adasum of parameter deltas      × 1 on CPU; × ``hvd.local_size()`` on GPU
                                                        with a NCCL-built Horovod
``horovod``             average of gradients            × world size (pytorch-lightning 1.x)
======================  ==============================  ===========================================

Processes are started by ``horovodrun`` / ``mpirun`` (one per device); Lightning never spawns them.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from lightning_fabric.utilities.types import ReduceOp
from pytorch_lightning.accelerators import CUDAAccelerator
from pytorch_lightning.strategies import ParallelStrategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from adasum_lightning import validation
from adasum_lightning.environment import HorovodEnvironment

__all__ = ["HorovodStrategy", "HorovodAdasumStrategy", "import_horovod"]

# Param-group keys that hold a learning rate: torch's optimizers use "lr"; schedulers keep their own
# copies ("initial_lr" for every LRScheduler, "max_lr"/"min_lr" for OneCycleLR).
_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")


def import_horovod():
    """Import ``horovod.torch`` or raise an ``ImportError`` that names the fix.

    Raises:
        ImportError: Horovod is missing, or was built without its PyTorch extension.
    """
    try:
        import horovod.torch as hvd
    except ImportError as err:
        raise ImportError(
            f"Horovod with PyTorch support is not importable ({err}). Build it against the installed torch "
            "with `make setup` (or `patches/build_horovod.sh --python $(which python)`)."
        ) from err
    return hvd


class HorovodStrategy(ParallelStrategy):
    """Data-parallel training with Horovod: one process per device, gradients averaged by allreduce.

    This is pytorch-lightning 1.x's ``strategy="horovod"`` for Lightning 2.x: each optimizer is wrapped
    in ``hvd.DistributedOptimizer(op=hvd.Average)`` and, with ``lr_scaling="auto"``, every learning rate
    is multiplied by the world size (PL #2574). :class:`HorovodAdasumStrategy` is the Adasum variant.

    Args:
        accelerator, parallel_devices, checkpoint_io, precision_plugin: as for any Lightning strategy;
            Lightning fills them from the ``Trainer`` arguments.
        lr_scaling: ``"auto"`` (this strategy's policy, see :meth:`lr_scale_factor`), ``"none"``
            (factor 1) or a positive number used as the factor. The factor multiplies each param group's
            ``lr`` (and ``initial_lr``/``max_lr``/``min_lr`` when a scheduler keeps them) and every
            scheduler's ``base_lrs``, once, when fitting starts.
        compression: ``"none"`` or ``"fp16"``: values are cast to float16 for the allreduce only
            (Horovod's ``Compression.fp16``).
        gradient_predivide_factor: Horovod's averaging split (gradients ÷ factor before the sum,
            × factor ÷ size after). Must be 1 for Adasum.

    Raises:
        ValueError: on an unknown ``lr_scaling`` or ``compression``.
    """

    strategy_name = "horovod"
    #: Horovod op name used by the optimizer wrapper ("Average" or "Adasum").
    reduction = "Average"

    def __init__(
        self,
        accelerator=None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io=None,
        precision_plugin=None,
        lr_scaling: str | float = "auto",
        compression: str = "none",
        gradient_predivide_factor: float = 1.0,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=HorovodEnvironment(),
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.lr_scaling = _check_lr_scaling(lr_scaling)
        if compression not in ("none", "fp16"):
            raise ValueError(f"compression must be 'none' or 'fp16', got {compression!r}")
        self.compression = compression
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.lr_factor: float | None = None
        self._hvd = None
        self._sampler_seed = 0
        self._hook_handles: list = []

    # ------------------------------------------------------------------ topology
    @property
    def hvd(self):
        """The ``horovod.torch`` module, imported on first use (see :func:`import_horovod`)."""
        if self._hvd is None:
            self._hvd = import_horovod()
        return self._hvd

    @property
    def is_distributed(self) -> bool:
        # Read by Lightning to insert a DistributedSampler and to honour ``sync_dist``.
        return True

    @property
    def root_device(self) -> torch.device:
        if isinstance(self.accelerator, CUDAAccelerator):
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        # One process per device: whatever ``devices`` the Trainer was given (e.g. "auto" = every GPU of
        # the node), this process drives cuda:<local rank> (or the CPU).
        if devices:
            kind = torch.device(devices[0]).type
            devices = [torch.device("cuda", self.local_rank)] if kind == "cuda" else [torch.device(kind)]
        self._parallel_devices = devices

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # One shuffling seed for all ranks (rank 0's), so that the shards are disjoint even when each
        # rank called seed_everything with its own seed.
        return {"num_replicas": self.world_size, "rank": self.global_rank, "seed": self._sampler_seed}

    def setup_environment(self) -> None:
        hvd = self.hvd
        hvd.init()
        rank_zero_only.rank = hvd.rank()
        super().setup_environment()
        with _reported_on_every_rank(hvd.rank()):
            self._validate_environment()  # before the first collective: a bad launch can crash in one
        self._sampler_seed = hvd.broadcast_object(int(os.environ.get("PL_GLOBAL_SEED", 0)), root_rank=0)

    def _validate_environment(self) -> None:
        """Rules on the launch (controller, world size, topology), checked right after ``hvd.init()``."""
        hvd = self.hvd
        validation.check_cpu_operations(
            mpi_enabled=hvd.mpi_enabled(), cpu_operations=os.environ.get("HOROVOD_CPU_OPERATIONS")
        )

    def _validate_trainer(self, trainer) -> None:
        """Rules on the Trainer's settings, checked when ``setup`` starts, before the model is wrapped."""

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @property
    def optimizers(self) -> list[Optimizer]:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list[Optimizer]) -> None:
        ParallelStrategy.optimizers.fset(self, optimizers)
        # Lightning's LightningOptimizer subclasses the optimizer's class; Horovod's wrapper methods call
        # super(self.__class__, self), which then recurses forever (manual optimisation's
        # opt.zero_grad()). Route those methods to the wrapper itself.
        for lightning_optimizer in self._lightning_optimizers:
            for name in ("zero_grad", "synchronize", "skip_synchronize"):
                if name in vars(type(lightning_optimizer._optimizer)):
                    setattr(lightning_optimizer, name, getattr(lightning_optimizer._optimizer, name))

    # ------------------------------------------------------------------ learning rate
    def lr_scale_factor(self) -> float:
        """The factor applied to the learning rates: ``hvd.size()`` under ``lr_scaling="auto"``."""
        if self.lr_scaling == "none":
            return 1.0
        if self.lr_scaling == "auto":
            return float(self.hvd.size())
        return float(self.lr_scaling)

    def _scale_learning_rates(self, factor: float) -> None:
        if factor == 1.0:
            return
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                for key in _LR_KEYS:
                    if isinstance(group.get(key), numbers.Real):
                        group[key] = group[key] * factor
        for config in self.lr_scheduler_configs:
            scheduler = config.scheduler
            if hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]

    # ------------------------------------------------------------------ setup
    def setup(self, trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            with _reported_on_every_rank(self.global_rank):
                self._validate_trainer(trainer)
        super().setup(trainer)
        assert self.lightning_module is not None
        module = self.lightning_module
        validation.check_single_device([*module.parameters(), *module.buffers()])
        if trainer.state.fn != TrainerFn.FITTING:
            return
        hvd = self.hvd
        self.lr_factor = self.lr_scale_factor()
        self._scale_learning_rates(self.lr_factor)
        rank_zero_info(
            f"{type(self).__name__}: world size {hvd.size()}, {self.reduction} reduction, "
            f"learning-rate factor {self.lr_factor:g} (lr_scaling={self.lr_scaling!r})"
        )
        # Every rank starts from rank 0's weights; broadcast before wrapping so that Horovod's
        # optimizer sees the final values.
        hvd.broadcast_parameters(module.state_dict(), root_rank=0)
        originals = list(self.optimizers)
        self.optimizers = [
            self._wrap_optimizer(optimizer, index, trainer.accumulate_grad_batches)
            for index, optimizer in enumerate(originals)
        ]
        # Schedulers must follow the wrapper: a checkpoint restore replaces its param groups.
        for config in self.lr_scheduler_configs:
            for original, wrapper in zip(originals, self.optimizers, strict=True):
                if getattr(config.scheduler, "optimizer", None) is original:
                    config.scheduler.optimizer = wrapper
                    _mark_step_for_schedulers(wrapper)

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

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint on every rank; a missing or unreadable file raises an error naming the fix.

        Raises:
            FileNotFoundError: the file does not exist.
            RuntimeError: the file is truncated, corrupt or not a Lightning checkpoint.
        """
        # pytorch-lightning < 2.5 has no weights_only argument here
        kwargs = {} if weights_only is None else {"weights_only": weights_only}
        try:
            checkpoint = super().load_checkpoint(checkpoint_path, **kwargs)
        except FileNotFoundError as err:
            raise FileNotFoundError(
                f"checkpoint {checkpoint_path} does not exist on rank {self.global_rank}. Pass the path of a "
                "checkpoint that every rank can read (Lightning writes them under "
                "<default_root_dir>/.../checkpoints/), or ckpt_path=None to start from scratch."
            ) from err
        except validation.CHECKPOINT_READ_ERRORS as err:
            raise validation.unreadable_checkpoint(checkpoint_path, err, self.global_rank) from err
        if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
            raise RuntimeError(
                f"checkpoint {checkpoint_path} holds no 'state_dict': it is not a Lightning checkpoint. "
                "Pass a file written by Trainer.fit (ModelCheckpoint), or ckpt_path=None."
            )
        return checkpoint

    def load_optimizer_state_dict(self, checkpoint) -> None:
        super().load_optimizer_state_dict(checkpoint)
        # Every rank read the same file; the broadcast also covers a file only rank 0 could read well.
        for optimizer in self.optimizers:
            if optimizer.state_dict()["state"]:
                self.hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # ------------------------------------------------------------------ step
    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        """Average: wait for the gradient allreduce right after backward (before clipping and before
        Lightning's ``on_before_optimizer_step``), then step without a second synchronisation."""
        hvd_optimizer = getattr(optimizer, "_optimizer", optimizer)

        def closure_then_synchronize() -> Any:
            result = closure()
            hvd_optimizer.synchronize()
            return result

        with hvd_optimizer.skip_synchronize():
            return super().optimizer_step(optimizer, closure_then_synchronize, model, **kwargs)

    # ------------------------------------------------------------------ collectives
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """Allreduce ``tensor`` over all ranks ("mean"/"avg", "sum", "max", "min"); other values pass through.

        Returns a tensor of the input's shape; non-tensors are returned unchanged.
        """
        if not isinstance(tensor, Tensor):
            return tensor
        op = self._horovod_op(reduce_op)
        return self.hvd.allreduce(tensor, op=op)

    def _horovod_op(self, reduce_op: ReduceOp | str | None):
        hvd = self.hvd
        name = getattr(reduce_op, "name", reduce_op)
        name = "mean" if name is None else str(name).lower()
        table = {
            "mean": hvd.Average,
            "avg": hvd.Average,
            "average": hvd.Average,
            "sum": hvd.Sum,
            "max": hvd.Max,
            "min": hvd.Min,
        }
        if name not in table:
            raise ValueError(f"reduce_op {reduce_op!r} is not supported; use 'mean', 'sum', 'max' or 'min'")
        return table[name]

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Gather ``tensor`` (any shape ``S``) from every rank: returns shape ``(world_size, *S)``."""
        if not sync_grads:
            tensor = tensor.detach()
        return self.hvd.allgather(tensor.unsqueeze(0))

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.hvd.broadcast_object(obj, root_rank=src)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._hvd is not None and self.hvd.is_initialized():
            self.hvd.barrier()

    # ------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        # Horovod's wrapper registers backward hooks on the gradient accumulators of the parameters and
        # keeps them alive; dropping them lets a later fit() wrap fresh optimizers without the old hooks.
        for optimizer in self.optimizers:
            grad_accs = getattr(optimizer, "_grad_accs", None)
            if isinstance(grad_accs, list):
                grad_accs.clear()
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description=cls.__doc__.splitlines()[0], override=True
        )


class HorovodAdasumStrategy(HorovodStrategy):
    """Data-parallel training with Horovod's Adasum: parameter deltas combined adaptively.

    Each optimizer is wrapped in ``hvd.DistributedOptimizer(op=hvd.Adasum)``. With world size > 1 that
    is Horovod's ``_DistributedAdasumOptimizer`` (``horovod/torch/optimizer.py``): on the
    ``backward_passes_per_step``-th backward of a parameter its hook runs the wrapped optimizer's step on
    that parameter alone, turns it into the delta (new − start) and starts an Adasum allreduce of the
    delta; ``step()`` waits and sets the parameter to start + reduced delta. Each rank keeps its own
    optimizer state (e.g. momentum from its local gradients). Adasum of two deltas ``a``, ``b`` is
    ``(1 − a·b/2‖a‖²)·a + (1 − a·b/2‖b‖²)·b`` (Maleki et al., MLSys 2021;
    :func:`adasum_lightning.ops.adasum`).

    Learning rate, ``lr_scaling="auto"`` (Horovod's ``docs/adasum_user_guide.rst``): no world-size
    scaling. Factor 1 on CPU; ``hvd.local_size()`` when Horovod is NCCL-built and the model is on GPU,
    because NCCL Adasum averages inside a node and applies Adasum across nodes.

    ``backward_passes_per_step`` is the Trainer's ``accumulate_grad_batches``.

    Args: as :class:`HorovodStrategy`.
    """

    strategy_name = "horovod_adasum"
    reduction = "Adasum"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        validation.check_gradient_predivide_factor(self.gradient_predivide_factor)

    def _validate_environment(self) -> None:
        super()._validate_environment()
        hvd = self.hvd
        if hvd.size() == 1:
            return  # nothing is reduced
        validation.check_controller(
            mpi_built=hvd.mpi_built(), mpi_enabled=hvd.mpi_enabled(), gloo_enabled=hvd.gloo_enabled()
        )
        if self.root_device.type == "cuda" and hvd.nccl_built():
            warning = validation.check_nccl_topology(hvd.size(), hvd.allgather_object(hvd.local_size()))
            if warning:
                rank_zero_warn(warning)
        else:
            validation.check_world_size(hvd.size())

    def _validate_trainer(self, trainer) -> None:
        validation.check_precision(self.precision_plugin.precision)
        algorithm = getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm)
        validation.check_gradient_clipping(trainer.gradient_clip_val, algorithm)

    def setup(self, trainer) -> None:
        super().setup(trainer)
        algorithm = getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm)
        if trainer.state.fn == TrainerFn.FITTING and trainer.gradient_clip_val and algorithm == "value":
            self._clip_values_before_local_step(float(trainer.gradient_clip_val))

    def _clip_values_before_local_step(self, clip_value: float) -> None:
        """Clamp each gradient to ``[-clip_value, clip_value]`` right before Adasum's local step.

        Horovod's hook (on the gradient accumulator) runs the local step on the last backward pass of a
        window; a post-accumulate-grad hook runs before it, so the clamp takes effect there. Lightning's
        own clipping after backward still covers parameters whose step runs inside ``step()`` (the partial
        window at an epoch's end, parameters without a gradient).
        """
        for optimizer in self.optimizers:
            if not _is_adasum_wrapper(optimizer):
                continue  # world size 1: Lightning's clipping acts before the step as usual
            for p in optimizer._requires_update:
                self._hook_handles.append(
                    p.register_post_accumulate_grad_hook(
                        functools.partial(_clamp_on_last_pass, optimizer, clip_value)
                    )
                )

    def lr_scale_factor(self) -> float:
        """1 on CPU; ``hvd.local_size()`` on GPU with a NCCL build (``lr_scaling="auto"``)."""
        if self.lr_scaling == "auto":
            hvd = self.hvd
            on_gpu = self.root_device.type == "cuda"
            return float(hvd.local_size()) if on_gpu and hvd.nccl_built() else 1.0
        return super().lr_scale_factor()

    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        # Horovod's Adasum step() runs the closure (forward + backward, whose hooks already did the local
        # step and started the delta allreduce), then waits and applies the reduced delta. It has no
        # synchronize() and its skip_synchronize() raises, so the step goes straight through. With world
        # size 1 Horovod returns its averaging wrapper, which takes the averaging path.
        if _is_adasum_wrapper(getattr(optimizer, "_optimizer", optimizer)):
            return ParallelStrategy.optimizer_step(self, optimizer, closure, model, **kwargs)
        return super().optimizer_step(optimizer, closure, model, **kwargs)


@contextlib.contextmanager
def _reported_on_every_rank(rank: int):
    """Print a refused configuration on this rank at once: when the first rank exits, the launcher kills
    the others, which could then die before Python prints their traceback."""
    try:
        yield
    except validation.AdasumConfigurationError as err:
        print(f"AdasumConfigurationError on rank {rank}: {err}", file=sys.stderr, flush=True)
        raise


def _is_adasum_wrapper(optimizer: Optimizer) -> bool:
    """True for Horovod's ``_DistributedAdasumOptimizer`` (a class Horovod builds at run time)."""
    return "_starting_models" in vars(optimizer)


def _clamp_on_last_pass(optimizer: Optimizer, clip_value: float, param: Tensor) -> None:
    # Horovod decrements _allreduce_delay[param] in its own hook, after this one: 1 means this backward
    # pass completes the window and the local step follows right away.
    if optimizer._allreduce_delay.get(param) == 1 and param.grad is not None:
        param.grad.clamp_(-clip_value, clip_value)


def _mark_step_for_schedulers(optimizer: Optimizer) -> None:
    """Let torch's LR schedulers see ``step()`` calls of a wrapper built after them (as they do for the
    optimizer they were created with), so that they neither warn nor lose track of the step order."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    @functools.wraps(step)
    def step_and_mark(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True
        return step(*args, **kwargs)

    step_and_mark._wrapped_by_lr_sched = True
    optimizer.step = step_and_mark


def _check_lr_scaling(value: str | float) -> str | float:
    if isinstance(value, str):
        if value in ("auto", "none"):
            return value
        try:
            value = float(value)
        except ValueError:
            raise ValueError(
                f"lr_scaling must be 'auto', 'none' or a positive number, got {value!r}"
            ) from None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"lr_scaling must be 'auto', 'none' or a positive number, got {value!r}")
    return float(value)
