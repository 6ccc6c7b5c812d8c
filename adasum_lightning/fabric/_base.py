"""What the Fabric strategies of ``torch.distributed`` share: Fabric's ``DDPStrategy`` without its wrapper."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import torch
from lightning_fabric.accelerators import Accelerator
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning_fabric.strategies import DDPStrategy
from torch.distributed.constants import default_pg_timeout
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
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision, process_group_backend,
            timeout, start_method: as for ``DDPStrategy``.
        compression: None, ``"bf16"`` or ``"fp16"``: the dtype of every piece the reduction sends.

    Raises:
        AdasumConfigurationError: an unknown ``compression``.
    """

    strategy_name: str = ""

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        compression: str | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
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
