"""The rules that refuse a configuration a strategy would fail late on, hang in or train wrongly with.

Each rule is a pure function of plain values whose error names the strategy and the fix; the strategies call
them on every rank, on the same values, before the first step.

Sources for Horovod's rules (0.28.1): ``horovod/torch/mpi_ops.py`` (CPU Adasum: power-of-2 world size),
``horovod/common/ops/adasum_gpu_operations.cc`` and ``docs/adasum_user_guide.rst`` (NCCL Adasum: homogeneous
power-of-2 nodes), ``horovod/common/operations.cc`` (Adasum for MPI only), ``horovod/torch/optimizer.py`` (the
local step runs in the backward hook; ``gradient_predivide_factor`` needs op=Average).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence

import torch

from adasum_lightning.launchers import DetectedLauncher
from adasum_lightning.ops import is_power_of_two, nearest_powers_of_two

__all__ = [
    "AdasumConfigurationError",
    "check_world_size",
    "check_nccl_topology",
    "check_controller",
    "check_cpu_operations",
    "check_precision",
    "check_gradient_clipping",
    "check_gradient_predivide_factor",
    "check_single_device",
    "check_module_unwrapped",
    "check_launch",
    "check_closure_optimizers",
    "check_horovod_dtypes",
    "check_sync_batchnorm",
    "check_launcher_world_size",
    "ADASUM_MESH_DIMS",
    "check_shard_size",
    "check_adasum_mesh",
    "check_sharded_parameters",
    "check_mesh_options",
    "check_optimizer_of_sharded_module",
    "check_uneven_inputs",
    "check_skipped_backward_passes",
    "check_overlap_backward",
    "check_compression",
    "WIRE_DTYPES",
    "check_wire_compression",
    "check_sync_every",
    "check_no_local_sgd",
    "check_outer_optimizer_form",
    "check_outer_optimizer",
    "local_sgd_without_outer_message",
    "overlap_fallback_reason",
    "clipping_refused",
    "identical_gradients_message",
    "scaled_learning_rate_message",
]


class AdasumConfigurationError(ValueError):
    """A configuration the strategy cannot run correctly; the message names the fix.

    A ``ValueError``, not Lightning's ``MisconfigurationException``: one class under either Lightning package.
    """


def _sizes(n: int) -> str:
    return " or ".join(str(v) for v in nearest_powers_of_two(n))


def check_world_size(size: int) -> None:
    """CPU (MPI) Adasum needs a power-of-2 world size; Horovod would fail in the first step otherwise.

    Raises:
        AdasumConfigurationError: naming the nearest valid sizes.
    """
    if not is_power_of_two(size):
        raise AdasumConfigurationError(
            f"horovod_adasum needs a world size that is a power of 2 (1, 2, 4, 8, …) for Adasum over MPI; "
            f"this job has {size} processes. Launch {_sizes(size)} processes (horovodrun -np N), or use "
            f"strategy='horovod' (gradient averaging), which takes any size."
        )


def check_nccl_topology(size: int, local_sizes: Sequence[int]) -> str | None:
    """NCCL GPU Adasum needs a power-of-2 node count and GPUs per node, the same on every node.

    Args:
        size: world size (processes in the job).
        local_sizes: every rank's ``hvd.local_size()``, in rank order.

    Returns:
        A warning text for a single node (Adasum then averages inside the node), else None.

    Raises:
        AdasumConfigurationError: heterogeneous nodes, or a node count or local size not a power of 2.
    """
    distinct = sorted(set(local_sizes))
    if len(distinct) != 1:
        raise AdasumConfigurationError(
            f"horovod_adasum with NCCL needs the same number of processes on every node; found {distinct} "
            "processes per node. Launch one process per GPU with the same GPU count on every node "
            "(e.g. horovodrun -H host1:4,host2:4)."
        )
    local = distinct[0]
    if not is_power_of_two(local):
        raise AdasumConfigurationError(
            f"horovod_adasum with NCCL needs a power-of-2 number of processes per node; found {local}. "
            f"Use {_sizes(local)} GPUs per node (Horovod issue #3400: 3 of 4 GPUs fails)."
        )
    nodes = size // local
    if not is_power_of_two(nodes):
        raise AdasumConfigurationError(
            f"horovod_adasum with NCCL needs a power-of-2 number of nodes; found {nodes} nodes of {local} "
            f"processes. Use {_sizes(nodes)} nodes."
        )
    if nodes == 1 and local > 1:
        return (
            f"horovod_adasum with NCCL on a single node: Horovod averages inside a node and applies Adasum "
            f"only across nodes, so this job averages its {local} GPUs' updates; the learning rate is "
            f"multiplied by {local} (GPUs per node), as for averaging."
        )
    return None


def check_controller(*, mpi_built: bool, mpi_enabled: bool, gloo_enabled: bool) -> None:
    """Adasum exists for Horovod's MPI controller only.

    Args:
        mpi_built, mpi_enabled, gloo_enabled: ``hvd.mpi_built()``, ``hvd.mpi_enabled()``,
            ``hvd.gloo_enabled()``.

    Raises:
        AdasumConfigurationError: Horovod without MPI, or the Gloo controller (``horovodrun --gloo``).
    """
    if not mpi_built:
        raise AdasumConfigurationError(
            "horovod_adasum needs Horovod built with MPI (Adasum exists only for the MPI controller); this "
            "Horovod has no MPI support. Rebuild it with `make setup` (HOROVOD_WITH_MPI=1), or use "
            "strategy='horovod' (averaging works with Gloo)."
        )
    if gloo_enabled or not mpi_enabled:
        raise AdasumConfigurationError(
            "horovod_adasum needs the MPI controller, but this job runs under Gloo (horovodrun --gloo), "
            "where Horovod has no Adasum operation. Launch with `horovodrun --mpi -np N ...` or "
            "`mpirun -np N ...`, or use strategy='horovod' (averaging works with Gloo)."
        )


def check_cpu_operations(
    *, mpi_enabled: bool, cpu_operations: str | None, strategy_name: str = "a Horovod strategy"
) -> None:
    """Gloo CPU operations under the MPI controller crash Horovod (a segfault in a collective).

    Args:
        mpi_enabled: ``hvd.mpi_enabled()``.
        cpu_operations: the ``HOROVOD_CPU_OPERATIONS`` environment variable (None when unset).
        strategy_name: the strategy's registered name, for the message.

    Raises:
        AdasumConfigurationError: MPI controller with ``HOROVOD_CPU_OPERATIONS=gloo``.
    """
    if mpi_enabled and cpu_operations is not None and cpu_operations.strip().lower() == "gloo":
        raise AdasumConfigurationError(
            f"{strategy_name} cannot run with HOROVOD_CPU_OPERATIONS=gloo under the MPI controller (mpirun / "
            "horovodrun --mpi): Horovod's "
            "Gloo collectives crash there (segmentation fault). Unset HOROVOD_CPU_OPERATIONS (or set it to "
            "mpi), or launch with horovodrun --gloo and strategy='horovod'."
        )


def check_precision(precision: str) -> None:
    """fp16 mixed precision (GradScaler) cannot work with Horovod's Adasum; ``"bf16-mixed"`` works.

    The scaler unscales and skips steps after backward, but the local step already ran inside backward on the
    scaled gradients: NaN loss (https://github.com/horovod/horovod/issues/3429).

    Raises:
        AdasumConfigurationError: for ``"16-mixed"`` (Lightning's name for ``precision=16``).
    """
    if str(precision) in ("16-mixed", "16"):
        raise AdasumConfigurationError(
            "horovod_adasum cannot use precision='16-mixed': its gradient scaler unscales gradients and "
            "skips overflowing steps after backward, but Adasum's local step already ran inside backward "
            "on the scaled gradients (NaN loss, Horovod #3429). Use precision='bf16-mixed', or "
            "strategy='horovod'."
        )


def check_gradient_clipping(value: float | None, algorithm: str | None) -> None:
    """Norm clipping cannot take effect with Horovod's Adasum; value clipping is applied inside the hook.

    The norm needs every gradient before any update; Adasum updates each parameter as its gradient is ready.

    Raises:
        AdasumConfigurationError: ``gradient_clip_val`` set with ``gradient_clip_algorithm="norm"``.
    """
    if value is None or float(value) <= 0:
        return
    if str(algorithm or "norm").lower() == "norm":
        raise AdasumConfigurationError(
            f"horovod_adasum cannot clip gradients by norm (gradient_clip_val={value}): Adasum's local step "
            "updates each parameter inside backward, before the norm over all parameters is known. Use "
            "gradient_clip_algorithm='value' (applied to each gradient before its local step), or "
            "strategy='horovod'."
        )


def check_compression(compression: str) -> str:
    """``compression`` of a Horovod strategy: ``"none"`` or ``"fp16"`` (Horovod's ``Compression.fp16``).

    Raises:
        ValueError: any other value.
    """
    if compression not in ("none", "fp16"):
        raise ValueError(f"compression must be 'none' or 'fp16', got {compression!r}")
    return compression


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


def check_gradient_predivide_factor(factor: float) -> None:
    """``gradient_predivide_factor`` splits an *average*; Adasum has none.

    Raises:
        AdasumConfigurationError: for any factor other than 1.
    """
    if float(factor) != 1.0:
        raise AdasumConfigurationError(
            f"horovod_adasum cannot use gradient_predivide_factor={factor}: it splits gradient averaging and "
            "Adasum does not average (Horovod raises deep inside otherwise). Leave it at 1, or use "
            "strategy='horovod'."
        )


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


def check_launch(
    horovod_size: int,
    launcher: DetectedLauncher | None,
    requested_devices: int,
    api: str = "Trainer",
    strategy_name: str = "a Horovod strategy",
) -> None:
    """A Horovod strategy in a process that Horovod sees alone, though more were meant to train together.

    Under ``torchrun``, ``srun`` or plain ``python`` each process is a Horovod world of 1 and trains alone.

    Args:
        horovod_size: ``hvd.size()``.
        launcher: :func:`adasum_lightning.launchers.detect_launcher` (None for a plain start).
        requested_devices: the ``devices`` the ``Trainer`` (or ``Fabric``) was given.
        api: ``"Trainer"`` or ``"Fabric"``, in the message.
        strategy_name: the strategy's registered name, for the message.

    Raises:
        AdasumConfigurationError: a world of 1 while the launcher started N > 1 processes or ``devices`` asks
            for N > 1; the message names the launcher seen and ``horovodrun -np N``.
    """
    if horovod_size != 1:
        return
    if launcher is not None and launcher.processes > 1:
        raise AdasumConfigurationError(
            f"{launcher.name} started {launcher.processes} processes "
            f"({launcher.variable}={launcher.processes}), but Horovod sees a world of 1 in each, so each "
            f"would train alone. {strategy_name} needs an MPI "
            f"launcher: `horovodrun -np {launcher.processes} python SCRIPT ...` (or `mpirun -np "
            f"{launcher.processes} ...`), or use strategy='ddp_adasum', which {launcher.name} can start."
        )
    if requested_devices > 1:
        seen = "no launcher (a plain `python` start)" if launcher is None else launcher.name
        raise AdasumConfigurationError(
            f"{api}(devices={requested_devices}) asks for {requested_devices} devices, but this process "
            "was "
            f"started by {seen} and Horovod sees a world of 1; {strategy_name} never starts processes "
            f"themselves. Launch `horovodrun -np {requested_devices} python SCRIPT ...` with devices=1 (one "
            "process per device), or use strategy='ddp_adasum', which starts the processes itself."
        )


def check_closure_optimizers(strategy_name: str, optimizers_needing_closure: Sequence[str]) -> None:
    """Horovod's Adasum cannot run an optimizer whose ``step`` requires a closure (e.g. ``LBFGS``).

    Its optimizer runs the wrapped ``step()`` inside each parameter's backward hook, without a closure.

    Args:
        strategy_name: the strategy's registered name, for the message.
        optimizers_needing_closure: class names of the optimizers whose ``step`` has a required ``closure``.

    Raises:
        AdasumConfigurationError: naming those optimizers and the strategies that can run them.
    """
    if optimizers_needing_closure:
        names = ", ".join(sorted(set(optimizers_needing_closure)))
        raise AdasumConfigurationError(
            f"{strategy_name} cannot use {names}: its step() needs a closure (it re-evaluates the loss), but "
            "Horovod's Adasum optimizer runs the local step inside backward, without one. Use "
            "strategy='ddp_adasum' (the local step runs after the closure, then the deltas are combined) or "
            "strategy='horovod' (averaging)."
        )


def check_horovod_dtypes(strategy_name: str, device_type: str, dtypes: Iterable[torch.dtype]) -> None:
    """Horovod 0.28.1's CPU collectives have no bfloat16: bfloat16 parameters cannot be reduced on CPU.

    Args:
        strategy_name: the strategy's registered name, for the message.
        device_type: the parameters' device (``"cpu"``, ``"cuda"``); GPUs are not checked.
        dtypes: the dtypes of the parameters that require a gradient.

    Raises:
        AdasumConfigurationError: a bfloat16 parameter on CPU (``precision="bf16-true"`` or a bfloat16 model).
    """
    if device_type == "cpu" and torch.bfloat16 in set(dtypes):
        raise AdasumConfigurationError(
            f"{strategy_name} cannot reduce bfloat16 parameters on CPU (precision='bf16-true' or a bfloat16 "
            "model): Horovod 0.28.1's CPU collectives have no bfloat16 type. Use precision='bf16-mixed' "
            "(float32 weights, bfloat16 compute), or strategy='ddp_adasum', which reduces bfloat16."
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


def check_skipped_backward_passes(
    strategy_name: str, strategy_class: str, skipped: int, backward_passes_per_step: int
) -> None:
    """``fabric.no_backward_sync`` may skip at most ``backward_passes_per_step`` − 1 passes before a step.

    Horovod's hooks cannot be paused: they reduce at the ``backward_passes_per_step``-th pass since a step.

    Raises:
        AdasumConfigurationError: ``skipped`` ≥ ``backward_passes_per_step``; the message names the setting.
    """
    if skipped < backward_passes_per_step:
        return
    passes = "pass" if skipped == 1 else "passes"
    raise AdasumConfigurationError(
        f"{strategy_name} cannot skip the gradient reduction of {skipped} backward {passes} before "
        "optimizer.step() (fabric.no_backward_sync(model, enabled=True)): Horovod's hooks cannot be paused, "
        f"they reduce as soon as backward_passes_per_step={backward_passes_per_step} backward pass(es) have "
        "run since the last step. Give the strategy the number of backward passes per optimizer step, e.g. "
        f"Fabric(strategy={strategy_class}(backward_passes_per_step={skipped + 1})); a shorter window is "
        "reduced at optimizer.step()."
    )


def clipping_refused(strategy_name: str, algorithm: str, value: float) -> AdasumConfigurationError:
    """The error for ``fabric.clip_gradients`` under Horovod's Adasum, whose local step ran inside backward.

    Args:
        algorithm: ``"norm"`` for ``max_norm``, ``"value"`` for ``clip_val``.
    """
    if algorithm == "norm":
        what = f"clip gradients by norm (fabric.clip_gradients(max_norm={value}))"
        why = "before the norm over all parameters is known"
    else:
        what = f"clip gradients by value (fabric.clip_gradients(clip_val={value}))"
        why = "so clipping afterwards would change nothing"
    return AdasumConfigurationError(
        f"{strategy_name} cannot {what}: Horovod's Adasum optimizer takes each parameter's local step "
        f"inside fabric.backward, {why}. Use Fabric(strategy='ddp_adasum') (its local step runs in "
        "optimizer.step(), after clipping), or strategy='horovod'."
    )


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


def check_no_local_sgd(options: Iterable[str], strategy_name: str) -> None:
    """The Horovod strategies take none of ``sync_every``, ``combine``, ``outer_optimizer``.

    Raises:
        AdasumConfigurationError: naming the options given and ``ddp_adasum``, which has them.
    """
    given = sorted(set(options) & {"sync_every", "combine", "outer_optimizer"})
    if given:
        raise AdasumConfigurationError(
            f"{strategy_name} has no {', '.join(given)}: Horovod's optimizer reduces inside every backward "
            "pass. Local SGD / DiLoCo is ddp_adasum's: DDPAdasumStrategy(sync_every=..., combine=..., "
            "outer_optimizer=...), launched by Lightning, torchrun or SLURM."
        )


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
