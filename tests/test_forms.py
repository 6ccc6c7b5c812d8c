"""The three forms of Adasum on one core: ``AdasumOptimizer`` in a plain loop (``torchrun``),
``Fabric(strategy="ddp_adasum")`` (``fabric.launch()``) and ``Trainer(strategy="ddp_adasum")`` (Lightning's
launcher) train the same model on the same shards to the same parameters.

Every test runs real processes (``tests/workers/forms.py``) and checks every rank. Equality is bitwise: the
three forms run the same arithmetic (Lightning's closure, Fabric's precision plugin and the plain loop
compute the same loss, gradients, clipping, unscaling and local step; the reduction is the same function).
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from adasum_lightning.ops import adasum_reduce
from adasum_lightning.validation import check_launcher_world_size, check_module_unwrapped
from tests.helpers import (
    ROOT,
    expected_message,
    load_ranks,
    mpi_env,
    run_as_pytorch_job,
    run_job,
    run_lightning,
    run_torchrun,
)
from tests.workers.lightning import PACKAGE
from tests.workers.samples import IndexedData, tiny_net

pytestmark = pytest.mark.mpi

#: The Fabric package of the Lightning package under test (make test-compat runs each).
FABRIC = "lightning_fabric" if PACKAGE == "pytorch_lightning" else "lightning.fabric"


def train(form: str, out: Path, np: int, *args: str, fabric: str = FABRIC) -> list[dict]:
    """Run one form on ``np`` processes into ``out/form``; every rank's saved results, rank order."""
    target = out / form
    if form == "plain":
        run_torchrun(np, "forms", str(target), "--form", "plain", *args)
    else:
        run_lightning(np, "forms", str(target), "--form", form, "--fabric-package", fabric, *args)
    ranks = load_ranks(target, np)
    for r, res in enumerate(ranks):
        assert res["world_size"] == np, (form, r)
        for name, tensor in ranks[0]["end"].items():
            assert torch.equal(tensor, res["end"][name]), f"{form}: {name} differs, rank 0 vs rank {r}"
    return ranks


def assert_same_training(reference: list[dict], other: list[dict], what: str) -> None:
    """Bitwise equal parameters, the same number of steps and (per rank) the same optimizer state."""
    for r, (ref, res) in enumerate(zip(reference, other, strict=True)):
        assert res["steps"] == ref["steps"], (what, r)
        for name, tensor in ref["end"].items():
            difference = (tensor - res["end"][name]).abs().max()
            assert torch.equal(tensor, res["end"][name]), (what, r, name, difference)
        for key, state in ref["opt_state"].items():
            for name, tensor in state.items():
                assert torch.equal(tensor, res["opt_state"][key][name]), (what, r, key, name)


def three_forms(tmp_path: Path, np: int, *args: str) -> list[dict]:
    plain = train("plain", tmp_path, np, *args)
    assert plain[0]["lightning_imported"] == []  # the plain loop needs no Lightning
    assert_same_training(plain, train("fabric", tmp_path, np, *args), "fabric vs plain")
    assert_same_training(plain, train("trainer", tmp_path, np, *args), "trainer vs plain")
    return plain


@pytest.mark.compat
@pytest.mark.parametrize(
    "options",
    [
        pytest.param(("--optimizer", "sgd", "--momentum", "0.9"), id="sgd-momentum"),
        pytest.param(("--optimizer", "adam", "--lr", "0.01"), id="adam"),
    ],
)
def test_the_three_forms_train_to_identical_parameters(options, tmp_path):
    plain = three_forms(tmp_path, 2, *options)
    assert plain[0]["steps"] == 2 * 64 // 2 // 4
    # each rank kept its own optimizer state (momentum or Adam moments from its own gradients)
    first = next(iter(plain[0]["opt_state"].values()))
    name = "momentum_buffer" if "momentum_buffer" in first else "exp_avg"
    assert not torch.equal(first[name], next(iter(plain[1]["opt_state"].values()))[name])


def test_accumulation_with_a_partial_window_and_norm_clipping(tmp_path):
    # 8 batches per epoch, a step every 3: steps after batches 3, 6 and 8 (Lightning's partial window)
    plain = three_forms(tmp_path, 2, "--accumulate", "3", "--clip-norm", "0.05", "--epochs", "1")
    assert plain[0]["steps"] == 3


def test_a_step_the_gradient_scaler_skips_on_one_rank_is_a_zero_update(tmp_path):
    # rank 1's loss is infinite at step 2: its scaler skips that step, rank 0's does not
    plain = three_forms(tmp_path, 2, "--fp16-scaler", "--inf-rank", "1", "--inf-step", "2", "--epochs", "1")
    assert all(torch.isfinite(t).all() for t in plain[0]["end"].values())  # the infinite step left no trace


def test_bf16_mixed_and_value_clipping_with_fabric_as_an_instance_under_torchrun(tmp_path):
    # Fabric's strategy object, setup_module + setup_optimizers, started by torchrun (not fabric.launch())
    options = ("--bf16", "--clip-value", "0.01", "--epochs", "1")
    plain = train("plain", tmp_path, 2, *options)
    fabric_dir = tmp_path / "fabric-torchrun"
    run_torchrun(2, "forms", str(fabric_dir), "--form", "fabric", "--fabric-package", FABRIC,
                 "--fabric-instance", "--devices", "2", *options)  # fmt: skip
    fabric = load_ranks(fabric_dir, 2)
    assert fabric[0]["strategy"].endswith("fabric.ddp_adasum.DDPAdasumStrategy")
    assert_same_training(plain, fabric, "fabric (instance, torchrun) vs plain")
    assert_same_training(plain, train("trainer", tmp_path, 2, *options), "trainer vs plain")


def test_lbfgs_with_a_closure(tmp_path):
    three_forms(tmp_path, 2, "--optimizer", "lbfgs", "--epochs", "1")


def test_a_world_of_three(tmp_path):
    plain = three_forms(tmp_path, 3, "--epochs", "1")
    assert plain[0]["steps"] == 6  # 64 samples padded to 66: 22 per rank, 6 batches


def test_plain_loop_equals_the_reference_adasum_of_every_ranks_local_step(tmp_path):
    # One step on 3 ranks, computed here in one process: each rank's local SGD step from the common start on
    # its first batch, then the Adasum of the three deltas (adasum_lightning.ops.adasum_reduce).
    ranks = train("plain", tmp_path, 3, "--epochs", "1", "--max-steps", "1", "--momentum", "0")
    start = ranks[0]["start"]
    data = IndexedData(64)
    deltas = []
    for res in ranks:
        net = tiny_net()
        net.load_state_dict(start)
        x, y = data.x[res["first_batch"]], data.y[res["first_batch"]]
        torch.nn.functional.cross_entropy(net(x), y).backward()
        torch.optim.SGD(net.parameters(), lr=0.1).step()
        deltas.append({k: v.detach() - start[k] for k, v in net.state_dict().items()})
    for r, res in enumerate(ranks):
        for name, end in res["end"].items():
            expected = start[name] + adasum_reduce([d[name] for d in deltas])
            difference = (end - expected).abs().max()
            assert torch.allclose(end, expected, rtol=1e-5, atol=1e-7), (r, name, difference)


def test_fabric_save_and_load_round_trip(tmp_path):
    ranks = train("fabric", tmp_path, 2, "--epochs", "1", "--save-load")
    assert (tmp_path / "fabric" / "fabric.ckpt").is_file()
    saved = torch.load(tmp_path / "fabric" / "fabric.ckpt", weights_only=False)  # what rank 0 wrote
    for r, res in enumerate(ranks):
        assert res["loaded_step"] == res["steps"] == 8
        for name, tensor in res["end"].items():
            assert torch.equal(res["loaded"][name], tensor), (r, name)
            assert torch.equal(saved["model"][name], tensor), (r, name)
        # every rank restores rank 0's optimizer state
        for key, state in ranks[0]["opt_state"].items():
            for name, tensor in state.items():
                assert torch.equal(res["loaded_opt_state"][key][name], tensor), (r, key, name)
    # Fabric's collectives on every rank: rank r contributed r + 1
    for res in ranks:
        assert res["all_gather"] == [1.0, 2.0] and res["all_reduce_sum"] == 3.0
        assert res["broadcast"] == "from rank 0"
        assert res["strategy"].endswith("fabric.ddp_adasum.DDPAdasumStrategy")


def test_fabric_under_both_package_names_trains_identically(tmp_path):
    pytest.importorskip("lightning")
    standalone = train("fabric", tmp_path / "a", 2, "--epochs", "1", fabric="lightning_fabric")
    unified = train("fabric", tmp_path / "b", 2, "--epochs", "1", fabric="lightning.fabric")
    assert standalone[0]["strategy"] == "adasum_lightning.fabric.ddp_adasum.DDPAdasumStrategy"
    assert unified[0]["strategy"] == "adasum_lightning.lightning.fabric.ddp_adasum.DDPAdasumStrategy"
    assert_same_training(standalone, unified, "lightning.fabric vs lightning_fabric")


def test_fabric_refuses_a_module_wrapped_in_ddp_on_every_rank(tmp_path):
    proc = run_lightning(2, "forms", str(tmp_path), "--form", "fabric", "--fabric-package", FABRIC,
                         "--ddp-wrapped", check=False)  # fmt: skip
    assert proc.returncode != 0
    message = expected_message(check_module_unwrapped, "ddp_adasum", True)
    for r in range(2):
        assert f"AdasumConfigurationError on rank {r}: {message}" in proc.stderr, proc.stderr[-3000:]
    assert not list(tmp_path.glob("rank*.pt"))


def test_fabric_refuses_a_world_size_its_devices_do_not_describe(tmp_path):
    # Two processes started as an Azure ML PyTorch job starts them (no torchrun); each Fabric says devices=1
    results = run_as_pytorch_job(2, "forms", str(tmp_path), "--form", "fabric", "--devices", "1",
                                 "--fabric-package", FABRIC)  # fmt: skip
    message = expected_message(check_launcher_world_size, 2, 1, 1, api="Fabric")
    for rank, (returncode, out) in enumerate(results):
        assert returncode != 0
        assert f"AdasumConfigurationError on rank {rank}: {message}" in out, out[-3000:]


# ---------------------------------------------------------------------------------- torch only, no Lightning
def torch_only_environment(where: Path) -> Path:
    """A virtual environment holding torch and what torch requires (its installed files, linked from this
    environment), and nothing else: no Lightning, no Horovod. Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    site = next((where / "lib").glob("python3*/site-packages"))
    wanted, seen = ["torch"], set()
    while wanted:
        name = wanted.pop()
        dist = importlib.metadata.distribution(name)
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        for requirement in map(Requirement, dist.requires or []):
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                wanted.append(requirement.name)
        base = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            source, link = base / top, site / top
            if top != ".." and source.exists() and not link.exists():
                link.symlink_to(source)
    return where / "bin" / "python"


def test_the_plain_loop_in_an_environment_with_torch_only(tmp_path):
    python = torch_only_environment(tmp_path / "venv")
    env = {**mpi_env(), "PYTHONPATH": str(ROOT)}
    code = (
        "import adasum_lightning.allreduce, adasum_lightning, importlib.util as u\n"
        "names = ('lightning', 'pytorch_lightning', 'lightning_fabric', 'horovod')\n"
        "print([m for m in names if u.find_spec(m)])"
    )
    check = subprocess.run([str(python), "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout == "[]\n", check.stderr[-3000:]
    out = tmp_path / "torch-only"
    cmd = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tests.workers.forms", str(out), "--form", "plain", "--epochs", "1"]  # fmt: skip
    run_job(cmd, env, timeout=240)
    alone = load_ranks(out, 2)
    full = train("plain", tmp_path, 2, "--epochs", "1")
    assert_same_training(full, alone, "torch-only vs full environment")
