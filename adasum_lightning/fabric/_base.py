"""What the Fabric strategies of ``torch.distributed`` share: Fabric's ``DDPStrategy`` without its wrapper."""

from __future__ import annotations

from typing import Any

from lightning_fabric.strategies import DDPStrategy
from typing_extensions import override

from adasum_lightning._namespaces import register
from adasum_lightning.allreduce import release_workspace
from adasum_lightning.launch_environment import check_strategy_world_size
from adasum_lightning.replicas import sampler_seed
from adasum_lightning.step import check_wire_compression

__all__ = ["UpdateReducingDDPStrategy"]


class UpdateReducingDDPStrategy(DDPStrategy):
    """Fabric's ``DDPStrategy`` without ``DistributedDataParallel``; subclasses reduce the update.

    Args:
        compression: None, ``"bf16"`` or ``"fp16"``: the dtype of every piece the reduction sends.
        **kwargs: ``DDPStrategy``'s (``accelerator``, ``parallel_devices``, ``cluster_environment``,
            ``checkpoint_io``, ``precision``, ``process_group_backend``, ``timeout``, ``start_method``).

    Raises:
        AdasumConfigurationError: an unknown ``compression``.
        TypeError: a keyword argument of ``DistributedDataParallel`` (the module is not wrapped).
    """

    strategy_name: str = ""

    def __init__(self, compression: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self._ddp_kwargs:
            raise TypeError(f"{type(self).__name__}: unexpected keyword arguments {list(self._ddp_kwargs)}")
        self.compression = compression
        self.wire_dtype = check_wire_compression(compression, self.strategy_name)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """``DDPStrategy``'s, with rank 0's ``seed_everything`` seed for every rank (a broadcast)."""
        return {**super().distributed_sampler_kwargs, "seed": sampler_seed(self)}

    @override
    def setup_environment(self) -> None:
        check_strategy_world_size(self, api="Fabric")
        super().setup_environment()

    @override
    def teardown(self) -> None:
        release_workspace()  # the reduction's buffers, kept between steps
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register(strategy_registry, cls)
