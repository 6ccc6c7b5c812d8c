"""What the Horovod strategies of both Lightning APIs share; imports no Lightning package."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_only, rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from adasum_lightning.errors import AdasumConfigurationError, reported_on_every_rank
from adasum_lightning.horovod import _compat, support
from adasum_lightning.launch_environment import detect_launcher, launcher_rank

__all__ = ["HorovodProcess", "agree_on_process_group", "process_group_address"]


class HorovodProcess:
    """One process per device, started by ``horovodrun``/``mpirun``: Horovod's start, launch rules, optimizer
    wrapper and learning-rate policy, and the ``torch.distributed`` process group beside it.

    Mixed in before a Lightning ``DDPStrategy`` (Trainer's or Fabric's), which provides the attributes
    declared below. ``__init__`` calls :meth:`_set_options` with ``compression`` (``"none"`` or ``"fp16"``,
    Horovod's wire dtype) and ``gradient_predivide_factor`` (Horovod's averaging split; 1 for Adasum).
    """

    strategy_name: str
    #: Horovod op name of the optimizer wrapper: ``"Average"`` or ``"Adasum"``.
    reduction: str = "Average"
    #: The Lightning API, for messages: ``"Trainer"`` or ``"Fabric"``.
    api: str = "Trainer"
    compression: str
    gradient_predivide_factor: float
    cluster_environment: Any
    world_size: int
    global_rank: int
    local_rank: int
    num_nodes: int
    _hvd: Any = None
    _requested_devices: int = 1

    @property
    def hvd(self) -> Any:
        """The ``horovod.torch`` module, imported on first use."""
        if self._hvd is None:
            self._hvd = support.import_horovod()
        return self._hvd

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices
        return devices[0] if devices else torch.device("cpu")

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        # Whatever ``devices`` Lightning was given, this process drives one: cuda:<local rank> or the CPU. The
        # requested count is kept for the launch check.
        if devices:
            self._requested_devices = len(devices)
            kind = torch.device(devices[0]).type
            devices = [torch.device("cuda", self.local_rank)] if kind == "cuda" else [torch.device(kind)]
        self._parallel_devices = devices

    def _configure_launcher(self) -> None:
        self._launcher = None  # horovodrun / mpirun start the processes

    def _set_options(self, compression: str, gradient_predivide_factor: float) -> None:
        """Set ``compression`` and ``gradient_predivide_factor`` (1 under Adasum, refused on every rank)."""
        self.compression = support.check_compression(compression)
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        if self.reduction == "Adasum":
            with reported_on_every_rank(launcher_rank()):
                support.check_gradient_predivide_factor(self.gradient_predivide_factor)

    def setup_environment(self) -> None:
        """``hvd.init()``, the launch rules, then the ``torch.distributed`` process group beside Horovod.

        Raises:
            AdasumConfigurationError: on every rank, before the first collective: a bad launch.
        """
        hvd = self.hvd
        hvd.init()
        rank_zero_only.rank = hvd.rank()
        with reported_on_every_rank(hvd.rank()):
            devices, name = self._requested_devices, self.strategy_name
            support.check_launch(hvd.size(), detect_launcher(), devices, api=self.api, strategy_name=name)
            self._validate_environment()
        self.num_nodes = agree_on_process_group(hvd, self.cluster_environment)
        super().setup_environment()  # type: ignore[misc]

    def _validate_environment(self) -> None:
        """Rules on the launch, right after ``hvd.init()``; under Adasum its world rules."""
        hvd, name, cpu = self.hvd, self.strategy_name, os.environ.get("HOROVOD_CPU_OPERATIONS")
        support.check_cpu_operations(mpi_enabled=hvd.mpi_enabled(), cpu_operations=cpu, strategy_name=name)
        if self.reduction != "Adasum" or hvd.size() == 1:
            return  # Adasum's rules: a world of 1 reduces nothing
        support.check_controller(
            mpi_built=hvd.mpi_built(), mpi_enabled=hvd.mpi_enabled(), gloo_enabled=hvd.gloo_enabled()
        )
        if self.root_device.type != "cuda" or not hvd.nccl_built():
            support.check_world_size(hvd.size())
        elif warning := support.check_nccl_topology(hvd.size(), hvd.allgather_object(hvd.local_size())):
            rank_zero_warn(warning)

    def _check_module(self, module: Module) -> None:
        """Refuse, on every rank, bfloat16 parameters on CPU."""
        dtypes = {p.dtype for p in module.parameters() if p.requires_grad}
        with reported_on_every_rank(self.global_rank):
            support.check_horovod_dtypes(self.strategy_name, self.root_device.type, dtypes)

    def _check_optimizers(self, optimizers: list[Optimizer]) -> None:
        """Refuse, on every rank, a closure optimizer under Adasum (its local step runs inside backward)."""
        if self.reduction == "Adasum":
            names = [type(opt).__name__ for opt in optimizers if support.needs_closure(opt)]
            with reported_on_every_rank(self.global_rank):
                support.check_closure_optimizers(self.strategy_name, names)

    def _auto_lr_factor(self) -> float:
        """``lr_scaling="auto"``: the world size (averaging); 1 or ``hvd.local_size()`` with NCCL (Adasum)."""
        if self.reduction == "Average":
            return float(self.world_size)
        on_gpu = self.root_device.type == "cuda"
        return float(self.hvd.local_size()) if on_gpu and self.hvd.nccl_built() else 1.0

    def _horovod_optimizer(
        self, optimizer: Optimizer, index: int, names: Mapping[Tensor, str], backward_passes_per_step: int
    ) -> Optimizer:
        """``optimizer`` in ``hvd.DistributedOptimizer``, its allreduces named after the parameters."""
        hvd = self.hvd
        named = [
            (names.get(p, f"optimizer{index}.group{g}.param{j}"), p)
            for g, group in enumerate(optimizer.param_groups)
            for j, p in enumerate(group["params"])
        ]
        wrapped = hvd.DistributedOptimizer(
            optimizer,
            named_parameters=named,
            compression=hvd.Compression.fp16 if self.compression == "fp16" else hvd.Compression.none,
            op=getattr(hvd, self.reduction),
            backward_passes_per_step=backward_passes_per_step,
            gradient_predivide_factor=self.gradient_predivide_factor,
        )
        _compat.route_horovod_methods_to(wrapped)  # Lightning's and Fabric's wrappers subclass its class
        return wrapped

    @staticmethod
    def _closure_then_synchronize(
        optimizer: Any, closure: Callable[[], Any], average_loss: bool, reduce: Callable[..., Tensor]
    ) -> Callable[[], Any]:
        """``closure``, then wait for the gradient allreduce; with ``average_loss`` a tensor it returns is
        averaged over the ranks, so that every rank decides alike (LBFGS's line search)."""

        def evaluate() -> Any:
            result = closure()
            optimizer.synchronize()
            if average_loss and isinstance(result, Tensor):
                result = reduce(result.detach().clone(), reduce_op="mean")
            return result

        return evaluate


def agree_on_process_group(hvd: Any, environment: Any) -> int:
    """Rank 0 picks the address and port of the ``torch.distributed`` group and Horovod broadcasts them;
    sets them and the node rank on ``environment``. Returns the number of hosts.

    Raises:
        AdasumConfigurationError: on every rank, for a job on several hosts with a loopback address.
    """
    proposal = (
        process_group_address(hvd.size() == hvd.local_size(), environment.free_port)
        if hvd.rank() == 0
        else None
    )
    address, port, problem = hvd.broadcast_object(proposal, root_rank=0, name="adasum_lightning.pg_address")
    if problem:
        with reported_on_every_rank(hvd.rank()):
            raise AdasumConfigurationError(problem)
    environment.set_main_address_and_port(address, port)
    hosts = list(dict.fromkeys(hvd.allgather_object(socket.gethostname(), name="adasum_lightning.hosts")))
    environment.set_node_rank(hosts.index(socket.gethostname()))
    return len(hosts)


def process_group_address(
    single_host: bool, free_port: Callable[[], int]
) -> tuple[str | None, int | None, str | None]:
    """On rank 0: ``(address, port, problem)`` of the process group beside Horovod: ``MASTER_ADDR``, else
    ``127.0.0.1`` on one host, else rank 0's host's address; ``MASTER_PORT``, else ``free_port()``.
    ``problem`` (address and port None) says why several hosts cannot use a loopback address."""
    port = int(os.environ.get("MASTER_PORT") or free_port())
    given = os.environ.get("MASTER_ADDR")
    if single_host:
        return given or "127.0.0.1", port, None
    address = given or socket.gethostbyname(socket.gethostname())
    if not socket.gethostbyname(address).startswith("127."):
        return address, port, None
    where = (
        f"MASTER_ADDR={given} is a loopback address"
        if given
        else f"rank 0's host name {socket.gethostname()!r} resolves to the loopback address {address}"
    )
    fix = "Unset MASTER_ADDR, or set it" if given else "Set MASTER_ADDR"
    return (
        None,
        None,
        f"this job spans several hosts, but {where}, which the other hosts cannot reach. {fix} to an "
        "address of rank 0's host that every host can reach (e.g. `mpirun -x MASTER_ADDR=10.0.0.4 ...`).",
    )
