"""``fsdp_adasum``: Adasum across replica groups, FSDP2 inside each (:mod:`adasum_lightning.sharded`)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from pytorch_lightning.accelerators import Accelerator
from pytorch_lightning.plugins.precision import Precision
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.optim import Optimizer
from typing_extensions import override

import adasum_lightning.checkpoint as ckpt
from adasum_lightning.allreduce import release_workspace
from adasum_lightning.errors import reported_on_every_rank
from adasum_lightning.launch_environment import check_strategy_world_size
from adasum_lightning.mesh import ReplicaMesh, broadcast_module_from_rank_zero, check_mesh_options
from adasum_lightning.replicas import make_parameters_contiguous
from adasum_lightning.sharded import (
    full_state_dict,
    load_full_state_dict,
    local_shards,
    optimizer_state_to_local,
    optimizer_state_to_shards,
    shard_module,
    sharded_adasum_step,
)
from adasum_lightning.step import check_wire_compression, optimizer_parameters

from . import _compat
from ._base import UpdateReducingDDPStrategy

__all__ = ["FSDPAdasumStrategy"]


class FSDPAdasumStrategy(ReplicaMesh, UpdateReducingDDPStrategy):
    """Adasum across replica groups of ``shard_size`` ranks, each group training a model sharded by FSDP2.

    **Semantics** (Horovod's hierarchical Adasum with a replica group of ranks in place of a node; see
    :mod:`adasum_lightning.sharded`): the world is a 2-D mesh ``replicate × shard`` (:attr:`device_mesh`,
    row-major: ranks ``0 … S−1`` are replica group 0). Inside a group FSDP2 works as usual: every rank reads
    its own batches, the gradients are reduce-scattered and averaged over the group, and each rank steps its
    own shard with its own shard of the optimizer state (Lightning's closure, precision plugin and
    accumulation window as under ``ddp``). Across the groups the parameter deltas of that step are combined by
    Adasum per parameter as a whole tensor (:func:`adasum_lightning.sharded.sharded_adasum_step`), so every
    group holds the same parameters after every step and keeps its own optimizer state. No learning-rate
    scaling by the number of groups (``lr_scaling="auto"`` is factor 1), as for ``ddp_adasum``.

    **Sharding.** When fitting starts every rank takes rank 0's parameters and buffers (the whole module,
    before sharding), then ``fully_shard(child, mesh=mesh["shard"])`` is applied to each top-level child
    module that has parameters, then to the LightningModule itself. A module that already holds FSDP2 modules
    (sharded in ``configure_model`` with ``self.device_mesh["shard"]``, the same values on the ranks of a
    group) is sharded at the root only, every group taking group 0's shards. Training,
    validation, test and predict steps run through the root module's ``forward`` (Lightning's forward
    redirection), so that FSDP2's root hooks run. Buffers are neither sharded nor combined: each rank keeps
    its own.

    **Checkpoints.** ``state_dict_type="full"``: the model's state is saved whole (gathered over the shard
    group: a checkpoint of ``ddp_adasum``'s layout, loadable without FSDP2); every rank saves its own shard of
    its group's optimizer state (rank 0's in the checkpoint, the others beside it, as ``ddp_adasum`` does)
    and resumes from it on the same mesh. A ``ddp_adasum`` checkpoint (whole optimizer states) resumes here
    too, each rank taking its chunk. ``state_dict_type="sharded"``: a folder written by
    ``torch.distributed.checkpoint`` (every rank its shards, each replica group's optimizer state under its
    own key) that resumes on any mesh: the parameters resharded, replica group ``q`` taking saved group
    ``q mod R_old``'s optimizer state. The model is restored after sharding, from either layout.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for
            ``ddp_adasum`` (:class:`._base.UpdateReducingDDPStrategy`).
        process_group_backend, timeout, start_method, lr_scaling, uneven_inputs: as for ``ddp_adasum``.
        shard_size: the ranks of one replica group, over which FSDP2 shards the model (default: the processes
            per node, ``devices``); it must divide the world size.
        mp_policy: FSDP2's mixed precision for every ``fully_shard`` (e.g. ``MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``: forward and backward in bfloat16, the
            gradients reduced, the shards stepped and the deltas combined in float32).
        state_dict_type: ``"full"`` or ``"sharded"`` (above).
        sync_every, combine, outer_optimizer: ``ddp_adasum``'s local SGD, refused with a mesh (use
            ``ddp_adasum``).
        compression: None (off), ``"bf16"`` or ``"fp16"``: every piece sent across the replica groups is
            rounded to that dtype (as for ``ddp_adasum``).

    Raises:
        AdasumConfigurationError: when the processes start, a ``shard_size`` that does not divide the world
            size (:func:`adasum_lightning.mesh.check_shard_size`); a ``state_dict_type`` other than
            ``"full"``/``"sharded"``, an unknown ``compression``; at a resume, a full checkpoint of another
            mesh.
    """

    strategy_name = "fsdp_adasum"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        lr_scaling: str | float = "auto",
        uneven_inputs: str = "truncate",
        shard_size: int | None = None,
        mp_policy: MixedPrecisionPolicy | None = None,
        state_dict_type: str = "full",
        sync_every: int = 1,
        combine: str = "adasum",
        outer_optimizer: Callable[[list[torch.Tensor]], Optimizer] | None = None,
        compression: str | None = None,
    ) -> None:
        check_mesh_options(self.strategy_name, sync_every, combine, outer_optimizer is not None)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            lr_scaling=lr_scaling,
            uneven_inputs=uneven_inputs,
        )
        self.shard_size = shard_size
        self.mp_policy = mp_policy
        self.state_dict_type = ckpt.check_state_dict_type(state_dict_type, self.strategy_name)
        self.compression = compression
        self.wire_dtype = check_wire_compression(compression, self.strategy_name)
        self._sharded_path: Any = None  # the folder of the sharded checkpoint being restored
        self._device_mesh: DeviceMesh | None = None

    # ------------------------------------------------------------------------------------------ properties

    # ------------------------------------------------------------------------------------------ lifecycle
    @override
    def setup_environment(self) -> None:
        check_strategy_world_size(self, api="Trainer")
        super().setup_environment()
        self._build_mesh()
        if self.lightning_module is not None:  # configure_model() may shard with self.device_mesh["shard"]
            self.lightning_module._device_mesh = self._device_mesh

    @override
    def configure_ddp(self) -> None:
        """Rank 0's parameters and buffers on every rank, then FSDP2 on ``mesh["shard"]`` (see the class)."""
        assert self.model is not None
        if any(isinstance(m, FSDPModule) for m in self.model.modules()):  # sharded by configure_model()
            broadcast_module_from_rank_zero(self.model, self.replicate_group)
        else:
            make_parameters_contiguous(self.model)
            _compat.sync_module_states(self.model)
        shard_module(self.model, self.device_mesh["shard"], self.mp_policy)

    @override
    def _describe_reduction(self) -> str:
        groups, shard = self.mesh_shape
        wire = f", sent as {self.compression}" if self.compression else ""
        return (
            f"Adasum of parameter deltas across {groups} replica groups over {self.process_group_backend}"
            f"{wire}, FSDP2 over {shard} ranks in each"
        )

    # ------------------------------------------------------------------------------------------ steps
    @override
    def _reduced_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any, kwargs: dict[str, Any]
    ) -> Any:
        """Lightning's local step in this replica group (FSDP2), then the Adasum of the deltas across the
        groups (see the class)."""
        params = optimizer_parameters(optimizer)
        with reported_on_every_rank(self.global_rank):
            local_shards(params, self.shard_group, self.strategy_name)
        local_step = functools.partial(self._local_step, optimizer, closure, model, kwargs)
        timeout = _compat.process_group_timeout(self)
        groups = self.replicate_group, self.shard_group
        return sharded_adasum_step(params, local_step, *groups, timeout, self.wire_dtype)

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
        """``lightning_module.<method>(...)``, called from inside the root module's ``forward`` once it is an
        FSDP2 module (its hooks gather the root's parameters and mark the root for the backward pass)."""
        module = self.lightning_module
        assert module is not None
        if isinstance(self.model, FSDPModule):
            return self._forward_redirection(self.model, module, method, *args, **kwargs)
        return getattr(module, method)(*args, **kwargs)

    # ------------------------------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """The model is restored once sharded: a sharded checkpoint is read into the shards of this mesh."""
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole module's state (every rank gathers over its shard group: a collective); with
        ``state_dict_type="sharded"`` the shards themselves."""
        assert self.lightning_module is not None
        if self.state_dict_type == "sharded":
            return ckpt.sharded_model_state(self.lightning_module, keep_plain=self.is_global_zero)
        shard_group = self.shard_group if self._device_mesh is not None else None
        return full_state_dict(self.lightning_module, shard_group)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's optimizer state, its shards as plain tensors (``to_local``); with
        ``state_dict_type="sharded"`` as ``DTensor`` shards."""
        state = super().optimizer_state(optimizer)
        return state if self.state_dict_type == "sharded" else optimizer_state_to_local(state)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """A full checkpoint also records the mesh whose ranks saved their optimizer shards; a sharded one is
        the folder ``filepath`` (see :meth:`_save_sharded`)."""
        if self.state_dict_type == "sharded":
            self._save_sharded(checkpoint, filepath)
            return
        if "optimizer_states" in checkpoint and self._device_mesh is not None:
            checkpoint = {**checkpoint, ckpt.SHARDED_OPTIMIZER_MESH: list(self.mesh_shape)}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _save_sharded(self, checkpoint: dict[str, Any], filepath: Any) -> None:
        """``torch.distributed.checkpoint`` of the model's shards (``model.<name>``) and of every replica
        group's optimizer state (``optimizer<i>.replica<q>.<parameter>.<state>``); the rest of rank 0's
        checkpoint, the optimizers' param groups and state layouts and the mesh in ``meta.pt``."""
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
        """A full checkpoint as ``ddp_adasum``'s; a sharded one (a folder): its ``meta.pt`` once its files are
        checked, the tensors read when the model and the optimizers are restored."""
        self._sharded_path = checkpoint_path if os.path.isdir(checkpoint_path) else None
        if self._sharded_path is None:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        meta = ckpt.read_sharded_meta(checkpoint_path)
        self._checkpoint_path = checkpoint_path
        self._resumed_world_size = (meta.get(ckpt.RANK_OPTIMIZER_STATES) or {}).get("world_size")
        return {**meta, "state_dict": {}}  # the model's tensors: load_model_state_dict

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Each rank fills its shards: its chunk of the whole saved tensors (a full checkpoint), or the parts
        of the saved shards that its shards cover (a sharded one, saved on any mesh)."""
        assert self.lightning_module is not None
        if self._sharded_path is not None:
            ckpt.load_sharded_model_state(self.lightning_module, self._sharded_path, "model.", strict=strict)
        else:
            load_full_state_dict(
                self.lightning_module, checkpoint["state_dict"], self.shard_group, strict=strict
            )

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """A full checkpoint: each rank its own saved shard (same mesh only, else AdasumConfigurationError;
        never another rank's), or its chunk of a whole saved state (``ddp_adasum``'s); a sharded one:
        :meth:`_load_sharded_optimizers`."""
        if self._sharded_path is not None:
            return self._load_sharded_optimizers(checkpoint)
        saved_mesh = checkpoint.get(ckpt.SHARDED_OPTIMIZER_MESH)
        with reported_on_every_rank(self.global_rank):
            ckpt.check_resume_mesh(saved_mesh or self.mesh_shape, self.mesh_shape, self.strategy_name)
        self._rank_file_fallback = saved_mesh is None  # a whole state stands in for another; a shard does not
        super().load_optimizer_state_dict(checkpoint)
        for optimizer in self.optimizers:
            optimizer_state_to_shards(optimizer, self.shard_group, whole=saved_mesh is None)

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

    # ------------------------------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        release_workspace()  # the reduction's buffers, kept between steps
        super().teardown()
