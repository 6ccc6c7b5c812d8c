"""``Fabric(strategy="fsdp_adasum")``: Adasum across replica groups, FSDP2 inside each."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from lightning_fabric.plugins import TorchCheckpointIO
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

import adasum_lightning.checkpoint as ckpt
import adasum_lightning.sharded as sharding
from adasum_lightning.checkpoint import Filter, _is_stateful
from adasum_lightning.errors import reported_on_every_rank
from adasum_lightning.mesh import ReplicaMesh, broadcast_module_from_rank_zero, check_mesh_options
from adasum_lightning.replicas import prepare_unwrapped_module
from adasum_lightning.step import optimizer_parameters

from . import _compat
from ._base import UpdateReducingDDPStrategy

__all__ = ["FSDPAdasumStrategy"]


class FSDPAdasumStrategy(ReplicaMesh, UpdateReducingDDPStrategy):
    """Adasum across replica groups of ``shard_size`` ranks, each group training a model sharded by FSDP2.

    The Trainer's ``fsdp_adasum`` (docs/fsdp_adasum.md). ``fabric.setup`` shards the model and rebinds an
    optimizer built before to the sharded parameters; ``fabric.no_backward_sync`` skips the reduce-scatter.

    Args:
        shard_size, mp_policy, state_dict_type, sync_every, combine, outer_optimizer: as for the Trainer's
            ``fsdp_adasum``.
        **kwargs: :class:`~adasum_lightning.fabric._base.UpdateReducingDDPStrategy`'s (``DDPStrategy``'s,
            ``compression``).

    Raises:
        AdasumConfigurationError: on every rank, before the first step: an invalid option, launch or module,
            an optimizer over the parameters before sharding, a full checkpoint of another mesh.
    """

    strategy_name = "fsdp_adasum"

    def __init__(
        self,
        shard_size: int | None = None,
        mp_policy: MixedPrecisionPolicy | None = None,
        state_dict_type: str = "full",
        sync_every: int = 1,
        combine: str = "adasum",
        outer_optimizer: Callable[[list[torch.Tensor]], Optimizer] | None = None,
        **kwargs: Any,
    ) -> None:
        check_mesh_options(self.strategy_name, sync_every, combine, outer_optimizer is not None)
        super().__init__(**kwargs)
        self._backward_sync_control = _ShardedGradientsSyncControl()
        self.shard_size = shard_size
        self.mp_policy = mp_policy
        self.state_dict_type = ckpt.check_state_dict_type(state_dict_type, self.strategy_name)
        self._sharded_parameters: set[int] = set()  # ids of the parameters of the modules set up

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._build_mesh()

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], *scheduler: Any
    ) -> tuple[Any, ...]:
        """Shard the model, then point each optimizer at the sharded parameters that replaced its own."""
        names = {id(p): name for name, p in module.named_parameters()}
        module = self.setup_module(module)
        sharded = dict(module.named_parameters())
        for optimizer in optimizers:
            with reported_on_every_rank(self.global_rank):
                has_state = bool(optimizer.state)
                sharding.check_optimizer_of_sharded_module(self.strategy_name, 0, 0, has_state=has_state)
            for group in optimizer.param_groups:
                group["params"] = [sharded.get(names.get(id(p), ""), p) for p in group["params"]]
        return (module, [self.setup_optimizer(o) for o in optimizers], *scheduler)

    @override
    def setup_module(self, module: Module) -> Module:
        """Rank 0's parameters and buffers on every rank, then FSDP2 on ``mesh["shard"]``."""
        if any(isinstance(m, FSDPModule) for m in module.modules()):  # sharded by the user on mesh["shard"]
            broadcast_module_from_rank_zero(module, self.replicate_group)
        else:
            prepare_unwrapped_module(self, module)
        sharding.shard_module(module, self.device_mesh["shard"], self.mp_policy)
        self._sharded_parameters.update(id(p) for p in module.parameters())
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Check that ``optimizer`` steps the sharded parameters (see the class)."""
        params = optimizer_parameters(optimizer)
        stale = sum(1 for p in params if id(p) not in self._sharded_parameters)
        with reported_on_every_rank(self.global_rank):
            sharding.check_optimizer_of_sharded_module(self.strategy_name, stale, len(params))
        return optimizer

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Fabric's local step in this replica group (FSDP2), then the Adasum of the deltas across groups."""
        params = optimizer_parameters(optimizer)
        with reported_on_every_rank(self.global_rank):
            sharding.local_shards(params, self.shard_group, self.strategy_name)
        local_step = functools.partial(super().optimizer_step, optimizer, **kwargs)
        timeout = self._timeout
        groups = self.replicate_group, self.shard_group
        return sharding.sharded_adasum_step(params, local_step, *groups, timeout, self.wire_dtype)

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        """The whole module's state (every rank gathers over its shard group: a collective)."""
        return sharding.full_state_dict(module, self.shard_group if self._device_mesh is not None else None)

    @override
    def load_module_state_dict(
        self, module: Module, state_dict: dict[str, Any | torch.Tensor], strict: bool = True
    ) -> None:
        """Each rank copies its chunk of the whole saved tensors into its shards."""
        sharding.load_full_state_dict(module, state_dict, self.shard_group, strict=strict)

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's optimizer state, its shards as plain tensors."""
        return sharding.optimizer_state_to_local(optimizer.state_dict())

    @override
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any = None, filter: Filter | None = None
    ) -> None:
        """The file of the whole model and every rank's optimizer shard, or with ``"sharded"`` the folder."""
        if self.state_dict_type == "full":
            return self._save_full(path, state, storage_options, filter)
        with reported_on_every_rank(self.global_rank):
            ckpt.check_sharded_save_filter(bool(filter))
        self._save_sharded(path, state)

    def _save_full(
        self, path: Any, state: dict[str, Any], storage_options: Any, filter: Filter | None
    ) -> None:
        """The whole model, the mesh and the save's identity; each rank's optimizer shard (rank 0's in the
        file, the others beside it)."""
        modules, optimizers = self.get_module_state_dict, self.get_optimizer_state
        converted, keys = ckpt.convert_state(state, modules, optimizers, filter)
        if keys:
            identity = ckpt.save_identity(state.get("step"), self.broadcast)
            converted |= {ckpt.SHARDED_OPTIMIZER_MESH: list(self.mesh_shape), ckpt.SAVE_IDENTITY: identity}
            if self.global_rank != 0:
                ckpt.save_rank_file(path, self.global_rank, {k: converted[k] for k in keys}, identity)
        if self.global_rank == 0:
            in_place = type(self.checkpoint_io) is TorchCheckpointIO
            ckpt.save_through(self.checkpoint_io, converted, path, storage_options, in_place)
        if keys:
            ckpt.commit_rank_file(path, self.global_rank, self.barrier)

    def _save_sharded(self, path: Any, state: dict[str, Any]) -> None:
        """Each module's shards and each replica group's optimizer state (``torch.distributed.checkpoint``);
        the rest, the param groups, state layouts and mesh in ``<path>/meta.pt``."""
        names = self._parameter_names(state)
        replica = self.device_mesh.get_local_rank("replicate")
        tensors: dict[str, Any] = {}
        meta: dict[str, Any] = {ckpt.SHARDED_OPTIMIZER_MESH: list(self.mesh_shape), ckpt.SHARDED_LAYOUTS: {}}
        for key, obj in state.items():
            if isinstance(obj, Module):
                module_state = ckpt.sharded_model_state(obj, keep_plain=self.global_rank == 0)
                tensors.update({f"{key}.{k}": v for k, v in module_state.items()})
            elif isinstance(obj, Optimizer):
                entries, layout = ckpt.sharded_optimizer_entries(obj, names, f"{key}.replica{replica}")
                tensors.update(entries)
                meta[ckpt.SHARDED_LAYOUTS][key] = layout
                meta[key] = obj.state_dict()["param_groups"]
            else:
                meta[key] = obj.state_dict() if _is_stateful(obj) else obj
        identity = ckpt.save_identity(state.get("step"), self.broadcast)
        ckpt.save_sharded(path, tensors, meta if self.global_rank == 0 else None, identity)

    @staticmethod
    def _parameter_names(state: Mapping[str, Any]) -> dict[int, str]:
        """``id(parameter)`` → ``<module key>.<parameter name>`` for the modules in ``state``."""
        return {
            id(p): f"{key}.{name}"
            for key, obj in state.items()
            if isinstance(obj, Module)
            for name, p in obj.named_parameters()
        }

    def _load_sharded(self, path: Any, state: dict[str, Any], strict: bool) -> dict[str, Any]:
        """Restore ``state`` from a folder of :meth:`_save_sharded` saved on any mesh (replica group ``q``
        takes group ``q mod R_old``'s optimizer state)."""
        meta = ckpt.read_sharded_meta(path)
        saved_groups = int(meta.pop(ckpt.SHARDED_OPTIMIZER_MESH)[0])
        layouts = meta.pop(ckpt.SHARDED_LAYOUTS)
        source = ckpt.source_rank(self.device_mesh.get_local_rank("replicate"), saved_groups)
        names = self._parameter_names(state)
        absent = [k for k in state if k not in meta and k not in layouts and not isinstance(state[k], Module)]
        ckpt.check_strict_keys(absent, strict)
        for key, obj in list(state.items()):
            if isinstance(obj, Module):
                ckpt.load_sharded_model_state(obj, path, f"{key}.", strict=strict)
            elif isinstance(obj, Optimizer) and key in layouts:
                param_groups = meta.pop(key)
                ckpt.load_sharded_optimizer_state(
                    obj, names, path, f"{key}.replica{source}", layouts[key], param_groups
                )
            elif key in meta:
                value = meta.pop(key)
                if _is_stateful(obj):
                    obj.load_state_dict(value)
                else:
                    state[key] = value
        return meta

    @override
    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, **kwargs: Any
    ) -> dict[str, Any]:
        """Restore ``state`` from a file or a sharded folder; returns the items ``state`` did not name."""
        if os.path.isdir(path) and state and not isinstance(state, (Module, Optimizer)):
            return self._load_sharded(path, state, strict)
        checkpoint = self.checkpoint_io.load_checkpoint(path, **kwargs)
        return self._load_full(path, checkpoint, state, strict) if state else checkpoint

    def _load_full(self, path: Any, checkpoint: dict[str, Any], state: Any, strict: bool) -> dict[str, Any]:
        """The model from the whole tensors, each optimizer from this rank's own shard (same mesh only).

        Raises:
            AdasumConfigurationError: optimizer shards of another mesh (IncompleteCheckpointError: this
                rank's file missing or from another save; KeyError: a missing key; TypeError: an optimizer).
        """
        if isinstance(state, Module):
            self.load_module_state_dict(state, checkpoint, strict=strict)
            return {}
        if isinstance(state, Optimizer):
            raise TypeError(
                "fsdp_adasum loads an optimizer's shard from a checkpoint of fabric.save(path, {'optimizer': "
                "optimizer, ...}): pass state={'optimizer': optimizer} (with the model)."
            )
        saved_mesh = checkpoint.pop(ckpt.SHARDED_OPTIMIZER_MESH, None)
        identity = checkpoint.pop(ckpt.SAVE_IDENTITY, None)
        own: dict[str, Any] = {}
        if saved_mesh is not None and any(
            isinstance(o, Optimizer) and k in checkpoint for k, o in state.items()
        ):
            with reported_on_every_rank(self.global_rank):
                ckpt.check_resume_mesh(saved_mesh, self.mesh_shape, self.strategy_name)
            rank = self.global_rank
            own = ckpt.load_rank_optimizer_states(path, rank, rank, identity, fallback=False) or {}

        def load_optimizer(key: str, optimizer: Optimizer, value: Any) -> None:
            optimizer.load_state_dict(own.get(key, value))
            sharding.optimizer_state_to_shards(optimizer, self.shard_group, whole=saved_mesh is None)

        def load_module(module: Module, value: Any) -> None:
            self.load_module_state_dict(module, value, strict=strict)

        return ckpt.restore_state(state, checkpoint, strict, load_module, load_optimizer)


class _ShardedGradientsSyncControl(_compat.BackwardSyncControl):
    """``fabric.no_backward_sync`` under FSDP2: no reduce-scatter in the skipped backward passes."""

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return _without_gradient_sync(module) if enabled else nullcontext()


@contextmanager
def _without_gradient_sync(module: Module) -> Generator[None, None, None]:
    sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in sharded:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for m in sharded:
            m.set_requires_gradient_sync(True, recurse=False)
