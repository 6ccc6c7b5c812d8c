"""``fsdp_adasum``: Adasum across replica groups, FSDP2 inside each."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.optim import Optimizer
from typing_extensions import override

import adasum_lightning.checkpoint as ckpt
import adasum_lightning.sharded as sharding
from adasum_lightning.allreduce import release_workspace
from adasum_lightning.errors import reported_on_every_rank
from adasum_lightning.launch_environment import check_strategy_world_size
from adasum_lightning.mesh import ReplicaMesh, broadcast_module_from_rank_zero, check_mesh_options
from adasum_lightning.replicas import make_parameters_contiguous
from adasum_lightning.step import check_wire_compression, optimizer_parameters

from . import _compat
from ._base import UpdateReducingDDPStrategy

__all__ = ["FSDPAdasumStrategy"]


class FSDPAdasumStrategy(ReplicaMesh, UpdateReducingDDPStrategy):
    """Adasum across replica groups of ``shard_size`` ranks, each group training a model sharded by FSDP2.

    Inside a replica group (``device_mesh["shard"]``) FSDP2 works as usual; across the groups each step's
    deltas are combined by Adasum per whole parameter (docs/fsdp_adasum.md).

    Args:
        shard_size: the ranks of one replica group (default: the processes per node); it must divide the
            world size.
        mp_policy: FSDP2's mixed precision for every ``fully_shard``.
        state_dict_type: ``"full"`` (the whole model, each rank's optimizer shard beside it; resumes on the
            same mesh) or ``"sharded"`` (a ``torch.distributed.checkpoint`` folder; resumes on any mesh).
        sync_every, combine, outer_optimizer: refused with a mesh (use ``ddp_adasum``).
        compression: None, ``"bf16"`` or ``"fp16"``: the dtype of every piece sent across the replica groups.
        **kwargs: :class:`~adasum_lightning.trainer._base.UpdateReducingDDPStrategy`'s.

    Raises:
        AdasumConfigurationError: an invalid option; at a resume, a full checkpoint of another mesh.
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
        compression: str | None = None,
        **kwargs: Any,
    ) -> None:
        check_mesh_options(self.strategy_name, sync_every, combine, outer_optimizer is not None)
        super().__init__(**kwargs)
        self.shard_size = shard_size
        self.mp_policy = mp_policy
        self.state_dict_type = ckpt.check_state_dict_type(state_dict_type, self.strategy_name)
        self.compression = compression
        self.wire_dtype = check_wire_compression(compression, self.strategy_name)
        self._sharded_path: Any = None  # the folder of the sharded checkpoint being restored

    @override
    def setup_environment(self) -> None:
        check_strategy_world_size(self, api="Trainer")
        super().setup_environment()
        self._build_mesh()
        if self.lightning_module is not None:  # configure_model() may shard with self.device_mesh["shard"]
            self.lightning_module._device_mesh = self._device_mesh

    @override
    def configure_ddp(self) -> None:
        """Rank 0's parameters and buffers on every rank, then FSDP2 on ``mesh["shard"]``."""
        assert self.model is not None
        if any(isinstance(m, FSDPModule) for m in self.model.modules()):  # sharded by configure_model()
            broadcast_module_from_rank_zero(self.model, self.replicate_group)
        else:
            make_parameters_contiguous(self.model)
            _compat.sync_module_states(self.model)
        sharding.shard_module(self.model, self.device_mesh["shard"], self.mp_policy)

    @override
    def _describe_reduction(self) -> str:
        groups, shard = self.mesh_shape
        wire = f", sent as {self.compression}" if self.compression else ""
        return (
            f"Adasum of parameter deltas across {groups} replica groups over {self.process_group_backend}"
            f"{wire}, FSDP2 over {shard} ranks in each"
        )

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """Lightning's local step in this replica group, then the Adasum of the deltas across the groups."""
        params = optimizer_parameters(optimizer)
        with reported_on_every_rank(self.global_rank):
            sharding.local_shards(params, self.shard_group, self.strategy_name)
        local_step = functools.partial(super().optimizer_step, optimizer, closure, model, **kwargs)
        timeout = self._timeout
        groups = self.replicate_group, self.shard_group
        output = sharding.sharded_adasum_step(params, local_step, *groups, timeout, self.wire_dtype)
        self._deliver_pending_sigterm()
        return output

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._through_root("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._through_root("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._through_root("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._through_root("predict_step", *args, **kwargs)

    def _through_root(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``lightning_module.<method>(...)`` through the FSDP2 root's ``forward``, so that its hooks run."""
        module = self.lightning_module
        assert module is not None
        if isinstance(self.model, FSDPModule):
            return self._forward_redirection(self.model, module, method, *args, **kwargs)
        return getattr(module, method)(*args, **kwargs)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """The model is restored once sharded, into the shards of this mesh."""
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole module's state (gathered over the shard group), or with ``"sharded"`` the shards."""
        assert self.lightning_module is not None
        if self.state_dict_type == "sharded":
            return ckpt.sharded_model_state(self.lightning_module, keep_plain=self.is_global_zero)
        shard_group = self.shard_group if self._device_mesh is not None else None
        return sharding.full_state_dict(self.lightning_module, shard_group)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's optimizer state, its shards as plain tensors (``"sharded"``: as ``DTensor``)."""
        state = super().optimizer_state(optimizer)
        return state if self.state_dict_type == "sharded" else sharding.optimizer_state_to_local(state)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """A full checkpoint also records the mesh; a sharded one is the folder ``filepath``."""
        if self.state_dict_type == "sharded":
            self._save_sharded(checkpoint, filepath)
            return
        if "optimizer_states" in checkpoint and self._device_mesh is not None:
            checkpoint = {**checkpoint, ckpt.SHARDED_OPTIMIZER_MESH: list(self.mesh_shape)}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _save_sharded(self, checkpoint: dict[str, Any], filepath: Any) -> None:
        """The model's shards and each replica group's optimizer state (``torch.distributed.checkpoint``);
        the rest, the param groups, state layouts and mesh in ``meta.pt``."""
        checkpoint = dict(checkpoint)
        tensors = {f"model.{k}": v for k, v in checkpoint.pop("state_dict", {}).items()}
        names = self._parameter_names()
        layouts, param_groups = [], []
        replica = self.device_mesh.get_local_rank("replicate")
        for i, optimizer in enumerate(self.optimizers if "optimizer_states" in checkpoint else []):
            entries, layout = ckpt.sharded_optimizer_entries(
                optimizer, names, f"optimizer{i}.replica{replica}"
            )
            tensors.update(entries)
            layouts.append(layout)
            param_groups.append(checkpoint["optimizer_states"][i]["param_groups"])
        identity = ckpt.save_identity(checkpoint.get("global_step"), self.broadcast)
        meta = None
        if self.is_global_zero:
            meta = {**checkpoint, ckpt.SHARDED_OPTIMIZER_MESH: list(self.mesh_shape)}
            if layouts:
                record = {"world_size": self.world_size, "lr_factor": self.lr_factor}
                meta |= {
                    "optimizer_states": param_groups,
                    ckpt.SHARDED_LAYOUTS: layouts,
                    ckpt.RANK_OPTIMIZER_STATES: record,
                }
        ckpt.save_sharded(filepath, tensors, meta, identity)

    def _parameter_names(self) -> dict[int, str]:
        assert self.lightning_module is not None
        return {id(p): name for name, p in self.lightning_module.named_parameters()}

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A full checkpoint as ``ddp_adasum``'s; a sharded folder's ``meta.pt`` (the tensors come later)."""
        self._sharded_path = checkpoint_path if os.path.isdir(checkpoint_path) else None
        if self._sharded_path is None:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        meta = ckpt.read_sharded_meta(checkpoint_path)
        self._checkpoint_path = checkpoint_path
        self._resumed_world_size = (meta.get(ckpt.RANK_OPTIMIZER_STATES) or {}).get("world_size")
        return {**meta, "state_dict": {}}  # the model's tensors: load_model_state_dict

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Each rank fills its shards from the whole saved tensors or from the saved shards."""
        assert self.lightning_module is not None
        if self._sharded_path is not None:
            ckpt.load_sharded_model_state(self.lightning_module, self._sharded_path, "model.", strict=strict)
        else:
            sharding.load_full_state_dict(
                self.lightning_module, checkpoint["state_dict"], self.shard_group, strict=strict
            )

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Each rank its own saved shard (same mesh only), its chunk of a whole state, or a sharded one's."""
        if self._sharded_path is not None:
            return self._load_sharded_optimizers(checkpoint)
        saved_mesh = checkpoint.get(ckpt.SHARDED_OPTIMIZER_MESH)
        with reported_on_every_rank(self.global_rank):
            ckpt.check_resume_mesh(saved_mesh or self.mesh_shape, self.mesh_shape, self.strategy_name)
        self._rank_file_fallback = saved_mesh is None  # a whole state stands in for another; a shard does not
        super().load_optimizer_state_dict(checkpoint)
        for optimizer in self.optimizers:
            sharding.optimizer_state_to_shards(optimizer, self.shard_group, whole=saved_mesh is None)

    def _load_sharded_optimizers(self, checkpoint: Any) -> None:
        """Replica group ``q`` takes saved group ``q mod R_old``'s optimizer state, resharded to this mesh."""
        record = checkpoint.get(ckpt.RANK_OPTIMIZER_STATES) or {}
        self._resumed_lr_factor = record.get("lr_factor")
        replica = self.device_mesh.get_local_rank("replicate")
        source = ckpt.source_rank(replica, checkpoint[ckpt.SHARDED_OPTIMIZER_MESH][0])
        names = self._parameter_names()
        layouts, param_groups = checkpoint[ckpt.SHARDED_LAYOUTS], checkpoint["optimizer_states"]
        for i, optimizer in enumerate(self.optimizers):
            key = f"optimizer{i}.replica{source}"
            ckpt.load_sharded_optimizer_state(
                optimizer, names, self._sharded_path, key, layouts[i], param_groups[i]
            )

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if not os.path.isdir(filepath):
            super().remove_checkpoint(filepath)
        elif self.is_global_zero:
            ckpt.remove_sharded(filepath)

    @override
    def teardown(self) -> None:
        release_workspace()  # the reduction's buffers, kept between steps
        super().teardown()
