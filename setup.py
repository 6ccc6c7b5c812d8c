"""Metadata is in setup.cfg; this file only adds two folders of the repository to the package as data.

``examples/`` becomes ``adasum_lightning.aml.example`` and ``patches/``
``adasum_lightning.aml.horovod_build``, so that ``adasum-aml`` finds the bundled MNIST example and the
Horovod build script and patch in a wheel install as in a checkout (setup.cfg cannot map folders outside
the package).
"""

from setuptools import find_packages, setup

BUNDLED = {"adasum_lightning.aml.example": "examples", "adasum_lightning.aml.horovod_build": "patches"}

setup(
    packages=[*find_packages(include=["adasum_lightning", "adasum_lightning.*"]), *BUNDLED],
    package_dir=BUNDLED,
    package_data={
        "adasum_lightning": ["constraints.txt"],
        "adasum_lightning.aml": ["Dockerfile.in", "Dockerfile.ddp.in"],
        "adasum_lightning.aml.example": ["mnist.yaml"],
        "adasum_lightning.aml.horovod_build": ["*.sh", "*.patch"],
    },
)
