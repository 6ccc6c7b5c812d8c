"""How a private API of another package is recorded and checked (``tests/test_compat.py``); no Lightning."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

__all__ = ["PrivateApi", "COMPAT_MODULES", "LIGHTNING_FREE_COMPAT_MODULES", "missing"]

#: The modules whose ``PRIVATE_APIS`` the strategies for each Lightning package use (Trainer's, Fabric's).
COMPAT_MODULES: dict[str, tuple[str, str]] = {
    "pytorch_lightning": ("adasum_lightning.trainer._compat", "adasum_lightning.fabric._compat"),
    "lightning.pytorch": ("adasum_lightning.lightning._compat", "adasum_lightning.lightning.fabric._compat"),
}
#: The modules whose ``PRIVATE_APIS`` the strategies of either Lightning package use.
LIGHTNING_FREE_COMPAT_MODULES: tuple[str, ...] = ("adasum_lightning.horovod._compat",)


@dataclass(frozen=True)
class PrivateApi:
    """One private name: ``module`` holds ``name``; ``attributes`` must appear in its source."""

    module: str
    name: str
    read_from: str
    attributes: tuple[str, ...] = ()
    optional: bool = False  # a feature some supported versions lack (used only where present)


def missing(package: str = "pytorch_lightning", include_optional: bool = False) -> list[str]:
    """One line per private API the strategies for ``package`` use and the installed versions lack."""
    modules = (*COMPAT_MODULES[package], *LIGHTNING_FREE_COMPAT_MODULES)
    apis = [api for module in modules for api in importlib.import_module(module).PRIVATE_APIS]
    return [
        problem
        for api in apis
        if (include_optional or not api.optional) and (problem := _check(api)) is not None
    ]


def _check(api: PrivateApi) -> str | None:
    """None when ``api`` is present in the installed version, else one line saying what is gone."""
    try:
        module = importlib.import_module(api.module)
    except ImportError as err:
        return f"{api.module} cannot be imported ({err})"
    obj = getattr(module, api.name, None)
    if obj is None:
        return f"{api.module}.{api.name} is gone (read from {api.read_from})"
    if api.attributes:
        source = inspect.getsource(module)
        lost = [attribute for attribute in api.attributes if attribute not in source]
        if lost:
            return f"{api.module}.{api.name} no longer uses {lost} (read from {api.read_from})"
    return None
