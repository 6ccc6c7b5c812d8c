"""``Fabric(strategy="ddp_adasum")``: Adasum of parameter deltas on ``torch.distributed``, in Fabric."""

from __future__ import annotations

import functools
import os
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning_fabric.accelerators import Accelerator
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning_fabric.strategies import DDPStrategy
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module, SyncBatchNorm
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from adasum_lightning import validation
from adasum_lightning.allreduce import release_workspace
from adasum_lightning.reporting import reported_on_every_rank
from adasum_lightning.step import adasum_step, broadcast_from_rank_zero, optimizer_parameters

from . import _compat

__all__ = ["DDPAdasumStrategy"]


class DDPAdasumStrategy(DDPStrategy):
    """Fabric's DDP strategy with Adasum of parameter deltas instead of gradient averaging.

    ``optimizer.step()`` of an optimizer set up by Fabric runs Fabric's local step (the precision plugin,
    including fp16's ``GradScaler``: a step it skips on this rank takes part with a zero update), then every
    rank sets ``θ = θ_before + Adasum(deltas of all ranks)`` (:func:`adasum_lightning.step.adasum_step`):
    the step semantics of the Trainer's ``ddp_adasum`` and of :class:`adasum_lightning.AdasumOptimizer`. Each
    rank keeps its own optimizer state; the learning rate needs no scaling by world size.

    The module is not wrapped in ``DistributedDataParallel``: ``fabric.setup`` gives every rank the first
    rank's parameters and buffers and gradients stay local, so ``fabric.clip_gradients`` clips this rank's
    gradients before its local step and ``fabric.no_backward_sync`` has nothing to skip (gradients accumulate
    until the step). Collectives (``all_gather``, ``all_reduce``, ``broadcast``, ``barrier``), the launcher
    (``fabric.launch()``, ``torchrun``, SLURM) and checkpoints (``fabric.save`` writes on rank 0) are
    ``DDPStrategy``'s.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision: as for ``DDPStrategy``;
            Fabric fills them from its arguments.
        process_group_backend: ``"gloo"`` (CPU default) or ``"nccl"`` (GPU default).
        timeout: how long a collective may wait for the other ranks before this rank fails (default 30 min).
        start_method: how ``fabric.launch()`` starts the processes (``"popen"``, ``"spawn"``, ``"fork"``,
            ``"forkserver"``), as for ``DDPStrategy``.

    Raises:
        AdasumConfigurationError: on every rank, before the first step — a launcher ``WORLD_SIZE`` that
            ``devices × num_nodes`` does not describe, a module on several devices or already wrapped in
            ``DistributedDataParallel``, ``SyncBatchNorm`` layers on CPU.
    """

    strategy_name = "ddp_adasum"

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
        self._backward_sync_control = _LocalGradientsSyncControl()

    # ------------------------------------------------------------------------------------------ properties
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """DDPStrategy's, with one shuffling seed for all ranks: rank 0's ``seed_everything`` seed.

        Fabric seeds the ``DistributedSampler`` from each rank's own ``PL_GLOBAL_SEED``; ranks seeded
        differently (a common way to vary dropout or augmentation) would shard with different permutations,
        overlapping. Read when ``fabric.setup_dataloaders`` runs, which every rank calls (a broadcast).
        """
        seed = self.broadcast(int(os.environ.get("PL_GLOBAL_SEED", 0)), src=0)
        return {**super().distributed_sampler_kwargs, "seed": seed}

    # ------------------------------------------------------------------------------------------ lifecycle
    @override
    def setup_environment(self) -> None:
        environment = self.cluster_environment
        launched_outside = environment is not None and environment.creates_processes_externally
        if launched_outside and os.environ.get("WORLD_SIZE", "").isdigit():
            with reported_on_every_rank(self.global_rank):
                # before the rendezvous, which a mismatch would leave waiting
                validation.check_launcher_world_size(
                    int(os.environ["WORLD_SIZE"]),
                    self.num_processes,
                    self.num_nodes,
                    api="Fabric",
                    strategy_name=self.strategy_name,
                )
        super().setup_environment()

    @override
    def setup_module(self, module: Module) -> Module:
        """Give every rank the first rank's parameters and buffers; no ``DistributedDataParallel`` wrapper."""
        with reported_on_every_rank(self.global_rank):
            validation.check_module_unwrapped(self.strategy_name, isinstance(module, DistributedDataParallel))
            validation.check_single_device(self.strategy_name, [*module.parameters(), *module.buffers()])
            sync_layers = [name for name, m in module.named_modules() if isinstance(m, SyncBatchNorm)]
            validation.check_sync_batchnorm(self.root_device.type, False, sync_layers, self.strategy_name)
        for param in module.parameters():
            if not param.data.is_contiguous():
                param.data = param.data.contiguous()  # the reduction works on parameters in place
        broadcast_from_rank_zero([*module.parameters(), *module.buffers()])
        return module

    @override
    def teardown(self) -> None:
        release_workspace()  # the reduction's buffers, kept between steps
        super().teardown()

    # ------------------------------------------------------------------------------------------ step
    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Fabric's local step, then the Adasum of the parameter deltas over all ranks (see the class)."""
        local_step = functools.partial(super().optimizer_step, optimizer, **kwargs)
        return adasum_step(
            optimizer_parameters(optimizer), local_step, timeout=_compat.process_group_timeout(self)
        )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description=(cls.__doc__ or "").splitlines()[0], override=True
        )


class _LocalGradientsSyncControl(_compat.BackwardSyncControl):
    """``fabric.no_backward_sync`` under Adasum: gradients are never synchronised in backward, so nothing to
    skip; accumulation works by stepping every k-th batch."""

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return nullcontext()
