"""Azure ML launcher for the MNIST example (``adasum-aml``, ``python -m adasum_lightning.aml``).

- :mod:`.job`: :class:`AmlJob`, the SDK-independent job description (validated on creation): an MPI job
  for ``horovod_adasum`` / ``horovod``, a PyTorch job for ``ddp_adasum``;
- :mod:`.workspace`: the workspace config file (``config_aml.json`` / ``config.json``), network check;
- :mod:`.staging`: the job's Docker build context and code snapshot;
- :mod:`.sdk_v1` (``azureml-core``, extra ``aml``) and :mod:`.sdk_v2` (``azure-ai-ml``, extra ``aml-v2``):
  real SDK objects, get-or-create AmlCompute, submit;
- :mod:`.local`: the job's command on this machine (under ``horovodrun``, or for ``ddp_adasum`` N processes
  with the variables an Azure ML PyTorch job sets);
- :mod:`.cli`: the command line.

Importing this package imports no Azure SDK.
"""

from adasum_lightning.aml.job import VM_SIZES, AmlJob, AmlSubmitError, AmlUsageError
from adasum_lightning.aml.workspace import WorkspaceConfig, load_workspace_config

__all__ = [
    "AmlJob",
    "AmlSubmitError",
    "AmlUsageError",
    "VM_SIZES",
    "WorkspaceConfig",
    "load_workspace_config",
]
