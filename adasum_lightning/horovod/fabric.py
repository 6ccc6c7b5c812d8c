"""The Horovod strategies for Fabric (``horovod_adasum``, ``horovod``) and :class:`HorovodEnvironment`, the
cluster environment of both APIs' Horovod strategies. Importing it registers the strategies."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from lightning_fabric.plugins.environments import ClusterEnvironment
from lightning_fabric.plugins.environments.lightning import find_free_network_port
from lightning_fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning_fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from adasum_lightning._namespaces import register
from adasum_lightning.errors import reported_on_every_rank
from adasum_lightning.fabric._compat import BackwardSyncControl
from adasum_lightning.horovod import support
from adasum_lightning.horovod.process import HorovodProcess
from adasum_lightning.launch_environment import (
    detect_launcher,
    launcher_local_rank,
    launcher_local_size,
    launcher_rank,
    launcher_world_size,
)
from adasum_lightning.learning_rate import check_lr_scaling, lr_factor, scale_learning_rates
from adasum_lightning.replicas import prepare_unwrapped_module, sampler_seed

__all__ = ["HorovodEnvironment", "HorovodStrategy", "HorovodAdasumStrategy"]


def _from_horovod(name: str, before_init: Callable[[], int]) -> int:
    """``hvd.<name>()`` once Horovod is initialised, else ``before_init()`` (the launcher's variables)."""
    try:
        import horovod.torch as hvd
    except ImportError:
        return before_init()
    return getattr(hvd, name)() if hvd.is_initialized() else before_init()


class HorovodEnvironment(ClusterEnvironment):
    """Ranks and sizes from Horovod once it is initialised (never by reading them), else from the launcher.

    The strategy sets where the process group beside Horovod meets and the node rank after ``hvd.init()``.
    """

    def __init__(self) -> None:
        super().__init__()
        self._main_address: str | None = None
        self._main_port: int | None = None
        self._node_rank: int | None = None

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        return self._main_address or os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    @override
    def main_port(self) -> int:
        return self._main_port if self._main_port is not None else int(os.environ.get("MASTER_PORT", 0))

    #: A free TCP port on this host for rank 0's store.
    free_port = staticmethod(find_free_network_port)

    def set_main_address_and_port(self, address: str, port: int) -> None:
        """Where rank 0 hosts the process group's TCP store."""
        self._main_address, self._main_port = address, int(port)

    @staticmethod
    @override
    def detect() -> bool:
        launcher = detect_launcher()
        return launcher is not None and launcher.horovod

    @override
    def world_size(self) -> int:
        return _from_horovod("size", launcher_world_size)

    @override
    def set_world_size(self, size: int) -> None:
        pass  # fixed by the launcher, as the rank

    @override
    def global_rank(self) -> int:
        return _from_horovod("rank", launcher_rank)

    set_global_rank = set_world_size

    @override
    def local_rank(self) -> int:
        return _from_horovod("local_rank", launcher_local_rank)

    def local_world_size(self) -> int:
        """Processes on this node (Horovod's local size)."""
        return _from_horovod("local_size", launcher_local_size)

    @override
    def node_rank(self) -> int:
        """This host's index among the job's hosts (set after ``hvd.init()``); before, rank ÷ local size."""
        if self._node_rank is not None:
            return self._node_rank
        return self.global_rank() // max(1, self.local_world_size())

    def set_node_rank(self, node_rank: int) -> None:
        self._node_rank = int(node_rank)


class HorovodStrategy(HorovodProcess, DDPStrategy):
    """Fabric with Horovod's gradient averaging: one process per device, started by ``horovodrun``/``mpirun``.

    Each optimizer is wrapped in ``hvd.DistributedOptimizer(op=hvd.Average)``; ``setup_optimizer`` scales
    its learning rates (build schedulers after ``fabric.setup``).

    Args:
        lr_scaling: ``"auto"`` (× world size here), ``"none"`` or a positive factor.
        backward_passes_per_step: backward passes per optimizer step (gradient accumulation), Horovod's.
        compression, gradient_predivide_factor: Horovod's (see :class:`~.process.HorovodProcess`).
        **kwargs: ``DDPStrategy``'s but ``cluster_environment`` (``process_group_backend`` and ``timeout``:
            of the process group beside Horovod).

    Raises:
        ValueError: an invalid option.
        AdasumConfigurationError: on every rank: a bad launch or module, too many passes skipped.
    """

    strategy_name = "horovod"
    reduction = "Average"
    api = "Fabric"

    def __init__(
        self,
        lr_scaling: str | float = "auto",
        backward_passes_per_step: int = 1,
        compression: str = "none",
        gradient_predivide_factor: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(cluster_environment=HorovodEnvironment(), **kwargs)
        if self._ddp_kwargs:
            raise TypeError(f"{type(self).__name__}: unexpected keyword arguments {list(self._ddp_kwargs)}")
        self.lr_scaling = check_lr_scaling(lr_scaling)
        passes = backward_passes_per_step
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be a positive int, got {passes!r}")
        self.backward_passes_per_step = backward_passes_per_step
        self._set_options(compression, gradient_predivide_factor)
        #: The learning-rate factor applied to the last optimizer set up (None before).
        self.lr_factor: float | None = None
        self._parameter_names: dict[Tensor, str] = {}
        self._modules_set_up = 0
        self._optimizers_set_up = 0
        self._synchronized: set[int] = set()  # ids of the optimizers whose allreduce has been waited for
        self._skipped_passes = 0  # backward passes under no_backward_sync since the last step
        self._backward_sync_control = _CountedBackwardSyncControl(self)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every Horovod rank a shard, shuffled with rank 0's ``seed_everything`` seed (a broadcast)."""
        return {"num_replicas": self.world_size, "rank": self.global_rank, "seed": sampler_seed(self)}

    @override
    def setup_module(self, module: Module) -> Module:
        """Give every rank the first rank's parameters and buffers; their names name the allreduces."""
        self._check_module(module)
        prepare_unwrapped_module(self, module)
        prefix = f"module{self._modules_set_up}." if self._modules_set_up else ""
        for name, param in module.named_parameters():
            self._parameter_names.setdefault(param, prefix + name)
        self._modules_set_up += 1
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Wrap the optimizer in ``hvd.DistributedOptimizer``, scale its learning rates; before loading it."""
        self._check_optimizers([optimizer])
        index = self._optimizers_set_up
        self._optimizers_set_up += 1
        wrapped = self._horovod_optimizer(
            optimizer, index, self._parameter_names, self.backward_passes_per_step
        )
        self.lr_factor = self.lr_scale_factor()
        scale_learning_rates([wrapped], [], self.lr_factor)
        rank_zero_info(
            f"{type(self).__name__}: world size {self.world_size}, Horovod {self.reduction} reduction, "
            f"learning-rate factor {self.lr_factor:g} (lr_scaling={self.lr_scaling!r})"
        )
        return wrapped

    def lr_scale_factor(self) -> float:
        """The factor ``setup_optimizer`` applies to the learning rates (see ``lr_scaling``)."""
        return lr_factor(self.lr_scaling, self._auto_lr_factor)

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
        self._before_clipping(optimizer, "norm", max_norm)
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Wait for the gradient allreduce, then clip the averaged gradients (as every rank does)."""
        self._before_clipping(optimizer, "value", clip_val)
        return super().clip_gradients_value(module, optimizer, clip_val)

    def _before_clipping(self, optimizer: Optimizer, kind: str, limit: float) -> None:
        self._synchronize(optimizer)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Averaging (also Adasum at world size 1): wait for the gradient allreduce, then Fabric's step."""
        try:
            if self.reduction == "Adasum" and self.world_size > 1:
                return super().optimizer_step(optimizer, **kwargs)
            closure = kwargs.get("closure")
            if closure is not None:
                kwargs["closure"] = self._closure_then_synchronize(optimizer, closure, True, self.all_reduce)
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

    def _skip_backward_pass(self) -> None:
        """Count one backward pass under ``fabric.no_backward_sync``; refuse one that Horovod would reduce."""
        self._skipped_passes += 1
        with reported_on_every_rank(self.global_rank):
            support.check_skipped_backward_passes(
                self.strategy_name, type(self).__name__, self._skipped_passes, self.backward_passes_per_step
            )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register(strategy_registry, cls)


class HorovodAdasumStrategy(HorovodStrategy):
    """Fabric with Horovod's Adasum of parameter deltas: one process per device, started by ``horovodrun``.

    Each parameter's hook in ``fabric.backward`` steps it and starts the Adasum of its delta, so clipping,
    fp16 with a gradient scaler and closure optimizers are refused.

    Args: as :class:`HorovodStrategy`.

    Raises:
        AdasumConfigurationError: on every rank: the refusals above, Horovod's Adasum rules.
    """

    strategy_name = "horovod_adasum"
    reduction = "Adasum"

    @override
    def _validate_environment(self) -> None:
        super()._validate_environment()
        support.check_precision(self.precision.precision)

    @override
    def _before_clipping(self, optimizer: Optimizer, kind: str, limit: float) -> None:
        """Refused on every rank: the local step ran inside backward."""
        with reported_on_every_rank(self.global_rank):
            raise support.clipping_refused(self.strategy_name, kind, limit)


class _CountedBackwardSyncControl(BackwardSyncControl):
    """``fabric.no_backward_sync`` under Horovod: each skipped pass counts against the window."""

    def __init__(self, strategy: HorovodStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        if enabled:
            self._strategy._skip_backward_pass()
        return nullcontext()


for _strategy in (HorovodAdasumStrategy, HorovodStrategy):
    _strategy.register_strategies(STRATEGY_REGISTRY)
