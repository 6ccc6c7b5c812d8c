"""What the three Trainer strategies share: Lightning's ``DDPStrategy`` without ``DistributedDataParallel``.

Lightning's cross-rank code (``self.log(sync_dist=True)``, ``all_gather``, ``broadcast``, the sampler, the
SIGTERM agreement, torchmetrics, checkpoints) runs as under ``strategy="ddp"``; only the training update
crosses ranks another way, reduced by each subclass (as Lightning's ``DeepSpeedStrategy`` lets its engine).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from pytorch_lightning.accelerators import Accelerator
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.exceptions import SIGTERMException
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.constants import default_pg_timeout
from torch.nn import SyncBatchNorm
from torch.optim import Optimizer
from typing_extensions import override

import adasum_lightning.checkpoint as ckpt
from adasum_lightning._namespaces import register
from adasum_lightning.errors import reported_on_every_rank
from adasum_lightning.learning_rate import (
    check_lr_scaling,
    lr_factor,
    scale_learning_rates,
    scaled_learning_rate_message,
)
from adasum_lightning.replicas import (
    check_single_device,
    check_sync_batchnorm,
    make_parameters_contiguous,
    sampler_seed,
)
from adasum_lightning.uneven import EvenBatches, check_uneven_inputs

from . import _compat

__all__ = ["UpdateReducingDDPStrategy"]

log = logging.getLogger(__name__)

#: Exit status of a process stopped by SIGTERM (shells report 128 + signal number).
SIGTERM_EXIT_CODE = 128 + int(signal.SIGTERM)


class UpdateReducingDDPStrategy(DDPStrategy):
    """``DDPStrategy``'s process group and collectives, without ``DistributedDataParallel``.

    Subclasses reduce the training update themselves. Common to all of them:

    - at fit start every rank takes rank 0's parameters and buffers (Lightning's own bucketed broadcast,
      any dtype, bool and non-contiguous tensors included);
    - the DistributedSampler gets the world size and one shuffling seed for all ranks (rank 0's
      ``seed_everything`` seed), so shards are disjoint even when each rank seeded differently;
    - ``lr_scaling`` multiplies every learning rate once when fitting starts (:meth:`lr_scale_factor`);
    - a ``SIGTERM`` that stops training (Lightning's ``SIGTERMException``) ends the process with exit
      status 143 (128 + SIGTERM) instead of 0, so launchers and schedulers see the job as stopped.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for
            ``DDPStrategy``; Lightning fills them from the ``Trainer`` arguments.
        process_group_backend: ``torch.distributed`` backend; default ``"gloo"`` on CPU, ``"nccl"`` on GPU.
        timeout: how long a collective of the process group may wait (``torch.distributed``'s timeout).
        start_method: how Lightning starts processes when it launches them itself (``DDPStrategy``'s).
        lr_scaling: ``"auto"`` (the subclass's policy), ``"none"`` (factor 1) or a positive number used as
            the factor. It multiplies each param group's ``lr`` (and ``initial_lr``/``max_lr``/``min_lr`` when
            a scheduler keeps them) and every scheduler's ``base_lrs``, once, when fitting starts.
        uneven_inputs: when the ranks have different numbers of training batches (per-rank data,
            ``use_distributed_sampler=False``, an ``IterableDataset``): ``"truncate"`` (every rank stops each
            epoch at the shortest rank's count; a warning on rank 0 names the counts, once per fit) or
            ``"error"`` (:class:`adasum_lightning.uneven.UnevenInputsError` on every rank). See
            :class:`adasum_lightning.uneven.EvenBatches`.

    Raises:
        ValueError: an invalid ``lr_scaling`` or ``uneven_inputs``.
    """

    #: Registered name (set by each subclass).
    strategy_name: str = ""

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
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.lr_scaling = check_lr_scaling(lr_scaling)
        self.uneven_inputs = check_uneven_inputs(uneven_inputs, self.strategy_name)
        self._uneven_warned = False
        self._checkpoint_path: Any = None
        #: The world size that saved the checkpoint being resumed (None: none, or not recorded).
        self._resumed_world_size: int | None = None
        self._resumed_lr_factor: float | None = None
        #: The learning-rate factor applied when fitting started (None before).
        self.lr_factor: float | None = None
        self._pending_sigterm: tuple[Any, int, Any] | None = None

    # ------------------------------------------------------------------------------------------ properties
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank a shard, with rank 0's ``seed_everything`` seed (read, a broadcast, when the Trainer
        prepares a loader on every rank)."""
        return {"num_replicas": self.world_size, "rank": self.global_rank, "seed": sampler_seed(self)}

    # ------------------------------------------------------------------------------------------ lifecycle
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._uneven_warned = False  # the uneven-inputs warning: once per fit
        if fitting:
            with reported_on_every_rank(self.global_rank):
                self._validate_trainer(trainer)
        super().setup(trainer)
        assert self.lightning_module is not None
        with reported_on_every_rank(self.global_rank):
            check_single_device(
                self.strategy_name, [*self.lightning_module.parameters(), *self.lightning_module.buffers()]
            )
        if fitting:
            self.lr_factor = self.lr_scale_factor()
            scale_learning_rates(
                self.optimizers, [c.scheduler for c in self.lr_scheduler_configs], self.lr_factor
            )
            rank_zero_info(
                f"{type(self).__name__}: world size {self.world_size}, {self._describe_reduction()}, "
                f"learning-rate factor {self.lr_factor:g} (lr_scaling={self.lr_scaling!r})"
            )
            if self.lr_factor != 1.0:
                rank_zero_warn(scaled_learning_rate_message(self.strategy_name, self.lr_factor))

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Training loaders stop every rank at the same batch (:class:`~adasum_lightning.uneven.EvenBatches`):
        an update is a collective, so a rank without a batch would leave the others waiting in it."""
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self.world_size == 1 or trainer is None or not trainer.training:
            return dataloader
        return EvenBatches(dataloader, uneven_inputs=self.uneven_inputs, on_uneven=self._warn_uneven_once)

    def _warn_uneven_once(self, message: str) -> None:
        if not self._uneven_warned:
            rank_zero_warn(message)
        self._uneven_warned = True

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._report_resume()
        self._rescale_resumed_learning_rates()
        self._defer_sigterm_to_step_end()

    def _report_resume(self) -> None:
        """Rank 0's line after a resume: the file, the step, the world size before and now, and torchrun's
        restart count (an elastic restart)."""
        if self._checkpoint_path is None:
            return
        step = self.lightning_module.trainer.global_step
        name, path = type(self).__name__, self._checkpoint_path
        rank_zero_info(ckpt.resume_line(name, path, step, self._resumed_world_size, self.world_size))

    def _rescale_resumed_learning_rates(self) -> None:
        """A run resumed at another world size gets the learning rates restored for the old one (scaled by the
        old ``lr_scaling`` factor): bring them to this world size's factor, once."""
        old, self._resumed_lr_factor = self._resumed_lr_factor, None
        if old is None or self.lr_factor is None or old == self.lr_factor:
            return
        scale_learning_rates(
            self.optimizers, [c.scheduler for c in self.lr_scheduler_configs], self.lr_factor / old
        )
        rank_zero_info(
            f"{type(self).__name__}: the checkpoint's learning rates were scaled by {old:g} for its world "
            f"size; rescaled to the factor {self.lr_factor:g} of world size {self.world_size}"
        )

    def _defer_sigterm_to_step_end(self) -> None:
        """Run Lightning's SIGTERM handler when an optimizer step ends instead of when the signal arrives.

        Lightning's handler broadcasts from rank 0 inside the signal handler; arriving while the other ranks
        wait for rank 0 in the update's reduction, it would leave both waiting for good. Here the handler only
        records the signal; :meth:`_deliver_pending_sigterm` runs Lightning's once the reduction is complete.
        """
        lightning_handler = signal.getsignal(signal.SIGTERM)
        if not callable(lightning_handler):
            return

        def record(signum: int, frame: Any) -> None:
            log.info(f"[rank: {self.global_rank}] SIGTERM received; handled when this optimizer step ends")
            self._pending_sigterm = (lightning_handler, signum, frame)

        signal.signal(signal.SIGTERM, record)

    def _deliver_pending_sigterm(self) -> None:
        """Run a SIGTERM handler deferred by :meth:`_defer_sigterm_to_step_end` (call when a step's update
        reduction is complete)."""
        if self._pending_sigterm is not None:
            handler, signum, frame = self._pending_sigterm
            self._pending_sigterm = None
            handler(signum, frame)
            if self.world_size > 1 and _compat.has_sigterm_agreement():
                # the barrier the other ranks pass after taking that broadcast, before they stop
                self.barrier("sigterm")

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """The step with its update reduced over the ranks (:meth:`_reduced_step`), then a SIGTERM that
        arrived during it (:meth:`_defer_sigterm_to_step_end`)."""
        output = self._reduced_step(optimizer, closure, model, kwargs)
        self._deliver_pending_sigterm()
        return output

    def _reduced_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any, kwargs: dict[str, Any]
    ) -> Any:
        """Each subclass's step: Lightning's local step (:meth:`_local_step`) and the update's reduction."""
        raise NotImplementedError(f"{type(self).__name__} reduces no update: override _reduced_step")

    def _local_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any, kwargs: dict[str, Any]
    ) -> Any:
        """Lightning's own optimizer step: the precision plugin, the closure, ``optimizer.step``."""
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def _validate_trainer(self, trainer: pl.Trainer) -> None:
        """Rules on the Trainer's settings and the module, checked when fitting sets up, before any step."""
        assert self.model is not None
        sync_layers = [name for name, m in self.model.named_modules() if isinstance(m, SyncBatchNorm)]
        requested = _compat.layer_sync(self) is not None
        check_sync_batchnorm(self.root_device.type, requested, sync_layers, self.strategy_name)

    @override
    def configure_ddp(self) -> None:
        """Take rank 0's parameters and buffers instead of wrapping the module in ``DistributedDataParallel``.

        Non-contiguous parameters are made contiguous first (same values, same ``Parameter`` objects), so
        that the update reductions can work on them in place.
        """
        assert self.model is not None
        make_parameters_contiguous(self.model)
        _compat.sync_module_states(self.model)

    def lr_scale_factor(self) -> float:
        """The factor applied to the learning rates when fitting starts (see ``lr_scaling``)."""
        return lr_factor(self.lr_scaling, self._auto_lr_factor)

    def _auto_lr_factor(self) -> float:
        return 1.0

    def _describe_reduction(self) -> str:
        return type(self).__name__

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint on every rank; a missing, unreadable or foreign file raises an error naming the
        fix (:func:`adasum_lightning.checkpoint.read_checkpoint`)."""
        kwargs = {} if weights_only is None else {"weights_only": weights_only}  # none before Lightning 2.5
        load = functools.partial(super().load_checkpoint, checkpoint_path, **kwargs)
        self._checkpoint_path = checkpoint_path  # where the other ranks' optimizer states lie
        checkpoint = ckpt.read_checkpoint(load, checkpoint_path, self.global_rank)
        self._resumed_world_size = (checkpoint.get(ckpt.RANK_OPTIMIZER_STATES) or {}).get("world_size")
        return checkpoint

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Save every rank's own optimizer state: rank 0's in the checkpoint, rank r's beside it in
        ``<file>.rank<r>-optimizer.pt`` (:mod:`adasum_lightning.checkpoint`), each renamed into place."""
        if "optimizer_states" in checkpoint:
            checkpoint = self._with_rank_files(checkpoint, filepath)
        if self.is_global_zero:
            in_place = type(self.checkpoint_io) is TorchCheckpointIO
            ckpt.save_through(self.checkpoint_io, checkpoint, filepath, storage_options, in_place)
        if ckpt.RANK_OPTIMIZER_STATES in checkpoint:
            ckpt.commit_rank_file(filepath, self.global_rank, self.barrier)

    def _with_rank_files(self, checkpoint: dict[str, Any], filepath: Any) -> dict[str, Any]:
        """Write this rank's file (ranks ≥ 1); the checkpoint with the world size, learning-rate factor and
        the save's identity (a broadcast: every rank saves)."""
        identity = ckpt.save_identity(checkpoint.get("global_step"), self.broadcast)
        if not self.is_global_zero:
            ckpt.save_rank_file(filepath, self.global_rank, checkpoint["optimizer_states"], identity)
        record = {"world_size": self.world_size, "lr_factor": self.lr_factor}
        return {**checkpoint, ckpt.RANK_OPTIMIZER_STATES: record, ckpt.SAVE_IDENTITY: identity}

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        if not self.is_global_zero:
            ckpt.remove_rank_file(filepath, self.global_rank)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Each rank restores its own optimizer state when the checkpoint has every rank's (new rank r: old
        rank ``r mod N_old``'s); a checkpoint without them (an older version, ``strategy="ddp"``, world size
        1) gives every rank rank 0's, as in Lightning, and so does a missing rank file, with a warning."""
        record = checkpoint.get(ckpt.RANK_OPTIMIZER_STATES)
        if record is not None:
            self._resumed_lr_factor = record.get("lr_factor")
            checkpoint = {**checkpoint, "optimizer_states": self._own_optimizer_states(checkpoint, record)}
        super().load_optimizer_state_dict(checkpoint)

    #: A missing rank file resumes that rank from rank 0's optimizer state (a whole state), with a warning.
    _rank_file_fallback = True

    def _own_optimizer_states(self, checkpoint: Any, record: dict[str, Any]) -> Any:
        """Old rank ``r mod N_old``'s saved states, checked against the checkpoint on every rank."""
        source = ckpt.source_rank(self.global_rank, record["world_size"])
        path = os.path.realpath(str(self._checkpoint_path))
        identity = checkpoint.get(ckpt.SAVE_IDENTITY)
        states = ckpt.load_rank_optimizer_states(
            path, source, self.global_rank, identity, fallback=self._rank_file_fallback
        )
        if source != 0 and states is None:
            warnings.warn(
                f"[rank {self.global_rank}] {ckpt.rank_optimizer_path(path, source)} is missing (the "
                f"optimizer state of rank {source} when the checkpoint was saved): this rank resumes from "
                "rank 0's optimizer state instead. Keep the <checkpoint>.rank<r>-optimizer.pt files beside "
                "the checkpoint when you copy it.",
                stacklevel=2,
            )
        return checkpoint["optimizer_states"] if states is None else states

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        # Lightning raises SIGTERMException, a SystemExit without a code (exit status 0), once the ranks agree
        # to stop after a SIGTERM; a preempted job must not look like a finished one.
        if isinstance(exception, SIGTERMException) and exception.code in (None, 0):
            exception.code = SIGTERM_EXIT_CODE

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register(strategy_registry, cls)
