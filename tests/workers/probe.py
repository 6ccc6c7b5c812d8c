"""Worker: what the case runner records for a case that ends well, raises, or hangs (``tests/test_cases.py``).

usage: python -m tests.workers.probe OUT {ok,raise,hang}
"""

import time
from pathlib import Path

import torch

from tests.workers import cases

out, mode = Path(cases.argv()[0]), cases.argv()[1]
if mode == "raise":
    raise ValueError("refused, as a strategy refuses")
if mode == "hang":
    time.sleep(600)  # a collective that never returns
torch.save({"mode": mode, "rank": cases.rank()}, out / f"rank{cases.rank()}.pt")
