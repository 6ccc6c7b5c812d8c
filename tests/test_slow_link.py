"""The slow-link benchmark's harness (``benchmarks/slow_link.py``): Lightning's post-local SGD with its hook
registered by hand really exchanges every 10 steps only, torchft's DiLoCo runs as a second job by torchft's
python (or is skipped) and equals DiLoCo written out, and the rate-limited namespace is torn down after a
failure."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import torch

from tests import twohosts
from tests.cases import Launch, case
from tests.helpers import load_ranks

#: 25 steps of post-local SGD at period 10, then 3 of Lightning's ddp (the control), a narrow MLP.
ANCHOR = case(Launch("lightning", 2), "slow-link-post-local-sgd", "slow_link", "--variants",
              "post_local_sgd_10:0:25,ddp:0:3", "--hidden", "16")  # fmt: skip


@pytest.mark.mpi
@pytest.mark.cases(ANCHOR)
def test_post_local_sgd_registered_by_hand_exchanges_only_every_10_steps(cases):
    # Same start on both ranks, different batches: the ranks' parameters are identical after a step only where
    # something was exchanged — DDP's allreduce of step 1 (start_localSGD_iter=1), then Lightning's averaging
    # after steps 2, 12 and 22. On CPU without the hand registration every step would be allreduced.
    out = cases[ANCHOR].out
    ranks = load_ranks(out / "post_local_sgd_10", 2)
    same = [torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True)]
    assert len(same) == 25
    assert [k + 1 for k, s in enumerate(same) if s] == [1, 2, 12, 22]
    step_11 = ranks[0]["params"][10], ranks[1]["params"][10]
    assert not torch.allclose(*step_11), "the ranks drift apart between averagings"
    ddp = load_ranks(out / "ddp", 2)
    assert all(torch.equal(a, b) for a, b in zip(ddp[0]["params"], ddp[1]["params"], strict=True))


@pytest.mark.twohosts
def test_the_limited_loopback_is_torn_down_after_a_failure():
    from benchmarks.slow_link import limited_loopback

    twohosts.require()
    with pytest.raises(RuntimeError, match="a job failed"), limited_loopback("250mbit") as netns:
        qdisc = subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "show", "dev", "lo"],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert "tbf" in qdisc and "rate 250Mbit" in qdisc, qdisc
        proc = subprocess.Popen(["ip", "netns", "exec", netns, "sleep", "60"])
        deadline = time.monotonic() + 10
        while twohosts.netns_pids(netns) != [proc.pid] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert twohosts.netns_pids(netns) == [proc.pid]
        raise RuntimeError("a job failed")
    assert proc.wait(timeout=10) == -9
    assert netns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not Path("/run/netns", netns).exists()


def _fake_rig(calls: list) -> object:
    """A rig that starts nothing: each variant of the job gets a result whose steps/s is its name's length."""

    def rig(rate, args, log, timeout, python):
        calls.append((args[0], python, args))
        out = Path(args[1])
        out.mkdir(parents=True, exist_ok=True)
        for item in args[args.index("--variants") + 1].split(","):
            v = item.split(":")[0]
            (out / f"{v}.json").write_text(json.dumps({"variant": v, "steps_per_s": float(len(v))}))
        return 1.0, "a command"

    return rig


@pytest.mark.parametrize("installed", [False, True], ids=["absent", "installed"])
def test_torchft_runs_as_a_second_job_by_its_python_or_is_skipped_with_the_reason(
    installed, tmp_path, monkeypatch
):
    from benchmarks import slow_link

    python = tmp_path / "tft" / "bin" / "python"
    if installed:  # a python that imports anything
        python.parent.mkdir(parents=True)
        python.write_text("#!/bin/sh\nexit 0\n")
        python.chmod(0o755)
    monkeypatch.setenv("ADASUM_TORCHFT_PYTHON", str(python))
    calls: list = []
    monkeypatch.setitem(slow_link.RIGS, "loopback", _fake_rig(calls))
    block = {
        "rig": "loopback",
        "rate": "1gbit",
        "variants": ["ddp", "torchft_diloco_10", "ceiling"],
        "rounds": 2,
    }
    cfg = {"steps": {"1": [1, 2], "10": [10, 10], "1000": [5, 5]}, "timeout_s": 1}
    result = slow_link.throughput(block, cfg, tmp_path / "results", "synthetic")
    lightning, torchft = (
        ("benchmarks.slow_link", sys.executable),
        ("benchmarks.slow_link_torchft", str(python)),
    )
    jobs = [(module, py) for module, py, _ in calls]
    assert (
        slow_link.skip_reason("torchft_diloco_10", "two_hosts")
        == "torchft's DiLoCo runs on the loopback rig only"
    )
    if not installed:
        reason = f"no torchft environment at {python} (ADASUM_TORCHFT_PYTHON; docs/local_sgd.md sets one up)"
        assert result["skipped"] == {"torchft_diloco_10": reason}
        assert jobs == [lightning, lightning]
        assert list(result["summary"]["variants"]) == ["ddp", "ceiling"]
        return
    assert result["skipped"] == {}
    assert jobs == [lightning, torchft, torchft, lightning], "the jobs' order rotates each round"
    args = calls[1][2]
    assert args[args.index("--variants") + 1] == "torchft_diloco_10:10:20"
    assert args[-2:] == ["--site", sysconfig.get_paths()["purelib"]]
    row = result["summary"]["variants"]["torchft_diloco_10"]
    assert row["fraction_of_ceiling"]["median"] == len("torchft_diloco_10") / len("ceiling")


def test_torchft_diloco_equals_diloco_written_out_and_its_replicas_agree_only_after_syncs(tmp_path):
    # Two replica groups of torchft (real lighthouse, Managers, Gloo) on the host's loopback, 20 steps at
    # sync_every=10, a narrow MLP; the reference: each replica's local SGD in this process, the outer
    # Nesterov step on the replicas' mean pseudo-gradient every 10 steps.
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler

    from benchmarks.common import ROOT
    from benchmarks.loops import BATCH, MOMENTUM, make_model, synthetic_data
    from benchmarks.slow_link import COMBINATIONS, _torchft_missing, torchft_python

    python = torchft_python()
    if reason := _torchft_missing(python):
        pytest.skip(reason)
    cmd = [python, "-m", "benchmarks.slow_link_torchft", str(tmp_path), "--variants",
           "torchft_diloco_10:0:20", "--site", sysconfig.get_paths()["purelib"], "--hidden", "16",
           "--trace", str(tmp_path / "trace")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "torchft_diloco_10.json").read_text())
    assert (result["global_step"], result["timed_steps"], result["manager_step"]) == (20, 20, 2)
    ranks = load_ranks(tmp_path / "trace" / "torchft_diloco_10", 2)

    data = synthetic_data(20, 2)
    torch.manual_seed(0)
    start = make_model("mlp", 16)
    replicas = [copy.deepcopy(start) for _ in range(2)]
    inner = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=MOMENTUM) for m in replicas]
    outer = COMBINATIONS["nesterov"]["outer_optimizer"](start.parameters())
    batches = [
        iter(DataLoader(data, BATCH, sampler=DistributedSampler(data, 2, r, seed=0))) for r in range(2)
    ]
    for step in range(1, 21):
        for model, opt, it in zip(replicas, inner, batches, strict=True):
            x, y = next(it)
            opt.zero_grad()
            F.nll_loss(model(x), y).backward()
            opt.step()
        if step % 10 == 0:
            for p, *local in zip(start.parameters(), *(m.parameters() for m in replicas), strict=True):
                p.grad = p.detach() - torch.stack([q.detach() for q in local]).mean(0)
            outer.step()
            for model in replicas:
                model.load_state_dict(start.state_dict())
            expected = torch.cat([p.detach().reshape(-1) for p in start.parameters()])
            for r in range(2):
                assert torch.allclose(ranks[r]["params"][step - 1], expected, rtol=1e-5, atol=1e-7), (r, step)
    same = [torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True)]
    assert [k + 1 for k, s in enumerate(same) if s] == [10, 20]
