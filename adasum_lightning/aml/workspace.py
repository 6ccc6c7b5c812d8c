"""Which Azure ML workspace to use (its config file), and the offline checks made before any SDK call.

The config file (``config_aml.json``, or Azure ML's ``config.json``) is a JSON object with
``subscription_id``, ``resource_group`` and ``workspace_name``, or a ``Scope`` (an ARM workspace id).
"""

from __future__ import annotations

import json
import os
import re
import socket
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from adasum_lightning.aml.errors import AmlSubmitError, AmlUsageError

#: Files tried, in order, when no ``--config`` is given.
DEFAULT_CONFIG_FILES = ("config_aml.json", "config.json", ".azureml/config.json")
REQUIRED_KEYS = ("subscription_id", "resource_group", "workspace_name")
_GUID_RE = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
_SCOPE_RE = re.compile(
    r"^/subscriptions/(?P<subscription_id>[^/]+)/resourceGroups/(?P<resource_group>[^/]+)"
    r"/providers/Microsoft\.MachineLearningServices/workspaces/(?P<workspace_name>[^/]+)/?$",
    re.I,
)
_EXAMPLE = '{"subscription_id": "<GUID>", "resource_group": "<group>", "workspace_name": "<workspace>"}'

#: Azure Resource Manager endpoint both SDKs talk to first.
ARM_HOST = "management.azure.com"


@dataclass(frozen=True)
class WorkspaceConfig:
    """An Azure ML workspace address and the file it was read from; credentials come from the Azure CLI login
    or the environment."""

    subscription_id: str
    resource_group: str
    workspace_name: str
    source: str = ""


def find_config_file(start: str | os.PathLike | None = None) -> Path:
    """The first of :data:`DEFAULT_CONFIG_FILES` present in ``start`` (default: the working directory)."""
    base = Path(start or os.getcwd())
    found = next((base / name for name in DEFAULT_CONFIG_FILES if (base / name).is_file()), None)
    if found is None:
        raise AmlUsageError(
            f"no workspace config file: none of {', '.join(DEFAULT_CONFIG_FILES)} in {base}. Download "
            "config.json from your workspace's overview page in Azure ML studio, or write config_aml.json as "
            f"{_EXAMPLE}, and pass it with --config PATH"
        )
    return found


def load_workspace_config(path: str | os.PathLike | None = None) -> WorkspaceConfig:
    """Read and validate a workspace config file (the module docstring gives the format); ``None`` searches
    :data:`DEFAULT_CONFIG_FILES` in the working directory. Each :class:`.errors.AmlUsageError` names the file
    and the fix."""
    file = Path(path) if path is not None else find_config_file()
    where = f"workspace config file {file}"
    if file.is_dir():
        raise AmlUsageError(
            f"{where} is a directory, not a JSON file. Pass the file itself: --config "
            f"{file / 'config_aml.json'} (contents {_EXAMPLE})"
        )
    if not file.is_file():
        raise AmlUsageError(
            f"{where} does not exist. Create it as {_EXAMPLE} (or download config.json from Azure ML studio) "
            "and pass --config PATH"
        )
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise AmlUsageError(
            f"{where} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}). It must be a "
            f"JSON object like {_EXAMPLE}"
        ) from err
    except (OSError, UnicodeDecodeError) as err:
        raise AmlUsageError(f"cannot read {where}: {err}. Fix its permissions") from err
    if not isinstance(data, dict):
        raise AmlUsageError(f"{where} holds a JSON {type(data).__name__}, not an object like {_EXAMPLE}")
    if not all(k in data for k in REQUIRED_KEYS) and isinstance(data.get("Scope"), str):
        match = _SCOPE_RE.match(data["Scope"].strip())
        if not match:
            raise AmlUsageError(
                f"{where}: 'Scope' is not an Azure ML workspace id "
                "(/subscriptions/<GUID>/resourceGroups/<group>/"
                "providers/Microsoft.MachineLearningServices/workspaces/<name>). Fix it or use the three "
                f"keys {', '.join(REQUIRED_KEYS)}"
            )
        data = {**match.groupdict(), **{k: v for k, v in data.items() if k in REQUIRED_KEYS}}
    missing = [k for k in REQUIRED_KEYS if k not in data]
    if missing:
        raise AmlUsageError(
            f"{where} lacks {', '.join(repr(k) for k in missing)}. Add "
            f"{'it' if len(missing) == 1 else 'them'}: the file must look like {_EXAMPLE}"
        )
    for key, value in ((k, data[k]) for k in REQUIRED_KEYS):
        if not isinstance(value, str) or not value.strip():
            raise AmlUsageError(f"{where}: {key!r} must be a non-empty string, got {value!r}. Fix it")
    subscription_id, resource_group, workspace_name = (data[k].strip() for k in REQUIRED_KEYS)
    if not _GUID_RE.match(subscription_id):
        raise AmlUsageError(
            f"{where}: subscription_id {subscription_id!r} is not a GUID "
            "(xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx). Copy it from the Azure portal (Subscriptions) or `az "
            "account show --query id`"
        )
    return WorkspaceConfig(subscription_id, resource_group, workspace_name, str(file))


def check_network(host: str = ARM_HOST, port: int = 443, timeout: float = 5.0) -> None:
    """Fail fast when Azure cannot be reached, before any credential or SDK client is created: one TCP
    connection to ``host:port``, or to the ``HTTPS_PROXY`` / ``https_proxy`` when set.

    Raises:
        AmlSubmitError: no connection within ``timeout`` seconds (names what was tried, never proxy
            credentials).
    """
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy") or ""
    parsed = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    target, target_port, via = host, port, ""
    if proxy and parsed.hostname:
        target, target_port = parsed.hostname, parsed.port or 8080
        via = f" through the proxy {target}:{target_port}"
    try:
        socket.create_connection((target, target_port), timeout=timeout).close()
    except OSError as err:
        raise AmlSubmitError(
            f"cannot reach {host}:{port}{via} ({type(err).__name__}: {err}). Submitting needs network access "
            "to Azure: check the connection or proxy, or use --dry-run (offline) or --local N"
        ) from err


_SECRET_ENV = ("AZURE_CLIENT_SECRET", "AZURE_CLIENT_CERTIFICATE_PASSWORD", "AZURE_PASSWORD", "AZUREML_TOKEN")
_JWT_RE = re.compile(r"eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*")
_KEYVAL_RE = re.compile(r"(?i)((?:secret|password|token|sig|key)[\"']?\s*[=:]\s*[\"']?)[^\s\"'&,;]+")


def redact(text: str) -> str:
    """``text`` with credentials (secret variables, bearer tokens, ``secret=…`` values) as ``***``."""
    for value in (os.environ.get(name) or "" for name in _SECRET_ENV):
        text = text.replace(value, "***") if len(value) >= 4 else text
    return _KEYVAL_RE.sub(r"\1***", _JWT_RE.sub("***", text))


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message (its type's name when empty), credentials redacted."""
    return redact(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
