"""``adasum-fabric``: Lightning's ``fabric`` command (``fabric run``, ``fabric consolidate``) with the Adasum
strategies registered, so that a Fabric script that takes its strategy from the command line runs with it:
``adasum-fabric run --strategy=ddp_adasum --devices=2 script.py``.

Why not ``fabric run`` itself: it checks ``--strategy`` against Fabric's registry when its module is
imported, before the script could ``import adasum_lightning``, and the processes it starts (through
torchrun) look the name up again in a registry the script has not filled. This command imports
``adasum_lightning`` before Lightning's command and runs the script through
:mod:`adasum_lightning.fabric_script`, which imports it in every process before running the script.
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
    """The ``fabric`` command's module of the installed Fabric package (the unified ``lightning`` first, as
    its ``fabric`` console script), imported after ``adasum_lightning``."""
    import adasum_lightning  # noqa: F401  (registers the strategies with each Fabric package on its import)

    name = "lightning.fabric.cli" if importlib.util.find_spec("lightning") else "lightning_fabric.cli"
    return importlib.import_module(name)


def _through_runner(cli: Any, args: list[str]) -> list[str]:
    """``run``'s arguments with :data:`SCRIPT_RUNNER` before the script (parsed by Lightning's own command);
    unchanged when they do not parse, so that Lightning's command reports the error."""
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
    """Run Lightning's ``fabric`` command with ``argv`` (default: this process's arguments).

    Raises:
        SystemExit: with the command's exit status; 1 with the fix when ``click`` (which Lightning's command
            needs) or a Fabric package is not installed.
    """
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
