"""What the Horovod strategies (Trainer and Fabric) share: importing Horovod, the process group beside it.

Imports no Lightning package, so every copy of the strategies imports it as it is.
"""

from __future__ import annotations

import importlib.resources
import inspect
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.optim import Optimizer

from adasum_lightning import reporting, validation

__all__ = [
    "HOROVOD_BUILD_PACKAGE",
    "import_horovod",
    "missing_horovod_message",
    "agree_on_process_group",
    "check_adasum_world",
    "process_group_address",
    "needs_closure",
]


#: The package of Horovod's build script and patch: ``patches/`` in a checkout, package data in a wheel.
HOROVOD_BUILD_PACKAGE = "adasum_lightning.aml.horovod_build"


def missing_horovod_message(
    what: str, alternative: str = "strategy='ddp_adasum'", python: str | None = None
) -> str:
    """The one message for a missing Horovod: the installed build script's command, or ``alternative``.

    Args:
        what: what is missing, e.g. ``"horovodrun (Horovod's launcher)"``.
        alternative: what needs no Horovod.
        python: the environment's interpreter (default: this one).
    """
    python = python or sys.executable
    try:
        script = importlib.resources.files(HOROVOD_BUILD_PACKAGE).joinpath("build_horovod.sh")
    except ModuleNotFoundError:  # a checkout on sys.path, not installed: the package is its patches/ folder
        script = Path(__file__).resolve().parent.parent / "patches" / "build_horovod.sh"
    return (
        f"{what} is not installed in the environment of {python}. Build Horovod against its torch with "
        f"`bash {script} --python {python}` (it needs Open MPI: the Debian/Ubuntu packages openmpi-bin and "
        f"libopenmpi-dev), or use {alternative}, which needs no Horovod."
    )


def import_horovod() -> Any:
    """Import ``horovod.torch`` or raise an ``ImportError`` that names the fix.

    Raises:
        ImportError: Horovod is missing, or was built without its PyTorch extension.
    """
    try:
        import horovod.torch as hvd
    except ImportError as err:
        raise ImportError(missing_horovod_message(f"Horovod with PyTorch support ({err})")) from err
    return hvd


def agree_on_process_group(hvd: Any, environment: Any) -> int:
    """Rank 0 picks the address and port of the ``torch.distributed`` group; Horovod broadcasts them.

    Also sets each rank's node rank (its host's index among the job's hosts).

    Args:
        hvd: ``horovod.torch``, initialised.
        environment: the strategy's ``HorovodEnvironment``, which picks the free port and receives the
            address, port and node rank.

    Returns:
        The number of hosts in the job.

    Raises:
        AdasumConfigurationError: on every rank, for a job on several hosts whose address would be a loopback
            one (``MASTER_ADDR``, or rank 0's host name, resolving so); the message names ``MASTER_ADDR``.
    """
    proposal = (
        process_group_address(hvd.size() == hvd.local_size(), environment.free_port)
        if hvd.rank() == 0
        else None
    )
    address, port, problem = hvd.broadcast_object(proposal, root_rank=0, name="adasum_lightning.pg_address")
    if problem:
        with reporting.reported_on_every_rank(hvd.rank()):
            raise validation.AdasumConfigurationError(problem)
    environment.set_main_address_and_port(address, port)
    hosts = list(dict.fromkeys(hvd.allgather_object(socket.gethostname(), name="adasum_lightning.hosts")))
    environment.set_node_rank(hosts.index(socket.gethostname()))
    return len(hosts)


def check_adasum_world(hvd: Any, device_type: str) -> str | None:
    """The launch rules of Horovod's Adasum, right after ``hvd.init()``; none at world size 1.

    Returns:
        A warning for rank 0 (NCCL on a single node: Adasum then averages), else None.

    Raises:
        AdasumConfigurationError: a rule of :mod:`adasum_lightning.validation` fails.
    """
    if hvd.size() == 1:
        return None  # nothing is reduced
    validation.check_controller(
        mpi_built=hvd.mpi_built(), mpi_enabled=hvd.mpi_enabled(), gloo_enabled=hvd.gloo_enabled()
    )
    if device_type == "cuda" and hvd.nccl_built():
        return validation.check_nccl_topology(hvd.size(), hvd.allgather_object(hvd.local_size()))
    validation.check_world_size(hvd.size())
    return None


def process_group_address(
    single_host: bool, free_port: Callable[[], int]
) -> tuple[str | None, int | None, str | None]:
    """On rank 0: ``(address, port, problem)`` of the process group beside Horovod.

    The address is ``MASTER_ADDR``, else ``127.0.0.1`` on one host, else what rank 0's host name resolves to;
    the port is ``MASTER_PORT``, else ``free_port()``. ``problem`` (address and port None) says why a job on
    several hosts cannot use a loopback address.
    """
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


def needs_closure(optimizer: Optimizer) -> bool:
    """True when the optimizer's own ``step`` has a ``closure`` without a default (e.g. LBFGS).

    Horovod's wrapper classes define ``step(closure=None)`` for every optimizer, so the wrapped class decides.
    """
    for cls in type(optimizer).__mro__:
        if "step" in vars(cls) and not cls.__module__.startswith("horovod."):
            try:
                parameter = inspect.signature(vars(cls)["step"]).parameters.get("closure")
            except (TypeError, ValueError):
                return False
            return parameter is not None and parameter.default is inspect.Parameter.empty
    return False
