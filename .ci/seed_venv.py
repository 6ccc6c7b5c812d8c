"""Seed a new venv with hard links of torch's installed files, so that it costs no disk space of its own.

    python .ci/seed_venv.py DEST_VENV [DIST ...]      (default DIST: torch torchvision)

Run with the interpreter of the environment that already holds them (``.venv/bin/python``). Each DIST and
the heavy distributions it requires (torch, torchvision, triton, ``nvidia-*``, ``cuda-*``: about 5.5 GB of
CUDA libraries on x86_64) are linked file by file, RECORD and all (and the byte code of its modules where
compiled), into DEST_VENV's site-packages, so pip there sees them installed at the pinned versions and
installs only the rest (sympy, numpy, ...) from the registry, as it would for a user. This is what uv's
``--link-mode=hardlink`` does from its cache; pip has no such mode. Console scripts are rewritten for
DEST_VENV's python. A file on another file system is copied.

Used by ``.ci/compat.sh`` and ``tests/test_wheel.py``, whose environments would otherwise each hold a full
copy of torch.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HEAVY = re.compile(r"^(torch|torchvision|triton|nvidia-.*|cuda-.*)$")


def heavy_closure(names: list[str]) -> list[metadata.Distribution]:
    """The installed distributions ``names`` and, transitively, the heavy ones they require (markers and
    extras evaluated for this interpreter). Raises ``PackageNotFoundError`` for one that is not installed."""
    todo = [(canonicalize_name(n), frozenset()) for n in names]
    seen: dict[str, metadata.Distribution] = {}
    done: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in done:
            continue
        done.add((name, extras))
        dist = seen.setdefault(name, metadata.distribution(name))
        for line in dist.requires or []:
            req = Requirement(line)
            environments = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(env) for env in environments):
                continue
            dep = canonicalize_name(req.name)
            if HEAVY.match(dep):
                todo.append((dep, frozenset(req.extras)))
    return list(seen.values())


def link_distribution(dist: metadata.Distribution, site: Path, bin_dir: Path, python: str) -> int:
    """Link (or copy) every file of ``dist``'s RECORD under ``site``; scripts go to ``bin_dir`` with their
    ``#!`` line pointing at ``python``. Returns the number of files."""
    source_site = Path(dist.locate_file(""))
    count = 0
    for entry in dist.files or []:
        source = Path(dist.locate_file(entry)).resolve()
        if not source.is_file():
            continue  # a RECORD line for a file pip did not write (e.g. a .pyc never compiled)
        if source.is_relative_to(source_site.resolve()):
            target = site / source.relative_to(source_site.resolve())
        else:  # ../../../bin/torchrun
            target = bin_dir / source.name
        target.parent.mkdir(parents=True, exist_ok=True)
        head = source.read_bytes()[:2] if target.parent == bin_dir else b""
        if head == b"#!":
            lines = source.read_text().splitlines(keepends=True)
            target.unlink(missing_ok=True)  # never write through a link to the source
            target.write_text(f"#!{python}\n" + "".join(lines[1:]))
            target.chmod(0o755)
        else:
            _link(source, target)
            # the source's byte code too (make setup compiles it): valid here, the mtime is the same
            cached = source.parent / "__pycache__" / f"{source.stem}.{sys.implementation.cache_tag}.pyc"
            if source.suffix == ".py" and cached.is_file():
                (target.parent / "__pycache__").mkdir(exist_ok=True)
                _link(cached, target.parent / "__pycache__" / cached.name)
        count += 1
    return count


def _link(source: Path, target: Path) -> None:
    if target.exists():
        target.unlink()
    try:
        os.link(source, target)
    except OSError:  # another file system
        shutil.copy2(source, target)


def main(argv: list[str]) -> None:
    dest = Path(argv[0]).absolute()
    names = argv[1:] or ["torch", "torchvision"]
    python = str(dest / "bin" / "python")
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
    )  # fmt: skip
    dists = heavy_closure(names)
    files = sum(link_distribution(d, site, dest / "bin", python) for d in dists)
    listed = ", ".join(sorted(f"{d.metadata['Name']} {d.version}" for d in dists))
    print(f"[seed_venv] {files} files of {len(dists)} distributions linked into {dest}: {listed}")


if __name__ == "__main__":
    main(sys.argv[1:])
