"""Submit the MNIST example to Azure ML in one command, as the seed's ``python submit.py`` did.

::

    python examples/submit.py                    # reads ./config_aml.json (or examples/config_aml.json)
    python examples/submit.py --dry-run --sdk v1 # any `adasum-aml submit` option works, see --help
    python examples/submit.py --strategy ddp_adasum   # a PyTorch job: Adasum on torch.distributed, no Horovod

``config_aml.json`` holds ``{"subscription_id": ..., "resource_group": ..., "workspace_name": ...}``
(Azure ML's ``config.json`` works too). The job: 8 nodes × 4 GPUs (Standard_NC64as_T4_v3), one MPI process
per GPU, ``examples/mnist.py`` with ``--trainer.strategy=horovod_adasum`` (``--strategy ddp_adasum``: one
process per GPU started by Azure ML, no MPI). Same as ``adasum-aml submit``.
"""

import sys
from pathlib import Path

from adasum_lightning.aml.cli import main


def with_default_config(args: list[str]) -> list[str]:
    """``args`` with ``--config config_aml.json`` added when absent and the file is in the working
    directory or beside this script (else ``adasum-aml`` searches its usual file names)."""
    if any(a == "--config" or a.startswith("--config=") for a in args):
        return args
    for candidate in (Path.cwd() / "config_aml.json", Path(__file__).resolve().with_name("config_aml.json")):
        if candidate.is_file():
            return ["--config", str(candidate), *args]
    return args


if __name__ == "__main__":
    sys.exit(main(["submit", *with_default_config(sys.argv[1:])]))
