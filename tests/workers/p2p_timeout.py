"""Worker: a peer that never joins ``adasum_allreduce``; the waiting rank must give up within the timeout.

usage: torchrun --standalone --nproc-per-node 2 -m tests.workers.p2p_timeout OUT TIMEOUT_S
    A Gloo group. Rank 1 never calls ``adasum_allreduce`` (it sleeps TIMEOUT_S + 5 s, as a rank behind a
    lost link would stay silent); rank 0 calls it with ``timeout=TIMEOUT_S`` and writes ``OUT/rank0.json``:
    the seconds until the call returned or raised, and the error's type and message.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from adasum_lightning.allreduce import adasum_allreduce

out, seconds = Path(sys.argv[1]), float(sys.argv[2])
timeout = timedelta(seconds=seconds)
dist.init_process_group("gloo", timeout=timeout)
if dist.get_rank() == 1:
    time.sleep(seconds + 5)
else:
    start = time.monotonic()
    error = None
    try:
        adasum_allreduce([torch.ones(1000)], timeout=timeout)
    except RuntimeError as err:
        error = {"type": type(err).__name__, "message": str(err)[:500]}
    result = {"seconds": time.monotonic() - start, "error": error}
    (out / "rank0.json").write_text(json.dumps(result))
