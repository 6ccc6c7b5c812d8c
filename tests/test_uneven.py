"""Uneven inputs: ranks with different numbers of batches end each epoch together, under every strategy.

Rank r holds 4 + r training batches (``tests/workers/uneven.py``: no DistributedSampler). Every strategy stops
both ranks after 4, warns once on rank 0 naming the counts, and keeps the ranks identical; an uneven
validation loop with an epoch-level ``sync_dist`` sum finishes and sums every rank's data. Plain loops use
``EvenBatches`` themselves (``tests/workers/even_batches.py``). Real processes, every rank checked.
"""

from __future__ import annotations

import pytest

from adasum_lightning.uneven import EvenBatches, uneven_message
from tests.helpers import assert_ranks_identical, load_ranks, run_horovod, run_lightning, run_torchrun
from tests.workers.samples import IndexedData

pytestmark = pytest.mark.mpi

DATA = IndexedData(128)
#: rank 0 validates samples 96..103, rank 1 samples 108..119 (the worker's val_dataloader)
VAL_SUM = float(DATA.x[96:104, 0].sum() + DATA.x[108:120, 0].sum())


def fit(strategy: str, loader: str, out, *args: str, check: bool = True):
    worker_args = [str(out), "--strategy", strategy, "--loader", loader, *args]
    if strategy == "ddp_adasum":
        return run_lightning(2, "uneven", *worker_args, timeout=180, check=check)
    return run_horovod(2, "uneven", *worker_args, timeout=180, check=check)


@pytest.mark.parametrize(
    "strategy",
    [pytest.param("ddp_adasum", marks=pytest.mark.compat), "horovod_adasum", "horovod"],
)
@pytest.mark.parametrize("loader", ["sized", "iterable"])
def test_uneven_batch_counts_stop_every_rank_at_the_shortest(strategy, loader, tmp_path):
    fit(strategy, loader, tmp_path, "--validate")
    ranks = load_ranks(tmp_path, 2)
    counts = ["4", "5"] if loader == "sized" else ["4", "more than 4"]
    assert ranks[0]["warnings"] == [uneven_message("training", counts, 4, refuse=False)]  # once per fit
    assert ranks[1]["warnings"] == []  # rank 0 only
    for res in ranks:
        assert res["seen"] == [4, 4] and res["global_step"] == 8 and res["error"] is None
        assert res["val_sums"] == [pytest.approx(VAL_SUM, abs=1e-5)] * 2  # every rank's validation data
    assert_ranks_identical(ranks)


@pytest.mark.parametrize("loader", ["sized", "iterable"])
def test_uneven_inputs_error_refuses_on_every_rank(loader, tmp_path):
    proc = fit("ddp_adasum", loader, tmp_path, "--uneven", "error", check=False)
    assert proc.returncode != 0
    counts = ["4", "5"] if loader == "sized" else ["4", "more than 4"]
    for res in load_ranks(tmp_path, 2):
        assert res["error"] == "UnevenInputsError: " + uneven_message("training", counts, 4, refuse=True)
        # sized: refused before the first step; iterable: when the first rank runs out, which Lightning's
        # one-batch-ahead fetch sees while the 4th step is about to run
        assert res["global_step"] == (0 if loader == "sized" else 3)


@pytest.mark.parametrize("loader", ["sized", "iterable", "promising"])
def test_even_batches_in_a_plain_loop(loader, tmp_path):
    # promising: an IterableDataset whose len() says 5 on both ranks; rank 0 yields 4: agreed per step anyway
    run_torchrun(2, "even_batches", str(tmp_path), loader, "truncate")
    ranks = load_ranks(tmp_path, 2)
    counts = ["4", "5"] if loader == "sized" else ["4", "more than 4"]
    assert ranks[0]["warnings"] == [uneven_message("training", counts, 4, refuse=False)]
    assert ranks[1]["warnings"] == [] and all(res["seen"] == [0, 1, 2, 3] for res in ranks)


def test_even_batches_error_in_a_plain_loop(tmp_path):
    run_torchrun(2, "even_batches", str(tmp_path), "sized", "error")
    for res in load_ranks(tmp_path, 2):
        assert res["seen"] == [] and res["error"] == uneven_message("training", ["4", "5"], 4, refuse=True)


def test_uneven_inputs_must_be_truncate_or_error():
    from tests.workers.lightning import DDPAdasumStrategy

    with pytest.raises(
        ValueError, match=r"^ddp_adasum's uneven_inputs must be 'truncate' .* or 'error' .*, got 'drop'"
    ):
        DDPAdasumStrategy(uneven_inputs="drop")
    with pytest.raises(ValueError, match=r"^EvenBatches's uneven_inputs must be"):
        EvenBatches([1, 2], uneven_inputs="drop")
