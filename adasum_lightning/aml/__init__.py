"""``adasum-aml``: Azure ML jobs that train the user's own Lightning project (its source folder) with Adasum.

:mod:`.job` (the SDK-independent :class:`AmlJob`), :mod:`.project` (script, snapshot, requirements, data),
:mod:`.workspace` (config file, network check), :mod:`.staging` (build context and snapshot), :mod:`.sdk_v1`
and :mod:`.sdk_v2` (the SDKs' objects, extras ``aml`` / ``aml-v2``), :mod:`.local` (``--local N``),
:mod:`.cli` (the command line), :mod:`.errors`. Importing this package imports no Azure SDK.
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
