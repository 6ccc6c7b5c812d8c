"""Worker: fits of ``benchmarks/slow_link.py`` (its variants, synthetic data); every rank's parameters after
each step go to ``OUT/<variant>/rank<r>.pt``.

usage: python -m tests.workers.slow_link OUT --variants NAME:SKIP:STEPS,... [--hidden H] --devices N
"""

from benchmarks import slow_link
from tests.workers import cases

out, *args = cases.argv()
slow_link.worker([out, "--trace", out, *args])
