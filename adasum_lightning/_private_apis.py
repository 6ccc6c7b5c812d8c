"""How a private API of another package is recorded and checked (see ``pytorch_lightning/_compat.py`` and
``fabric/_compat.py``, which list them); needs no Lightning."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

__all__ = ["PrivateApi"]


@dataclass(frozen=True)
class PrivateApi:
    """One private name: ``module`` holds ``name``; ``attributes`` must appear in its source."""

    module: str
    name: str
    read_from: str
    attributes: tuple[str, ...] = ()
    optional: bool = False  # a feature some supported versions lack (used only where present)


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
