"""``adasum_step`` (deltas written straight into the reduction's flat bucket, the result straight back) gives
bitwise the parameters of the step written out the plain way (clone, subtract, ``adasum_allreduce``, add),
on every rank, at 2, 3 and 4 ranks, for SGD with momentum and Adam, with frozen, unused, float64 and
non-contiguous parameters (``tests/workers/step_paths.py`` under torchrun). So does the step bucket by bucket
during backward (``BackwardAdasumStep``, ``ddp_adasum(overlap_backward=True)``), with several buckets
completed in a different order on each rank."""

from __future__ import annotations

import re

import pytest
import torch

from adasum_lightning.step import check_overlap_backward, overlap_fallback_reason
from tests.cases import Launch, case
from tests.helpers import assert_ranks_identical

pytestmark = pytest.mark.mpi

STEPS = {
    (np, o): case(Launch("torchrun", np), f"step-paths-{np}-{o}", "step_paths", o)
    for np in (2, 3, 4)
    for o in ("sgd", "adam")
}


@pytest.mark.parametrize(
    ("np", "optimizer"), [pytest.param(*k, marks=pytest.mark.cases(c)) for k, c in STEPS.items()]
)
def test_the_step_equals_the_reference_step_bitwise(np, optimizer, cases):
    ranks = cases[STEPS[np, optimizer]].ranks
    for r, res in enumerate(ranks):
        assert all(res["identical"].values()), (r, [k for k, same in res["identical"].items() if not same])
        names = {f"{m}.{w}" for m in ("frozen", "body", "head", "branch") for w in ("weight", "bias")}
        assert set(res["identical"]) == names | {"scale", "transposed"}
        assert res["identical_backward"] == dict.fromkeys(res["identical"], True), r
        # [transposed], [scale] (float64), [branch.*, head.*] (at finish where the branch is unused), [body.*]
        assert res["buckets"] == 4, r
        assert res["changed_error"].startswith(
            "the optimizer's trainable parameters changed (requires_grad set or cleared, or a param group "
            "added) since this BackwardAdasumStep was built"
        ), r
    assert_ranks_identical(ranks)


WIRE = case(Launch("torchrun", 2), "step-paths-2-sgd-bf16", "step_paths", "sgd", "bf16")


@pytest.mark.cases(WIRE, STEPS[2, "sgd"])
def test_a_bf16_wire_gives_the_same_bits_on_every_path(cases):
    # adasum_step, BackwardAdasumStep (ddp_adasum's overlap_backward) and the step written out with
    # adasum_allreduce(wire_dtype=torch.bfloat16): the same parameters, not those of the float32 wire
    ranks = cases[WIRE].ranks
    for r, res in enumerate(ranks):
        assert all(res["identical"].values()) and all(res["identical_backward"].values()), r
        uncompressed = cases[STEPS[2, "sgd"]].ranks[r]["end"]
        assert not any(torch.equal(v, uncompressed[k]) for k, v in res["end"].items() if "frozen" not in k), r
    assert_ranks_identical(ranks)


# ---------------------------------------------------------------- ddp_adasum(overlap_backward=True)
OVERLAP_OK = dict(
    automatic_optimization=True,
    optimizer="SGD",
    per_parameter=True,
    gradient_clipping=None,
    gradient_scaler=False,
    precision_plugin=None,
    before_step_hooks=[],
)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({}, None),
        ({"automatic_optimization": False}, "manual optimization calls backward and step itself"),
        (
            {"optimizer": "LBFGS", "per_parameter": False},
            "LBFGS is not one of the per-parameter torch.optim optimizers (SGD, Adam, AdamW, Adagrad, "
            "Adamax, NAdam, RAdam, RMSprop)",
        ),
        (
            {"gradient_clipping": "gradient_clip_val=0.5"},
            "gradient clipping (gradient_clip_val=0.5) needs every gradient before the first bucket steps",
        ),
        (
            {"gradient_scaler": True},
            "fp16 mixed precision's GradScaler checks every gradient before the step (bf16 has no scaler)",
        ),
        (
            {"precision_plugin": "FSDPPrecision"},
            "the precision plugin FSDPPrecision runs the optimizer step its own way",
        ),
        (
            {"before_step_hooks": ["GradNormLogger.on_before_optimizer_step", "Net.on_after_backward"]},
            "GradNormLogger.on_before_optimizer_step, Net.on_after_backward run between backward and the "
            "step (they may change gradients or read parameters)",
        ),
    ],
)
def test_overlap_fallback_rule(change, reason):
    assert overlap_fallback_reason(**{**OVERLAP_OK, **change}) == reason


@pytest.mark.parametrize(
    ("overlap", "cap", "message"),
    [
        ("yes", 25, "ddp_adasum's overlap_backward is True (step and reduce bucket by bucket during the "
                    "backward pass) or False (the whole step after it), got 'yes'"),
        (True, 0, "ddp_adasum's bucket_cap_mb is the bucket size in MiB, a positive number such as 25 "
                  "(DDP's default), got 0"),
        (True, "25", "got '25'"),
        (True, True, "got True"),
    ],
)  # fmt: skip
def test_overlap_options_rule(overlap, cap, message):
    check_overlap_backward(False, 0.5, "ddp_adasum")
    with pytest.raises(ValueError, match=re.escape(message)):
        check_overlap_backward(overlap, cap, "ddp_adasum")
