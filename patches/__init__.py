"""The Horovod build script and patch, shipped inside the wheel as ``adasum_lightning.aml.horovod_build``
(setup.py maps this folder), so that ``adasum-aml`` builds the job image from a pip install."""
