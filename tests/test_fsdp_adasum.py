"""Adasum across replica groups, FSDP2 sharding inside each (``AdasumOptimizer(mesh=...)``,
``adasum_lightning.sharded``): real processes (``tests/workers/fsdp.py``, cases of a 4-rank and a 6-rank
torchrun launch: ``tests/cases.py``), every rank checked, against the unsharded algorithm computed here; and
the refusals as pure rules.

The reference: every replica group averages its ranks' gradients (each rank's own batch), steps its own SGD
with momentum on the whole model, and the groups' deltas are combined per parameter by
:func:`adasum_lightning.ops.adasum_reduce` (the pairing of the allreduce, for any number of groups).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adasum_lightning.ops import adasum_reduce
from adasum_lightning.validation import (
    AdasumConfigurationError,
    check_adasum_mesh,
    check_mesh_options,
    check_resume_mesh,
    check_shard_size,
    check_sharded_parameters,
    identical_gradients_message,
)
from tests.cases import Launch, assert_refused_on_every_rank, case
from tests.helpers import expected_message
from tests.workers.samples import IndexedData, tiny_net

pytestmark = pytest.mark.mpi

FOUR = Launch("torchrun", 4, group="fsdp")
SIX = Launch("torchrun", 6, group="fsdp")
TRAINER = Launch("lightning", 4, group="fsdp")

TRAIN = {
    (2, 2): case(FOUR, "fsdp-train-2x2", "fsdp", "train", "--shard-size", "2"),
    (4, 1): case(FOUR, "fsdp-train-4x1", "fsdp", "train", "--shard-size", "1"),
    (3, 2): case(SIX, "fsdp-train-3x2", "fsdp", "train", "--shard-size", "2"),
}
ALLREDUCE = {
    (2, 2): case(FOUR, "fsdp-allreduce-2x2", "fsdp", "allreduce", "--shard-size", "2"),
    (3, 2): case(SIX, "fsdp-allreduce-3x2", "fsdp", "allreduce", "--shard-size", "2"),
}
REFUSALS = case(FOUR, "fsdp-refusals", "fsdp", "refusals", "--shard-size", "2")
SAME_DATA = case(
    FOUR, "fsdp-same-data", "fsdp", "train", "--shard-size", "2", "--same-data-per-group", "--steps", "1"
)

#: Float32 round-off: the reference averages the loss, FSDP2 the gradients (reduce-scatter, then ÷ S).
ATOL = 1e-6


def reference(ranks: list[dict], shard_size: int, combine=adasum_reduce) -> dict:
    """The unsharded algorithm from the common start on every rank's recorded batches: full parameters."""
    groups = len(ranks) // shard_size
    data = IndexedData(64)
    theta = {k: v.clone() for k, v in ranks[0]["start"].items()}
    nets = [tiny_net() for _ in range(groups)]
    optimizers = [torch.optim.SGD(n.parameters(), lr=0.1, momentum=0.9) for n in nets]
    for step in range(len(ranks[0]["batches"])):
        deltas = []
        for g, (net, optimizer) in enumerate(zip(nets, optimizers, strict=True)):
            net.load_state_dict(theta)  # in place: the optimizer keeps this group's momentum
            optimizer.zero_grad()
            members = range(g * shard_size, (g + 1) * shard_size)
            batches = [ranks[r]["batches"][step] for r in members]
            loss = sum(F.cross_entropy(net(data.x[b]), data.y[b]) for b in batches) / shard_size
            loss.backward()
            optimizer.step()
            deltas.append({k: v.detach() - theta[k] for k, v in net.state_dict().items()})
        theta = {k: theta[k] + combine([d[k] for d in deltas]) for k in theta}
    return theta


def max_difference(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(tensors).mean(0)


@pytest.mark.parametrize(
    ("groups", "shard_size"), [pytest.param(*k, marks=pytest.mark.cases(c)) for k, c in TRAIN.items()]
)
def test_sharded_training_equals_the_unsharded_algorithm(groups, shard_size, cases):
    ranks = cases[TRAIN[groups, shard_size]].ranks
    world = groups * shard_size
    assert [res["world_size"] for res in ranks] == [world] * world
    assert ranks[0]["mesh"] == [list(range(g * shard_size, (g + 1) * shard_size)) for g in range(groups)]
    torch.manual_seed(100)
    seeded = tiny_net().state_dict()
    expected = reference(ranks, shard_size)
    for r, res in enumerate(ranks):
        # every replica group started from group 0's parameters (the others had moved theirs away)
        assert all(torch.equal(res["start"][k], v) for k, v in seeded.items()), r
        assert res["batches"] != ranks[(r + 1) % world]["batches"], r
        assert res["warned"] == [], r
        difference = max_difference(res["end"], expected)
        assert difference <= ATOL, (r, difference)
        assert max_difference(res["end"], reference(ranks, shard_size, mean)) > 1e-4  # Adasum, not the mean
        for k, shard in res["local"].items():
            # rank r's shard: its dim-0 chunk of the full parameter (FSDP2's layout)
            assert torch.equal(shard, torch.chunk(res["end"][k], shard_size)[r % shard_size]), (r, k)
            # the replicas of this shard (same position, other groups) hold the same bits
            for other in range(r % shard_size, world, shard_size):
                assert torch.equal(shard, ranks[other]["local"][k]), (r, other, k)
        # each replica group kept its own momentum
        other_group = (r + shard_size) % world
        assert not any(torch.equal(m, ranks[other_group]["momentum"][k]) for k, m in res["momentum"].items())
    if shard_size > 1:  # the shards of one group differ
        assert not torch.equal(ranks[0]["local"]["0.weight"], ranks[1]["local"]["0.weight"])
        assert ranks[0]["local"]["2.weight"].shape == (4 // shard_size, 16)


@pytest.mark.cases(TRAIN[4, 1])
def test_shard_groups_of_one_rank_train_as_the_optimizer_without_a_mesh_bitwise(cases):
    for r, res in enumerate(cases[TRAIN[4, 1]].ranks):
        for k, v in res["plain_end"].items():
            assert torch.equal(res["end"][k], v), (r, k, float((res["end"][k] - v).abs().max()))


@pytest.mark.parametrize(
    ("groups", "shard_size"), [pytest.param(*k, marks=pytest.mark.cases(c)) for k, c in ALLREDUCE.items()]
)
def test_allreduce_of_sharded_tensors_is_the_adasum_of_the_whole_tensors(groups, shard_size, cases):
    ranks = cases[ALLREDUCE[groups, shard_size]].ranks
    by_group = [ranks[g * shard_size]["whole"] for g in range(groups)]
    for r, res in enumerate(ranks):
        assert (res["group"], res["position"]) == (r // shard_size, r % shard_size)
        for i, shard in enumerate(res["shards"]):
            expected = adasum_reduce([whole[i] for whole in by_group])
            parts = torch.chunk(expected, shard_size)
            part = parts[res["position"]] if res["position"] < len(parts) else expected[:0]
            assert shard.dtype == expected.dtype and shard.shape == part.shape, (r, i)
            assert torch.allclose(shard, part, rtol=1e-6, atol=1e-7), (r, i, (shard - part).abs().max())
            assert torch.equal(shard, ranks[r % shard_size]["shards"][i]), (r, i)  # group 0's bits
    assert ranks[1]["shards"][1].numel() == 0  # a (1, 3) tensor has no second chunk


@pytest.mark.cases(SAME_DATA)
def test_the_first_rank_warns_when_every_replica_group_had_the_same_gradients(cases):
    # the same batches in both replica groups: equal gradient shards across the replicate groups
    ranks = cases[SAME_DATA].ranks
    assert ranks[0]["batches"] == ranks[2]["batches"] != ranks[1]["batches"]
    assert [res["warned"] for res in ranks] == [[identical_gradients_message("AdasumOptimizer")], [], [], []]
    expected = reference(ranks, 2)
    for r, res in enumerate(ranks):
        assert max_difference(res["end"], expected) <= ATOL, r


@pytest.mark.cases(REFUSALS)
def test_refusals_on_every_rank(cases):
    ranks = cases[REFUSALS].ranks
    owner = "AdasumOptimizer"
    expected = {
        "one_d": expected_message(check_adasum_mesh, 1, ("replicate",), owner),
        "misnamed": expected_message(check_adasum_mesh, 2, ("shard", "replicate"), owner),
        "sync_every": expected_message(check_mesh_options, owner, 2, "adasum", False),
        "mean": expected_message(check_mesh_options, owner, 1, "mean", False),
    }
    for r, res in enumerate(ranks):
        for key, message in expected.items():
            assert res[key] == message, (r, key, res[key])
        assert res["unsharded"].startswith(
            "AdasumOptimizer: 4 parameter(s) are not sharded over the mesh's 'shard' dimension (size 2): "
            "#0 (16, 8) a plain Parameter; #1 (16,) a plain Parameter; #2 (4, 16) a plain Parameter; and 1 "
            "more."
        ), (r, res["unsharded"])
        assert res["process_group"] == expected_message(
            check_mesh_options, owner, 1, "adasum", False, True
        ), r


# ---------------------------------------------------------------------------------------------------------
# The rules, as pure functions


@pytest.mark.parametrize("world", range(1, 13))
def test_shard_size_rule(world):
    for shard in range(1, world + 1):
        if world % shard == 0:
            check_shard_size(world, shard)
            continue
        with pytest.raises(AdasumConfigurationError) as info:
            check_shard_size(world, shard)
        divisors = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
        assert str(info.value) == (
            f"fsdp_adasum: shard_size={shard} does not divide the {world} processes into replica groups: "
            f"pass shard_size as one of {divisors}, or launch a multiple of {shard} processes."
        )


@pytest.mark.parametrize("shard", [0, -2, 1.5, "2", True, None])
def test_shard_size_is_a_whole_number_of_ranks(shard):
    with pytest.raises(AdasumConfigurationError, match=r"a whole number ≥ 1; got .*pass one of 1, 2, 3, 6\."):
        check_shard_size(6, shard)


@pytest.mark.parametrize(
    ("ndim", "names"),
    [
        (1, ("replicate",)),
        (2, ("shard", "replicate")),
        (2, None),
        (2, ("dp", "fsdp")),
        (3, ("replicate", "shard", "tp")),
    ],
)
def test_mesh_rule(ndim, names):
    check_adasum_mesh(2, ("replicate", "shard"))
    check_adasum_mesh(2, ["replicate", "shard"])
    with pytest.raises(AdasumConfigurationError) as info:
        check_adasum_mesh(ndim, names, "fsdp_adasum")
    given = tuple(names) if names is not None else None
    assert str(info.value).startswith(
        "fsdp_adasum: the mesh must be 2-D with dimensions named ('replicate', 'shard') (replica groups × "
        f"the ranks FSDP2 shards over), got a {ndim}-D mesh named {given}. Build it with "
        "torch.distributed.device_mesh.init_device_mesh(device_type, (world_size // shard_size, shard_size), "
        "mesh_dim_names=('replicate', 'shard'))"
    )


def test_sharded_parameters_rule():
    check_sharded_parameters("AdasumOptimizer", 2, [])
    with pytest.raises(AdasumConfigurationError) as info:
        check_sharded_parameters("AdasumOptimizer", 2, ["#0 a", "#1 b"])
    assert (
        "2 parameter(s) are not sharded over the mesh's 'shard' dimension (size 2): #0 a; #1 b. Apply "
        in str(info.value)
    )
    assert "fully_shard(block, mesh=mesh['shard'])" in str(info.value)


@pytest.mark.parametrize(
    ("sync_every", "combine", "outer", "given"),
    [
        (3, "adasum", False, "sync_every=3"),
        (1, "mean", False, "combine='mean'"),
        (1, "adasum", True, "an outer_optimizer"),
        (2, "mean", True, "sync_every=2 and combine='mean' and an outer_optimizer"),
    ],
)
def test_mesh_options_rule(sync_every, combine, outer, given):
    check_mesh_options("AdasumOptimizer", 1, "adasum", False)
    with pytest.raises(AdasumConfigurationError) as info:
        check_mesh_options("AdasumOptimizer", sync_every, combine, outer)
    assert f"every step is combined by Adasum; {given} is not supported there yet: drop it" in str(info.value)


# ---------------------------------------------------------------------------------------------------------
# The Trainer: strategy="fsdp_adasum" (FSDPAdasumStrategy)


def trainer_case(name: str, *args: str):
    return case(TRAINER, f"fsdp-trainer-{name}", "fsdp_trainer", "--shard-size", "2", *args)


FIT = trainer_case("fit-3", "--max-steps", "3")
SAVED = trainer_case("save-2", "--max-steps", "2", "--save")
RESUMED = trainer_case("resume-3", "--max-steps", "3", "--resume", "{fsdp-trainer-save-2}/ckpt")
OTHER_MESH = case(TRAINER, "fsdp-trainer-resume-4x1", "fsdp_trainer", "--shard-size", "1", "--max-steps", "3",
                  "--resume", "{fsdp-trainer-save-2}/ckpt")  # fmt: skip
DDP_SAVED = trainer_case("ddp-save-2", "--strategy", "ddp_adasum", "--max-steps", "2", "--save")
FROM_DDP = trainer_case("from-ddp-3", "--max-steps", "3", "--resume", "{fsdp-trainer-ddp-save-2}/ckpt")


def assert_same_shards(ranks: list[dict], others: list[dict], what: str) -> None:
    for r, (res, other) in enumerate(zip(ranks, others, strict=True)):
        for key in ("local", "momentum"):
            for k, t in res[key].items():
                assert torch.equal(t, other[key][k]), (
                    what,
                    r,
                    key,
                    k,
                    float((t - other[key][k]).abs().max()),
                )


@pytest.mark.cases(FIT, TRAIN[2, 2])
def test_the_trainer_trains_as_the_plain_loop_bitwise(cases):
    ranks = cases[FIT].ranks
    plain = cases[TRAIN[2, 2]].ranks
    expected = reference(ranks, 2)
    for r, res in enumerate(ranks):
        assert (res["world_size"], res["steps"], res["mesh"]) == (4, 3, [[0, 1], [2, 3]]), r
        assert res["sharded"] == ["", "net"], r  # the top-level child with parameters, then the root
        assert res["batches"] == plain[r]["batches"], r
        assert max_difference(res["end"], expected) <= ATOL, (r, max_difference(res["end"], expected))
    assert_same_shards(ranks, plain, "trainer vs plain")


@pytest.mark.cases(FIT, SAVED, RESUMED)
def test_a_resumed_fit_continues_exactly(cases):
    # every rank saved its own shard of its group's momentum beside the checkpoint of the whole model
    straight, resumed = cases[FIT].ranks, cases[RESUMED].ranks
    checkpoint = torch.load(cases[SAVED].out / "ckpt", weights_only=False)
    assert checkpoint["adasum_sharded_optimizer_mesh"] == [2, 2]
    saved = cases[SAVED].ranks
    assert {k: tuple(v.shape) for k, v in checkpoint["state_dict"].items()} == {
        "net.0.weight": (16, 8), "net.0.bias": (16,), "net.2.weight": (4, 16), "net.2.bias": (4,)
    }  # fmt: skip
    for k, v in checkpoint["state_dict"].items():
        assert torch.equal(v, saved[0]["end"][k.removeprefix("net.")]), k
    for r, res in enumerate(resumed):
        assert res["steps"] == 3 and res["batches"] == straight[r]["batches"][2:], r
        for k, m in res["resumed_momentum"].items():
            assert torch.equal(m, saved[r]["momentum"][k]), (r, k)
    assert_same_shards(resumed, straight, "resumed vs straight")


@pytest.mark.cases(SAVED, OTHER_MESH)
def test_a_resume_on_another_mesh_is_refused_on_every_rank(cases):
    message = expected_message(check_resume_mesh, [2, 2], (4, 1))
    assert message.endswith(
        "resuming on another mesh is not supported yet. Resume with 4 processes and shard_size=2."
    )
    assert_refused_on_every_rank(cases[OTHER_MESH], message)


@pytest.mark.cases(DDP_SAVED, FROM_DDP)
def test_a_ddp_adasum_checkpoint_resumes_with_each_rank_taking_its_chunk(cases):
    saved, resumed = cases[DDP_SAVED].ranks, cases[FROM_DDP].ranks
    for r, res in enumerate(resumed):
        assert res["steps"] == 3, r
        for k, m in res["resumed_momentum"].items():
            # rank r's own momentum of the ddp_adasum run, cut as FSDP2 cuts the parameter
            assert torch.equal(m, torch.chunk(saved[r]["momentum"][k], 2)[r % 2]), (r, k)
        assert all(torch.equal(res["start"][k], saved[0]["end"][k]) for k in res["start"]), r


def test_resume_mesh_rule():
    check_resume_mesh([2, 2], (2, 2))
    with pytest.raises(AdasumConfigurationError) as info:
        check_resume_mesh((2, 4), (4, 2))
    assert str(info.value) == (
        "fsdp_adasum: the checkpoint holds optimizer states sharded over a 2 × 4 mesh (replica groups × "
        "shard_size), this run has 4 × 2; resuming on another mesh is not supported yet. Resume with 8 "
        "processes and shard_size=4."
    )


def test_mesh_and_process_group_rule():
    with pytest.raises(AdasumConfigurationError) as info:
        check_mesh_options("AdasumOptimizer", 1, "adasum", False, process_group=True)
    assert str(info.value).startswith(
        "AdasumOptimizer: pass either process_group (every rank a replica) or mesh"
    )
