"""``adasum-aml submit --local N`` (the job's command under horovodrun) and the example's MLflow hook."""

from __future__ import annotations

import csv
import sys

import pytest

from adasum_lightning.aml import cli
from adasum_lightning.aml.job import AmlJob
from adasum_lightning.aml.local import local_command
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
