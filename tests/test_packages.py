"""Both Lightning package names: every strategy by name and as an instance, with ``pytorch_lightning`` and
with ``lightning.pytorch``, in real multi-process runs; the import rules; LightningCLI."""

from __future__ import annotations

import configparser
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

from adasum_lightning import _namespaces
from tests.cases import Launch, case
from tests.helpers import ROOT, assert_ranks_identical, mpi_env
from tests.workers.lightning import PACKAGE

PACKAGES = ["pytorch_lightning", "lightning.pytorch"]
HAS_LIGHTNING = importlib.util.find_spec("lightning") is not None
needs_jsonargparse = pytest.mark.skipif(
    importlib.util.find_spec("jsonargparse") is None, reason="LightningCLI needs jsonargparse"
)
needs_lightning = pytest.mark.skipif(
    not HAS_LIGHTNING, reason="the unified `lightning` package is not installed"
)


def _package_param(package: str, *marks):
    return pytest.param(package, marks=[*marks, *[needs_lightning] * (package == "lightning.pytorch")])


def packages_fit(launcher: str, package: str, strategy: str, by: str):
    """A fit in a launch whose cases import ``package`` only (as a user's script would)."""
    return case(Launch(launcher, 2, group=package), f"packages-{package}-{strategy}-{by}", "packages",
                "--package", package, "--strategy", strategy, "--by", by)  # fmt: skip


def horovod_fit(package: str, strategy: str, by: str):
    return packages_fit("horovodrun", package, strategy, by)


def ddp_adasum_fit(package: str, by: str):
    return packages_fit("lightning", package, "ddp_adasum", by)


def copy_for(package: str) -> str:
    """This project's copy of the strategies for a Lightning package."""
    return "adasum_lightning.lightning" if package == "lightning.pytorch" else "adasum_lightning.trainer"


def module_for(package: str, name: str) -> str:
    """The module of the strategies ``name`` (``"ddp_adasum"``, ``"horovod"``) in the copy for ``package``."""
    if name == "horovod":
        mirror = "adasum_lightning.lightning." if package == "lightning.pytorch" else "adasum_lightning."
        return mirror + "horovod.trainer"
    return f"{copy_for(package)}.{name}"


def check_fit(ranks: list[dict], package: str, strategy_class: str, np: int = 2) -> None:
    module = module_for(package, "ddp_adasum" if strategy_class == "DDPAdasumStrategy" else "horovod")
    for res in ranks:
        assert res["world_size"] == np and res["global_step"] == 2 * 32 // 4 // np
        assert res["strategy_class"] == f"{module}.{strategy_class}"
        assert f"{package}.strategies.ddp.DDPStrategy" in res["strategy_base"]
        # the script imported one Lightning package, and so did adasum_lightning
        assert res["imported"] == [package.split(".")[0]]
        assert res["logged"] == pytest.approx(1.5)  # sync_dist mean of rank + 1 over 2 ranks
    assert_ranks_identical(ranks)


HOROVOD_CLASSES = {"horovod_adasum": "HorovodAdasumStrategy", "horovod": "HorovodStrategy"}


@pytest.mark.mpi
@pytest.mark.compat_oldest
@pytest.mark.parametrize(
    "package",
    [
        _package_param(
            p,
            pytest.mark.cases(
                *(horovod_fit(p, s, by) for s in HOROVOD_CLASSES for by in ("name", "instance"))
            ),
        )
        for p in PACKAGES
    ],
)
@pytest.mark.parametrize("by", ["name", "instance"])
@pytest.mark.parametrize("strategy", list(HOROVOD_CLASSES))
def test_horovod_strategies_with_each_package(package, by, strategy, cases):
    check_fit(cases[horovod_fit(package, strategy, by)].ranks, package, HOROVOD_CLASSES[strategy])


@pytest.mark.mpi
@pytest.mark.compat_oldest
@pytest.mark.parametrize(
    "package",
    [
        _package_param(p, pytest.mark.cases(*(ddp_adasum_fit(p, by) for by in ("name", "instance"))))
        for p in PACKAGES
    ],
)
@pytest.mark.parametrize("by", ["name", "instance"])
def test_ddp_adasum_with_each_package_launched_by_lightning(package, by, cases):
    check_fit(cases[ddp_adasum_fit(package, by)].ranks, package, "DDPAdasumStrategy")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env=mpi_env(), capture_output=True, text=True, timeout=120
    )


@needs_lightning
def test_a_bare_name_follows_the_imported_package_and_is_refused_when_ambiguous():
    code = (
        "import adasum_lightning, sys\n"
        "import lightning as L\n"
        "s = adasum_lightning.HorovodAdasumStrategy\n"
        "print(s.__module__, 'pytorch_lightning' in sys.modules)\n"
        "t = L.Trainer(strategy=s(), accelerator='cpu', logger=False)\n"
        "import pytorch_lightning\n"
        "try:\n    adasum_lightning.DDPAdasumStrategy\nexcept ImportError as e:\n    print(e)\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "adasum_lightning.lightning.horovod.trainer False"
    assert lines[1] == _namespaces.AMBIGUOUS_MESSAGE


def test_without_lightning_the_torch_part_imports_and_a_strategy_names_both_packages():
    code = (
        "import sys\n"
        "for name in ('pytorch_lightning', 'lightning', 'lightning_fabric'):\n"
        "    sys.modules[name] = None  # as if no Lightning package were installed\n"
        "import adasum_lightning\n"
        "from adasum_lightning import AdasumOptimizer, adasum_allreduce, adasum_step\n"
        "print('torch part', AdasumOptimizer.__name__, adasum_allreduce.__name__, adasum_step.__name__)\n"
        "adasum_lightning.DDPAdasumStrategy\n"
    )
    proc = _python(code)
    assert proc.stdout == "torch part AdasumOptimizer adasum_allreduce adasum_step\n"
    assert proc.returncode != 0
    assert f"ImportError: {_namespaces.missing_lightning_message()}" in proc.stderr
    assert "pip install lightning" in proc.stderr and "pip install pytorch-lightning" in proc.stderr


@pytest.mark.parametrize("package", [_package_param(p) for p in PACKAGES])
def test_each_registry_holds_the_three_names_with_its_own_classes(package):
    code = (
        f"import adasum_lightning, importlib; pl = importlib.import_module({package!r})\n"
        "from importlib import import_module\n"
        f"registry = import_module({package!r} + '.strategies').StrategyRegistry\n"
        "for name in ('horovod_adasum', 'horovod', 'ddp_adasum'):\n"
        "    cls = registry[name]['strategy']\n"
        "    print(name, cls.__module__, cls.__name__, issubclass(cls, pl.strategies.Strategy))\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    horovod, ddp_adasum = module_for(package, "horovod"), module_for(package, "ddp_adasum")
    assert proc.stdout.splitlines() == [
        f"horovod_adasum {horovod} HorovodAdasumStrategy True",
        f"horovod {horovod} HorovodStrategy True",
        f"ddp_adasum {ddp_adasum} DDPAdasumStrategy True",
    ]


@pytest.mark.skipif(
    importlib.util.find_spec("jsonargparse") is None, reason="LightningCLI needs jsonargparse"
)
@pytest.mark.parametrize("package", [_package_param(p) for p in PACKAGES])
@pytest.mark.parametrize(
    ("strategy_args", "expected"),
    [
        (["--trainer.strategy=ddp_adasum"], "ddp_adasum DDPAdasumStrategy 0:30:00"),
        (["--trainer.strategy=horovod_adasum"], "horovod HorovodAdasumStrategy 0:30:00"),
        (  # the class-path form, with an init argument
            [
                "--trainer.strategy.class_path=adasum_lightning.DDPAdasumStrategy",
                "--trainer.strategy.init_args.timeout=0:00:45",
            ],
            "ddp_adasum DDPAdasumStrategy 0:00:45",
        ),
    ],
    ids=["ddp_adasum", "horovod_adasum", "class_path"],
)
def test_lightning_cli_of_each_package_finds_the_strategies(package, strategy_args, expected, tmp_path):
    code = (
        "import importlib, sys\nimport adasum_lightning\n"
        f"cli = importlib.import_module({package!r} + '.cli')\n"
        f"demos = importlib.import_module({package!r} + '.demos.boring_classes')\n"
        "s = cli.LightningCLI(demos.BoringModel, demos.BoringDataModule, run=False).trainer.strategy\n"
        "print(type(s).__module__, type(s).__name__, s._timeout)\n"
    )
    cmd = [sys.executable, "-c", code, *strategy_args, "--trainer.accelerator=cpu", "--trainer.logger=false",
           f"--trainer.default_root_dir={tmp_path}"]  # fmt: skip
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    name, rest = expected.split(" ", 1)
    assert proc.stdout.strip().splitlines()[-1] == f"{module_for(package, name)} {rest}"


def test_the_mirror_is_the_same_source_with_the_package_names_renamed():
    pytest.importorskip("lightning")
    import adasum_lightning.lightning.horovod.trainer as mirrored

    import adasum_lightning.horovod.trainer as source

    assert mirrored.__file__ == source.__file__  # tracebacks point at the real file
    assert mirrored.HorovodStrategy is not source.HorovodStrategy
    # each copy's strategies extend their own package's DDPStrategy, and only that one
    lightning_bases = [
        c.__module__ for c in mirrored.HorovodStrategy.__mro__ if "strategies.ddp" in c.__module__
    ]
    assert lightning_bases == ["lightning.pytorch.strategies.ddp"]
    source_bases = [c.__module__ for c in source.HorovodStrategy.__mro__ if "strategies.ddp" in c.__module__]
    assert source_bases == ["pytorch_lightning.strategies.ddp"]
    assert mirrored.support is source.support  # the package-independent modules are shared


@pytest.mark.skipif(
    os.environ.get("ADASUM_PLAIN_INSTALL") != "1",
    reason="runs in `make test-compat`'s environments, where `pip install .` alone installed the project",
)
def test_plain_install_imports_and_fits_without_the_examples_extra(tmp_path):
    code = (
        "import importlib.util, torch, adasum_lightning\n"
        f"import {PACKAGE} as pl\n"
        "print(adasum_lightning.__file__)\n"
        "print(importlib.util.find_spec('torchvision'), importlib.util.find_spec('jsonargparse'))\n"
        "class M(pl.LightningModule):\n"
        "    def __init__(self):\n        super().__init__(); self.net = torch.nn.Linear(2, 1)\n"
        "    def training_step(self, batch, i):\n        return self.net(batch[0]).pow(2).mean()\n"
        "    def train_dataloader(self):\n"
        "        data = torch.utils.data.TensorDataset(torch.randn(8, 2))\n"
        "        return torch.utils.data.DataLoader(data, batch_size=4)\n"
        "    def configure_optimizers(self):\n        return torch.optim.SGD(self.parameters(), lr=0.1)\n"
        "for name in ('ddp_adasum', 'horovod_adasum', 'horovod'):\n"
        "    m = M(); before = m.net.weight.detach().clone()\n"
        "    t = pl.Trainer(strategy=name, accelerator='cpu', devices=1, max_epochs=1, logger=False,\n"
        "                   enable_checkpointing=False, enable_progress_bar=False,\n"
        "                   enable_model_summary=False)\n"
        "    t.fit(m)\n"
        "    print(name, t.global_step, not torch.equal(before, m.net.weight))\n"
    )
    env = {k: v for k, v in mpi_env().items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    installed = lines[0]  # the installed copy, not the checkout's
    assert "site-packages" in installed and not installed.startswith(str(ROOT / "adasum_lightning"))
    assert lines[1] == "None None"  # no torchvision, no jsonargparse: the examples extra is not installed
    assert lines[2:] == ["ddp_adasum 2 True", "horovod_adasum 2 True", "horovod 2 True"]


@pytest.mark.parametrize("package", [_package_param(p) for p in PACKAGES])
def test_lightnings_own_errors_are_the_ones_docs_limits_quotes(package):
    # docs/limits.md, "Lightning's own errors": the name unknown without `import adasum_lightning`, and a
    # strategy object of the other Lightning package (Lightning's wording, checked on every tested release).
    other = "adasum_lightning.lightning" if package == "pytorch_lightning" else "adasum_lightning.trainer"
    code = (
        f"import importlib\npl = importlib.import_module({package!r})\n"
        "def fails(**kwargs):\n"
        "    try:\n        pl.Trainer(accelerator='cpu', **kwargs)\n"
        "    except ValueError as err:\n        print(str(err).split(' Example choices')[0])\n"
        "fails(strategy='ddp_adasum')\n"
        "import adasum_lightning\n"
        "pl.Trainer(strategy='ddp_adasum', accelerator='cpu')\n"
        f"if importlib.util.find_spec('lightning'):\n"
        f"    fails(strategy=importlib.import_module({other!r}).DDPAdasumStrategy())\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == (
        "You selected an invalid strategy name: `strategy='ddp_adasum'`. It must be either a string or an "
        f"instance of `{package}.strategies.Strategy`."
    )
    if HAS_LIGHTNING:
        assert lines[1].startswith("You selected an invalid strategy name: `strategy=<adasum_lightning.")
        assert lines[1].endswith(
            f"It must be either a string or an instance of `{package}.strategies.Strategy`."
        )


#: Lightning releases compromised on the package index (GHSA-w37p-236h-pfx3): no requirement may admit them.
COMPROMISED = ("2.6.2", "2.6.3")


def compromised_admitted(requirements: list[str], where: str) -> list[str]:
    """Each Lightning requirement among ``requirements`` that admits a compromised release (at least one
    Lightning requirement must be among them)."""
    lightning = [r for r in map(Requirement, requirements) if r.name in ("lightning", "pytorch-lightning")]
    assert lightning, f"{where}: no Lightning requirement among {requirements}"
    return [f"{where}: {r} admits {v}" for r in lightning for v in COMPROMISED if r.specifier.contains(v)]


def test_no_declared_requirement_admits_the_compromised_lightning_releases(tmp_path):
    from adasum_lightning.aml.errors import AmlUsageError
    from adasum_lightning.aml.project import read_requirements
    from adasum_lightning.aml.staging import IMAGE_EXTRA_REQUIREMENTS, constraints, image_dependencies

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    blocks = [cfg["options"]["install_requires"], *cfg["options.extras_require"].values()]
    declared = [line for b in blocks for line in b.splitlines() if line and not line.startswith("#")]
    compat = re.findall(r'"((?:pytorch-)?lightning==[^"]+)"', (ROOT / "Makefile").read_text())
    image = [f"{name}{spec}" for name, specs in image_dependencies().items() for spec in specs]
    admitted = [
        *compromised_admitted(declared, "setup.cfg"),
        *compromised_admitted(compat, "Makefile's compat matrix"),
        *compromised_admitted(
            importlib.metadata.requires("adasum-lightning") or [], "the installed adasum-lightning"
        ),
        *compromised_admitted([*image, *IMAGE_EXTRA_REQUIREMENTS], "the Azure ML image"),
    ]
    assert not admitted, "\n".join([*admitted, "(installed: older than setup.cfg? make setup reinstalls it)"])
    # a project's own requirement cannot bring one into the image either
    (tmp_path / "requirements.txt").write_text("lightning==2.6.2\n")
    with pytest.raises(AmlUsageError, match="conflicts with adasum-lightning's own requirement lightning"):
        read_requirements(tmp_path / "requirements.txt", constraints(), image_dependencies())
