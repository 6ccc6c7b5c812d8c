"""``AdasumOptimizer``: Adasum for a plain PyTorch training loop on ``torch.distributed`` (no Lightning)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from adasum_lightning.local_sgd import (
    PeriodicSync,
    check_outer_optimizer,
    check_outer_optimizer_form,
    check_sync_every,
    local_sgd_without_outer_message,
)
from adasum_lightning.mesh import broadcast_from_replica_zero, check_mesh_options, replica_groups
from adasum_lightning.sharded import local_shards, sharded_adasum_step
from adasum_lightning.step import (
    broadcast_from_rank_zero,
    check_wire_compression,
    optimizer_parameters,
    world_size,
)

__all__ = ["AdasumOptimizer", "identical_gradients_message"]


def identical_gradients_message(owner: str) -> str:
    """The warning when every rank's first gradients are bitwise identical: Adasum then combines nothing."""
    return (
        f"{owner}: every rank's gradients were identical at the first step, so the Adasum of their updates "
        "is one rank's update and Adasum combines nothing. If the model is wrapped in "
        "torch.nn.parallel.DistributedDataParallel (it averages the gradients in backward), remove the "
        "wrapper: train the module itself (model.module) and build the optimizer from its parameters. If "
        "every rank reads the same batches, give each rank its own shard (DistributedSampler)."
    )


class AdasumOptimizer(Optimizer):
    """Wrap any ``torch.optim`` optimizer so that every ``step()`` combines the ranks' updates by Adasum.

    ``step()`` runs the wrapped step on this rank's gradients, then :func:`~adasum_lightning.step.adasum_step`
    over ``process_group``; every rank calls it the same number of times. ``param_groups``, ``state``,
    ``zero_grad`` and ``state_dict`` are the wrapped optimizer's. At construction (and in
    :meth:`add_param_group`) every rank takes rank 0's parameters. A step ``GradScaler`` skips takes part with
    a zero update. docs/strategies.md describes the options.

    Args:
        optimizer: the optimizer to wrap.
        process_group: the ranks that combine their updates (default: the default process group).
        timeout: how long one exchange waits for a peer (default: torch's 30 minutes).
        sync_every, combine, outer_optimizer, overlap_sync: local SGD / DiLoCo
            (:class:`~adasum_lightning.local_sgd.PeriodicSync`); call :meth:`sync` before evaluating or saving
            mid-window.
        mesh: None, or the 2-D ``("replicate", "shard")`` mesh of a model sharded by FSDP2 over
            ``mesh["shard"]`` (:func:`~adasum_lightning.sharded.sharded_adasum_step`; no ``process_group``).
        compression: None, ``"bf16"`` or ``"fp16"``: the dtype every sent piece is rounded to.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer`` (or wrapped already), or ``timeout`` is
            not a ``timedelta``.
        RuntimeError: ``torch.distributed`` is not initialised.
        AdasumConfigurationError: an option out of range, or a mesh, parameters or options that do not fit.
    """

    #: ``GradScaler.step`` hands ``grad_scale`` and ``found_inf`` to :meth:`step`: skipped steps still reduce.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        optimizer: Optimizer,
        process_group: dist.ProcessGroup | None = None,
        timeout: timedelta | None = None,
        sync_every: int = 1,
        combine: str = "adasum",
        outer_optimizer: Optimizer | None = None,
        mesh: DeviceMesh | None = None,
        compression: str | None = None,
        overlap_sync: bool = False,
    ) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"AdasumOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}: build the "
                "optimizer first, e.g. AdasumOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))."
            )
        if isinstance(optimizer, AdasumOptimizer):
            raise TypeError("already an AdasumOptimizer: wrap the torch.optim optimizer once.")
        if timeout is not None and not isinstance(timeout, timedelta):
            raise TypeError(f"timeout is a datetime.timedelta, e.g. timedelta(minutes=5); got {timeout!r}")
        check_sync_every(sync_every, combine, "AdasumOptimizer", overlap_sync=overlap_sync)
        self.wire_dtype = check_wire_compression(compression, "AdasumOptimizer")
        check_outer_optimizer_form("AdasumOptimizer", outer_optimizer, builder=False)
        if outer_optimizer is not None:
            check_outer_optimizer(
                "AdasumOptimizer",
                [id(p) for p in optimizer_parameters(optimizer)],
                [id(p) for p in optimizer_parameters(outer_optimizer)],
                builder=False,
            )
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "AdasumOptimizer needs torch.distributed: call torch.distributed.init_process_group() before "
                "building it, or use the optimizer itself in a single process."
            )
        self.mesh = mesh
        #: With a mesh: this rank's (replicate group, shard group); None otherwise.
        self.replica_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None
        if mesh is not None:
            check_mesh_options(
                "AdasumOptimizer", sync_every, combine, outer_optimizer is not None, process_group is not None
            )
            self.replica_groups = replica_groups(mesh)
            local_shards(optimizer_parameters(optimizer), self.replica_groups[1], "AdasumOptimizer")
        self.optimizer = optimizer
        self.process_group = process_group
        self.timeout = timeout
        # Optimizer.__init__ gives the wrapper its step hooks; then it shares the wrapped groups and state.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._share_wrapped_state()
        self._broadcast(optimizer_parameters(optimizer))
        self._gradients_checked = False
        self._sync_options = (int(sync_every), combine, outer_optimizer, overlap_sync)
        self._overlap_group: dist.ProcessGroup | None = None  # overlap_sync's worker thread's
        if overlap_sync and world_size(process_group) > 1:
            ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
            self._overlap_group = dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)
        self._periodic = self._periodic_sync()
        if sync_every > 1 and combine == "adasum" and outer_optimizer is None and dist.get_rank() == 0:
            warnings.warn(local_sgd_without_outer_message("AdasumOptimizer", sync_every), stacklevel=2)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The wrapped optimizer's step on this rank, then the Adasum of the updates; returns the wrapped
        step's value (None for a step a gradient scaler skipped)."""
        # Set by GradScaler.step (see _step_supports_amp_scaling) and removed by it after this call.
        grad_scale: torch.Tensor | None = getattr(self, "grad_scale", None)
        found_inf: torch.Tensor | None = getattr(self, "found_inf", None)

        def local_step() -> Any:
            if found_inf is not None and bool(found_inf.item()):
                return None  # inf/NaN gradients on this rank: no local update, a zero delta
            if grad_scale is not None and getattr(self.optimizer, "_step_supports_amp_scaling", False):
                # e.g. fused Adam unscales in its own kernel: hand the two attributes on
                self.optimizer.grad_scale, self.optimizer.found_inf = grad_scale, found_inf
                try:
                    return self.optimizer.step()
                finally:
                    del self.optimizer.grad_scale, self.optimizer.found_inf
            if grad_scale is not None:  # as GradScaler: × the float32 reciprocal of the float64 scale
                inv_scale = grad_scale.double().reciprocal().float()
                for p in optimizer_parameters(self.optimizer):
                    if p.grad is not None:
                        p.grad.mul_(inv_scale.to(p.grad.device))
            if closure is None:
                return self.optimizer.step()
            with torch.enable_grad():
                return self.optimizer.step(closure)

        params = optimizer_parameters(self.optimizer)
        if not self._gradients_checked:
            self._gradients_checked = True
            self._warn_if_gradients_identical(params)
        if self.replica_groups is not None:
            groups = self.replica_groups
            return sharded_adasum_step(params, local_step, *groups, self.timeout, self.wire_dtype)
        return self._periodic.step(local_step)

    def sync(self) -> None:
        """End the local-SGD window now (every rank at the same step): the parameters become θ_sync."""
        self._periodic.sync()

    def _periodic_sync(self) -> PeriodicSync:
        sync_every, combine, outer, overlap = self._sync_options
        params = optimizer_parameters(self.optimizer)
        return PeriodicSync(
            params,
            sync_every,
            combine,
            outer,
            self.process_group,
            self.timeout,
            self.wire_dtype,
            overlap_sync=overlap,
            overlap_group=self._overlap_group,
        )

    def _warn_if_gradients_identical(self, params: list[torch.Tensor]) -> None:
        # Once: all_gather of each rank's float64 sum and sum of squares of the gradients (with a mesh: the
        # local shards over the replicate group); equal everywhere means averaged gradients, e.g. by DDP.
        group = self.process_group if self.replica_groups is None else self.replica_groups[0]
        grads = [p.grad for p in params if p.grad is not None]
        if world_size(group) == 1 or not grads:
            return  # a closure computes its gradients inside the step
        grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        sums = [(g.double().sum(), g.double().square().sum()) for g in grads]
        zero = torch.zeros((), dtype=torch.float64, device=grads[0].device)
        fingerprint = torch.stack([sum((s for s, _ in sums), zero), sum((q for _, q in sums), zero)])
        gathered = [torch.empty_like(fingerprint) for _ in range(world_size(group))]
        dist.all_gather(gathered, fingerprint, group=group)
        first = dist.get_rank(group) == 0 and (
            self.replica_groups is None or dist.get_rank(self.replica_groups[1]) == 0
        )
        if all(torch.equal(f, gathered[0]) for f in gathered) and first:
            warnings.warn(identical_gradients_message("AdasumOptimizer"), stacklevel=3)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the wrapped optimizer; its parameters take the first rank's values."""
        if self.param_groups is not self.optimizer.param_groups:
            super().add_param_group(param_group)  # Optimizer.__init__ filling the wrapper's own list
            return
        self._periodic.sync()
        self.optimizer.add_param_group(param_group)
        self._broadcast(self.optimizer.param_groups[-1]["params"])
        self._periodic = self._periodic_sync()

    def _broadcast(self, params: list[torch.Tensor]) -> None:
        if self.replica_groups is None:
            broadcast_from_rank_zero(params, self.process_group)
        else:
            broadcast_from_replica_zero(params, self.replica_groups[0])

    def state_dict(self) -> dict[str, Any]:
        state = self.optimizer.state_dict()
        if not self._periodic.every_step:
            state["adasum_sync"] = self._periodic.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        periodic = state_dict.pop("adasum_sync", None)
        self.optimizer.load_state_dict(state_dict)
        self._share_wrapped_state()  # loading replaces the wrapped optimizer's groups and state objects
        if periodic is not None:
            self._periodic.load_state_dict(periodic)

    def _share_wrapped_state(self) -> None:
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.defaults = self.optimizer.defaults

    def __repr__(self) -> str:
        return f"AdasumOptimizer({self.optimizer!r})"
