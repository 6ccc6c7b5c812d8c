"""The user's project as an Azure ML job sees it: entry script, code snapshot, requirements and data.

Every check raises :class:`.errors.AmlUsageError` naming the fix, before any SDK object exists. The script's
arguments name the data as ``${{inputs.NAME}}``/``${{outputs.NAME}}``: SDK v2 binds them,
:func:`bind_placeholders` does for SDK v1 and ``--local``.
"""

from __future__ import annotations

import ast
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from packaging.requirements import InvalidRequirement, Requirement

from adasum_lightning.aml.errors import AmlUsageError

#: Files Azure ML reads for what not to upload, in order of precedence (only the first found is used).
IGNORE_FILES = (".amlignore", ".gitignore")
#: Always left out of the snapshot (as Azure ML does for ``.git``; caches are never code).
ALWAYS_IGNORED = (".git/", "__pycache__/", "*.pyc", ".ipynb_checkpoints/")

INPUT_MODES = ("ro_mount", "download")
OUTPUT_MODES = ("rw_mount", "upload")
DATA_TYPES = ("uri_folder", "uri_file")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,254}$")
_DATASTORE_RE = re.compile(
    r"^azureml://(subscriptions/[^/]+/resource[gG]roups/[^/]+/workspaces/[^/]+/)?"
    r"datastores/(?P<datastore>[A-Za-z0-9_]+)/paths/(?P<path>[^?#]*)$"
)
_ASSET_RE = re.compile(
    r"^azureml:(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]*)(:(?P<version>[A-Za-z0-9_.-]+)|@latest)$"
)
_PLACEHOLDER_RE = re.compile(r"\$\{\{\s*(?P<kind>inputs|outputs)\.(?P<name>[A-Za-z0-9_]+)\s*\}\}")


# -- the entry script and the code snapshot -----------------------------------------------------------
def check_script(source_dir: str | Path, script: str) -> tuple[Path, str]:
    """``(source directory, script path relative to it, POSIX form)`` for ``adasum-aml submit SCRIPT``.

    Raises:
        AmlUsageError: the source directory is missing, not a directory or empty; the script is missing, not a
            file, unreadable, or outside the source directory (the job runs it from the snapshot's root).
    """
    source = Path(source_dir).expanduser()
    if not source.is_dir():
        raise AmlUsageError(f"--source-dir {source_dir}: no such directory; pass the folder of your project")
    source = source.resolve()
    if not any(source.iterdir()):
        raise AmlUsageError(
            f"--source-dir {source} is empty: pass the folder that holds your training script"
        )
    path = (source / Path(script).expanduser()).resolve()  # an absolute SCRIPT stays as it is
    if not path.is_relative_to(source):
        raise AmlUsageError(
            f"the script {script} is outside the source directory {source}: Azure ML uploads only the source "
            "directory. Pass --source-dir with a folder that contains it, and SCRIPT relative to that folder"
        )
    relative = path.relative_to(source).as_posix()
    if path.is_dir():
        raise AmlUsageError(f"the script {relative} is a directory: pass the training script inside it")
    if not path.is_file():
        raise AmlUsageError(
            f"the script {relative} does not exist in the source directory {source}: pass SCRIPT relative to "
            "--source-dir (default: the current directory)"
        )
    try:
        path.read_bytes()
    except OSError as err:
        raise AmlUsageError(
            f"the script {path} cannot be read ({err.strerror}): fix its permissions"
        ) from None
    return source, relative


def copy_snapshot(source_dir: Path, dest: Path, script: str) -> list[str]:
    """Copy into ``dest`` what Azure ML uploads of ``source_dir``: its files minus what the first of
    :data:`IGNORE_FILES` excludes (and :data:`ALWAYS_IGNORED`); returns them (sorted POSIX paths).

    Raises:
        AmlUsageError: the ignore file excludes the entry script itself (the job could not start).
    """
    import pathspec

    used = next((source_dir / name for name in IGNORE_FILES if (source_dir / name).is_file()), None)
    lines = [
        *ALWAYS_IGNORED,
        *(used.read_text(encoding="utf-8", errors="replace").splitlines() if used else []),
    ]
    spec = pathspec.PathSpec.from_lines("gitwildmatch", lines)
    paths = (
        path.relative_to(source_dir).as_posix() for path in sorted(source_dir.rglob("*")) if not path.is_dir()
    )
    files = [path for path in paths if not spec.match_file(path)]
    if script not in files:
        raise AmlUsageError(
            f"{used or 'the ignore rules'} excludes the entry script {script}, so Azure ML would not upload "
            f"it: add the line !{script} to {used.name if used else '.amlignore'}"
        )
    for relative in files:
        (dest / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source_dir / relative, dest / relative)
    return files


@dataclass(frozen=True)
class ScriptFacts:
    """What the entry script's own code shows (its syntax tree; comments and strings do not count): it uses
    ``LightningCLI`` (under any alias: it takes ``--trainer.*``), it imports ``adasum_lightning`` (which
    registers the strategy names)."""

    lightning_cli: bool
    imports_adasum: bool


def script_facts(script_path: Path) -> ScriptFacts:
    """:class:`ScriptFacts` of the entry script.

    Raises:
        AmlUsageError: the script is not a ``.py`` file or not valid Python (the job runs ``python SCRIPT``).
    """
    if script_path.suffix != ".py":
        raise AmlUsageError(
            f"the script {script_path.name} is not a Python file: the job runs `python SCRIPT`; pass your "
            "training script (.py)"
        )
    try:
        tree = ast.parse(script_path.read_text(encoding="utf-8", errors="replace"), filename=str(script_path))
    except SyntaxError as err:
        raise AmlUsageError(
            f"the script {script_path.name} is not valid Python (line {err.lineno}: {err.msg}): fix it "
            "before submitting"
        ) from None
    cli = adasum = False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            cli |= any(alias.name == "LightningCLI" for alias in node.names)
            adasum |= (node.module or "").split(".")[0] == "adasum_lightning"
        elif isinstance(node, ast.Import):
            adasum |= any(alias.name.split(".")[0] == "adasum_lightning" for alias in node.names)
        cli |= (
            getattr(node, "attr", getattr(node, "id", None)) == "LightningCLI"
        )  # pl.cli.LightningCLI or LightningCLI
    return ScriptFacts(cli, adasum)


# -- the project's own pip requirements ---------------------------------------------------------------
def read_requirements(
    path: str | Path, pins: Mapping[str, str], dependencies: Mapping[str, Sequence] = MappingProxyType({})
) -> tuple[str, ...]:
    """The requirement lines of the user's ``--requirements FILE`` (comments and blank lines dropped).

    Args:
        pins: ``{"torch": "2.14.1", ...}``, the image's pins; a requirement that excludes one is refused here
            instead of failing the image build.
        dependencies: adasum-lightning's own requirements (:func:`.staging.image_dependencies`); an exact pin
            (``NAME==V``) outside them is refused.

    Raises:
        AmlUsageError: a missing or unreadable file; a line that is not a requirement specifier (pip
            options, ``-r``/``-e``, local paths); adasum-lightning itself; a conflict with ``pins`` or
            ``dependencies``.
    """
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except FileNotFoundError:
        raise AmlUsageError(
            f"--requirements {path}: no such file; pass your project's requirements.txt"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise AmlUsageError(f"--requirements {path} cannot be read ({err}): fix the file") from None
    lines = [(n, raw.split(" #", 1)[0].strip()) for n, raw in enumerate(text.splitlines(), start=1)]
    for number, line in lines:
        where = f"--requirements {path}, line {number}"
        if not line or line.startswith("#"):
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:
            raise AmlUsageError(
                f"{where}: {line!r} is not a requirement the image can install (pip options, -r/-e and local "
                "paths are not part of the image's build context): write NAME, NAME==VERSION or NAME @ "
                "https://…"
            ) from None
        name, exact = req.name.lower(), [spec.version for spec in req.specifier if spec.operator == "=="]
        pinned = pins.get(name)
        if pinned is not None and req.specifier and not req.specifier.contains(pinned, prereleases=True):
            raise AmlUsageError(
                f"{where}: {line} excludes {req.name}=={pinned}, the version the image pins "
                f"(adasum_lightning/constraints.txt): drop the line or allow {pinned}"
            )
        if name.replace("_", "-") == "adasum-lightning":
            raise AmlUsageError(
                f"{where}: the image installs the adasum-lightning that submits the job (built from this "
                "installation): drop the line"
            )
        for allowed in dependencies.get(name, ()) if exact else ():
            if not allowed.contains(exact[0], prereleases=True):
                raise AmlUsageError(
                    f"{where}: {line} conflicts with adasum-lightning's own requirement {req.name}{allowed}: "
                    "drop the line or pin a version within it"
                )
    return tuple(line for _, line in lines if line and not line.startswith("#"))


# -- data in and out ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class DataBinding:
    """One ``--input`` or ``--output`` of the job: ``${{<direction>.<name>}}`` in the script's arguments, its
    ``uri`` (``azureml://datastores/<ds>/paths/<p>``, ``azureml:<asset>:<version>``, ``https://…`` or, for
    ``--local``, a local path), one of :data:`DATA_TYPES` and one of :data:`INPUT_MODES`/:data:`OUTPUT_MODES`.
    """

    name: str
    uri: str
    direction: str
    type: str = "uri_folder"
    mode: str = ""

    @property
    def datastore_path(self) -> tuple[str, str] | None:
        """``(datastore, path)`` of an ``azureml://datastores/…`` URI, else ``None``."""
        match = _DATASTORE_RE.match(self.uri)
        return (match["datastore"], match["path"]) if match else None

    @property
    def asset(self) -> tuple[str, str | None] | None:
        """``(name, version or None for @latest)`` of an ``azureml:<asset>`` reference, else ``None``."""
        match = _ASSET_RE.match(self.uri)
        return (match["name"], match["version"]) if match else None

    @property
    def is_remote(self) -> bool:
        return bool(self.datastore_path or self.asset or self.uri.startswith("https://"))

    @property
    def option(self) -> str:
        return "--input" if self.direction == "inputs" else "--output"


def _pairs(values: Iterable[str], option: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for text in values:
        name, sep, value = text.partition("=")
        if not sep or not _NAME_RE.match(name) or not value:
            raise AmlUsageError(
                f"{option} {text!r}: expected NAME=VALUE with a NAME of letters, digits and '_' (e.g. "
                f"{option} data=azureml://datastores/workspaceblobstore/paths/mnist)"
            )
        if name in pairs:
            raise AmlUsageError(f"{option} {name} is given twice: keep one")
        pairs[name] = value
    return pairs


def parse_bindings(
    inputs: Sequence[str] = (),
    outputs: Sequence[str] = (),
    input_modes: Sequence[str] = (),
    output_modes: Sequence[str] = (),
    types: Sequence[str] = (),
    *,
    local: bool = False,
) -> tuple[DataBinding, ...]:
    """The job's data bindings from the CLI's ``--input``/``--output``/``--*-mode``/``--input-type`` values.

    Args:
        local: for ``--local``: inputs and outputs are local folders (or files); remote URIs are refused.

    Raises:
        AmlUsageError: a malformed pair, an unknown URI form, mode or type, a mode or type for a name without
            a binding, a local path for a cluster job or a remote URI for ``--local``.
    """
    given = {"inputs": _pairs(inputs, "--input"), "outputs": _pairs(outputs, "--output")}
    both = set(given["inputs"]) & set(given["outputs"])
    if both:
        raise AmlUsageError(f"{', '.join(sorted(both))} is both an --input and an --output: rename one")
    settings = (
        ("inputs", "--input-mode", input_modes, INPUT_MODES),
        ("outputs", "--output-mode", output_modes, OUTPUT_MODES),
        ("inputs", "--input-type", types, DATA_TYPES),
    )
    chosen = []
    for direction, option, values, allowed in settings:
        chosen.append(_pairs(values, option))
        for name, value in chosen[-1].items():
            if name not in given[direction]:
                raise AmlUsageError(f"{option} {name}={value}: there is no {option[:-5]} {name}=URI")
            if value not in allowed:
                raise AmlUsageError(f"{option} {name}={value}: use one of {', '.join(allowed)}")
    modes, kinds = {"inputs": chosen[0], "outputs": chosen[1]}, chosen[2]
    bindings = []
    for direction, allowed in (("inputs", INPUT_MODES), ("outputs", OUTPUT_MODES)):
        for name, uri in given[direction].items():
            mode = modes[direction].get(name, allowed[0])
            bindings.append(DataBinding(name, uri, direction, kinds.get(name, "uri_folder"), mode))
            _check_uri(bindings[-1], local)
    return tuple(bindings)


def _check_uri(binding: DataBinding, local: bool) -> None:
    option, name, uri = binding.option, binding.name, binding.uri
    if local:
        if binding.is_remote or "://" in uri or uri.startswith("azureml:"):
            raise AmlUsageError(
                f"{option} {name}={uri}: --local reads and writes local folders; pass {option} {name}=PATH "
                "(e.g. a downloaded copy of the data)"
            )
        if binding.direction == "inputs" and not Path(uri).expanduser().exists():
            raise AmlUsageError(
                f"--input {name}={uri}: no such file or folder (a relative path is taken from the current "
                "directory, not from --source-dir)"
            )
        return
    if binding.direction == "outputs" and not binding.datastore_path:
        raise AmlUsageError(
            f"--output {name}={uri}: outputs are written to a datastore: pass --output "
            f"{name}=azureml://datastores/<datastore>/paths/<folder>"
        )
    if binding.is_remote and re.search(r"[?&](sig|sv|se)=", uri):
        raise AmlUsageError(
            f"{option} {name}: the URL carries a SAS token, which would be shown in the job's definition: "
            "register the storage as a datastore and pass azureml://datastores/<datastore>/paths/<path>"
        )
    if binding.is_remote:
        return
    if uri.startswith(("azureml:", "azureml://")):
        raise AmlUsageError(
            f"{option} {name}={uri} is not an Azure ML URI this launcher reads: use "
            "azureml://datastores/<datastore>/paths/<path> or azureml:<data asset>:<version> (or @latest)"
        )
    if "://" in uri:
        raise AmlUsageError(f"--input {name}={uri}: only https:// URLs are read; use https")
    raise AmlUsageError(
        f"--input {name}={uri} is a local path, which the cluster cannot read and this launcher does not "
        "upload: register it once (`az ml data create --name NAME --version 1 --type uri_folder --path "
        f"{uri}`) and pass --input {name}=azureml:NAME:1, or use --local"
    )


def check_placeholders(args: Sequence[str], bindings: Sequence[DataBinding]) -> None:
    """Refuse ``${{inputs.X}}`` / ``${{outputs.X}}`` in ``args`` that no binding defines (names the missing
    ``--input``/``--output``), and single-brace ``${inputs.X}``."""
    known = {(b.direction, b.name) for b in bindings}
    for arg in args:
        loose = re.search(r"\$\{\s*(inputs|outputs)\.([A-Za-z0-9_]+)\s*\}(?!\})", arg)
        if loose and not _PLACEHOLDER_RE.search(arg):
            raise AmlUsageError(
                f"the script argument {arg!r} has {loose[0]}: Azure ML binds double braces, "
                "${{" + f"{loose[1]}.{loose[2]}" + "}}"
            )
        for match in _PLACEHOLDER_RE.finditer(arg):
            if (match["kind"], match["name"]) not in known:
                option = "--input" if match["kind"] == "inputs" else "--output"
                raise AmlUsageError(
                    f"the script argument {arg!r} refers to {match[0]}, but there is no {option} "
                    f"{match['name']}=URI: add it"
                )


def bind_placeholders(args: Sequence[str], paths: Mapping[tuple[str, str], str]) -> list[str]:
    """``args`` with each ``${{inputs.X}}`` / ``${{outputs.X}}`` replaced by ``paths[(kind, X)]``."""
    return [_PLACEHOLDER_RE.sub(lambda m: paths[(m["kind"], m["name"])], arg) for arg in args]
