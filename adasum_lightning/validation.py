"""The rules that refuse a configuration a strategy would fail late on, hang in or train wrongly with.

Each rule is a pure function of plain values whose error names the strategy and the fix; the strategies call
them on every rank, on the same values, before the first step. Horovod's rules are in
:mod:`adasum_lightning.horovod.support`.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "AdasumConfigurationError",
    "check_single_device",
    "check_module_unwrapped",
    "check_sync_batchnorm",
    "check_launcher_world_size",
    "ADASUM_MESH_DIMS",
    "check_shard_size",
    "check_adasum_mesh",
    "check_sharded_parameters",
    "check_mesh_options",
    "check_optimizer_of_sharded_module",
    "check_uneven_inputs",
    "check_overlap_backward",
    "WIRE_DTYPES",
    "check_wire_compression",
    "check_sync_every",
    "check_outer_optimizer_form",
    "check_outer_optimizer",
    "local_sgd_without_outer_message",
    "overlap_fallback_reason",
    "identical_gradients_message",
    "scaled_learning_rate_message",
]


class AdasumConfigurationError(ValueError):
    """A configuration the strategy cannot run correctly; the message names the fix.

    A ``ValueError``, not Lightning's ``MisconfigurationException``: one class under either Lightning package.
    """


#: ``compression`` of ``ddp_adasum``, ``fsdp_adasum`` and ``AdasumOptimizer``: the dtype of every sent piece.
WIRE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_wire_compression(compression: object, owner: str) -> torch.dtype | None:
    """``compression``: None (off), ``"bf16"`` or ``"fp16"``; returns the wire dtype (None: off).

    Raises:
        AdasumConfigurationError: any other value; the message names the accepted ones.
    """
    if compression not in (None, *WIRE_DTYPES):
        raise AdasumConfigurationError(
            f"{owner}'s compression is None (off), 'bf16' or 'fp16' (every piece the combination sends "
            f"rounded to bfloat16 or float16), got {compression!r}"
        )
    return None if compression is None else WIRE_DTYPES[compression]


def check_single_device(strategy_name: str, tensors: Iterable[torch.Tensor]) -> None:
    """One process drives one device: every parameter and buffer must be on the same device.

    Raises:
        AdasumConfigurationError: naming the devices found and how to start one process per device.
    """
    devices = sorted({str(t.device) for t in tensors})
    if len(devices) > 1:
        launch = "horovodrun -np N" if strategy_name.startswith("horovod") else "devices=N, or torchrun"
        raise AdasumConfigurationError(
            f"{strategy_name} runs one process per device, but this module's parameters span {devices}. "
            "Keep the whole module on one device (Lightning moves it to cuda:<local rank> or cpu) and start "
            f"one process per GPU ({launch})."
        )


def check_module_unwrapped(strategy_name: str, wrapped_in_ddp: bool) -> None:
    """A module already wrapped in ``DistributedDataParallel`` would average its gradients before Adasum.

    Raises:
        AdasumConfigurationError: when ``wrapped_in_ddp``.
    """
    if wrapped_in_ddp:
        raise AdasumConfigurationError(
            f"{strategy_name} was given a module wrapped in DistributedDataParallel: its gradients would be "
            "averaged in backward before Adasum combines the updates. Pass the module itself "
            "(fabric.setup(model, optimizer) with the plain nn.Module)."
        )


def check_sync_batchnorm(
    device_type: str, requested: bool, sync_layers: Sequence[str], strategy_name: str = "this strategy"
) -> None:
    """Synchronised batch norm needs an accelerator: torch's ``SyncBatchNorm`` refuses CPU tensors.

    Args:
        device_type: the device the module is on.
        requested: ``Trainer(sync_batchnorm=True)``.
        sync_layers: names of the module's ``SyncBatchNorm`` layers (converted by the user).
        strategy_name: the strategy's registered name, for the message.

    Raises:
        AdasumConfigurationError: synchronised batch norm on CPU.
    """
    if device_type == "cpu" and (requested or sync_layers):
        what = (
            "Trainer(sync_batchnorm=True)"
            if requested
            else f"SyncBatchNorm layers ({', '.join(sync_layers)})"
        )
        raise AdasumConfigurationError(
            f"{strategy_name} cannot use {what} on CPU: torch's SyncBatchNorm runs on GPUs only (it raises "
            "in the first forward pass). "
            "Train on GPUs (accelerator='gpu') to synchronise the statistics, or leave sync_batchnorm off "
            "and keep plain BatchNorm: then each rank keeps its own running statistics (checkpoints hold "
            "rank 0's)."
        )


def check_launcher_world_size(
    launcher_world_size: int,
    devices: int,
    num_nodes: int,
    api: str = "Trainer",
    strategy_name: str = "ddp_adasum",
) -> None:
    """The processes a launcher started must be the ``Trainer``'s (or ``Fabric``'s) ``devices × num_nodes``.

    Lightning's generic cluster environment does not compare them with ``WORLD_SIZE``: a mismatch gives
    duplicate ranks or a rendezvous that waits forever.

    Raises:
        AdasumConfigurationError: ``launcher_world_size`` ≠ ``devices × num_nodes``; the message names both.
    """
    if launcher_world_size != devices * num_nodes:
        raise AdasumConfigurationError(
            f"{strategy_name}: the launcher started {launcher_world_size} processes "
            f"(WORLD_SIZE={launcher_world_size}), but "
            f"the {api} describes devices={devices} × num_nodes={num_nodes} = {devices * num_nodes}. Set "
            f"{api}(devices=<processes per node>, num_nodes=<nodes>) to match the launch."
        )


def check_uneven_inputs(value: str, owner: str = "EvenBatches") -> str:
    """``uneven_inputs`` of a strategy or ``EvenBatches``: ``"truncate"`` or ``"error"``; ``owner`` names it.

    Raises:
        ValueError: anything else, naming the two values.
    """
    if value not in ("truncate", "error"):
        raise ValueError(
            f"{owner}'s uneven_inputs must be 'truncate' (every rank stops an epoch at the shortest rank's "
            f"batch count) or 'error' (refuse uneven batch counts), got {value!r}"
        )
    return value


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


def scaled_learning_rate_message(strategy_name: str, factor: float) -> str:
    """The warning when a strategy multiplied the learning rates the module (or ``Tuner.lr_find``) set."""
    return (
        f"{strategy_name} multiplied every learning rate by {factor:g} (lr_scaling): the rates your "
        f"configure_optimizers returns (a Tuner.lr_find suggestion included) train {factor:g}× larger. Pass "
        f"lr_scaling='none' to train with them as they are."
    )


def check_overlap_backward(overlap_backward: object, bucket_cap_mb: object, strategy_name: str) -> None:
    """``overlap_backward`` is a bool and ``bucket_cap_mb`` a positive number of MiB.

    Raises:
        ValueError: either is off; the message names the accepted values.
    """
    if not isinstance(overlap_backward, bool):
        raise ValueError(
            f"{strategy_name}'s overlap_backward is True (step and reduce bucket by bucket during the "
            f"backward pass) or False (the whole step after it), got {overlap_backward!r}"
        )
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, int | float) or not bucket_cap_mb > 0:
        raise ValueError(
            f"{strategy_name}'s bucket_cap_mb is the bucket size in MiB, a positive number such as 25 (DDP's "
            f"default), got {bucket_cap_mb!r}"
        )


def overlap_fallback_reason(
    *,
    automatic_optimization: bool,
    optimizer: str,
    per_parameter: bool,
    gradient_clipping: str | None,
    gradient_scaler: bool,
    precision_plugin: str | None,
    before_step_hooks: Sequence[str],
) -> str | None:
    """Why ``overlap_backward=True`` must take the whole step after backward, or None when it need not.

    Args:
        automatic_optimization: the LightningModule's ``automatic_optimization``.
        optimizer: the optimizer's class name.
        per_parameter: whether it is one of :data:`adasum_lightning.step.PER_PARAMETER_OPTIMIZERS`.
        gradient_clipping: how gradients are clipped (e.g. ``"gradient_clip_val=1.0"``); None: not clipped.
        gradient_scaler: fp16 mixed precision's ``GradScaler`` is in use.
        precision_plugin: the precision plugin's class name when it runs the step its own way, else None.
        before_step_hooks: overrides between backward and the step, as ``Class.hook``.
    """
    if not automatic_optimization:
        return "manual optimization calls backward and step itself"
    if not per_parameter:
        return (
            f"{optimizer} is not one of the per-parameter torch.optim optimizers (SGD, Adam, AdamW, Adagrad, "
            "Adamax, NAdam, RAdam, RMSprop)"
        )
    if gradient_clipping is not None:
        return f"gradient clipping ({gradient_clipping}) needs every gradient before the first bucket steps"
    if gradient_scaler:
        return "fp16 mixed precision's GradScaler checks every gradient before the step (bf16 has no scaler)"
    if precision_plugin is not None:
        return f"the precision plugin {precision_plugin} runs the optimizer step its own way"
    if before_step_hooks:
        hooks = ", ".join(before_step_hooks)
        return f"{hooks} run between backward and the step (they may change gradients or read parameters)"
    return None


def check_sync_every(
    sync_every: object,
    combine: object,
    owner: str,
    overlap_backward: bool = False,
    outer_optimizer: bool = False,
    overlap_sync: bool = False,
) -> None:
    """``sync_every`` is a whole number ≥ 1 and ``combine`` one of ``"adasum"``, ``"mean"``;
    ``overlap_backward`` (the Adasum of every step, during backward) goes with neither a window of several
    steps, nor the mean, nor an outer optimizer; ``overlap_sync`` needs windows of several steps and no
    ``overlap_backward``.

    Raises:
        AdasumConfigurationError: the value that is off and the accepted ones.
    """
    if isinstance(sync_every, bool) or not isinstance(sync_every, numbers.Integral) or sync_every < 1:
        raise AdasumConfigurationError(
            f"{owner}'s sync_every is the number of local optimizer steps between syncs, a whole number ≥ 1 "
            f"(1: combine every step), got {sync_every!r}"
        )
    if combine not in ("adasum", "mean"):
        raise AdasumConfigurationError(
            f"{owner}'s combine is 'adasum' (orthogonal pseudo-gradients add, parallel ones average) or "
            f"'mean' (their average, as local SGD and DiLoCo do), got {combine!r}"
        )
    if overlap_sync and overlap_backward:
        raise AdasumConfigurationError(
            f"{owner}: overlap_sync=True and overlap_backward=True overlap different exchanges; pass one of "
            "them (overlap_sync with sync_every > 1, overlap_backward with sync_every=1)."
        )
    if overlap_sync and sync_every == 1:
        raise AdasumConfigurationError(
            f"{owner}: overlap_sync=True runs a window's exchange during the next window, which sync_every=1 "
            "does not have: pass sync_every > 1, or overlap_sync=False."
        )
    if overlap_backward and (sync_every > 1 or combine != "adasum" or outer_optimizer):
        given = f"sync_every={sync_every}" if sync_every > 1 else f"combine={combine!r}"
        given = "an outer optimizer" if sync_every == 1 and combine == "adasum" else given
        raise AdasumConfigurationError(
            f"{owner}: overlap_backward=True combines every step by Adasum during backward, which {given} "
            "does not: pass overlap_backward=False with local SGD (sync_every, combine, outer_optimizer)."
        )


#: The outer optimizer as the strategies take it (``builder``), and as ``AdasumOptimizer`` takes it.
_OUTER_OPTIMIZER_FORMS = {
    True: "a callable such as functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True)",
    False: "an optimizer over the same parameters, e.g. torch.optim.SGD(model.parameters(), lr=0.1, "
    "momentum=0.9, nesterov=True)",
}


def check_outer_optimizer_form(owner: str, outer: object, builder: bool) -> None:
    """``outer_optimizer`` of the strategies (``builder``) is a callable that builds the outer optimizer from
    the parameters; of ``AdasumOptimizer``, an optimizer. None (no outer optimizer) is fine for both. An
    optimizer class is neither: it would step with its default learning rate (SGD's 0.001).

    Raises:
        AdasumConfigurationError: the other form, a class, or neither; the message shows the right one.
    """
    if outer is None:
        return
    if isinstance(outer, type) and issubclass(outer, torch.optim.Optimizer):
        raise AdasumConfigurationError(
            f"{owner}'s outer_optimizer is the class {outer.__name__}, which would step with its default "
            f"learning rate: pass {_OUTER_OPTIMIZER_FORMS[builder]}, the outer learning rate named"
        )
    is_optimizer = isinstance(outer, torch.optim.Optimizer)
    if builder and (is_optimizer or not callable(outer)):
        raise AdasumConfigurationError(
            f"{owner}'s outer_optimizer builds the outer optimizer from an optimizer's parameters (one per "
            f"optimizer, at its first step): pass {_OUTER_OPTIMIZER_FORMS[True]}, got {type(outer).__name__}"
        )
    if not builder and not is_optimizer:
        raise AdasumConfigurationError(
            f"{owner}'s outer_optimizer is {_OUTER_OPTIMIZER_FORMS[False]}, got {type(outer).__name__}"
        )


def local_sgd_without_outer_message(owner: str, sync_every: int) -> str:
    """The warning for the Adasum of windows of several steps applied without an outer optimizer."""
    return (
        f"{owner}: sync_every={sync_every} with combine='adasum' and no outer optimizer adds the Adasum of "
        "many-step pseudo-gradients at once, which overshoots (docs/local_sgd.md): pass an outer optimizer "
        "with a small learning rate, e.g. functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, "
        "nesterov=True), or combine='mean'."
    )


def check_outer_optimizer(owner: str, inner: Sequence[int], outer: Sequence[int], builder: bool) -> None:
    """The outer optimizer steps exactly the inner optimizer's parameters (``inner``, ``outer``: their ids);
    ``builder``: the strategies built it from them (else ``AdasumOptimizer`` was given it).

    Raises:
        AdasumConfigurationError: naming how many parameters differ and the form ``owner`` takes.
    """
    missing, extra = len(set(inner) - set(outer)), len(set(outer) - set(inner))
    if missing or extra:
        raise AdasumConfigurationError(
            f"{owner}: the outer optimizer must step the same parameters as the inner one ({missing} of the "
            f"inner optimizer's parameters missing, {extra} others): pass {_OUTER_OPTIMIZER_FORMS[builder]}"
            f"{', which builds it from them' if builder else ''}."
        )


#: The dimension names of the 2-D device mesh of Adasum across replica groups, FSDP2 inside each
#: (:mod:`adasum_lightning.sharded`): ``replicate`` (the replica groups) first, ``shard`` (a group's ranks).
ADASUM_MESH_DIMS = ("replicate", "shard")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_shard_size(world_size: int, shard_size: object, owner: str = "fsdp_adasum") -> None:
    """``shard_size`` (the ranks of one replica group, which FSDP2 shards the model over) is a whole number
    ≥ 1 that divides ``world_size``: the world is ``world_size // shard_size`` replica groups.

    Raises:
        AdasumConfigurationError: naming the shard sizes this world size allows.
    """
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
    """The device mesh of sharded Adasum is 2-D with the dimensions named ``("replicate", "shard")``
    (:data:`ADASUM_MESH_DIMS`), replica groups first.

    Raises:
        AdasumConfigurationError: naming the mesh given and how to build the right one.
    """
    names = tuple(dim_names) if dim_names is not None else None
    if ndim != 2 or names != ADASUM_MESH_DIMS:
        raise AdasumConfigurationError(
            f"{owner}: the mesh must be 2-D with dimensions named {ADASUM_MESH_DIMS} (replica groups × the "
            f"ranks FSDP2 shards over), got a {ndim}-D mesh named {names}. Build it with "
            "torch.distributed.device_mesh.init_device_mesh(device_type, (world_size // shard_size, "
            "shard_size), mesh_dim_names=('replicate', 'shard')) and shard the model with "
            "fully_shard(..., mesh=mesh['shard'])."
        )


def check_sharded_parameters(owner: str, shard_size: int, unsharded: Sequence[str]) -> None:
    """Every parameter is sharded by FSDP2 over the shard group (a ``DTensor`` with ``Shard`` placements on
    the 1-D mesh ``mesh["shard"]``); with ``shard_size`` 1 plain tensors are whole tensors and fine.
    ``unsharded``: a description of each parameter that is not.

    Raises:
        AdasumConfigurationError: naming up to three such parameters and the fix.
    """
    if not unsharded:
        return
    shown = "; ".join(unsharded[:3]) + (f"; and {len(unsharded) - 3} more" if len(unsharded) > 3 else "")
    raise AdasumConfigurationError(
        f"{owner}: {len(unsharded)} parameter(s) are not sharded over the mesh's 'shard' dimension "
        f"(size {shard_size}): {shown}. Apply fully_shard(block, mesh=mesh['shard']) to each block and then "
        "to the root module before building the optimizer (not on the 2-D mesh: that would average the "
        "gradients across the replica groups, which Adasum combines instead)."
    )


def check_mesh_options(
    owner: str, sync_every: int, combine: str, outer_optimizer: bool, process_group: bool = False
) -> None:
    """With a device mesh (Adasum across replica groups, FSDP2 inside) the mesh's ``replicate`` dimension is
    the group Adasum combines over (no ``process_group`` besides), and every step is combined by Adasum: no
    local-SGD window, no mean, no outer optimizer (not supported yet).

    Raises:
        AdasumConfigurationError: naming the option to drop.
    """
    if process_group:
        raise AdasumConfigurationError(
            f"{owner}: pass either process_group (every rank a replica) or mesh (replica groups of "
            "FSDP2-sharded ranks), not both: the mesh's 'replicate' dimension is the group Adasum combines "
            "over."
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


def check_optimizer_of_sharded_module(
    strategy_name: str, stale: int, total: int, has_state: bool = False
) -> None:
    """An optimizer set up under an FSDP2 strategy steps the sharded module's parameters: ``fully_shard``
    replaces each parameter by a new (sharded) one, so an optimizer built before the module was set up holds
    ``stale`` of its ``total`` parameters that no longer train. ``fabric.setup(model, optimizer)`` rebinds an
    optimizer that has no state yet; ``has_state``: one that has stepped already (it cannot be rebound).

    Raises:
        AdasumConfigurationError: naming the order of calls that works.
    """
    if not stale and not has_state:
        return
    what = (
        "has optimizer state already (it stepped before the model was sharded)"
        if has_state
        else f"holds {stale} of its {total} parameter(s) from before the model was sharded (fully_shard "
        "replaces every parameter)"
    )
    raise AdasumConfigurationError(
        f"{strategy_name}: the optimizer {what}. Set the model up first, then build the optimizer from its "
        "parameters: model = fabric.setup_module(model); optimizer = fabric.setup_optimizers("
        "torch.optim.SGD(model.parameters(), ...)) — or pass a fresh optimizer with the model: "
        "model, optimizer = fabric.setup(model, optimizer)."
    )
