"""Runs ``SCRIPT [ARGS]`` as ``__main__`` after ``import adasum_lightning``: what every process of
``adasum-fabric run`` runs (:mod:`adasum_lightning.fabric_command`).
"""

import os
import runpy
import sys

if __name__ == "__main__":
    script = sys.argv[1]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it (not this folder)
    sys.argv = sys.argv[1:]
    import adasum_lightning  # noqa: F401  (registers the strategies with each Fabric package on its import)

    runpy.run_path(script, run_name="__main__")
