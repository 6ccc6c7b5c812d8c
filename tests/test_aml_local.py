"""``adasum-aml submit --local N`` (the job's command under horovodrun, or for ``ddp_adasum`` N processes
started as an Azure ML PyTorch job starts them) and the example's MLflow hook."""

from __future__ import annotations

import csv
import sys
import time

import pytest
import torch

from adasum_lightning import failure_detection
from adasum_lightning.aml import cli, local
from adasum_lightning.aml.job import AmlJob
from adasum_lightning.aml.local import local_command, pytorch_job_environment
from examples import mnist
from tests.aml_support import no_network  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("no_network")


def test_local_command_is_the_job_command_plus_cpu_overrides(tmp_path):
    job = AmlJob(training_args=["--model.lr=0.02"])
    cmd = local_command(job, 4, tmp_path / "data", tmp_path / "out", 3)
    assert cmd[1:6] == ["-np", "4", "-H", "localhost:4", "--mpi"]
    start = cmd.index(sys.executable)
    assert cmd[start + 1 : start + 1 + len(job.training_command()) - 1] == job.training_command()[1:]
    assert cmd[-6:] == [
        "--trainer.accelerator=cpu",
        "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=3",
        "--trainer.limit_val_batches=3",
        f"--data.data_dir={tmp_path / 'data'}",
        f"--trainer.default_root_dir={tmp_path / 'out'}",
    ]


@pytest.mark.mpi
def test_local_2_trains_a_few_batches_with_2_processes(mnist_root, tmp_path, capfd, monkeypatch):
    if mnist_root is None:
        pytest.skip("MNIST is absent and could not be downloaded")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    argv = ["submit", "--local", "2", "--local-batches", "3", "--data-dir", str(mnist_root)]
    rc = cli.main([*argv, "--staging-dir", str(tmp_path), "--", "--trainer.log_every_n_steps=1"])
    out = capfd.readouterr()
    text = out.out + out.err
    assert rc == 0, text[-4000:]
    assert "HorovodAdasumStrategy: world size 2, Horovod Adasum reduction" in text
    assert "--trainer.strategy=horovod_adasum" in text  # the job's command was run
    assert "val_acc=" in text
    version = tmp_path / "outputs" / "lightning_logs" / "version_0"
    rows = list(csv.DictReader((version / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows if r.get("train_loss")] == [0, 1, 2]  # 3 batches on rank 0
    assert any(r.get("val_acc") for r in rows)
    config = (version / "config.yaml").read_text()
    assert "strategy: horovod_adasum" in config and "accelerator: cpu" in config


# -- ddp_adasum: the processes of an Azure ML PyTorch job, here ------------------------------------------
def test_ddp_local_command_is_the_job_command_on_one_node_without_horovodrun(tmp_path):
    job = AmlJob(strategy="ddp_adasum", training_args=["--model.lr=0.02"])
    cmd = local_command(job, 3, tmp_path / "data", tmp_path / "out", 2)
    assert cmd[: len(job.training_command())] == job.training_command(python=sys.executable)
    assert not any("horovodrun" in c or "mpirun" in c for c in cmd)
    assert cmd[-8:] == [
        "--trainer.accelerator=cpu",
        "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=2",
        "--trainer.limit_val_batches=2",
        f"--data.data_dir={tmp_path / 'data'}",
        f"--trainer.default_root_dir={tmp_path / 'out'}",
        "--trainer.devices=3",  # N processes on one node (LightningCLI: the last value wins)
        "--trainer.num_nodes=1",
    ]


def test_each_local_process_gets_what_azure_ml_sets():
    assert pytorch_job_environment(3, 2, 29501) == {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29501",
        "WORLD_SIZE": "3",
        "NODE_RANK": "0",
        "RANK": "2",
        "LOCAL_RANK": "2",
    }


def test_local_processes_inherit_no_other_launchers_variables():
    """So that Lightning picks LightningEnvironment, as on Azure ML (TORCHELASTIC_RUN_ID would select
    TorchElasticEnvironment, SLURM_NTASKS SLURMEnvironment; OMPI_COMM_WORLD_RANK sets rank-zero logging)."""
    inherited = {
        "PATH": "/bin",
        "NCCL_DEBUG": "WARN",
        "TORCHELASTIC_RUN_ID": "x",
        "GROUP_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "SLURM_NTASKS": "4",
        "OMPI_COMM_WORLD_RANK": "3",
        "HOROVOD_RANK": "3",
        "RANK": "7",
        "MASTER_PORT": "1",
    }
    assert local._without_other_launchers(inherited) == {"PATH": "/bin", "NCCL_DEBUG": "WARN"}


@pytest.mark.walltime
def test_when_one_local_process_fails_the_others_are_stopped(tmp_path):
    code = "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(120)\n"
    envs = [pytorch_job_environment(3, rank, 1) for rank in range(3)]
    start = time.monotonic()
    assert local._run_processes([sys.executable, "-c", code], envs, cwd=tmp_path, timeout=60) == 3
    assert time.monotonic() - start < 30  # the sleeping ones got SIGTERM, not the 120 s


def test_local_ddp_run_times_out_with_124(tmp_path):
    envs = [pytorch_job_environment(2, rank, 1) for rank in range(2)]
    assert (
        local._run_processes(
            [sys.executable, "-c", "import time; time.sleep(120)"], envs, cwd=tmp_path, timeout=1
        )
        == 124
    )


def test_local_3_ddp_adasum_trains_a_few_batches_with_3_processes(mnist_root, tmp_path, capfd, monkeypatch):
    """3 processes (no power of 2: ddp_adasum takes any world size) with Azure ML's variables: Lightning's
    LightningEnvironment (no torchrun, no MPI) computes the ranks from NODE_RANK, LOCAL_RANK and devices."""
    if mnist_root is None:
        pytest.skip("MNIST is absent and could not be downloaded")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "not-for-the-local-run")  # not passed on (as on Azure ML)
    argv = ["submit", "--strategy", "ddp_adasum", "--local", "3", "--local-batches", "3"]
    argv += ["--data-dir", str(mnist_root), "--staging-dir", str(tmp_path)]
    rc = cli.main([*argv, "--", "--trainer.log_every_n_steps=1"])
    out = capfd.readouterr()
    text = out.out + out.err
    assert rc == 0, text[-4000:]
    assert "3 processes started as an Azure ML PyTorch job starts them" in text
    assert "horovodrun" not in text and "--trainer.strategy=adasum_lightning.DDPAdasumStrategy" in text
    assert "DDPAdasumStrategy: world size 3, Adasum of parameter deltas over gloo" in text
    for rank in range(3):
        assert f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/3" in text
    assert "val_acc=" in text
    version = tmp_path / "outputs" / "lightning_logs" / "version_0"
    rows = list(csv.DictReader((version / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows if r.get("train_loss")] == [0, 1, 2]  # 3 batches on rank 0
    assert any(r.get("val_acc") for r in rows)
    config = (version / "config.yaml").read_text()
    assert "class_path: adasum_lightning.DDPAdasumStrategy" in config
    assert f"timeout: {str(failure_detection.DDP_PROCESS_GROUP_TIMEOUT)}" in config
    assert "accelerator: cpu" in config and "devices: '3'" in config and "num_nodes: 1" in config


def test_a_rerun_of_a_resume_job_resumes_from_its_last_checkpoint(mnist_root, tmp_path, capfd, monkeypatch):
    """What Azure ML does after a preemption, here: the same job run again with the same checkpoint output.
    The first run starts fresh and keeps last.ckpt (and each rank's optimizer file) there; the second restores
    it and trains no step again (its epoch is done)."""
    if mnist_root is None:
        pytest.skip("MNIST is absent and could not be downloaded")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    checkpoints = tmp_path / "checkpoints"
    argv = ["submit", "--strategy", "ddp_adasum", "--local", "2", "--local-batches", "2", "--resume"]
    argv += ["--output", f"checkpoints={checkpoints}", "--data-dir", str(mnist_root)]
    steps = []
    for run in ("first", "second"):
        rc = cli.main([*argv, "--staging-dir", str(tmp_path / run)])
        out = capfd.readouterr()
        text = out.out + out.err
        assert rc == 0, text[-4000:]
        assert f"--trainer.callbacks.dirpath={checkpoints}" in text
        steps.append(torch.load(checkpoints / "last.ckpt", weights_only=False)["global_step"])
        restored = f"Restoring states from the checkpoint path at {checkpoints / 'last.ckpt'}" in text
        assert restored == (run == "second"), text[-4000:]
    assert steps == [2, 2]
    assert sorted(p.name for p in checkpoints.glob("last*")) == ["last.ckpt", "last.ckpt.rank1-optimizer.pt"]


# -- MLflow logging on Azure ML (examples/mnist.py) ----------------------------------------------------
def test_without_mlflow_uri_the_example_logs_to_csv_only(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    logger = mnist.default_logger(str(tmp_path))
    assert type(logger).__name__ == "CSVLogger" and logger.save_dir == str(tmp_path)


def test_with_mlflow_uri_the_example_adds_lightnings_mlflow_logger(tmp_path, monkeypatch):
    made = {}

    class RecordingMLFlowLogger:
        def __init__(self, **kwargs):
            made.update(kwargs)

    monkeypatch.setattr("pytorch_lightning.loggers.MLFlowLogger", RecordingMLFlowLogger)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "azureml://eastus.api.azureml.ms/mlflow/v1.0/subscriptions/x")
    monkeypatch.setenv("MLFLOW_RUN_ID", "adasum_run_1")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "adasum-lightning-mnist")
    csv_logger, mlflow_logger = mnist.default_logger(str(tmp_path))
    assert type(csv_logger).__name__ == "CSVLogger" and isinstance(mlflow_logger, RecordingMLFlowLogger)
    assert made == {
        "experiment_name": "adasum-lightning-mnist",
        "tracking_uri": "azureml://eastus.api.azureml.ms/mlflow/v1.0/subscriptions/x",
        "run_id": "adasum_run_1",
    }


def test_with_mlflow_uri_but_no_mlflow_package_the_example_warns(tmp_path, monkeypatch):
    try:
        import mlflow  # noqa: F401

        pytest.skip("mlflow is installed here")
    except ImportError:
        pass
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:///tmp/mlruns")
    with pytest.warns(UserWarning, match="MLFLOW_TRACKING_URI is set but MLflow logging is off"):
        logger = mnist.default_logger(str(tmp_path))
    assert type(logger).__name__ == "CSVLogger"
