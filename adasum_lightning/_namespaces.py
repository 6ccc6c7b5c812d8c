"""The two Lightning package names, and a copy of the strategies for each.

``pytorch_lightning`` and ``lightning`` can be installed together, each with its own ``Strategy`` class, so
the strategies are loaded a second time under ``adasum_lightning.lightning`` with the package names renamed.
Names are registered once a Lightning package is imported.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "NAMESPACES",
    "FABRIC_NAMESPACES",
    "Namespace",
    "installed",
    "strategies_for",
    "resolve",
    "register",
    "register_when_imported",
]

_MIRROR_PACKAGE = "adasum_lightning.lightning"
_PACKAGE_DIR = Path(__file__).resolve().parent
#: Mirror package → the source folder it is loaded from, the more specific first.
_MIRRORS = (
    (f"{_MIRROR_PACKAGE}.fabric", _PACKAGE_DIR / "fabric"),
    (f"{_MIRROR_PACKAGE}.horovod", _PACKAGE_DIR / "horovod"),
    (_MIRROR_PACKAGE, _PACKAGE_DIR / "trainer"),
)


@dataclass(frozen=True)
class Namespace:
    """One Lightning package: the module whose ``Trainer`` or ``Fabric`` users build, and our strategies'."""

    trainer_module: str
    strategies_module: str


#: The standalone package first: it is installed whenever either is (``lightning`` requires it).
NAMESPACES: tuple[Namespace, ...] = (
    Namespace("pytorch_lightning", "adasum_lightning.trainer"),
    Namespace("lightning.pytorch", _MIRROR_PACKAGE),
)

FABRIC_NAMESPACES: tuple[Namespace, ...] = (
    Namespace("lightning_fabric", "adasum_lightning.fabric"),
    Namespace("lightning.fabric", f"{_MIRROR_PACKAGE}.fabric"),
)

_RENAMES = (
    (re.compile(r"\bpytorch_lightning\b"), "lightning.pytorch"),
    (re.compile(r"\blightning_fabric\b"), "lightning.fabric"),
    (re.compile(r"\badasum_lightning\.fabric\b"), f"{_MIRROR_PACKAGE}.fabric"),
    (re.compile(r"\badasum_lightning\.trainer\b"), _MIRROR_PACKAGE),
    # only the Horovod modules that import Lightning: the others are shared by both copies
    (re.compile(r"\badasum_lightning\.horovod\.(?=(trainer|fabric)\b)"), f"{_MIRROR_PACKAGE}.horovod."),
)


def installed(namespaces: tuple[Namespace, ...] = NAMESPACES) -> list[Namespace]:
    """The Lightning packages of ``namespaces`` importable here (found on the path; nothing is imported)."""
    found = []
    for namespace in namespaces:
        top = namespace.trainer_module.split(".")[0]
        if top in sys.modules and sys.modules[top] is None:
            continue  # import blocked
        with contextlib.suppress(ImportError, ValueError):
            if importlib.util.find_spec(namespace.trainer_module if top in sys.modules else top):
                found.append(namespace)
    return found


def strategies_for(namespace: Namespace) -> ModuleType:
    """This project's strategies for ``namespace`` (imports that Lightning package)."""
    return importlib.import_module(namespace.strategies_module)


def resolve() -> Namespace:
    """The package a bare ``adasum_lightning.<Strategy>`` means: the one imported, else ``lightning``.

    Raises:
        ImportError: neither package is installed, or both are imported.
    """
    imported = [ns for ns in NAMESPACES if sys.modules.get(ns.trainer_module) is not None]
    if len(imported) == 1:
        return imported[0]
    if len(imported) > 1:
        raise ImportError(AMBIGUOUS_MESSAGE)
    available = installed()
    if not available:
        raise ImportError(missing_lightning_message())
    return available[-1]


AMBIGUOUS_MESSAGE = (
    "both pytorch_lightning and lightning.pytorch are imported in this process, so "
    "`adasum_lightning.<Strategy>` is ambiguous: a strategy object must belong to the package of the Trainer "
    "it is given to. Import it from `adasum_lightning.lightning` (for lightning.pytorch.Trainer) or "
    "`adasum_lightning.trainer` (for pytorch_lightning.Trainer), or pass the strategy by name, "
    "e.g. Trainer(strategy='horovod_adasum'), which works with either."
)


def missing_lightning_message() -> str:
    return (
        "adasum_lightning needs PyTorch Lightning 2.4–2.6, as either package name: install it with "
        "`pip install lightning` (imported as `lightning.pytorch`) or `pip install pytorch-lightning` "
        "(imported as `pytorch_lightning`)."
    )


def register(strategy_registry: Any, strategy: type) -> None:
    """Add ``strategy`` to a Lightning registry under its ``strategy_name`` (its docstring's first line)."""
    description = (strategy.__doc__ or "").splitlines()[0]
    strategy_registry.register(strategy.strategy_name, strategy, description=description, override=True)


def register_when_imported() -> None:
    """Register the strategy names with each Lightning package's registries once it is imported."""
    import wrapt  # installed with Lightning; not needed for the torch-only part of the project

    sys.meta_path.insert(0, _MirrorFinder())
    for namespace in (*NAMESPACES, *FABRIC_NAMESPACES):
        # importing the strategies registers them
        wrapt.register_post_import_hook(lambda _, ns=namespace: strategies_for(ns), namespace.trainer_module)


class _MirrorLoader(importlib.abc.SourceLoader):
    """Loads a source module under its mirror with the imports renamed (tracebacks keep its lines)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def get_filename(self, fullname: str) -> str:
        return str(self.path)

    def get_data(self, path: str) -> bytes:
        text = Path(path).read_text(encoding="utf-8")
        for pattern, replacement in _RENAMES:
            text = pattern.sub(replacement, text)
        return text.encode("utf-8")


class _MirrorFinder(importlib.abc.MetaPathFinder):
    """Finds ``adasum_lightning.lightning[.fabric|.horovod][.X]``: the renamed files of :data:`_MIRRORS`."""

    def find_spec(self, fullname, path=None, target=None):
        found = [(m, d) for m, d in _MIRRORS if fullname == m or fullname.startswith(m + ".")]
        if not found:
            return None
        mirror, source_dir = found[0]
        parts = fullname[len(mirror) :].lstrip(".").split(".") if fullname != mirror else []
        source = source_dir.joinpath(*parts)
        is_package = source.is_dir()
        source = source / "__init__.py" if is_package else source.with_suffix(".py")
        if not source.is_file():
            return None
        return importlib.util.spec_from_file_location(
            fullname,
            source,
            loader=_MirrorLoader(source),
            submodule_search_locations=[str(source.parent)] if is_package else None,
        )
