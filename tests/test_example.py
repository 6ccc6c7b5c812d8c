"""The MNIST example: its data handling, and the real 3-epoch run with 2 processes."""

import csv
import gzip
import re
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from torchvision import datasets  # noqa: E402

from examples.mnist import MNISTDataModule  # noqa: E402
from tests.helpers import ROOT, plain_env, run_horovod, run_job

FILES = [name for name, _ in datasets.MNIST.resources]


def _readonly_copy(src_root, dst_root):
    raw = dst_root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in FILES:
        shutil.copyfile(src_root / "MNIST" / "raw" / name, raw / name)
    for path in (raw, raw.parent, dst_root):
        path.chmod(stat.S_IRUSR | stat.S_IXUSR)
    return dst_root


def test_read_only_data_dir_is_copied_to_the_cache(mnist_root, tmp_path, monkeypatch):
    if mnist_root is None:
        pytest.skip("MNIST is absent and could not be downloaded")
    if not (mnist_root / "MNIST" / "raw" / FILES[0]).exists():
        pytest.skip("only extracted MNIST files are available")
    ro = _readonly_copy(mnist_root, tmp_path / "ro")
    monkeypatch.setenv("ADASUM_DATA_CACHE", str(tmp_path / "cache"))
    try:
        dm = MNISTDataModule(data_dir=str(ro))
        assert dm.root() == tmp_path / "cache"
        dm.prepare_data()
        dm.setup("fit")
        assert (len(dm.train_set), len(dm.val_set)) == (60000, 10000)
        assert sorted(p.name for p in ro.joinpath("MNIST", "raw").iterdir()) == sorted(FILES)  # untouched
    finally:
        for path in (ro, ro / "MNIST", ro / "MNIST" / "raw"):
            path.chmod(stat.S_IRWXU)


def test_corrupt_gz_names_the_file(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    with gzip.open(raw / "train-labels-idx1-ubyte.gz", "wb") as f:
        f.write(b"not mnist")
    with pytest.raises(RuntimeError, match=r"train-labels-idx1-ubyte\.gz is corrupt \(MD5 mismatch"):
        MNISTDataModule(data_dir=str(tmp_path)).prepare_data()


def test_missing_data_without_network_says_where_to_put_the_files(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.MNIST, "mirrors", ["http://127.0.0.1:9/"])  # nothing listens: no network
    with pytest.raises(RuntimeError) as info:
        MNISTDataModule(data_dir=str(tmp_path / "empty")).prepare_data()
    message = str(info.value)
    assert "could not be downloaded" in message
    assert f"{tmp_path / 'empty' / 'MNIST' / 'raw'}/" in message and "train-images-idx3-ubyte.gz" in message


@pytest.mark.slow
@pytest.mark.mpi
def test_the_plain_loop_and_the_fabric_example_train_mnist_alike(mnist_root, tmp_path):
    # the README's launch lines, one epoch: the same seed, model, shards and arithmetic in both loops
    if mnist_root is None:
        pytest.skip("MNIST is absent and could not be downloaded")
    data = ["--data-dir", str(mnist_root), "--epochs", "1"]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    plain = run_job([torchrun, "--standalone", "--nproc-per-node", "2", "examples/mnist_plain.py", *data],
                    plain_env(), timeout=300)  # fmt: skip
    fabric = run_job([sys.executable, "examples/mnist_fabric.py", "--devices", "2", *data], plain_env(), 300)
    lines = [re.findall(r"epoch=0 val_acc=([0-9.]+)", proc.stdout) for proc in (plain, fabric)]
    assert lines[0] == lines[1] and len(lines[0]) == 1, (plain.stdout[-2000:], fabric.stdout[-2000:])
    assert float(lines[0][0]) >= 0.90


@dataclass(frozen=True)
class ExampleFit:
    """A finished run of examples/mnist.py: its output and the validation accuracy logged per epoch."""

    stdout: str
    val_acc: list[str]  # metrics.csv's values, as written


_FITS: dict[tuple[str, int], ExampleFit] = {}


def fit_example(strategy: str, epochs: int, data: Path, tmp_path_factory) -> ExampleFit:
    """The README's launch line of ``strategy`` on 2 processes for ``epochs`` epochs (examples/mnist.yaml
    otherwise), once per session: ddp_adasum as a plain python command (Lightning starts the second process),
    horovod_adasum under horovodrun."""
    if (strategy, epochs) in _FITS:
        return _FITS[strategy, epochs]
    out = tmp_path_factory.mktemp(f"{strategy}-{epochs}")
    args = [
        "fit",
        "--config",
        str(ROOT / "examples" / "mnist.yaml"),
        f"--trainer.strategy={strategy}",
        f"--trainer.max_epochs={epochs}",
        f"--data.data_dir={data}",
        f"--trainer.default_root_dir={out}",
        "--trainer.enable_progress_bar=false",
    ]
    if strategy == "ddp_adasum":
        cmd = [sys.executable, str(ROOT / "examples" / "mnist.py"), *args, "--trainer.devices=2"]
        proc = subprocess.run(cmd, env=plain_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    else:
        proc = run_horovod(2, ROOT / "examples" / "mnist.py", *args, timeout=600)
    rows = list(csv.DictReader((out / "lightning_logs" / "version_0" / "metrics.csv").open()))
    assert list(rows[0])[:2] == ["epoch", "step"] and "val_acc" in rows[0], rows[0]
    logged = [(row["epoch"], row["val_acc"]) for row in rows if row["val_acc"]]
    assert [epoch for epoch, _ in logged] == [str(e) for e in range(epochs)], logged  # once per epoch
    _FITS[strategy, epochs] = ExampleFit(proc.stdout, [value for _, value in logged])
    return _FITS[strategy, epochs]


@pytest.mark.slow
@pytest.mark.mpi
def test_two_processes_reach_95_percent_in_three_epochs(mnist_root, tmp_path_factory):
    # `make demo-ddp` and the README's quick start: ddp_adasum, 3 epochs
    if mnist_root is None:
        pytest.skip("MNIST is absent and could not be downloaded")
    fit = fit_example("ddp_adasum", 3, mnist_root, tmp_path_factory)
    found = re.findall(r"val_acc=([0-9.]+)", fit.stdout)
    assert len(found) == 1, fit.stdout[-2000:]  # printed once, by rank 0
    assert float(found[0]) >= 0.95 and float(fit.val_acc[-1]) == pytest.approx(float(found[0]), abs=1e-4)


@pytest.mark.slow
@pytest.mark.mpi
def test_horovod_adasum_trains_the_example_as_ddp_adasum_does(mnist_root, tmp_path_factory):
    # `make demo`: horovod_adasum under horovodrun, one epoch; it ends at ddp_adasum's first-epoch validation
    # accuracy to the last digit (the same Adasum of the same deltas: seed, shards and data order agree).
    if mnist_root is None:
        pytest.skip("MNIST is absent and could not be downloaded")
    horovod = fit_example("horovod_adasum", 1, mnist_root, tmp_path_factory)
    assert len(re.findall(r"val_acc=([0-9.]+)", horovod.stdout)) == 1, horovod.stdout[-2000:]  # rank 0
    assert horovod.val_acc == fit_example("ddp_adasum", 3, mnist_root, tmp_path_factory).val_acc[:1]


@pytest.mark.mpi
def test_torchrun_starts_the_example_with_ddp_adasum(mnist_root, tmp_path):
    # docs/launching.md's one-node torchrun line, a few batches: torchrun starts the processes, Lightning's
    # TorchElasticEnvironment gives the ranks, and the example trains and validates with ddp_adasum.
    if mnist_root is None:
        pytest.skip("MNIST is absent and could not be downloaded")
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "examples/mnist.py", "fit",
           "--config", "examples/mnist.yaml", "--trainer.strategy=ddp_adasum", "--trainer.devices=2",
           f"--data.data_dir={mnist_root}", f"--trainer.default_root_dir={tmp_path}",
           "--trainer.max_epochs=1", "--trainer.limit_train_batches=8", "--trainer.limit_val_batches=2",
           "--trainer.enable_progress_bar=false"]  # fmt: skip
    proc = run_job(cmd, plain_env(), timeout=300)
    found = re.findall(r"val_acc=([0-9.]+)", proc.stdout)
    assert len(found) == 1, proc.stdout[-2000:]  # printed once, by rank 0
    metrics = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "val_acc" in metrics.splitlines()[0]


def test_cli_names_an_unreadable_checkpoint(tmp_path):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"garbage")
    cmd = [sys.executable, str(ROOT / "examples" / "mnist.py"), "fit", f"--ckpt_path={bad}",
           f"--data.data_dir={tmp_path}", f"--trainer.default_root_dir={tmp_path}"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"RuntimeError: checkpoint {bad} could not be read on rank 0 (UnpicklingError" in out.stderr
    assert "pass another ckpt_path, or ckpt_path=None" in out.stderr
