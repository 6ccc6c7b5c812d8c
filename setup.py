"""Metadata is in setup.cfg; this file adds two folders of the repository to the package as data, and keeps
setuptools' build folders out of the checkout.

``examples/`` becomes ``adasum_lightning.aml.example`` and ``patches/``
``adasum_lightning.aml.horovod_build``, so that ``adasum-aml`` finds the bundled MNIST example and the
Horovod build script and patch in a wheel install as in a checkout (setup.cfg cannot map folders outside
the package).
"""

import atexit
import shutil
import tempfile

from setuptools import find_packages, setup

BUNDLED = {"adasum_lightning.aml.example": "examples", "adasum_lightning.aml.horovod_build": "patches"}
#: setuptools' build/ and *.egg-info/ go to a scratch folder, not into the checkout (which may be read-only).
SCRATCH = tempfile.mkdtemp(prefix="adasum-lightning-build-")
atexit.register(shutil.rmtree, SCRATCH, ignore_errors=True)

setup(
    options={"build": {"build_base": SCRATCH}, "egg_info": {"egg_base": SCRATCH}},
    packages=[*find_packages(include=["adasum_lightning", "adasum_lightning.*"]), *BUNDLED],
    package_dir=BUNDLED,
    package_data={
        "adasum_lightning": ["constraints.txt"],
        "adasum_lightning.aml": ["Dockerfile.in", "Dockerfile.ddp.in"],
        "adasum_lightning.aml.example": ["mnist.yaml"],
        "adasum_lightning.aml.horovod_build": ["*.sh", "*.patch"],
    },
)
