"""The 2-D device mesh ``replicate × shard``: FSDP2 shards over ``mesh["shard"]``, Adasum combines over
``mesh["replicate"]``; ranks ``0 … S−1`` are replica group 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn import Module

from adasum_lightning.errors import AdasumConfigurationError, reported_on_every_rank
from adasum_lightning.step import broadcast_from_rank_zero

__all__ = [
    "ADASUM_MESH_DIMS",
    "check_shard_size",
    "check_adasum_mesh",
    "check_mesh_options",
    "replica_groups",
    "broadcast_from_replica_zero",
    "broadcast_module_from_rank_zero",
    "ReplicaMesh",
]


#: The dimension names of the 2-D device mesh: the replica groups first, then a group's ranks.
ADASUM_MESH_DIMS = ("replicate", "shard")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_shard_size(world_size: int, shard_size: object, owner: str = "fsdp_adasum") -> None:
    """``shard_size`` (the ranks of one replica group) is a whole number ≥ 1 dividing ``world_size``. Raises
    ``AdasumConfigurationError``: naming the shard sizes this world size allows."""
    allowed = ", ".join(str(d) for d in _divisors(max(world_size, 1)))
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise AdasumConfigurationError(
            f"{owner}: shard_size is the number of ranks of one replica group (FSDP2 shards the model over "
            f"them), a whole number ≥ 1; got {shard_size!r}. With {world_size} processes pass one of "
            f"{allowed}."
        )
    if world_size % shard_size:
        raise AdasumConfigurationError(
            f"{owner}: shard_size={shard_size} does not divide the {world_size} processes into replica "
            f"groups: pass shard_size as one of {allowed}, or launch a multiple of {shard_size} processes."
        )


def check_adasum_mesh(ndim: int, dim_names: Sequence[str] | None, owner: str = "AdasumOptimizer") -> None:
    """The mesh is 2-D with the dimensions :data:`ADASUM_MESH_DIMS`. Raises ``AdasumConfigurationError``:
    naming the mesh given and how to build the right one."""
    names = tuple(dim_names) if dim_names is not None else None
    if ndim != 2 or names != ADASUM_MESH_DIMS:
        raise AdasumConfigurationError(
            f"{owner}: the mesh must be 2-D with dimensions named {ADASUM_MESH_DIMS} (replica groups × the "
            f"ranks FSDP2 shards over), got a {ndim}-D mesh named {names}. Build it with "
            "torch.distributed.device_mesh.init_device_mesh(device_type, (world_size // shard_size, "
            "shard_size), mesh_dim_names=('replicate', 'shard')) and shard the model with "
            "fully_shard(..., mesh=mesh['shard'])."
        )


def check_mesh_options(
    owner: str, sync_every: int, combine: str, outer_optimizer: bool, process_group: bool = False
) -> None:
    """With a mesh, no ``process_group`` besides and every step combined by Adasum (no local SGD yet). Raises
    ``AdasumConfigurationError``: naming the option to drop."""
    if process_group:
        raise AdasumConfigurationError(
            f"{owner}: pass either process_group (every rank a replica) or mesh (replica groups), not both."
        )
    given = [
        *([f"sync_every={sync_every}"] if sync_every != 1 else []),
        *([f"combine={combine!r}"] if combine != "adasum" else []),
        *(["an outer_optimizer"] if outer_optimizer else []),
    ]
    if given:
        raise AdasumConfigurationError(
            f"{owner}: with a mesh (Adasum across replica groups, FSDP2 inside each) every step is combined "
            f"by Adasum; {' and '.join(given)} is not supported there yet: drop it (sync_every=1, "
            "combine='adasum', no outer_optimizer), or train unsharded over all ranks, where local SGD is "
            "supported: ddp_adasum (Trainer, Fabric) or AdasumOptimizer without a mesh."
        )


def replica_groups(
    mesh: DeviceMesh, owner: str = "AdasumOptimizer"
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's ``(replicate_group, shard_group)`` of ``mesh``. Raises ``AdasumConfigurationError``: the
    mesh is not 2-D ``("replicate", "shard")``. TypeError: ``mesh`` is not a ``DeviceMesh``."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"{owner}'s mesh is a DeviceMesh, got {type(mesh).__name__}: build it with "
            "init_device_mesh(device_type, (groups, shard_size), mesh_dim_names=('replicate', 'shard'))."
        )
    check_adasum_mesh(mesh.ndim, mesh.mesh_dim_names, owner)
    return mesh.get_group("replicate"), mesh.get_group("shard")


def broadcast_from_replica_zero(params: Sequence[torch.Tensor], replicate_group: dist.ProcessGroup) -> None:
    """Give every replica group replica group 0's local shards of ``params``, in place."""
    with torch.no_grad():
        shards = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    broadcast_from_rank_zero([t for t in shards if t.numel()], replicate_group)


def broadcast_module_from_rank_zero(module: Module, replicate_group: dist.ProcessGroup) -> None:
    """Give every rank rank 0's values of a module that may be sharded already, in place (a collective)."""
    tensors = [*module.parameters(), *module.buffers()]
    broadcast_from_replica_zero([t for t in tensors if isinstance(t, DTensor)], replicate_group)
    broadcast_from_rank_zero([t for t in tensors if not isinstance(t, DTensor)])


class ReplicaMesh:
    """The 2-D mesh of both APIs' ``fsdp_adasum`` strategies, mixed into them."""

    strategy_name: str
    shard_size: int | None
    _device_mesh: Any = None
    # the Lightning strategy's
    global_rank: int
    world_size: int
    num_processes: int
    root_device: torch.device

    @property
    def device_mesh(self) -> Any:
        """The ``DeviceMesh``; RuntimeError before the processes started."""
        if self._device_mesh is None:
            raise RuntimeError(f"{self.strategy_name}'s device mesh is built when the processes start")
        return self._device_mesh

    @property
    def replicate_group(self) -> dist.ProcessGroup:
        """One rank per replica group, at this rank's shard position."""
        return self.device_mesh.get_group("replicate")

    @property
    def shard_group(self) -> dist.ProcessGroup:
        """The ranks of this rank's replica group (FSDP2 shards over them)."""
        return self.device_mesh.get_group("shard")

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """``(replica groups, shard_size)``."""
        groups, shard = self.device_mesh.shape
        return groups, shard

    def _build_mesh(self) -> None:
        """Build the mesh (``shard_size`` default: the processes per node) once the process group exists."""
        from torch.distributed.device_mesh import init_device_mesh

        shard = self.shard_size if self.shard_size is not None else self.num_processes
        with reported_on_every_rank(self.global_rank):
            check_shard_size(self.world_size, shard, self.strategy_name)
        shape = (self.world_size // shard, shard)
        self._device_mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=ADASUM_MESH_DIMS)
