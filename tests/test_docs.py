"""Every shell command shown in README.md and docs/*.md is one that a test runs.

Each fenced shell block (```bash, ```sh, ```shell, ```console) must follow a marker comment, on the last
non-blank line before the fence, that names what runs its commands:

    <!-- tested by tests/test_example.py::test_two_processes_reach_95_percent_in_three_epochs, .ci/run -->

A name is a test (``tests/FILE.py::test_name``, or ``tests/FILE.py::Class::test_name``) or a CI script or
Makefile (a path alone). For every command of the block (backslash continuations joined, comments removed;
variable assignments, ``export``, ``source`` and ``cd`` lines are set-up, not commands) this test checks
that each named test exists and that the code of at least one of them contains the command's key parts:
the program (or a helper named after it, e.g. ``run_torchrun``) and what it runs (the script's file name,
the module after ``-m``, the make target, the sub-command), and every ``--option`` the command passes, and
that the scripts and files the command names exist. A command no test runs therefore fails here, with the
page and line.
"""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
MARKER = re.compile(r"<!--\s*tested by:?\s*(?P<names>.+?)\s*-->")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<info>[^\s`]*)")
#: Pages whose blocks are still to get their markers (issue I rewrites them): a block there without a marker
#: is reported as an expected failure, one with a marker is checked as everywhere else.
AWAITING_MARKERS: set[str] = set()
#: Files whose functions a test calls by name and whose code counts as the test's (one level deep).
HELPER_MODULES = ["tests/helpers.py", "tests/twohosts.py", "tests/aml_support.py"]
#: Programs whose key may also appear as the helper or the module that runs them.
ALIASES = {
    "horovodrun": ("horovodrun", "run_horovod"),
    "adasum-horovodrun": ("adasum-horovodrun", "adasum_lightning.horovod.horovodrun", "horovodrun.main"),
    "adasum-aml": ("adasum-aml", "adasum_lightning.aml.cli", "cli.main"),
    "torchrun": ("torchrun", "run_torchrun"),
    "python": ("python", "sys.executable", "run_job", "run_lightning"),
    "python3": ("python", "sys.executable", "run_job", "run_lightning"),
}
LOOPS_TEST = "tests/test_example.py::test_the_plain_loop_and_the_fabric_example_train_mnist_alike"
SETUP_WORDS = {"export", "source", ".", "cd", "set", "unset"}
LAUNCHERS = {"torchrun", "horovodrun", "adasum-horovodrun", "mpirun", "mpiexec", "srun"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    marker: str | None
    commands: tuple[tuple[int, str], ...]  # (line, command)

    def where(self, line: int | None = None) -> str:
        return f"{self.page.relative_to(ROOT)}:{line or self.line}"


def shell_blocks(page: Path) -> list[Block]:
    """The fenced shell blocks of a Markdown page, with the marker before each."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, info, start = match["fence"], match["info"].lower(), i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence)), len(lines))
        if info in SHELL_LANGUAGES:
            previous = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            marker = MARKER.search(previous)
            body = [(n + 1, lines[n]) for n in range(start + 1, end)]
            blocks.append(Block(page, start + 1, marker["names"] if marker else None, tuple(commands(body))))
        i = end + 1
    return blocks


def commands(body: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The commands of a shell block: continuations joined, comments and set-up lines dropped."""
    out, pending, first = [], "", 0
    for number, text in body:
        text = text.rstrip()
        if text.startswith("$ "):  # a console prompt
            text = text[2:]
        if not pending:
            first = number
        else:
            text = text.lstrip()
        if text.endswith("\\"):
            pending += text[:-1].rstrip() + " "
            continue
        line, pending = pending + text, ""
        words = shlex.split(line, comments=True)
        if not words or words[0] in SETUP_WORDS or all(_assignment(w) for w in words):
            continue
        out.append((first, line))
    return out


def _assignment(word: str) -> bool:
    return re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", word) is not None


def key_parts(command: str) -> tuple[list[tuple[str, ...]], list[str]]:
    """(the key parts, each a tuple of accepted spellings; the repository files the command names)."""
    words = [w for w in shlex.split(command, comments=True)]
    while words and _assignment(words[0]):
        words.pop(0)
    files = [w for w in words if re.fullmatch(r"[\w./-]+\.(py|ya?ml|sh|cfg|toml)", w) and "/" in w]
    program = Path(words[0]).name
    keys: list[tuple[str, ...]] = [ALIASES.get(program, (program,))]
    rest = words[1:]
    if program in LAUNCHERS:  # what the launcher starts: python SCRIPT, SCRIPT, or -m MODULE
        scripts = [w for w in rest if w.endswith(".py")]
        modules = [rest[i + 1] for i, w in enumerate(rest[:-1]) if w == "-m"]
        if scripts or modules:
            keys.append((Path(scripts[0]).name,) if scripts else (modules[0],))
    elif program in ("python", "python3"):
        if rest[:1] == ["-m"]:
            keys.append((rest[1],))
        elif rest:
            keys.append((Path(rest[0]).name,))
    elif program == "pip":
        keys.append(("install",) if "install" in rest else (rest[0],))
        extras = [e for w in rest for e in re.findall(r"\[([\w,-]+)\]", w)]
        keys.extend((extra,) for spec in extras for extra in spec.split(","))
    else:  # make TARGET, adasum-aml submit, bash SCRIPT, ...
        positional = [w for w in rest if not w.startswith("-")]
        if positional:
            keys.append((Path(positional[0]).name,))
    return keys, files


@cache
def _module(path: str) -> tuple[str, ast.Module]:
    text = (ROOT / path).read_text(encoding="utf-8")
    return text, ast.parse(text)


def _functions(path: str) -> dict[str, ast.AST]:
    _, tree = _module(path)
    found: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            found[node.name] = node
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    found[f"{node.name}::{item.name}"] = item
    return found


def _source(path: str, node: ast.AST) -> str:
    text, _ = _module(path)
    lines = text.splitlines()
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return "\n".join(lines[start - 1 : node.end_lineno])


def code_of(name: str) -> str:
    """The code of a named test (with its decorators and the helpers it calls by name, three deep), or of a
    CI file.

    Raises:
        LookupError: the file or the test does not exist.
    """
    path, _, test = name.partition("::")
    if not (ROOT / path).is_file():
        raise LookupError(f"{path} does not exist")
    if not test:
        return (ROOT / path).read_text(encoding="utf-8")
    functions = _functions(path)
    if test not in functions:
        raise LookupError(f"{path} has no test {test}")
    helpers = {
        name: (module, helper)
        for module in [path, *HELPER_MODULES]
        if (ROOT / module).is_file()
        for name, helper in _functions(module).items()
    }
    code, seen, todo = [], {test}, [(path, functions[test])]
    for _ in range(4):  # the test, the helpers it calls, and theirs, two levels down
        calls = set()
        for module, node in todo:
            code.append(_source(module, node))
            calls |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            calls |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
        todo = [helpers[name] for name in sorted(calls - seen) if name in helpers]
        seen |= calls
    return "\n".join(code)


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in shell_blocks(page)]


def _block_id(block: Block) -> str:
    return block.where()


@pytest.mark.parametrize("block", all_blocks(), ids=_block_id)
def test_every_shell_command_is_run_by_a_named_test(block):
    if not block.marker and str(block.page.relative_to(ROOT)) in AWAITING_MARKERS:
        pytest.xfail(f"{block.where()}: markers to be added with the page's rewrite")
    assert block.marker, (
        f"{block.where()}: a shell block without a `<!-- tested by tests/FILE.py::test_name -->` line "
        "before it"
    )
    names = [name.strip() for name in block.marker.split(",") if name.strip()]
    codes = {}
    for name in names:
        try:
            codes[name] = code_of(name)
        except LookupError as err:
            pytest.fail(f"{block.where()}: the marker names {name}, but {err}")
    problems = []
    for line, command in block.commands:
        keys, files = key_parts(command)
        missing_files = [f for f in files if not (ROOT / f).exists()]
        if missing_files:
            problems.append(f"{block.where(line)}: `{command.strip()}` names missing files {missing_files}")
        options = [w.split("=")[0] for w in shlex.split(command, comments=True) if w.startswith("--")]
        if not any(
            all(any(k in code for k in key) for key in keys) and all(o in code for o in options)
            for code in codes.values()
        ):
            wanted = " and ".join(["/".join(key) for key in keys] + options)
            problems.append(
                f"{block.where(line)}: `{command.strip()}` — none of {names} contains {wanted}: name the "
                "test that runs this command, or show the command a test runs"
            )
    assert not problems, "\n".join(problems)


def test_the_extraction_sees_commands_and_markers():
    # The checker itself: a marker, continuations, comments, set-up lines and a console prompt.
    page = ROOT / "tests" / "docs_sample.md"
    text = (
        "text\n\n<!-- tested by tests/test_docs.py::test_make_targets_run_the_tested_commands -->\n"
        '```bash\nexport A=1\nMCA="--mca x 1"\n$ make demo   # a comment\n'
        "torchrun --standalone --nproc-per-node 2 \\\n    examples/mnist_plain.py --data-dir D\n```\n"
        "```python\nprint('not a shell block')\n```\n```sh\nadasum-aml submit --dry-run\n```\n"
    )
    try:
        page.write_text(text)
        first, second = shell_blocks(page)
    finally:
        page.unlink()
    assert first.marker == "tests/test_docs.py::test_make_targets_run_the_tested_commands"
    assert [c for _, c in first.commands] == [
        "make demo   # a comment",
        "torchrun --standalone --nproc-per-node 2 examples/mnist_plain.py --data-dir D",
    ]
    assert key_parts(first.commands[1][1]) == (
        [ALIASES["torchrun"], ("mnist_plain.py",)],
        ["examples/mnist_plain.py"],
    )
    assert key_parts("python examples/mnist.py fit --config examples/mnist.yaml")[1] == [
        "examples/mnist.py",
        "examples/mnist.yaml",
    ]
    assert key_parts("make demo") == ([("make",), ("demo",)], [])
    assert key_parts('pip install ".[lightning]"') == ([("pip",), ("install",), ("lightning",)], [])
    assert second.marker is None and key_parts(second.commands[0][1])[0][1] == ("submit",)


def test_an_untested_command_or_a_missing_test_fails():
    page = ROOT / "tests" / "docs_sample_untested.md"
    page.write_text(
        f"<!-- tested by {LOOPS_TEST} -->\n```bash\npython examples/mnist_fabric.py --devices 2\n"
        "adasum-horovodrun -np 2 -H localhost:2 python examples/mnist.py fit\n```\n"
        "<!-- tested by tests/test_example.py::test_nothing_of_that_name -->\n```bash\nmake demo\n```\n"
    )
    try:
        untested, missing = shell_blocks(page)
    finally:
        page.unlink()
    with pytest.raises(AssertionError, match=r"docs_sample_untested.md:4: `adasum-horovodrun .* none of"):
        test_every_shell_command_is_run_by_a_named_test(untested)
    with pytest.raises(pytest.fail.Exception, match="has no test test_nothing_of_that_name"):
        test_every_shell_command_is_run_by_a_named_test(missing)


def _make_dry_run(target: str) -> str:
    proc = subprocess.run(
        ["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_make_targets_run_the_tested_commands():
    # The README's `make demo` / `make demo-ddp` run the example's training that tests/test_example.py's
    # fit_example runs (horovod_adasum under adasum-horovodrun; ddp_adasum started by Lightning); `make
    # test` is pytest, `make docs` Sphinx with
    # warnings as errors; `make bench-quick` / `make bench` run the benchmark pipeline's entry point.
    demo = _make_dry_run("demo")
    assert "adasum-horovodrun -np 2 -H localhost:2" in demo
    assert "examples/mnist.py fit --config examples/mnist.yaml" in demo and "--data.data_dir=" in demo
    demo_ddp = _make_dry_run("demo-ddp")
    assert "examples/mnist.py fit --config examples/mnist.yaml --trainer.strategy=ddp_adasum" in demo_ddp
    assert "--trainer.devices=2" in demo_ddp
    assert "-m pytest" in _make_dry_run("test")
    assert "-m sphinx -b html -E -W --keep-going" in _make_dry_run("docs")
    assert "-m benchmarks --quick" in _make_dry_run("bench-quick")
    assert "-m benchmarks 2>&1" in _make_dry_run("bench")
    for target in ("lint", "test-compat", "setup"):
        _make_dry_run(target)
