"""``adasum-fabric``: Lightning's ``fabric`` command with the Adasum strategies registered.

``fabric run`` checks ``--strategy`` on import, before a script could ``import adasum_lightning``, and its
processes look the name up again: this command imports the package first and runs the script through
:mod:`adasum_lightning.fabric_script` in every process.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]

#: The file the started processes run in place of the script (it runs the script).
SCRIPT_RUNNER = str(Path(__file__).with_name("fabric_script.py"))


def _fabric_cli() -> Any:
    """The installed ``fabric`` command's module, imported after ``adasum_lightning``."""
    import adasum_lightning  # noqa: F401  (registers the strategies with each Fabric package on its import)

    name = "lightning.fabric.cli" if importlib.util.find_spec("lightning") else "lightning_fabric.cli"
    return importlib.import_module(name)


def _through_runner(cli: Any, args: list[str]) -> list[str]:
    """``run``'s arguments with :data:`SCRIPT_RUNNER` before the script; unchanged when they do not parse."""
    try:
        with cli._run.make_context("run", args[1:], resilient_parsing=True) as context:
            script = context.params.get("script")
    except Exception:  # click's usage errors: Lightning's command reports them below
        return args
    if not script or script not in args:
        return args
    at = args.index(script)
    return [*args[:at], SCRIPT_RUNNER, *args[at:]]


def main(argv: Sequence[str] | None = None) -> None:
    """Run Lightning's ``fabric`` command with ``argv``; exit with the fix when Fabric or click is missing."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        cli = _fabric_cli()
    except ImportError:
        sys.exit("adasum-fabric: error: Lightning Fabric is not installed: pip install lightning")
    if not cli._CLICK_AVAILABLE:
        sys.exit("adasum-fabric: error: Lightning's fabric command needs click: pip install click")
    if args[:1] == ["run"]:
        args = _through_runner(cli, args)
    cli._main.main(args=args, prog_name="adasum-fabric")
