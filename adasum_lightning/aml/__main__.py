"""``python -m adasum_lightning.aml``: the ``adasum-aml`` command line (see :mod:`.cli`)."""

import sys

from adasum_lightning.aml.cli import main

sys.exit(main())
