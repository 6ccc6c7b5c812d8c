"""``adasum-aml``: Azure ML jobs that train the user's own Lightning project (its source folder) with Adasum.

- :mod:`.job`: :class:`AmlJob`, the SDK-independent job, validated on creation: an MPI job for
  ``horovod_adasum`` / ``horovod``, a PyTorch job for ``ddp_adasum``;
- :mod:`.project`: the entry script, code snapshot, requirements and data bindings of the user's project;
- :mod:`.workspace`: the workspace config file and the network check;
- :mod:`.staging`: the job's Docker build context and code snapshot;
- :mod:`.sdk_v1` (``azureml-core``, extra ``aml``) and :mod:`.sdk_v2` (``azure-ai-ml``, extra ``aml-v2``):
  the SDK objects, get-or-create AmlCompute, submit;
- :mod:`.local`: the job's command on this machine (``--local N``);
- :mod:`.cli`: the command line; :mod:`.errors`: its two errors.

Importing this package imports no Azure SDK.
"""

from adasum_lightning.aml.errors import AmlSubmitError, AmlUsageError
from adasum_lightning.aml.job import VM_SIZES, AmlJob
from adasum_lightning.aml.workspace import WorkspaceConfig, load_workspace_config

__all__ = [
    "AmlJob",
    "AmlSubmitError",
    "AmlUsageError",
    "VM_SIZES",
    "WorkspaceConfig",
    "load_workspace_config",
]
