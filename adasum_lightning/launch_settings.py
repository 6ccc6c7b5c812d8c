"""PLACEHOLDER until the two-host work lands: Open MPI settings that end a job instead of hanging it."""

from __future__ import annotations

MPI_FAULT_SETTINGS: dict[str, str] = {"odls_base_sigkill_timeout": "5"}


def mpi_environment() -> dict[str, str]:
    return {f"OMPI_MCA_{name}": value for name, value in MPI_FAULT_SETTINGS.items()}
