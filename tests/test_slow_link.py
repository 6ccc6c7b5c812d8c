"""The slow-link benchmark's harness (``benchmarks/slow_link.py``): Lightning's post-local SGD with its hook
registered by hand really exchanges every 10 steps only, and the rate-limited namespace is torn down after a
failure."""

from __future__ import annotations

import subprocess
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
