"""Run the MNIST example (``examples/mnist.py``) and record this process's peak RSS afterwards.

usage: python -m benchmarks.rss_example OUT_DIR <examples/mnist.py arguments>
(under horovodrun, or plainly with ``--trainer.devices=N --trainer.strategy=ddp_adasum``).
Each rank writes ``OUT_DIR/rss_rank<r>.json``: ``{"rank", "peak_rss_kb"}`` (``ru_maxrss``, KiB on Linux).
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

from adasum_lightning.launch_environment import detect_launcher, launcher_rank


def main() -> None:
    out = Path(sys.argv[1])
    from examples.mnist import main as example_main

    example_main(sys.argv[2:])
    seen = detect_launcher()
    # Lightning's launcher gives its children LOCAL_RANK (one node here); its first process has nothing set
    rank = launcher_rank() if seen and seen.horovod else int(os.environ.get("LOCAL_RANK") or 0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rss_rank{rank}.json").write_text(json.dumps({"rank": rank, "peak_rss_kb": peak}) + "\n")


if __name__ == "__main__":
    main()
