"""Uneven inputs: ranks with different numbers of batches end each epoch together, under every strategy.

Rank r holds 4 + r training batches (``tests/workers/uneven.py``: no DistributedSampler). Every strategy stops
both ranks after 4, warns once on rank 0 naming the counts, and keeps the ranks identical; an uneven
validation loop with an epoch-level ``sync_dist`` sum finishes and sums every rank's data. Plain loops use
``EvenBatches`` themselves (``tests/workers/even_batches.py``). Real processes (cases of a few launches:
``tests/cases.py``), every rank checked.
"""

from __future__ import annotations

import pytest

from adasum_lightning.uneven import EvenBatches, uneven_message
from tests.cases import Launch, case
from tests.helpers import assert_ranks_identical, load_ranks
from tests.workers.samples import IndexedData

pytestmark = pytest.mark.mpi

DATA = IndexedData(128)
#: rank 0 validates samples 96..103, rank 1 samples 108..119 (the worker's val_dataloader)
VAL_SUM = float(DATA.x[96:104, 0].sum() + DATA.x[108:120, 0].sum())


def fit(strategy: str, loader: str, *args: str):
    launch = Launch("lightning" if strategy == "ddp_adasum" else "horovodrun", 2)
    name = "-".join(["uneven", strategy, loader, *(a.strip("-") for a in args)])
    return case(launch, name, "uneven", "--strategy", strategy, "--loader", loader, *args)


@pytest.mark.parametrize(
    "strategy, loader",
    [
        pytest.param(s, loader, marks=[pytest.mark.cases(fit(s, loader, "--validate")),
                                       *[pytest.mark.compat] * (s == "ddp_adasum")])
        for s in ("ddp_adasum", "horovod_adasum", "horovod")
        for loader in ("sized", "iterable")
    ],
)  # fmt: skip
def test_uneven_batch_counts_stop_every_rank_at_the_shortest(strategy, loader, cases):
    ranks = cases[fit(strategy, loader, "--validate")].ranks
    counts = ["4", "5"] if loader == "sized" else ["4", "more than 4"]
    assert ranks[0]["warnings"] == [uneven_message("training", counts, 4, refuse=False)]  # once per fit
    assert ranks[1]["warnings"] == []  # rank 0 only
    for res in ranks:
        assert res["seen"] == [4, 4] and res["global_step"] == 8 and res["error"] is None
        assert res["val_sums"] == [pytest.approx(VAL_SUM, abs=1e-5)] * 2  # every rank's validation data
    assert_ranks_identical(ranks)


def refusing(loader: str):
    return fit("ddp_adasum", loader, "--uneven", "error")


@pytest.mark.parametrize(
    "loader", [pytest.param(k, marks=pytest.mark.cases(refusing(k))) for k in ("sized", "iterable")]
)
def test_uneven_inputs_error_refuses_on_every_rank(loader, cases):
    result = cases[refusing(loader)]
    assert [s["status"] for s in result.statuses] == ["error"] * 2  # the worker exits non-zero
    counts = ["4", "5"] if loader == "sized" else ["4", "more than 4"]
    for res in load_ranks(result.out, 2):
        assert res["error"] == "UnevenInputsError: " + uneven_message("training", counts, 4, refuse=True)
        # sized: refused before the first step; iterable: when the first rank runs out, which Lightning's
        # one-batch-ahead fetch sees while the 4th step is about to run
        assert res["global_step"] == (0 if loader == "sized" else 3)


def plain_loop(loader: str, uneven: str):
    return case(Launch("torchrun", 2), f"even-batches-{loader}-{uneven}", "even_batches", loader, uneven)


@pytest.mark.parametrize(
    "loader",
    [
        pytest.param(k, marks=pytest.mark.cases(plain_loop(k, "truncate")))
        for k in ("sized", "iterable", "promising")
    ],
)
def test_even_batches_in_a_plain_loop(loader, cases):
    # promising: an IterableDataset whose len() says 5 on both ranks; rank 0 yields 4: agreed per step anyway
    ranks = cases[plain_loop(loader, "truncate")].ranks
    counts = ["4", "5"] if loader == "sized" else ["4", "more than 4"]
    assert ranks[0]["warnings"] == [uneven_message("training", counts, 4, refuse=False)]
    assert ranks[1]["warnings"] == [] and all(res["seen"] == [0, 1, 2, 3] for res in ranks)


@pytest.mark.cases(plain_loop("sized", "error"))
def test_even_batches_error_in_a_plain_loop(cases):
    for res in cases[plain_loop("sized", "error")].ranks:
        assert res["seen"] == [] and res["error"] == uneven_message("training", ["4", "5"], 4, refuse=True)


def test_uneven_inputs_must_be_truncate_or_error():
    from tests.workers.lightning import DDPAdasumStrategy

    with pytest.raises(
        ValueError, match=r"^ddp_adasum's uneven_inputs must be 'truncate' .* or 'error' .*, got 'drop'"
    ):
        DDPAdasumStrategy(uneven_inputs="drop")
    with pytest.raises(ValueError, match=r"^EvenBatches's uneven_inputs must be"):
        EvenBatches([1, 2], uneven_inputs="drop")
