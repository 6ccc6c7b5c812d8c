"""What the Trainer strategies share: Lightning's ``DDPStrategy`` without ``DistributedDataParallel``."""

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
    """``DDPStrategy``'s process group and collectives without ``DistributedDataParallel``.

    Subclasses reduce the update in ``optimizer_step``. A ``SIGTERM`` that stops training exits with 143.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io: as for ``DDPStrategy``.
        precision_plugin, process_group_backend, timeout, start_method: as for ``DDPStrategy``.
        lr_scaling: ``"auto"`` (the subclass's policy), ``"none"`` (factor 1) or a positive factor applied to
            every learning rate (and scheduler's ``base_lrs``) when fitting starts.
        uneven_inputs: when the ranks have different numbers of training batches: ``"truncate"`` (stop every
            rank at the shortest rank's count, with a warning) or ``"error"``
            (:class:`~adasum_lightning.uneven.EvenBatches`).

    Raises:
        ValueError: an invalid ``lr_scaling`` or ``uneven_inputs``.
    """

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
        self._resumed_world_size: int | None = None  # of the checkpoint resumed from, when it records it
        self._resumed_lr_factor: float | None = None
        #: The learning-rate factor applied when fitting started (None before).
        self.lr_factor: float | None = None
        self._sigterm_handler: Callable[[int, Any], Any] | None = None  # Lightning's, run after the step
        self._pending_sigterm: tuple[int, Any] | None = None  # (signum, frame) received during the step

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank a shard, with rank 0's ``seed_everything`` seed (a broadcast)."""
        return {"num_replicas": self.world_size, "rank": self.global_rank, "seed": sampler_seed(self)}

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._uneven_warned = False  # the uneven-inputs warning: once per fit
        if fitting:
            with reported_on_every_rank(self.global_rank):
                self._validate_trainer(trainer)
        super().setup(trainer)
        assert self.lightning_module is not None
        module = self.lightning_module
        with reported_on_every_rank(self.global_rank):
            check_single_device(self.strategy_name, [*module.parameters(), *module.buffers()])
        if fitting:
            self.lr_factor = self.lr_scale_factor()
            schedulers = [c.scheduler for c in self.lr_scheduler_configs]
            scale_learning_rates(self.optimizers, schedulers, self.lr_factor)
            rank_zero_info(
                f"{type(self).__name__}: world size {self.world_size}, {self._describe_reduction()}, "
                f"learning-rate factor {self.lr_factor:g} (lr_scaling={self.lr_scaling!r})"
            )
            if self.lr_factor != 1.0:
                rank_zero_warn(scaled_learning_rate_message(self.strategy_name, self.lr_factor))

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Training loaders stop every rank at the same batch: an update is a collective."""
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
        """Rank 0 says where a resume started: the file, the step, the world sizes, torchrun's restart."""
        if self._checkpoint_path is None:
            return
        step = self.lightning_module.trainer.global_step
        name, path = type(self).__name__, self._checkpoint_path
        rank_zero_info(ckpt.resume_line(name, path, step, self._resumed_world_size, self.world_size))

    def _rescale_resumed_learning_rates(self) -> None:
        """Bring learning rates restored for another world size's ``lr_scaling`` factor to this one's."""
        old, self._resumed_lr_factor = self._resumed_lr_factor, None
        if old is None or self.lr_factor is None or old == self.lr_factor:
            return
        schedulers = [c.scheduler for c in self.lr_scheduler_configs]
        scale_learning_rates(self.optimizers, schedulers, self.lr_factor / old)
        rank_zero_info(
            f"{type(self).__name__}: the checkpoint's learning rates were scaled by {old:g} for its world "
            f"size; rescaled to the factor {self.lr_factor:g} of world size {self.world_size}"
        )

    def _defer_sigterm_to_step_end(self) -> None:
        """Run Lightning's SIGTERM handler (a broadcast) after the step, not inside the update's reduction."""
        handler = signal.getsignal(signal.SIGTERM)
        if not callable(handler):
            return
        self._sigterm_handler = handler

        def record(signum: int, frame: Any) -> None:
            log.info(f"[rank: {self.global_rank}] SIGTERM received; handled when this optimizer step ends")
            self._pending_sigterm = (signum, frame)

        signal.signal(signal.SIGTERM, record)

    def _deliver_pending_sigterm(self, agreed: bool = False) -> None:
        """Run the SIGTERM handler deferred during the step; every ``optimizer_step`` ends with it.
        ``agreed``: the ranks have agreed on rank 0's SIGTERM, so it runs also where this rank's own has not
        arrived (the handler's broadcast then runs on every rank)."""
        pending, self._pending_sigterm = self._pending_sigterm, None
        pending = (signal.SIGTERM, None) if agreed and pending is None else pending
        if pending is None or self._sigterm_handler is None:
            return
        self._sigterm_handler(*pending)
        if self.world_size > 1 and _compat.has_sigterm_agreement():
            # the barrier the other ranks pass after taking that broadcast, before they stop
            self.barrier("sigterm")

    def _validate_trainer(self, trainer: pl.Trainer) -> None:
        """Rules on the Trainer's settings and the module, checked before any step."""
        assert self.model is not None
        sync_layers = [name for name, m in self.model.named_modules() if isinstance(m, SyncBatchNorm)]
        requested = self._layer_sync is not None  # Trainer(sync_batchnorm=True)
        check_sync_batchnorm(self.root_device.type, requested, sync_layers, self.strategy_name)

    @override
    def configure_ddp(self) -> None:
        """Take rank 0's parameters and buffers (contiguous, for the in-place reductions); no DDP wrapper."""
        assert self.model is not None
        make_parameters_contiguous(self.model)
        _compat.sync_module_states(self.model)

    def lr_scale_factor(self) -> float:
        """The factor applied to the learning rates when fitting starts (``lr_scaling``)."""
        return lr_factor(self.lr_scaling, self._auto_lr_factor)

    def _auto_lr_factor(self) -> float:
        return 1.0

    def _describe_reduction(self) -> str:
        return type(self).__name__

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint on every rank (:func:`adasum_lightning.checkpoint.read_checkpoint`)."""
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
        """Every rank saves its own optimizer state: rank 0's in the checkpoint, the others beside it."""
        if "optimizer_states" in checkpoint:
            checkpoint = self._with_rank_files(checkpoint, filepath)
        if self.is_global_zero:
            in_place = type(self.checkpoint_io) is TorchCheckpointIO
            ckpt.save_through(self.checkpoint_io, checkpoint, filepath, storage_options, in_place)
        if ckpt.RANK_OPTIMIZER_STATES in checkpoint:
            ckpt.commit_rank_file(filepath, self.global_rank, self.barrier)

    def _with_rank_files(self, checkpoint: dict[str, Any], filepath: Any) -> dict[str, Any]:
        """Write this rank's file (ranks ≥ 1); the checkpoint with the world size, factor and identity."""
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
        """Each rank its own optimizer state (new rank r: old rank ``r mod N_old``'s), else rank 0's."""
        record = checkpoint.get(ckpt.RANK_OPTIMIZER_STATES)
        if record is not None:
            self._resumed_lr_factor = record.get("lr_factor")
            checkpoint = {**checkpoint, "optimizer_states": self._own_optimizer_states(checkpoint, record)}
        super().load_optimizer_state_dict(checkpoint)

    _rank_file_fallback = True  # a missing rank file resumes from rank 0's state

    def _own_optimizer_states(self, checkpoint: Any, record: dict[str, Any]) -> Any:
        """Old rank ``r mod N_old``'s saved states, checked against the checkpoint."""
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
        # Lightning's SIGTERMException exits with status 0: a preempted job must not look finished
        if isinstance(exception, SIGTERMException) and exception.code in (None, 0):
            exception.code = SIGTERM_EXIT_CODE

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register(strategy_registry, cls)
