"""The Lightning package the tests run against: ``pytorch_lightning`` (default) or ``lightning.pytorch``.

``ADASUM_TEST_PACKAGE=lightning.pytorch`` runs the strategy, validation and multi-process tests against the
unified ``lightning`` package (``make test-compat``); workers inherit the variable from the test process.
"""

from __future__ import annotations

import importlib
import os

PACKAGE = os.environ.get("ADASUM_TEST_PACKAGE", "pytorch_lightning")
if PACKAGE not in ("pytorch_lightning", "lightning.pytorch"):
    raise ValueError(f"ADASUM_TEST_PACKAGE must be pytorch_lightning or lightning.pytorch, got {PACKAGE!r}")

pl = importlib.import_module(PACKAGE)
callbacks = importlib.import_module(f"{PACKAGE}.callbacks")
strategies = importlib.import_module(f"{PACKAGE}.strategies")
#: This project's strategy classes for that package.
adasum_strategies = importlib.import_module(
    "adasum_lightning.trainer" if PACKAGE == "pytorch_lightning" else "adasum_lightning.lightning"
)

import adasum_lightning  # noqa: E402,F401  (registers the strategy names)

HorovodAdasumStrategy = adasum_strategies.HorovodAdasumStrategy
HorovodStrategy = adasum_strategies.HorovodStrategy
DDPAdasumStrategy = adasum_strategies.DDPAdasumStrategy
HorovodEnvironment = adasum_strategies.HorovodEnvironment
