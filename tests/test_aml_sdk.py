"""Azure ML launcher with the real SDK objects (azureml-core v1, azure-ai-ml v2), all offline."""

from __future__ import annotations

import json
import re
import time
import zipfile
from unittest.mock import create_autospec

import pytest
import yaml

from adasum_lightning import failure_detection
from adasum_lightning.aml import cli, sdk_v1, sdk_v2
from adasum_lightning.aml.errors import AmlSubmitError, AmlUsageError
from adasum_lightning.aml.job import (
    DEFAULT_BASE_IMAGE,
    DEFAULT_DDP_BASE_IMAGE,
    AmlJob,
)
from adasum_lightning.aml.staging import constraints, stage_job
from adasum_lightning.aml.workspace import WorkspaceConfig
from tests.aml_support import no_network  # noqa: F401  (fixture)
from tests.helpers import ROOT

pytestmark = pytest.mark.usefixtures("no_network")
azureml_core = pytest.importorskip("azureml.core", reason="pip install -e '.[aml]'")
azure_ai_ml = pytest.importorskip("azure.ai.ml", reason="pip install -e '.[aml-v2]'")

TOPOLOGY = {"ADASUM_STRATEGY": "horovod_adasum", "ADASUM_ACCELERATOR": "gpu", "ADASUM_DEVICES": "1"}
SUB = "0a1b2c3d-4e5f-6789-abcd-ef0123456789"
CONFIG = WorkspaceConfig(SUB, "rg-adasum", "ws-adasum", "config_aml.json")
BASE_ENV = {"OMP_NUM_THREADS": "1", "NCCL_DEBUG": "WARN", "PYTHONUNBUFFERED": "1"}
#: What a script that takes no --trainer.* arguments reads (DDP_JOB: 3 nodes × 4 GPUs; the default: 8 × 4).
DDP_ENV = {
    **BASE_ENV,
    "ADASUM_STRATEGY": "ddp_adasum",
    "ADASUM_ACCELERATOR": "gpu",
    "ADASUM_DEVICES": "4",
    "ADASUM_NUM_NODES": "3",
}
#: MPI jobs also carry Open MPI's fault settings (OMPI_MCA_*), read by Azure ML's mpirun.
ENV = {**BASE_ENV, **TOPOLOGY, "ADASUM_NUM_NODES": "8", **failure_detection.mpi_env()}
DDP_JOB = {"strategy": "ddp_adasum", "node_count": 3, "process_count_per_node": 4}


@pytest.fixture
def staged(tmp_path):
    return stage_job(AmlJob(), tmp_path / "stage")


# -- the job environment's build context ---------------------------------------------------------------
PINS = "pip install -c /tmp/adasum/constraints.txt torch torchvision"


def _wheel(ctx):
    (wheel,) = ctx.glob("adasum_lightning-*-py3-none-any.whl")
    return wheel


def test_build_context_builds_horovod_with_nccl_after_torch(staged):
    ctx = staged.context_dir
    wheel = _wheel(ctx)
    assert sorted(p.name for p in ctx.iterdir()) == sorted(
        ["Dockerfile", "constraints.txt", "patches", "requirements.txt", wheel.name]
    )
    for name in ("build_horovod.sh", "horovod-0.28.1-torch2.patch"):  # the repo's own, byte for byte
        assert (ctx / "patches" / name).read_bytes() == (ROOT / "patches" / name).read_bytes()
    assert sorted(p.name for p in (ctx / "patches").iterdir()) == [
        "build_horovod.sh",
        "horovod-0.28.1-torch2.patch",
    ]
    pins = (ROOT / "adasum_lightning" / "constraints.txt").read_bytes()
    assert (ctx / "constraints.txt").read_bytes() == pins
    dockerfile = (ctx / "Dockerfile").read_text()
    assert "@" not in re.sub(r"#.*", "", dockerfile)  # every placeholder filled
    assert dockerfile.splitlines()[
        [i for i, line in enumerate(dockerfile.splitlines()) if line.startswith("FROM")][0]
    ] == (f"FROM {DEFAULT_BASE_IMAGE}")
    torch_at = dockerfile.index(PINS)
    wheel_at = dockerfile.index(f'"/tmp/adasum/{wheel.name}[examples,lightning]" -r /tmp/adasum/requirements')
    build_at = dockerfile.index("bash /tmp/adasum/patches/build_horovod.sh --gpu")
    assert torch_at < wheel_at < build_at and "openmpi-bin libopenmpi-dev" in dockerfile
    assert "hvd.nccl_built()" in dockerfile
    assert (ctx / "requirements.txt").read_text().split() == ["azureml-mlflow"]
    # the wheel is the installed copy: the example's LightningCLI needs jsonargparse (its `examples` extra)
    with zipfile.ZipFile(wheel) as whl:
        metadata = whl.read(f"adasum_lightning-{wheel.name.split('-')[1]}.dist-info/METADATA").decode()
        example = whl.read("adasum_lightning/aml/example/mnist.py")
    assert example == (ROOT / "examples" / "mnist.py").read_bytes()
    assert re.search(r"Requires-Dist: jsonargparse\[signatures\].*extra == \"examples\"", metadata)


def test_the_environment_version_follows_the_image_content(tmp_path):
    first = stage_job(AmlJob(), tmp_path / "a").environment_version
    assert stage_job(AmlJob(), tmp_path / "b").environment_version == first  # same content, same version
    assert len(first) == 16 and int(first, 16) >= 0
    other_image = stage_job(AmlJob(base_image="nvidia/cuda:13.0.1-devel-ubuntu22.04"), tmp_path / "c")
    with_requirements = stage_job(AmlJob(requirements=("tqdm>=4.57",)), tmp_path / "d")
    ddp = stage_job(AmlJob(strategy="ddp_adasum"), tmp_path / "e")
    versions = {first, other_image.environment_version, with_requirements.environment_version}
    assert len(versions | {ddp.environment_version}) == 4


@pytest.fixture
def staged_ddp(tmp_path):
    return stage_job(AmlJob(**DDP_JOB), tmp_path / "stage-ddp")


def _instructions(dockerfile: str) -> str:
    return "\n".join(line for line in dockerfile.splitlines() if not line.lstrip().startswith("#"))


def test_ddp_adasum_build_context_has_no_mpi_and_no_horovod(staged_ddp):
    ctx = staged_ddp.context_dir
    names = sorted(p.name for p in ctx.iterdir())
    # no patches/: nothing is compiled in this image
    assert names == sorted(["Dockerfile", "constraints.txt", "requirements.txt", _wheel(ctx).name])
    dockerfile = (ctx / "Dockerfile").read_text()
    steps = _instructions(dockerfile)
    assert "@" not in steps  # every placeholder filled
    assert steps.splitlines()[0] == f"FROM {DEFAULT_DDP_BASE_IMAGE}"
    assert PINS in steps and f"/tmp/adasum/{_wheel(ctx).name}[examples,lightning]" in steps
    assert "dist.is_nccl_available()" in steps
    for absent in ("horovod", "openmpi", "mpi", "build-essential", "nvcc", "patches", "openssh"):
        assert absent not in steps.lower(), absent
    assert (ctx / "requirements.txt").read_text().split() == ["azureml-mlflow"]


@pytest.mark.parametrize("strategy", ["horovod_adasum", "horovod"])
def test_mpi_strategies_keep_the_horovod_image(strategy, tmp_path):
    ctx = stage_job(AmlJob(strategy=strategy), tmp_path / "stage").context_dir
    steps = _instructions((ctx / "Dockerfile").read_text())
    assert steps.splitlines()[0] == f"FROM {DEFAULT_BASE_IMAGE}"
    assert "bash /tmp/adasum/patches/build_horovod.sh --gpu" in steps and "openmpi-bin" in steps
    assert (ctx / "patches" / "build_horovod.sh").is_file()


def test_image_pins_are_the_ones_make_setup_installs():
    import torch
    import torchvision

    pins = constraints()  # the one place that pins them; this environment was installed from it
    assert pins == {
        "torch": torch.__version__.split("+")[0],
        "torchvision": torchvision.__version__.split("+")[0],
    }
    assert "-c adasum_lightning/constraints.txt" in (ROOT / ".ci" / "setup.sh").read_text()


def test_code_snapshot_of_the_bundled_example_is_its_two_files(staged):
    code = staged.code_dir
    assert sorted(p.name for p in code.iterdir()) == ["mnist.py", "mnist_torch.py"] == sorted(staged.files)
    assert (code / "mnist.py").read_bytes() == (ROOT / "examples" / "mnist.py").read_bytes()


def _not_registered(*args, **kwargs):
    raise Exception("Environment not found")  # what azureml-core raises for an unknown name


# -- SDK v1 ------------------------------------------------------------------------------------------
def test_v1_script_run_config(staged):
    from azureml.core import Environment, ScriptRunConfig
    from azureml.core.runconfig import MpiConfiguration

    src = sdk_v1.build(AmlJob(), staged)
    assert isinstance(src, ScriptRunConfig) and isinstance(src.run_config.environment, Environment)
    assert isinstance(src.run_config.mpi, MpiConfiguration)
    rc = sdk_v1.run_configuration(src)
    assert rc["script"] == "mnist.py" and rc["arguments"][0] == "fit"
    assert "--trainer.strategy=horovod_adasum" in rc["arguments"] and "--trainer.devices=1" in rc["arguments"]
    assert rc["target"] == "adasum-nc64t4"
    assert rc["mpi"] == {"processCountPerNode": 4, "nodeCount": 8} and rc["nodeCount"] == 8
    assert rc["communicator"] == "IntelMpi"  # what azureml-core sets for any MpiConfiguration
    assert rc["environmentVariables"] == ENV
    env = rc["environment"]
    assert env["name"] == f"adasum-lightning-horovod-nccl-{staged.environment_version}"
    assert env["docker"]["buildContext"] == {
        "locationType": None,
        "location": str(staged.context_dir),
        "dockerfilePath": "Dockerfile",
    }
    assert (
        env["python"]["userManagedDependencies"] is True
        and env["python"]["interpreterPath"] == "/opt/venv/bin/python"
    )
    assert rc["docker"]["useDocker"] is True and rc["docker"]["shmSize"] == "16g"
    assert json.loads(sdk_v1.render(src)) == rc


def test_v1_pytorch_job_for_ddp_adasum(staged_ddp):
    from azureml.core.runconfig import PyTorchConfiguration

    src = sdk_v1.build(AmlJob(**DDP_JOB), staged_ddp)
    assert isinstance(src.run_config.pytorch, PyTorchConfiguration)
    rc = sdk_v1.run_configuration(src)
    # azureml-core's run configuration JSON for PyTorchConfiguration: framework PyTorch, the NCCL backend,
    # processCount = the job's total processes (nodes × per node), nodeCount = nodes
    assert rc["framework"] == "PyTorch" and rc["communicator"] == "nccl" and rc["nodeCount"] == 3
    assert rc["pytorch"] == {"communicationBackend": "nccl", "processCount": 12, "nodeCount": 3}
    assert rc["script"] == "mnist.py" and rc["arguments"][0] == "fit"
    timeout = str(failure_detection.DDP_PROCESS_GROUP_TIMEOUT)
    for arg in (
        "--trainer.strategy=adasum_lightning.DDPAdasumStrategy",
        f"--trainer.strategy.timeout={timeout}",
        "--trainer.accelerator=gpu",
        "--trainer.devices=4",
        "--trainer.num_nodes=3",
    ):
        assert arg in rc["arguments"], arg
    assert rc["environmentVariables"] == DDP_ENV  # no OMPI_MCA_* without MPI
    env = rc["environment"]
    assert env["name"] == f"adasum-lightning-ddp-{staged_ddp.environment_version}"
    assert env["docker"]["buildContext"]["location"] == str(staged_ddp.context_dir)
    assert env["python"]["interpreterPath"] == "/opt/venv/bin/python"
    assert json.loads(sdk_v1.render(src)) == rc


def test_v1_mpi_job_carries_the_open_mpi_fault_settings(staged):
    rc = sdk_v1.run_configuration(sdk_v1.build(AmlJob(strategy="horovod"), staged))
    assert rc["framework"] != "PyTorch" and rc["mpi"] == {"processCountPerNode": 4, "nodeCount": 8}
    assert failure_detection.mpi_env().items() <= rc["environmentVariables"].items()
    assert "--trainer.strategy=horovod" in rc["arguments"]


def test_v1_submit_goes_to_the_experiment_and_creates_the_cluster(staged, monkeypatch, capsys):
    from azureml.core import Experiment, Run, Workspace
    from azureml.core.compute import ComputeTarget
    from azureml.core.compute.amlcompute import AmlComputeProvisioningConfiguration
    from azureml.core.compute_target import ComputeTargetException

    workspace = create_autospec(Workspace, instance=True)
    compute_cls = create_autospec(ComputeTarget)
    compute_cls.side_effect = ComputeTargetException("ComputeTargetNotFound")
    monkeypatch.setattr("azureml.core.compute.ComputeTarget", compute_cls)
    experiment = create_autospec(Experiment, instance=True)
    run = create_autospec(Run, instance=True)
    run.id = "adasum_1"
    run.get_portal_url.return_value = "https://ml.azure.com/runs/adasum_1"
    experiment.submit.return_value = run
    made = []

    def experiment_factory(ws, name):
        made.append((ws, name))
        return experiment

    monkeypatch.setattr("azureml.core.Environment.get", _not_registered)
    job = AmlJob()
    out = sdk_v1.submit(
        job,
        staged,
        CONFIG,
        workspace=workspace,
        experiment_factory=experiment_factory,
        upload_build_context=False,
    )
    assert out == (run, None) and made == [(workspace, "adasum-lightning-mnist")]
    compute_cls.assert_called_once_with(workspace=workspace, name="adasum-nc64t4")
    (ws, name, config), _ = compute_cls.create.call_args
    assert (ws, name) == (workspace, "adasum-nc64t4") and isinstance(
        config, AmlComputeProvisioningConfiguration
    )
    scale = config.scale_settings
    assert (config.vm_size, scale.minimum_node_count, scale.maximum_node_count) == (
        "Standard_NC64as_T4_v3",
        0,
        8,
    )
    assert scale.idle_seconds_before_scaledown == 1800
    (src,), _ = experiment.submit.call_args
    rc = sdk_v1.run_configuration(src)
    assert rc["mpi"] == {"processCountPerNode": 4, "nodeCount": 8} and rc["environmentVariables"] == ENV
    assert "https://ml.azure.com/runs/adasum_1" in capsys.readouterr().out


def test_v1_existing_cluster_of_another_size_is_refused(staged, monkeypatch):
    from azureml.core import Workspace
    from azureml.core.compute import ComputeTarget

    existing = create_autospec(ComputeTarget, instance=True)
    existing.vm_size = "Standard_NC96ads_A100_v4"
    monkeypatch.setattr(
        "azureml.core.compute.ComputeTarget", create_autospec(ComputeTarget, return_value=existing)
    )
    with pytest.raises(
        AmlUsageError, match=r"exists with VM size Standard_NC96ads_A100_v4.*--cluster NEW_NAME"
    ):
        sdk_v1.get_or_create_cluster(create_autospec(Workspace, instance=True), AmlJob())


# -- SDK v2 ------------------------------------------------------------------------------------------
def test_v2_command_job(staged, tmp_path):
    from azure.ai.ml import MpiDistribution, load_job
    from azure.ai.ml.entities import CommandJob

    job_entity = sdk_v2.build(AmlJob(), staged)
    assert isinstance(job_entity, CommandJob) and isinstance(job_entity.distribution, MpiDistribution)
    assert (
        job_entity.resources.instance_count == 8 and job_entity.distribution.process_count_per_instance == 4
    )
    assert job_entity.command.startswith("python mnist.py fit --trainer.strategy=horovod_adasum ")
    text = sdk_v2.render(job_entity)
    data = yaml.safe_load(text)
    assert data["type"] == "command" and data["compute"] == "azureml:adasum-nc64t4"
    assert data["resources"] == {"instance_count": 8, "properties": {}, "shm_size": "16g"}
    assert data["distribution"] == {"type": "mpi", "process_count_per_instance": 4}
    assert "--trainer.strategy=horovod_adasum" in data["command"].split()
    assert "--trainer.accelerator=gpu" in data["command"].split()
    assert data["environment_variables"] == ENV
    assert data["environment"]["build"] == {"path": str(staged.context_dir), "dockerfile_path": "Dockerfile"}
    assert data["code"] == str(staged.code_dir) and data["experiment_name"] == "adasum-lightning-mnist"
    (tmp_path / "job.yml").write_text(text)
    reloaded = load_job(tmp_path / "job.yml")
    assert reloaded.resources.instance_count == 8 and reloaded.distribution.process_count_per_instance == 4
    assert reloaded.command == job_entity.command


def test_v2_pytorch_job_for_ddp_adasum(staged_ddp, tmp_path):
    from azure.ai.ml import PyTorchDistribution, load_job

    job_entity = sdk_v2.build(AmlJob(**DDP_JOB), staged_ddp)
    assert isinstance(job_entity.distribution, PyTorchDistribution)
    text = sdk_v2.render(job_entity)
    data = yaml.safe_load(text)
    assert data["distribution"] == {"type": "pytorch", "process_count_per_instance": 4}
    assert data["resources"] == {"instance_count": 3, "properties": {}, "shm_size": "16g"}
    words = data["command"].split()
    assert words[:4] == ["python", "mnist.py", "fit", "--trainer.strategy=adasum_lightning.DDPAdasumStrategy"]
    timeout = str(failure_detection.DDP_PROCESS_GROUP_TIMEOUT)
    for arg in (f"--trainer.strategy.timeout={timeout}", "--trainer.devices=4", "--trainer.num_nodes=3"):
        assert arg in words, arg
    assert "--trainer.accelerator=gpu" in words
    assert data["environment_variables"] == DDP_ENV
    assert data["environment"]["name"] == "adasum-lightning-ddp"
    assert data["environment"]["build"] == {
        "path": str(staged_ddp.context_dir),
        "dockerfile_path": "Dockerfile",
    }
    assert data["tags"]["strategy"] == "ddp_adasum" and data["tags"]["world_size"] == "12"
    (tmp_path / "job.yml").write_text(text)
    reloaded = load_job(tmp_path / "job.yml")
    assert isinstance(reloaded.distribution, PyTorchDistribution)
    assert reloaded.distribution.process_count_per_instance == 4 and reloaded.resources.instance_count == 3


def test_v2_mpi_job_carries_the_open_mpi_fault_settings(staged):
    data = yaml.safe_load(sdk_v2.render(sdk_v2.build(AmlJob(strategy="horovod", node_count=3), staged)))
    assert data["distribution"] == {"type": "mpi", "process_count_per_instance": 4}
    assert failure_detection.mpi_env().items() <= data["environment_variables"].items()


def _mock_client():
    from azure.ai.ml import MLClient
    from azure.ai.ml.operations import ComputeOperations, EnvironmentOperations, JobOperations
    from azure.core.exceptions import ResourceNotFoundError

    client = create_autospec(MLClient, instance=True)
    client.compute = create_autospec(ComputeOperations, instance=True)
    client.jobs = create_autospec(JobOperations, instance=True)
    client.environments = create_autospec(EnvironmentOperations, instance=True)
    client.environments.get.side_effect = ResourceNotFoundError("no such environment")
    return client


def test_v2_submit_creates_the_cluster_and_the_job(staged, capsys):
    from azure.ai.ml.entities import AmlCompute, CommandJob
    from azure.core.exceptions import ResourceNotFoundError

    client = _mock_client()
    client.compute.get.side_effect = ResourceNotFoundError("no such compute")
    created = client.jobs.create_or_update.return_value
    created.name, created.studio_url = "adasum_job_1", "https://ml.azure.com/runs/adasum_job_1"
    assert sdk_v2.submit(AmlJob(), staged, CONFIG, client=client) == (created, None)
    client.compute.get.assert_called_once_with("adasum-nc64t4")
    (cluster,), _ = client.compute.begin_create_or_update.call_args
    assert isinstance(cluster, AmlCompute)
    assert (cluster.name, cluster.size, cluster.min_instances, cluster.max_instances) == (
        "adasum-nc64t4",
        "Standard_NC64as_T4_v3",
        0,
        8,
    )
    (job_entity,), kwargs = client.jobs.create_or_update.call_args
    assert kwargs == {"experiment_name": "adasum-lightning-mnist"} and isinstance(job_entity, CommandJob)
    assert (
        job_entity.resources.instance_count == 8 and job_entity.distribution.process_count_per_instance == 4
    )
    assert dict(job_entity.environment_variables) == ENV
    assert "https://ml.azure.com/runs/adasum_job_1" in capsys.readouterr().out


def test_v2_submit_of_ddp_adasum_sends_a_pytorch_job(staged_ddp):
    from azure.ai.ml import PyTorchDistribution
    from azure.ai.ml.entities import AmlCompute

    client = _mock_client()
    client.compute.get.return_value = AmlCompute(
        name="adasum-nc64t4", size="Standard_NC64as_T4_v3", max_instances=8
    )
    sdk_v2.submit(AmlJob(**DDP_JOB), staged_ddp, CONFIG, client=client)
    (job_entity,), _ = client.jobs.create_or_update.call_args
    assert isinstance(job_entity.distribution, PyTorchDistribution)
    assert (
        job_entity.distribution.process_count_per_instance == 4 and job_entity.resources.instance_count == 3
    )


def test_v2_existing_cluster_too_small_is_refused(staged):
    from azure.ai.ml.entities import AmlCompute

    client = _mock_client()
    client.compute.get.return_value = AmlCompute(
        name="adasum-nc64t4", size="Standard_NC64as_T4_v3", max_instances=4
    )
    with pytest.raises(AmlUsageError, match=r"scales to 4 nodes, fewer than --nodes 8"):
        sdk_v2.submit(AmlJob(), staged, CONFIG, client=client)
    client.jobs.create_or_update.assert_not_called()


def test_v2_authentication_failure_is_reported_without_the_secret(staged, monkeypatch):
    from azure.core.exceptions import ClientAuthenticationError

    monkeypatch.setenv("AZURE_CLIENT_SECRET", "s3cr3t-value")
    client = _mock_client()
    client.compute.get.side_effect = ClientAuthenticationError("bad client secret s3cr3t-value")
    with pytest.raises(AmlSubmitError, match=r"Azure authentication failed.*az login") as info:
        sdk_v2.submit(AmlJob(), staged, CONFIG, client=client)
    assert "s3cr3t-value" not in str(info.value)


# -- the command line --------------------------------------------------------------------------------
def test_dry_run_v1_prints_the_complete_run_configuration(capsys, tmp_path):
    assert cli.main(["submit", "--sdk", "v1", "--dry-run", "--staging-dir", str(tmp_path)]) == 0
    out = capsys.readouterr()
    rc = json.loads(out.out)
    assert rc["mpi"] == {"processCountPerNode": 4, "nodeCount": 8} and rc["script"] == "mnist.py"
    assert rc["environment"]["docker"]["buildContext"]["location"] == str(tmp_path / "image")
    assert "nothing was sent to Azure" in out.err


def test_dry_run_v2_prints_the_job_yaml_with_pass_through_args(capsys, tmp_path):
    argv = ["submit", "--sdk", "v2", "--dry-run", "--nodes", "4", "--staging-dir", str(tmp_path)]
    assert cli.main([*argv, "--", "--trainer.max_epochs=2"]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert (
        data["resources"]["instance_count"] == 4 and data["distribution"]["process_count_per_instance"] == 4
    )
    assert data["command"].endswith("--trainer.default_root_dir=outputs --trainer.max_epochs=2")


def test_dry_run_v1_ddp_adasum_prints_a_pytorch_job(capsys, tmp_path):
    argv = ["submit", "--strategy", "ddp_adasum", "--sdk", "v1", "--dry-run", "--nodes", "3"]
    assert cli.main([*argv, "--staging-dir", str(tmp_path)]) == 0
    out = capsys.readouterr()
    rc = json.loads(out.out)
    assert rc["framework"] == "PyTorch" and rc["pytorch"]["processCount"] == 12 and rc["nodeCount"] == 3
    assert "--trainer.num_nodes=3" in rc["arguments"] and "--trainer.devices=4" in rc["arguments"]
    assert not any(k.startswith("OMPI_") for k in rc["environmentVariables"])
    assert not (tmp_path / "image" / "patches").exists()
    assert re.search(
        r"mnist.py with ddp_adasum as a PyTorch job, image adasum-lightning-ddp-[0-9a-f]{16}, "
        r"3 nodes × 4 processes \(12 GPUs\)",
        out.err,
    )


def test_dry_run_v2_ddp_adasum_takes_a_world_size_that_is_no_power_of_2(capsys, tmp_path):
    argv = ["submit", "--strategy", "ddp_adasum", "--sdk", "v2", "--dry-run", "--nodes", "3"]
    assert (
        cli.main([*argv, "--gpus-per-node", "3", "--staging-dir", str(tmp_path), "--trainer.max_epochs=2"])
        == 0
    )
    data = yaml.safe_load(capsys.readouterr().out)
    assert data["distribution"] == {"type": "pytorch", "process_count_per_instance": 3}
    assert data["resources"]["instance_count"] == 3
    words = data["command"].split()
    assert "--trainer.devices=3" in words and "--trainer.num_nodes=3" in words
    assert words[-1] == "--trainer.max_epochs=2"


@pytest.mark.parametrize("sdk", ["v1", "v2"])
@pytest.mark.parametrize("strategy", ["horovod_adasum", "horovod"])
def test_dry_run_of_mpi_jobs_shows_the_open_mpi_fault_settings(sdk, strategy, capsys, tmp_path):
    argv = ["submit", "--strategy", strategy, "--sdk", sdk, "--dry-run", "--staging-dir", str(tmp_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    env = (
        json.loads(out)["environmentVariables"]
        if sdk == "v1"
        else yaml.safe_load(out)["environment_variables"]
    )
    assert failure_detection.mpi_env().items() <= env.items()
    assert all(name.startswith("OMPI_MCA_") for name in failure_detection.mpi_env())


@pytest.mark.walltime
@pytest.mark.parametrize("sdk", ["v1", "v2"])
def test_submit_without_network_fails_fast_and_creates_no_credential(sdk, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    monkeypatch.setenv("AZURE_CLIENT_SECRET", "s3cr3t-value")
    config = tmp_path / "config_aml.json"
    config.write_text(json.dumps({"subscription_id": SUB, "resource_group": "rg", "workspace_name": "ws"}))
    start = time.monotonic()
    assert cli.main(["submit", "--sdk", sdk, "--config", str(config)]) == 1
    assert time.monotonic() - start < 10
    out = capsys.readouterr()
    assert "adasum-aml: submit failed: cannot reach management.azure.com:443" in out.err
    assert "s3cr3t-value" not in out.out + out.err


# -- low-priority (spot) clusters and resume --------------------------------------------------------------
def test_v2_low_priority_creates_a_low_priority_cluster_and_a_job_that_resumes(staged):
    from azure.ai.ml.entities import AmlCompute
    from azure.core.exceptions import ResourceNotFoundError

    client = _mock_client()
    client.compute.get.side_effect = ResourceNotFoundError("no such compute")
    job = AmlJob(low_priority=True)
    sdk_v2.submit(job, staged, CONFIG, client=client)
    (cluster,), _ = client.compute.begin_create_or_update.call_args
    assert isinstance(cluster, AmlCompute) and cluster.tier == "low_priority"
    assert cluster._to_rest_object().properties.properties.vm_priority == "LowPriority"
    (job_entity,), _ = client.jobs.create_or_update.call_args
    output = job_entity.outputs["checkpoints"]
    assert output.path == _checkpoints(job) and output.mode == "rw_mount"
    assert job_entity.command.endswith(
        "--trainer.callbacks+=ModelCheckpoint '--trainer.callbacks.dirpath=${{outputs.checkpoints}}' "
        "--trainer.callbacks.save_last=true --ckpt_path=last"
    )


def test_v2_low_priority_on_an_existing_dedicated_cluster_is_refused(staged):
    from azure.ai.ml.entities import AmlCompute

    client = _mock_client()
    client.compute.get.return_value = AmlCompute(
        name="adasum-nc64t4", size="Standard_NC64as_T4_v3", max_instances=8, tier="dedicated"
    )
    with pytest.raises(AmlUsageError, match=r"exists with dedicated VMs, so --low-priority would not apply"):
        sdk_v2.submit(AmlJob(low_priority=True), staged, CONFIG, client=client)
    client.jobs.create_or_update.assert_not_called()


def test_v1_low_priority_creates_a_low_priority_cluster_and_a_run_that_resumes(staged, monkeypatch):
    from azureml.core import Workspace
    from azureml.core.compute import ComputeTarget
    from azureml.core.compute_target import ComputeTargetException

    compute_cls = create_autospec(ComputeTarget)
    compute_cls.side_effect = ComputeTargetException("ComputeTargetNotFound")
    monkeypatch.setattr("azureml.core.compute.ComputeTarget", compute_cls)
    job = AmlJob(low_priority=True)
    sdk_v1.get_or_create_cluster(create_autospec(Workspace, instance=True), job)
    (_, _, config), _ = compute_cls.create.call_args
    assert config.vm_priority == "lowpriority"
    rc = sdk_v1.run_configuration(sdk_v1.build_script_run_config(job, staged.code_dir, None))
    location = rc["outputData"]["checkpoints"]["outputLocation"]["dataPath"]
    assert location == {
        "datastoreName": "workspaceblobstore",
        "relativePath": _checkpoints(job).split("/paths/", 1)[1],
    }
    assert rc["arguments"][-4:] == [
        "--trainer.callbacks+=ModelCheckpoint",
        "--trainer.callbacks.dirpath=$AZUREML_DATAREFERENCE_checkpoints",
        "--trainer.callbacks.save_last=true",
        "--ckpt_path=last",
    ]


def test_dry_run_of_a_low_priority_job_shows_its_checkpoint_output_and_resume(capsys, tmp_path):
    argv = [
        "submit",
        "--low-priority",
        "--strategy",
        "ddp_adasum",
        "--dry-run",
        "--staging-dir",
        str(tmp_path),
    ]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    data = yaml.safe_load(out)
    output = data["outputs"]["checkpoints"]
    assert output["mode"] == "rw_mount"
    assert output["path"].startswith(
        "azureml://datastores/workspaceblobstore/paths/adasum-checkpoints/adasum-lightning-mnist/"
    )
    assert data["command"].endswith("--trainer.callbacks.save_last=true --ckpt_path=last")
    assert "(0–8 low-priority nodes)" in err and f"checkpoints in {output['path']}, a restart resumes" in err


def _checkpoints(job: AmlJob) -> str:
    (uri,) = [b.uri for b in job.data if b.name == "checkpoints"]
    assert uri.startswith(
        "azureml://datastores/workspaceblobstore/paths/adasum-checkpoints/adasum-lightning-mnist/"
    )
    return uri
