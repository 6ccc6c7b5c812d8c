"""The user's project as an Azure ML job sees it: entry script, code snapshot, requirements and data.

Every check raises :class:`.errors.AmlUsageError` naming the fix, before any SDK object exists. The code
snapshot is the source directory minus what its ``.amlignore`` (else ``.gitignore``) excludes, as Azure ML
uploads it. ``--input``/``--output NAME=URI`` become ``uri_folder``/``uri_file`` bindings that the script's
arguments name as ``${{inputs.NAME}}``/``${{outputs.NAME}}`` (SDK v2 binds them; :func:`bind_placeholders`
does for SDK v1 and ``--local``).
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
    given = Path(script).expanduser()
    path = (given if given.is_absolute() else source / given).resolve()
    try:
        relative = path.relative_to(source)
    except ValueError:
        raise AmlUsageError(
            f"the script {script} is outside the source directory {source}: Azure ML uploads only the source "
            "directory. Pass --source-dir with a folder that contains it, and SCRIPT relative to that folder"
        ) from None
    if path.is_dir():
        raise AmlUsageError(
            f"the script {relative.as_posix()} is a directory: pass the training script inside it"
        )
    if not path.is_file():
        raise AmlUsageError(
            f"the script {relative.as_posix()} does not exist in the source directory {source}: pass SCRIPT "
            "relative to --source-dir (default: the current directory)"
        )
    try:
        path.read_bytes()
    except OSError as err:
        raise AmlUsageError(
            f"the script {path} cannot be read ({err.strerror}): fix its permissions"
        ) from None
    return source, relative.as_posix()


def ignore_spec(source_dir: Path):
    """The ``pathspec.PathSpec`` of what Azure ML leaves out of ``source_dir``, and its ignore file."""
    import pathspec

    lines = list(ALWAYS_IGNORED)
    used = None
    for name in IGNORE_FILES:
        candidate = source_dir / name
        if candidate.is_file():
            lines += candidate.read_text(encoding="utf-8", errors="replace").splitlines()
            used = candidate
            break
    return pathspec.PathSpec.from_lines("gitwildmatch", lines), used


def snapshot_files(source_dir: Path) -> list[str]:
    """The files (POSIX paths relative to ``source_dir``, sorted) that the job's code snapshot holds."""
    spec, _ = ignore_spec(source_dir)
    files = []
    for path in sorted(source_dir.rglob("*")):
        relative = path.relative_to(source_dir).as_posix()
        if path.is_dir():
            continue
        if not spec.match_file(relative):
            files.append(relative)
    return files


def copy_snapshot(source_dir: Path, dest: Path, script: str) -> list[str]:
    """Copy the snapshot of ``source_dir`` into ``dest`` (created); returns the copied files.

    Raises:
        AmlUsageError: the ignore file excludes the entry script itself (the job could not start).
    """
    files = snapshot_files(source_dir)
    if script not in files:
        _, used = ignore_spec(source_dir)
        raise AmlUsageError(
            f"{used or 'the ignore rules'} excludes the entry script {script}, so Azure ML would not upload "
            f"it: add the line !{script} to {used.name if used else '.amlignore'}"
        )
    for relative in files:
        target = dest / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source_dir / relative, target)
    return files


@dataclass(frozen=True)
class ScriptFacts:
    """What the entry script's own code shows (its syntax tree; comments and strings do not count).

    Attributes:
        lightning_cli: it imports or calls ``LightningCLI`` (under any alias), so it takes ``--trainer.*``.
        imports_adasum: it imports ``adasum_lightning``, which registers the strategy names.
    """

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
        elif isinstance(node, ast.Attribute) and node.attr == "LightningCLI":
            cli = True
        elif isinstance(node, ast.Name) and node.id == "LightningCLI":
            cli = True
    return ScriptFacts(cli, adasum)


# -- the project's own pip requirements ---------------------------------------------------------------
def read_requirements(
    path: str | Path, pins: Mapping[str, str], dependencies: Mapping[str, Sequence] = MappingProxyType({})
) -> tuple[str, ...]:
    """The requirement lines of the user's ``--requirements FILE`` (comments and blank lines dropped).

    Args:
        path: a pip requirements file.
        pins: ``{"torch": "2.14.1", ...}``, the image's pins; a requirement that excludes one is refused here
            instead of failing the image build.
        dependencies: adasum-lightning's own requirements (:func:`.staging.image_dependencies`); an exact pin
            (``NAME==V``) outside them is refused.

    Raises:
        AmlUsageError: a missing or unreadable file; a line that is not a requirement specifier (pip options,
            ``-r``/``-e``, local paths); a conflict with ``pins``.
    """
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise AmlUsageError(
            f"--requirements {path}: no such file; pass your project's requirements.txt"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise AmlUsageError(f"--requirements {path} cannot be read ({err}): fix the file") from None
    lines = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:
            raise AmlUsageError(
                f"--requirements {path}, line {number}: {line!r} is not a requirement the image can install "
                "(pip options, -r/-e and local paths are not part of the image's build context): write "
                "NAME, NAME==VERSION or NAME @ https://…"
            ) from None
        pinned = pins.get(req.name.lower())
        if pinned is not None and req.specifier and not req.specifier.contains(pinned, prereleases=True):
            raise AmlUsageError(
                f"--requirements {path}, line {number}: {line} excludes {req.name}=={pinned}, the version "
                f"the image pins (adasum_lightning/constraints.txt): drop the line or allow {pinned}"
            )
        if req.name.lower().replace("_", "-") == "adasum-lightning":
            raise AmlUsageError(
                f"--requirements {path}, line {number}: the image installs the adasum-lightning that submits "
                "the job (built from this installation): drop the line"
            )
        exact = [spec.version for spec in req.specifier if spec.operator == "=="]
        for allowed in dependencies.get(req.name.lower(), ()):
            if exact and not allowed.contains(exact[0], prereleases=True):
                raise AmlUsageError(
                    f"--requirements {path}, line {number}: {line} conflicts with adasum-lightning's own "
                    f"requirement {req.name}{allowed}: drop the line or pin a version within it"
                )
        lines.append(line)
    return tuple(lines)


# -- data in and out ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class DataBinding:
    """One ``--input`` or ``--output`` of the job.

    Attributes:
        name: the binding's name (``${{inputs.NAME}}``): letters, digits and ``_``.
        uri: ``azureml://datastores/<ds>/paths/<p>``, ``azureml:<asset>:<version>`` or ``https://`` (inputs
            only), or a local folder for ``--local``.
        direction: ``"inputs"`` or ``"outputs"``.
        type: ``"uri_folder"`` (default) or ``"uri_file"``.
        mode: inputs ``"ro_mount"`` (default) or ``"download"``; outputs ``"rw_mount"`` (default) or
            ``"upload"``.
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
    modes = {"inputs": _pairs(input_modes, "--input-mode"), "outputs": _pairs(output_modes, "--output-mode")}
    kinds = _pairs(types, "--input-type")
    both = set(given["inputs"]) & set(given["outputs"])
    if both:
        raise AmlUsageError(f"{', '.join(sorted(both))} is both an --input and an --output: rename one")
    for direction, allowed in (("inputs", INPUT_MODES), ("outputs", OUTPUT_MODES)):
        option = "--input" if direction == "inputs" else "--output"
        for name, mode in modes[direction].items():
            if name not in given[direction]:
                raise AmlUsageError(f"{option}-mode {name}={mode}: there is no {option} {name}=URI")
            if mode not in allowed:
                raise AmlUsageError(f"{option}-mode {name}={mode}: use one of {', '.join(allowed)}")
    for name, kind in kinds.items():
        if name not in given["inputs"]:
            raise AmlUsageError(f"--input-type {name}={kind}: there is no --input {name}=URI")
        if kind not in DATA_TYPES:
            raise AmlUsageError(f"--input-type {name}={kind}: use uri_folder or uri_file")
    bindings = []
    for direction, allowed in (("inputs", INPUT_MODES), ("outputs", OUTPUT_MODES)):
        for name, uri in given[direction].items():
            binding = DataBinding(
                name,
                uri,
                direction,
                kinds.get(name, "uri_folder"),
                modes[direction].get(name, allowed[0]),
            )
            _check_uri(binding, local)
            bindings.append(binding)
    return tuple(bindings)


def _check_uri(binding: DataBinding, local: bool) -> None:
    option = "--input" if binding.direction == "inputs" else "--output"
    uri = binding.uri
    if local:
        if binding.is_remote or "://" in uri or uri.startswith("azureml:"):
            raise AmlUsageError(
                f"{option} {binding.name}={uri}: --local reads and writes local folders; pass {option} "
                f"{binding.name}=PATH (e.g. a downloaded copy of the data)"
            )
        if binding.direction == "inputs" and not Path(uri).expanduser().exists():
            raise AmlUsageError(
                f"--input {binding.name}={uri}: no such file or folder (a relative path is taken from the "
                "current directory, not from --source-dir)"
            )
        return
    if binding.direction == "outputs" and not binding.datastore_path:
        raise AmlUsageError(
            f"--output {binding.name}={uri}: outputs are written to a datastore: pass --output "
            f"{binding.name}=azureml://datastores/<datastore>/paths/<folder>"
        )
    if binding.is_remote:
        if re.search(r"[?&](sig|sv|se)=", uri):
            raise AmlUsageError(
                f"{option} {binding.name}: the URL carries a SAS token, which would be shown in the job's "
                "definition: register the storage as a datastore and pass "
                "azureml://datastores/<datastore>/paths/<path>"
            )
        return
    if uri.startswith(("azureml:", "azureml://")):
        raise AmlUsageError(
            f"{option} {binding.name}={uri} is not an Azure ML URI this launcher reads: use "
            "azureml://datastores/<datastore>/paths/<path> or azureml:<data asset>:<version> (or @latest)"
        )
    if "://" in uri:
        raise AmlUsageError(f"--input {binding.name}={uri}: only https:// URLs are read; use https")
    raise AmlUsageError(
        f"--input {binding.name}={uri} is a local path, which the cluster cannot read and this launcher does "
        "not upload: register it once (`az ml data create --name NAME --version 1 --type uri_folder --path "
        f"{uri}`) and pass --input {binding.name}=azureml:NAME:1, or use --local"
    )


def check_placeholders(args: Sequence[str], bindings: Sequence[DataBinding]) -> None:
    """Refuse ``${{inputs.X}}`` / ``${{outputs.X}}`` in ``args`` that no binding defines.

    Raises:
        AmlUsageError: names the missing ``--input``/``--output``.
    """
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
