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
    """The warning when every rank's first gradients are bitwise identical: Adasum then combines nothing.

    Most often a model still wrapped in ``DistributedDataParallel``, else the same batches on every rank.
    """
    return (
        f"{owner}: every rank's gradients were identical at the first step, so the Adasum of their updates "
        "is one rank's update and Adasum combines nothing. If the model is wrapped in "
        "torch.nn.parallel.DistributedDataParallel (it averages the gradients in backward), remove the "
        "wrapper: train the module itself (model.module) and build the optimizer from its parameters. If "
        "every rank reads the same batches, give each rank its own shard (DistributedSampler)."
    )


class AdasumOptimizer(Optimizer):
    """Wrap any ``torch.optim`` optimizer so that every ``step()`` combines the ranks' updates by Adasum.

    ``step(closure=None)`` runs the wrapped optimizer's step on this rank's gradients, then replaces the
    change of every parameter by the Adasum of all ranks' changes over ``process_group``
    (:func:`adasum_lightning.step.adasum_step`) — the step semantics of ``strategy="ddp_adasum"``: each rank
    keeps its own optimizer state, every rank holds the same parameters after every step, and the learning
    rate needs no scaling by world size. At construction every rank takes the first rank's parameter values
    (as ``DistributedDataParallel`` does), and so do parameters given later to :meth:`add_param_group`.

    The rest is the wrapped optimizer's: ``param_groups`` and ``state`` are its own objects, ``zero_grad``,
    ``state_dict``/``load_state_dict`` are its own; LR schedulers take the wrapper. Use it as usual:

    - gradient accumulation: call ``step()`` every k-th batch (the ranks must agree on k);
    - clipping: ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` before ``step()``;
    - closures (``LBFGS``): ``step(closure)``; the closure runs on this rank only;
    - ``torch.amp.GradScaler``: ``scaler.step(opt)`` unscales and checks for inf/NaN as usual; a step the
      scaler skips on this rank takes part with a zero update, so the other ranks do not wait for it.

    Every rank must call ``step()`` the same number of times; a rank that stops stepping leaves the others
    waiting up to ``timeout``.

    Local SGD / DiLoCo (``sync_every=H`` > 1, or an ``outer_optimizer``): ``step()`` is this rank's alone for
    H steps, then the ranks' pseudo-gradients are combined (:class:`adasum_lightning.local_sgd.PeriodicSync`).
    Call :meth:`sync` before evaluating or saving mid-window, so that every rank holds θ_sync;
    ``state_dict()`` then also holds the window's position and the outer optimizer's state
    (``"adasum_sync"``). With ``overlap_sync=True`` each window's exchange runs in a worker thread, on a
    process group of its own (built here over the ranks of ``process_group``), while the next window
    computes, and is applied one window late; :meth:`sync` and ``state_dict()`` (every rank) finish it.

    Sharded models (``mesh``): Adasum across replica groups, FSDP2 inside each (:mod:`adasum_lightning.
    sharded`). ``mesh`` is the 2-D ``DeviceMesh`` ``("replicate", "shard")``, the model is sharded with
    ``fully_shard(..., mesh=mesh["shard"])`` and ``optimizer`` steps its sharded parameters; each step is the
    group's FSDP2 step, then the Adasum of the groups' deltas per whole parameter
    (:func:`adasum_lightning.sharded.sharded_adasum_step`). At construction every replica group takes group
    0's parameters. Every step is combined (no local SGD with a mesh yet).

    Args:
        optimizer: the optimizer to wrap (any ``torch.optim.Optimizer``).
        process_group: the ranks that combine their updates (default: the default process group).
        timeout: how long one exchange waits for a peer before this rank fails (default: torch's default
            process-group timeout, 30 minutes); see :func:`adasum_lightning.adasum_allreduce`.
        sync_every: local optimizer steps between syncs (1: every step).
        combine: ``"adasum"`` or ``"mean"``: how the pseudo-gradients are combined.
        outer_optimizer: None (θ_sync + combined Δ) or an optimizer over the same parameters that takes
            −(combined Δ) as the gradient of θ_sync (DiLoCo: Nesterov SGD, lr 0.7, momentum 0.9).
        overlap_sync: with ``sync_every`` > 1, each window's exchange behind the next window's steps
            (docs/local_sgd.md, "The sync behind compute").
        mesh: None, or the 2-D device mesh ``("replicate", "shard")`` of a model sharded by FSDP2 over
            ``mesh["shard"]`` (then no ``process_group``).
        compression: None (off), ``"bf16"`` or ``"fp16"``: every piece the combination sends is rounded to
            that dtype; the parameters and optimizer states keep theirs (docs/strategies.md, "Compression").

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer`` (or is an ``AdasumOptimizer`` already), or
            ``timeout`` is not a ``timedelta``.
        RuntimeError: ``torch.distributed`` is not initialised; the message names the fix.
        AdasumConfigurationError: ``sync_every`` < 1, an unknown ``combine`` or ``compression``, an outer
            optimizer over other parameters, ``overlap_sync`` with ``sync_every=1``; with ``mesh``: a mesh
            that is not 2-D ``("replicate", "shard")``, parameters not sharded over ``mesh["shard"]``,
            ``process_group``, or a local-SGD option.
    """

    #: ``GradScaler.step`` then hands the scale and the inf/NaN flag to :meth:`step` (``grad_scale``,
    #: ``found_inf``) instead of skipping the call, so that a skipped step still takes part in the reduction.
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
            raise TypeError(
                "this optimizer is already an AdasumOptimizer: wrap the torch.optim optimizer once (a second "
                "wrapper would reduce every update twice)."
            )
        if timeout is not None and not isinstance(timeout, timedelta):
            raise TypeError(
                f"timeout is a datetime.timedelta, e.g. timedelta(minutes=5); got {timeout!r} "
                f"({type(timeout).__name__})"
            )
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
                "AdasumOptimizer needs torch.distributed: call torch.distributed.init_process_group() "
                "before building it (torchrun sets its variables; backend 'gloo' on CPU, 'nccl' on GPU). For "
                "a single process, use the optimizer itself."
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
        # Optimizer.__init__ gives the wrapper its step hooks and profiling; then the wrapper shares the
        # wrapped optimizer's param_groups list and state (add_param_group below tells the two phases apart).
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

    # ------------------------------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The wrapped optimizer's step on this rank, then the Adasum of the parameter updates over the group.

        Returns:
            What the wrapped optimizer's ``step`` returns (the closure's loss, if any); None for a step that a
            gradient scaler skipped.
        """
        # Set by GradScaler.step (see _step_supports_amp_scaling) and removed by it after this call.
        grad_scale: torch.Tensor | None = getattr(self, "grad_scale", None)
        found_inf: torch.Tensor | None = getattr(self, "found_inf", None)

        def local_step() -> Any:
            if found_inf is not None and bool(found_inf.item()):
                return None  # inf/NaN gradients on this rank: no local update, a zero delta
            if grad_scale is not None:
                if getattr(self.optimizer, "_step_supports_amp_scaling", False):
                    return self._step_with_scale_handed_on(grad_scale, found_inf)  # e.g. fused Adam
                self._unscale_gradients(grad_scale)
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
        """End the local-SGD window now (every rank at the same step; with ``overlap_sync`` the exchange in
        flight first): the ranks' parameters become θ_sync. Nothing to do when every step is combined
        (``sync_every=1`` without an outer optimizer)."""
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
        # One all_gather of two float64 numbers per rank (the sum and the sum of squares of the gradients),
        # once: equal on every rank means bitwise-equal gradients, e.g. averaged by DistributedDataParallel.
        # With a mesh: the local gradient shards over the replicate group (equal shards in every replica group
        # mean the groups' gradients were averaged, e.g. by fully_shard on the whole 2-D mesh).
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

    def _step_with_scale_handed_on(self, grad_scale: torch.Tensor, found_inf: torch.Tensor | None) -> Any:
        # An optimizer that unscales in its own kernel takes the two attributes as GradScaler gives them.
        self.optimizer.grad_scale, self.optimizer.found_inf = grad_scale, found_inf
        try:
            return self.optimizer.step()
        finally:
            del self.optimizer.grad_scale, self.optimizer.found_inf

    def _unscale_gradients(self, grad_scale: torch.Tensor) -> None:
        # GradScaler's own unscaling multiplies by the float32 reciprocal of the float64 scale.
        inv_scale = grad_scale.double().reciprocal().float()
        for p in optimizer_parameters(self.optimizer):
            if p.grad is not None:
                p.grad.mul_(inv_scale.to(p.grad.device))

    # ------------------------------------------------------------------------------------------ delegation
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
        # every rank (with a mesh: every replica group) takes the first one's values
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
