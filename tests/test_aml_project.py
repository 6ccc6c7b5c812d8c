"""``adasum-aml submit`` for a user's own project: the fixture in tests/fixtures/aml_project (its own
Lightning script without LightningCLI, a requirements.txt, an .amlignore, a ``uri_folder`` input), with the
real SDK objects of both SDKs and both job kinds, offline; ``--local 2`` trains it with both Adasum
strategies on its input folder."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from unittest.mock import create_autospec

import pytest
import yaml

from adasum_lightning.aml import cli, sdk_v1, sdk_v2
from adasum_lightning.aml.job import experiment_name_for
from adasum_lightning.aml.workspace import WorkspaceConfig
from tests.aml_support import no_network  # noqa: F401  (fixture)
from tests.helpers import ROOT

pytestmark = pytest.mark.usefixtures("no_network")
pytest.importorskip("azureml.core", reason="pip install -e '.[aml]'")
pytest.importorskip("azure.ai.ml", reason="pip install -e '.[aml-v2]'")

FIXTURE = ROOT / "tests" / "fixtures" / "aml_project"
DATA = ROOT / "tests" / "fixtures" / "aml_project_data"
CONFIG = WorkspaceConfig("0a1b2c3d-4e5f-6789-abcd-ef0123456789", "rg-adasum", "ws-adasum", "config.json")
POINTS = "azureml://datastores/workspaceblobstore/paths/fixture/points"
MODEL = "azureml://datastores/workspaceblobstore/paths/fixture/model"


@pytest.fixture
def project(tmp_path):
    """A copy of the fixture project with files its .amlignore leaves out (and a .gitignore it overrides)."""
    dest = tmp_path / "project"
    shutil.copytree(FIXTURE, dest)
    (dest / "scratch").mkdir()
    (dest / "scratch" / "big.bin").write_bytes(b"\0" * 1024)
    (dest / "run.log").write_text("old log\n")
    (dest / ".gitignore").write_text("train.py\n")  # ignored itself: .amlignore takes precedence
    return dest


def _argv(project, *extra, script="train.py"):
    return [
        "submit",
        "--source-dir",
        str(project),
        script,
        "--requirements",
        str(project / "requirements.txt"),
        "--input",
        f"points={POINTS}",
        "--output",
        f"model={MODEL}",
        *extra,
        "--",
        "--data-dir",
        "${{inputs.points}}",
        "--out-dir",
        "${{outputs.model}}",
        "--epochs",
        "3",
    ]


# -- the dry run: the user's command, the input binding, the requirements in the image --------------------
@pytest.mark.parametrize("strategy", ["horovod_adasum", "ddp_adasum"])
def test_v2_dry_run_has_the_users_command_data_and_requirements(strategy, project, tmp_path, capsys):
    stage = tmp_path / "stage"
    argv = _argv(project, "--sdk", "v2", "--dry-run", "--strategy", strategy, "--staging-dir", str(stage))
    assert cli.main(argv) == 0
    job = yaml.safe_load(capsys.readouterr().out)
    assert job["command"] == (
        "python train.py --data-dir '${{inputs.points}}' --out-dir '${{outputs.model}}' --epochs 3"
    )  # no --trainer.* arguments: the script is not a LightningCLI one
    assert job["inputs"] == {"points": {"type": "uri_folder", "path": POINTS, "mode": "ro_mount"}}
    assert job["outputs"] == {"model": {"type": "uri_folder", "path": MODEL, "mode": "rw_mount"}}
    assert job["distribution"]["type"] == ("mpi" if strategy == "horovod_adasum" else "pytorch")
    env = job["environment_variables"]
    devices = "1" if strategy == "horovod_adasum" else "4"
    assert (env["ADASUM_STRATEGY"], env["ADASUM_DEVICES"], env["ADASUM_NUM_NODES"]) == (
        strategy,
        devices,
        "8",
    )
    # the code snapshot: the project minus what .amlignore excludes
    code = sorted(
        p.relative_to(stage / "code").as_posix() for p in (stage / "code").rglob("*") if p.is_file()
    )
    assert code == [".amlignore", ".gitignore", "requirements.txt", "train.py"]
    assert (stage / "image" / "requirements.txt").read_text().split() == ["azureml-mlflow", "tqdm>=4.57"]
    assert job["display_name"] == f"train-{'adasum' if strategy == 'horovod_adasum' else 'ddp-adasum'}-8x4"
    assert job["experiment_name"] == "project"  # the project's folder, not the bundled example's


def test_the_experiment_is_named_after_the_project_unless_given(project):
    for argv, expected in [
        (_argv(project), "project"),
        (_argv(project, "--experiment", "mine"), "mine"),
        (["submit"], "adasum-lightning-mnist"),  # the bundled example
    ]:
        job, _ = cli.job_from_args(cli.parse_args(argv))
        assert job.experiment_name == expected
    assert experiment_name_for("_my project.v2") == "my-project-v2"  # as Azure ML accepts it
    assert experiment_name_for("__") == "adasum-lightning-mnist"


def test_v1_dry_run_binds_the_data_as_data_references(project, tmp_path, capsys):
    stage = ["--staging-dir", str(tmp_path / "stage")]
    argv = _argv(project, "--sdk", "v1", "--dry-run", "--input-mode", "points=download", *stage)
    assert cli.main(argv) == 0
    rc = json.loads(capsys.readouterr().out)
    assert rc["script"] == "train.py"
    assert rc["arguments"] == [
        "--data-dir",
        "$AZUREML_DATAREFERENCE_points",
        "--out-dir",
        "$AZUREML_DATAREFERENCE_model",
        "--epochs",
        "3",
    ]
    points = rc["data"]["points"]
    assert points["dataLocation"]["dataPath"] == {
        "datastoreName": "workspaceblobstore",
        "relativePath": "fixture/points",
    }
    assert (
        points["mechanism"] == "download"
        and points["environmentVariableName"] == "AZUREML_DATAREFERENCE_points"
    )
    model = rc["outputData"]["model"]
    assert (
        model["outputLocation"]["dataPath"]["relativePath"] == "fixture/model"
        and model["mechanism"] == "mount"
    )


def test_data_asset_and_https_inputs_are_referenced_not_uploaded(project, tmp_path, capsys):
    argv = [
        "submit", "--source-dir", str(project), "train.py", "--sdk", "v2", "--dry-run",
        "--staging-dir", str(tmp_path / "stage"), "--input", "points=azureml:fixture-points:3",
        "--input", "extra=https://example.org/data/extra.csv", "--input-type", "extra=uri_file",
        "--", "--data-dir", "${{inputs.points}}",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    job = yaml.safe_load(capsys.readouterr().out)
    assert job["inputs"]["points"] == {
        "type": "uri_folder",
        "path": "azureml:fixture-points:3",
        "mode": "ro_mount",
    }
    assert job["inputs"]["extra"]["type"] == "uri_file"


@pytest.mark.parametrize("sdk", ["v1", "v2"])
def test_the_bundled_example_reads_mnist_from_an_input(sdk, tmp_path, capsys):
    argv = ["submit", "--sdk", sdk, "--dry-run", "--staging-dir", str(tmp_path / "stage")]
    assert (
        cli.main([*argv, "--input", "mnist=azureml:mnist:1", "--", "--data.data_dir=${{inputs.mnist}}"]) == 0
    )
    out = capsys.readouterr().out
    if sdk == "v2":
        job = yaml.safe_load(out)
        assert job["command"].endswith(
            "--data.data_dir=data --trainer.default_root_dir=outputs '--data.data_dir=${{inputs.mnist}}'"
        )  # the last value wins
        assert job["inputs"]["mnist"] == {"type": "uri_folder", "path": "azureml:mnist:1", "mode": "ro_mount"}
    else:
        rc = json.loads(out)
        assert rc["arguments"][-1] == "--data.data_dir=$AZUREML_DATAREFERENCE_mnist"
        assert rc["data"]["mnist"]["dataLocation"]["dataset"] == {
            "id": None, "name": "mnist", "version": "1",
        }  # fmt: skip


def test_lightning_cli_scripts_get_the_trainer_arguments(project, tmp_path, capsys):
    (project / "cli.py").write_text("from lightning.pytorch.cli import LightningCLI\n\nLightningCLI()\n")
    argv = [
        "submit",
        "--source-dir",
        str(project),
        "cli.py",
        "--sdk",
        "v2",
        "--dry-run",
        "--strategy",
        "ddp_adasum",
    ]
    assert cli.main([*argv, "--staging-dir", str(tmp_path / "s"), "--", "fit", "--config", "c.yaml"]) == 0
    command = yaml.safe_load(capsys.readouterr().out)["command"]
    assert command.startswith(
        "python cli.py fit --config c.yaml --trainer.strategy=adasum_lightning.DDPAdasumStrategy"
    )
    assert command.endswith("--trainer.devices=4 --trainer.num_nodes=8")


# -- the image: built once per content, reused on the second submit; or a registered one -------------------
def _client():
    from azure.ai.ml import MLClient
    from azure.ai.ml.entities import AmlCompute
    from azure.ai.ml.operations import ComputeOperations, EnvironmentOperations, JobOperations

    client = create_autospec(MLClient, instance=True)
    client.compute = create_autospec(ComputeOperations, instance=True)
    client.jobs = create_autospec(JobOperations, instance=True)
    client.environments = create_autospec(EnvironmentOperations, instance=True)
    client.compute.get.return_value = AmlCompute(
        name="adasum-nc64t4", size="Standard_NC64as_T4_v3", max_instances=8
    )
    created = client.jobs.create_or_update.return_value
    created.name, created.studio_url = "train_job_1", "https://ml.azure.com/runs/train_job_1"
    return client


def _submit_v2(project, tmp_path, monkeypatch, client, *extra):
    monkeypatch.setattr(sdk_v2, "connect", lambda config: client)
    monkeypatch.setattr(cli, "load_workspace_config", lambda path: CONFIG)
    return cli.main([*_argv(project, "--sdk", "v2", *extra)])


def test_v2_second_submit_reuses_the_image(project, tmp_path, monkeypatch, capsys):
    from azure.ai.ml.entities import Environment
    from azure.core.exceptions import ResourceNotFoundError

    client = _client()
    registered = {}

    def get(name, version=None, label=None):
        if (name, version) not in registered:
            raise ResourceNotFoundError("no such environment")
        return registered[(name, version)]

    client.environments.get.side_effect = get
    assert _submit_v2(project, tmp_path, monkeypatch, client) == 0
    (first,), _ = client.jobs.create_or_update.call_args
    assert isinstance(first.environment, Environment) and first.environment.build is not None
    name, version = first.environment.name, first.environment.version
    assert name == "adasum-lightning-horovod-nccl" and re.fullmatch(r"[0-9a-f]{16}", version)
    out = capsys.readouterr().out
    assert f"new environment {name}:{version}" in out
    assert "submitted job train_job_1: https://ml.azure.com/runs/train_job_1" in out
    registered[(name, version)] = first.environment  # Azure ML registered it with the first job
    assert _submit_v2(project, tmp_path, monkeypatch, client) == 0
    (second,), _ = client.jobs.create_or_update.call_args
    assert second.environment == f"azureml:{name}:{version}"  # a reference: no second image build
    assert f"reusing the environment {name}:{version}" in capsys.readouterr().out


def test_v2_registered_environment_instead_of_a_build(project, tmp_path, monkeypatch, capsys):
    from azure.ai.ml.entities import Environment
    from azure.core.exceptions import ResourceNotFoundError

    client = _client()
    client.environments.get.return_value = Environment(name="team-horovod", version="7", image="x")
    argv = [*_argv(project, "--sdk", "v2", "--environment", "azureml:team-horovod:7")]
    argv.remove("--requirements"), argv.remove(str(project / "requirements.txt"))
    monkeypatch.setattr(sdk_v2, "connect", lambda config: client)
    monkeypatch.setattr(cli, "load_workspace_config", lambda path: CONFIG)
    assert cli.main(argv) == 0
    client.environments.get.assert_called_with("team-horovod", version="7")
    (job,), _ = client.jobs.create_or_update.call_args
    assert job.environment == "azureml:team-horovod:7"
    client.environments.get.side_effect = ResourceNotFoundError("nope")
    capsys.readouterr()
    assert cli.main(argv) == 2
    assert "the workspace has no such environment" in capsys.readouterr().err


def test_v1_second_submit_reuses_the_image(project, tmp_path, monkeypatch):
    from azureml.core import Environment, Experiment, Run, Workspace

    workspace = create_autospec(Workspace, instance=True)
    registered = {}

    def get(ws, name, version=None):
        if name not in registered:
            raise Exception(f"Environment {name} not found")
        return registered[name]

    monkeypatch.setattr(Environment, "get", staticmethod(get))
    monkeypatch.setattr(sdk_v1, "get_or_create_cluster", lambda ws, job: None)
    experiment = create_autospec(Experiment, instance=True)
    experiment.submit.return_value = create_autospec(Run, instance=True)
    args = cli.parse_args(_argv(project, "--sdk", "v1"))
    job, source = cli.job_from_args(args)
    from adasum_lightning.aml.staging import stage_job

    for attempt in range(2):
        staged = stage_job(job, tmp_path / f"s{attempt}", source)
        sdk_v1.submit(
            job, staged, CONFIG, workspace=workspace, experiment_factory=lambda ws, n: experiment,
            upload_build_context=False,
        )  # fmt: skip
        (src,), _ = experiment.submit.call_args
        env = src.run_config.environment
        if attempt == 0:
            assert env.docker.build_context is not None
            assert env.name == f"adasum-lightning-horovod-nccl-{staged.environment_version}"
            registered[env.name] = env
            first = env
        else:
            assert env is first  # the registered one, fetched by its content name


# -- after submit: --stream follows the logs and exits with the job's status -------------------------------
@pytest.mark.parametrize(("status", "code"), [("Completed", 0), ("Failed", 3)])
def test_v2_stream_follows_the_job_and_returns_its_status(
    status, code, project, tmp_path, monkeypatch, capsys
):
    from azure.core.exceptions import ResourceNotFoundError

    client = _client()
    client.environments.get.side_effect = ResourceNotFoundError("new")
    client.jobs.get.return_value.status = status
    assert _submit_v2(project, tmp_path, monkeypatch, client, "--stream") == code
    client.jobs.stream.assert_called_once_with("train_job_1")
    assert f"job train_job_1 ended: {status}" in capsys.readouterr().out


@pytest.mark.parametrize(("status", "code"), [("Completed", 0), ("Canceled", 3)])
def test_v1_stream_waits_for_the_run(status, code, project, tmp_path, monkeypatch):
    from azureml.core import Environment, Experiment, Run, Workspace

    run = create_autospec(Run, instance=True)
    run.id = "train_1"
    run.wait_for_completion.return_value = {"status": status}
    experiment = create_autospec(Experiment, instance=True)
    experiment.submit.return_value = run
    monkeypatch.setattr(
        Environment, "get", staticmethod(lambda *a, **k: (_ for _ in ()).throw(Exception("new")))
    )
    monkeypatch.setattr(sdk_v1, "connect", lambda config: create_autospec(Workspace, instance=True))
    monkeypatch.setattr(sdk_v1, "get_or_create_cluster", lambda ws, job: None)
    monkeypatch.setattr("azureml.core.Experiment", lambda ws, name: experiment)
    monkeypatch.setattr(
        "azureml.core.environment.DockerBuildContext.from_local_directory", lambda *a: None, raising=False
    )
    monkeypatch.setattr(cli, "load_workspace_config", lambda path: CONFIG)
    assert cli.main([*_argv(project, "--sdk", "v1", "--stream")]) == code
    run.wait_for_completion.assert_called_once_with(show_output=True, raise_on_error=False)


# -- bad input: exit 2 naming the fix, before any SDK call, nothing written --------------------------------
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["missing.py"], r"the script missing.py does not exist in the source directory"),
        (["../outside.py"], r"outside the source directory .*Pass --source-dir"),
        (
            ["--", "train.py", "--epochs", "2"],
            r"train.py after '--' would be an argument of the bundled MNIST",
        ),
        (["train.py", "--requirements", "nope.txt"], r"--requirements nope.txt: no such file"),
        (["train.py", "--requirements", "BAD"], r"line 1: '-e ../lib' is not a requirement .*NAME==VERSION"),
        (["train.py", "--requirements", "TORCH"], r"excludes torch==[0-9.]+, the version the image pins"),
        (["train.py", "--input", "points=s3://bucket/x"], r"only https:// URLs are read"),
        (["train.py", "--input", "points=azureml:no-version"], r"not an Azure ML URI this launcher reads"),
        (["train.py", "--input", "points"], r"expected NAME=VALUE"),
        (
            ["train.py", "--input", f"points={DATA}"],
            r"is a local path, which the cluster cannot read.*az ml data",
        ),
        (["train.py", "--input", f"p={POINTS}", "--input-mode", "p=copy"], r"use one of ro_mount, download"),
        (["train.py", "--input-mode", "q=download"], r"there is no --input q=URI"),
        (["train.py", "--output", "m=azureml:asset:1"], r"outputs are written to a datastore"),
        (["train.py", "--", "--data-dir", "${{inputs.points}}"], r"no --input points=URI: add it"),
        (["train.py", "--environment", "team env"], r"not an Azure ML environment reference"),
        (
            ["train.py", "--environment", "e:1", "--requirements", "REQ"],
            r"add the packages to that environment",
        ),
        (["train.py", "--environment", "e:1", "--base-image", "x:y"], r"drop one of them"),
        (["train.py", "--stream"], r"--stream follows a submitted job: drop it for --dry-run"),
        (["--trainer-args", "off"], r"--trainer-args applies to a script of your own"),
        (["train.py", "--data-dir", "d"], r"give your script its data with --input"),
        (
            ["train.py", "--local", "2", "--input", f"points={POINTS}"],
            r"--local reads and writes local folders",
        ),
        (["requirements.txt"], r"is not a Python file: the job runs `python SCRIPT`"),
        (["scratch"], r"the script scratch is a directory"),
        (["broken.py"], r"broken.py is not valid Python \(line 1"),
        (
            ["train.py", "--trainer.max_epochs=3"],
            r"--trainer.max_epochs=3 is a LightningCLI option, but train.py",
        ),
        (["train.py", "--", "--data-dir", "${inputs.points}"], r"Azure ML binds double braces"),
        (
            ["train.py", "--input", "p=https://a.blob.core.windows.net/c/d?sv=1&sig=SECRET"],
            r"carries a SAS token",
        ),
        (
            ["train.py", "--requirements", "SELF"],
            r"the image installs the adasum-lightning that submits the job",
        ),
        (
            ["train.py", "--requirements", "OLDPL"],
            r"conflicts with adasum-lightning's own requirement pytorch-lightning",
        ),
        (
            ["train.py", "--staging-dir", "IN_PROJECT"],
            r"is inside the source directory .* pass a folder outside it",
        ),
        (["train.py", "--staging-dir", "train.py"], r"--staging-dir train.py is a file"),
    ],
)
def test_bad_input_exits_2_with_the_fix_and_writes_nothing(
    argv, message, project, tmp_path, capsys, monkeypatch
):
    (project / "bad.txt").write_text("-e ../lib\n")
    (project / "torch.txt").write_text("torch<2.10\n")
    (project / "self.txt").write_text("adasum-lightning==0.1\n")
    (project / "old-pl.txt").write_text("pytorch-lightning==1.9.0\n")
    (project / "broken.py").write_text("def f(:\n")
    names = {"BAD": "bad.txt", "TORCH": "torch.txt", "SELF": "self.txt", "OLDPL": "old-pl.txt"}
    files = {key: str(project / name) for key, name in names.items()}
    files["IN_PROJECT"] = str(project / "stage-here")
    files["REQ"] = str(project / "requirements.txt")
    argv = [files.get(a, a) for a in argv]
    monkeypatch.chdir(project)
    before = sorted(p.as_posix() for p in tmp_path.rglob("*"))
    stage = [] if "--staging-dir" in argv else ["--staging-dir", str(tmp_path / "stage")]
    dry = [] if "--local" in argv else ["--dry-run"]
    before_project = sorted(p.as_posix() for p in project.rglob("*"))
    code = cli.main(["submit", "--sdk", "v2", *dry, *stage, *argv])
    err = capsys.readouterr().err
    assert code == 2 and re.search(message, err), err
    assert err.startswith("adasum-aml: error: ") and "SECRET" not in err  # a SAS token is never printed
    assert sorted(p.as_posix() for p in tmp_path.rglob("*")) == before  # no staging folder, nothing else
    assert sorted(p.as_posix() for p in project.rglob("*")) == before_project


def test_a_staging_dir_in_use_is_refused(project, tmp_path, capsys):
    used = tmp_path / "used"
    used.mkdir()
    (used / "old.txt").write_text("from an earlier run\n")
    argv = ["submit", "--dry-run", "--source-dir", str(project), "train.py", "--staging-dir", str(used)]
    assert cli.main(argv) == 2
    assert "is not empty: pass a new or empty folder" in capsys.readouterr().err
    assert sorted(p.name for p in used.iterdir()) == ["old.txt"]


@pytest.mark.parametrize(
    ("source", "trainer_args"),
    [
        ("from lightning.pytorch.cli import LightningCLI as CLI\n\nCLI()\n", True),
        ("import lightning.pytorch as pl\n\npl.cli.LightningCLI()\n", True),
        ("# unlike LightningCLI(...), this script parses its own arguments\nimport argparse\n", False),
    ],
)
def test_lightning_cli_is_found_in_the_scripts_code_not_its_comments(
    source, trainer_args, project, tmp_path, capsys
):
    (project / "entry.py").write_text(source)
    argv = ["submit", "--sdk", "v2", "--dry-run", "--source-dir", str(project), "entry.py"]
    assert cli.main([*argv, "--staging-dir", str(tmp_path / "s")]) == 0
    out = capsys.readouterr()
    assert ("--trainer.strategy=horovod_adasum" in yaml.safe_load(out.out)["command"]) is trainer_args
    assert ("--trainer.* arguments appended" in out.err) is trainer_args
    # none of them imports adasum_lightning: Lightning would not know the name horovod_adasum
    assert "warning: entry.py does not import adasum_lightning" in out.err


def test_sdk_v1_says_it_is_deprecated(project, tmp_path, capsys):
    argv = ["submit", "--sdk", "v1", "--dry-run", "--source-dir", str(project), "train.py"]
    assert cli.main([*argv, "--staging-dir", str(tmp_path / "s")]) == 0
    err = capsys.readouterr().err
    assert "SDK v1 (azureml-core) is deprecated and its support ended on 2026-06-30" in err
    assert "warning" not in err  # the fixture imports adasum_lightning


def test_empty_source_dir_and_an_ignored_script_are_refused(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert cli.main(["submit", "--dry-run", "--source-dir", str(tmp_path / "empty"), "train.py"]) == 2
    assert "is empty: pass the folder that holds your training script" in capsys.readouterr().err
    project = tmp_path / "p"
    project.mkdir()
    (project / "train.py").write_text("print('hi')\n")
    (project / ".amlignore").write_text("*.py\n")
    code = cli.main(
        [
            "submit",
            "--dry-run",
            "--source-dir",
            str(project),
            "train.py",
            "--staging-dir",
            str(tmp_path / "s"),
        ]
    )
    assert code == 2 and "add the line !train.py to .amlignore" in capsys.readouterr().err


# -- --local 2: the fixture project trains on its input folder with both Adasum strategies -----------------
def _local(strategy, project, tmp_path, *extra):
    out = tmp_path / f"model-{strategy}"
    argv = [
        sys.executable, "-m", "adasum_lightning.aml.cli", "submit", "--strategy", strategy, "--local", "2",
        "--staging-dir", str(tmp_path / f"local-{strategy}"), "--source-dir", str(project), "train.py",
        "--input", f"points={DATA}", "--output", f"model={out}",
        "--", "--data-dir", "${{inputs.points}}", "--out-dir", "${{outputs.model}}", *extra,
    ]  # fmt: skip
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("OMPI_COMM", "PMI_"))}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    return proc, out


_DDP_ADASUM_LOCAL: list[tuple[subprocess.CompletedProcess, Path]] = []


def _local_ddp_adasum(project, tmp_path):
    """``_local("ddp_adasum", ...)`` once per session (two tests read it)."""
    if not _DDP_ADASUM_LOCAL:
        _DDP_ADASUM_LOCAL.append(_local("ddp_adasum", project, tmp_path))
    return _DDP_ADASUM_LOCAL[0]


def test_local_ddp_adasum_trains_the_project_on_its_input(project, tmp_path):
    proc, out = _local_ddp_adasum(project, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fixture trained: world_size=2 strategy=ddp_adasum" in proc.stdout
    weight, bias = map(float, (out / "line.txt").read_text().split())
    assert weight > 0.3 and bias < 0  # moving towards y = 3x - 1 from its start
    assert not (out.parent / "local-ddp_adasum" / "code" / "scratch").exists()


@pytest.mark.mpi
def test_local_horovod_adasum_trains_the_project_as_ddp_adasum_does(project, tmp_path):
    proc, out = _local("horovod_adasum", project, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fixture trained: world_size=2 strategy=horovod_adasum" in proc.stdout
    ddp, ddp_out = _local_ddp_adasum(project, tmp_path)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    # Horovod's Adasum and ddp_adasum give the same line (to float32 rounding of the printed digits)
    horovod_line = [float(v) for v in (out / "line.txt").read_text().split()]
    ddp_line = [float(v) for v in (ddp_out / "line.txt").read_text().split()]
    assert horovod_line == pytest.approx(ddp_line, abs=2e-6)


def test_local_ddp_adasum_refuses_a_script_whose_devices_contradict_the_launch(project, tmp_path):
    proc, _ = _local("ddp_adasum", project, tmp_path, "--devices", "1")
    assert proc.returncode != 0
    assert (
        "ddp_adasum: the launcher started 2 processes (WORLD_SIZE=2), but the Trainer describes devices=1 × "
        "num_nodes=1 = 1" in proc.stderr
    )
    assert "fixture trained" not in proc.stdout
