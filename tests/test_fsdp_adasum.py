"""Adasum across replica groups, FSDP2 sharding inside each (``AdasumOptimizer(mesh=...)``,
``adasum_lightning.sharded``): real processes (``tests/workers/fsdp.py``, cases of a 4-rank and a 6-rank
torchrun launch: ``tests/cases.py``), every rank checked, against the unsharded algorithm computed here; and
the refusals as pure rules.

The reference: every replica group averages its ranks' gradients (each rank's own batch), steps its own SGD
with momentum on the whole model, and the groups' deltas are combined per parameter by
:func:`adasum_lightning.reference.adasum_reduce` (the pairing of the allreduce, for any number of groups).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn.functional as F

from adasum_lightning.checkpoint import check_resume_mesh, check_sharded_save_filter, check_state_dict_type
from adasum_lightning.errors import AdasumConfigurationError
from adasum_lightning.mesh import check_adasum_mesh, check_mesh_options, check_shard_size
from adasum_lightning.optimizer import identical_gradients_message
from adasum_lightning.reference import adasum_reduce
from adasum_lightning.sharded import check_optimizer_of_sharded_module, check_sharded_parameters
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


def reference(
    ranks: list[dict],
    shard_size: int,
    combine=adasum_reduce,
    accumulate: int = 1,
    clip: float | None = None,
    clip_by: str = "whole",
    frozen: tuple[str, ...] = (),
    momenta: list[dict] | None = None,
) -> dict:
    """The unsharded algorithm from the common start on every rank's recorded batches: full parameters.

    ``accumulate``: micro-batches per step (the loss ÷ accumulate); ``clip``: each group's averaged gradients
    clipped to that norm before its step — by the whole model's norm (``clip_by="whole"``, torch's
    ``clip_grad_norm_``), or, as a control, each shard position's chunks by their own norm (``"shard"``);
    ``frozen``: parameter names with ``requires_grad=False``; ``momenta``: each group's momentum buffers at
    the start (full tensors by name; a resumed run). The norms before clipping are kept in
    ``reference.norms`` (per step, per group).
    """
    groups = len(ranks) // shard_size
    data = IndexedData(64)
    theta = {k: v.clone() for k, v in ranks[0]["start"].items()}
    nets = [tiny_net() for _ in range(groups)]
    for net in nets:
        for k, q in net.named_parameters():
            q.requires_grad_(k not in frozen)
    optimizers = [torch.optim.SGD(n.parameters(), lr=0.1, momentum=0.9) for n in nets]
    for net, optimizer, start in zip(nets, optimizers, momenta or [], strict=False):
        for k, q in net.named_parameters():
            optimizer.state[q]["momentum_buffer"] = start[k].clone()
    reference.norms = []
    for step in range(len(ranks[0]["batches"]) // accumulate):
        deltas, norms = [], []
        for g, (net, optimizer) in enumerate(zip(nets, optimizers, strict=True)):
            net.load_state_dict(theta)  # in place: the optimizer keeps this group's momentum
            optimizer.zero_grad()
            members = range(g * shard_size, (g + 1) * shard_size)
            micro = range(step * accumulate, (step + 1) * accumulate)
            batches = [ranks[r]["batches"][m] for r in members for m in micro]
            loss = sum(F.cross_entropy(net(data.x[b]), data.y[b]) for b in batches) / len(batches)
            loss.backward()
            grads = [q.grad for q in net.parameters() if q.grad is not None]
            norms.append(
                float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in grads])))
            )
            if clip is not None and clip_by == "whole":
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            elif clip is not None:
                for j in range(shard_size):
                    chunks = [c[j] for t in grads if j < len(c := torch.chunk(t, shard_size))]
                    total = torch.linalg.vector_norm(
                        torch.stack([torch.linalg.vector_norm(c) for c in chunks])
                    )
                    for c in chunks:
                        c.mul_(torch.clamp(clip / (total + 1e-6), max=1.0))
            optimizer.step()
            deltas.append({k: v.detach() - theta[k] for k, v in net.state_dict().items()})
        reference.norms.append(norms)
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
        # the step keeps one shard of the parameters (θ_before); the partner's deltas went into the gradients
        assert res["step_buffer_bytes"] == res["shard_bytes"] > 0, (r, res["step_buffer_bytes"])
        assert res["released"] == [groups > 1] * len(res["batches"]), r
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


WIRE = case(FOUR, "fsdp-train-2x2-wire-bf16", "fsdp", "train", "--shard-size", "2", "--compression", "bf16")


@pytest.mark.cases(WIRE)
def test_a_bf16_wire_equals_the_unsharded_algorithm_with_rounded_deltas(cases):
    # compression="bf16" with a mesh: the Adasum of the replica groups' deltas rounded to bfloat16 (each level
    # rounded), identical in every group, closer to that reference than to the float32 wire's
    ranks = cases[WIRE].ranks
    expected = reference(ranks, 2, lambda ds: adasum_reduce([d.to(torch.bfloat16) for d in ds]).float())
    float32_wire = reference(ranks, 2)
    for r, res in enumerate(ranks):
        assert max_difference(res["end"], expected) <= ATOL, (r, max_difference(res["end"], expected))
        assert max_difference(res["end"], float32_wire) > 1e-5, (r, max_difference(res["end"], float32_wire))
        for k, shard in res["local"].items():
            assert torch.equal(shard, ranks[(r + 2) % 4]["local"][k]), (r, k)  # the replica of this shard


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


@pytest.mark.parametrize("copy", ["adasum_lightning.trainer", "adasum_lightning.fabric"])
def test_strategies_refuse_local_sgd_with_a_mesh_naming_ddp_adasum(copy):
    import importlib

    cls = importlib.import_module(copy).FSDPAdasumStrategy
    with pytest.raises(AdasumConfigurationError) as info:
        cls(sync_every=10)
    assert str(info.value) == (
        "fsdp_adasum: with a mesh (Adasum across replica groups, FSDP2 inside each) every step is combined "
        "by Adasum; sync_every=10 is not supported there yet: drop it (sync_every=1, combine='adasum', no "
        "outer_optimizer), or train unsharded over all ranks, where local SGD is supported: ddp_adasum "
        "(Trainer, Fabric) or AdasumOptimizer without a mesh."
    )
    with pytest.raises(AdasumConfigurationError, match="combine='mean' and an outer_optimizer is not"):
        cls(combine="mean", outer_optimizer=functools.partial(torch.optim.SGD, lr=0.7))
    assert cls(sync_every=1, combine="adasum", outer_optimizer=None).strategy_name == "fsdp_adasum"


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
        "Resume with 4 processes and shard_size=2, or save with state_dict_type='sharded' (any mesh resumes "
        "from that)."
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
        "shard_size), this run has 4 × 2; a full checkpoint resumes on its own mesh only. Resume with 8 "
        "processes and shard_size=4, or save with state_dict_type='sharded' (any mesh resumes from that)."
    )


def test_mesh_and_process_group_rule():
    with pytest.raises(AdasumConfigurationError) as info:
        check_mesh_options("AdasumOptimizer", 1, "adasum", False, process_group=True)
    assert str(info.value).startswith(
        "AdasumOptimizer: pass either process_group (every rank a replica) or mesh"
    )


# ---------------------------------------------------------------------------------------------------------
# Sharded checkpoints (state_dict_type="sharded": torch.distributed.checkpoint), resumed on any mesh

SHARDED = ("--state-dict-type", "sharded")
SHARDED_SAVED = trainer_case("sharded-save-2", "--max-steps", "2", "--save", *SHARDED)
SHARDED_RESUMED = trainer_case(
    "sharded-resume-3", "--max-steps", "3", "--resume", "{fsdp-trainer-sharded-save-2}/ckpt", *SHARDED
)
SHARDED_ON = {
    (groups, shard): case(TRAINER, f"fsdp-trainer-sharded-resume-{groups}x{shard}", "fsdp_trainer",
                          "--shard-size", str(shard), "--max-steps", "3",
                          "--resume", "{fsdp-trainer-sharded-save-2}/ckpt")
    for groups, shard in ((4, 1), (1, 4))
}  # fmt: skip


def whole_momentum(saved: list[dict], group: int, shard_size: int) -> dict:
    """Replica group ``group``'s momentum of a run of ``shard_size`` ranks per group: its ranks' shards."""
    members = range(group * shard_size, (group + 1) * shard_size)
    return {k: torch.cat([saved[r]["momentum"][k] for r in members]) for k in saved[0]["momentum"]}


@pytest.mark.cases(FIT, SHARDED_SAVED, SHARDED_RESUMED)
def test_a_sharded_checkpoint_resumes_exactly_on_the_same_mesh(cases):
    straight, saved, resumed = cases[FIT].ranks, cases[SHARDED_SAVED].ranks, cases[SHARDED_RESUMED].ranks
    folder = cases[SHARDED_SAVED].out / "ckpt"
    assert folder.is_dir() and (folder / "meta.pt").is_file() and (folder / ".metadata").is_file()
    assert not list(folder.parent.glob("ckpt.rank*"))  # no per-rank files beside it
    meta = torch.load(folder / "meta.pt", weights_only=False)
    assert meta["adasum_sharded_optimizer_mesh"] == [2, 2] and meta["global_step"] == 2
    for r, res in enumerate(resumed):
        assert res["steps"] == 3 and res["batches"] == straight[r]["batches"][2:], r
        for k, m in res["resumed_momentum"].items():
            assert torch.equal(m, saved[r]["momentum"][k]), (r, k)
    assert_same_shards(resumed, straight, "sharded resume vs straight")


@pytest.mark.parametrize(
    ("groups", "shard_size"),
    [pytest.param(*k, marks=pytest.mark.cases(SHARDED_SAVED, c)) for k, c in SHARDED_ON.items()],
)
def test_a_sharded_checkpoint_resumes_on_another_mesh(groups, shard_size, cases):
    # saved on 2 × 2; replica group q of the new mesh takes old group q mod 2's momentum, resharded
    saved, ranks = cases[SHARDED_SAVED].ranks, cases[SHARDED_ON[groups, shard_size]].ranks
    momenta = [whole_momentum(saved, q % 2, 2) for q in range(groups)]
    expected = reference(ranks, shard_size, momenta=momenta)
    for r, res in enumerate(ranks):
        assert res["mesh"] == [list(range(g * shard_size, (g + 1) * shard_size)) for g in range(groups)], r
        assert res["steps"] == 3 and len(res["batches"]) == 1, r
        assert all(torch.equal(res["start"][k], v) for k, v in saved[0]["end"].items()), r  # resharded
        for k, m in res["resumed_momentum"].items():
            part = torch.chunk(momenta[r // shard_size][k], shard_size)[r % shard_size]
            assert torch.equal(m, part), (r, k)
        assert max_difference(res["end"], expected) <= ATOL, (r, max_difference(res["end"], expected))


# ---------------------------------------------------------------------------------------------------------
# A damaged companion file: named on every rank before a step; no rank takes another rank's shard


def damaged(name: str, source: str, *how: str):
    """A copy of ``source`` with a file damaged (``tests/workers/damage_checkpoint.py``); a resume from it."""
    copy = case(TRAINER, f"fsdp-trainer-{name}", "damage_checkpoint", source, *how)
    sharded = SHARDED if "sharded" in source else ()
    resume = trainer_case(f"resume-{name}", "--max-steps", "3", "--resume", f"{{{copy.name}}}/ckpt", *sharded)
    return copy, resume


LOST_SHARD = (SAVED, *damaged("lost-rank-file", "{fsdp-trainer-save-2}/ckpt", "drop", "2"))
TRUNCATED_META = (
    SHARDED_SAVED,
    *damaged("truncated-meta", "{fsdp-trainer-sharded-save-2}/ckpt", "truncate-meta"),
)
LOST_DISTCP = (SHARDED_SAVED, *damaged("lost-distcp", "{fsdp-trainer-sharded-save-2}/ckpt", "drop-shard"))


def assert_named_on_every_rank(result, prefix: str, suffix: str = "") -> None:
    errors = result.errors()
    assert len(set(errors)) == 1, errors  # the same error on every rank
    (kind, message), *_ = errors
    assert kind == "IncompleteCheckpointError" and message.startswith(prefix) and message.endswith(suffix), (
        message
    )
    assert not list(result.out.glob("rank*.pt"))  # no rank trained


@pytest.mark.cases(*LOST_SHARD)
def test_a_missing_rank_file_is_refused_on_every_rank_instead_of_taking_another_ranks_shard(cases):
    path = os.path.realpath(cases[LOST_SHARD[1]].out / "ckpt")
    assert_named_on_every_rank(
        cases[LOST_SHARD[2]],
        f"rank 2: {path}.rank2-optimizer.pt is missing: rank 2's optimizer shard of checkpoint {path} (no "
        "rank resumes from another rank's shard). Copy the <checkpoint>.rank<r>-optimizer.pt files with the "
        "checkpoint, or resume from another checkpoint.",
    )


@pytest.mark.cases(*TRUNCATED_META)
def test_a_truncated_sharded_meta_file_is_named_on_every_rank(cases):
    folder = os.path.realpath(cases[TRUNCATED_META[1]].out / "ckpt")
    assert_named_on_every_rank(
        cases[TRUNCATED_META[2]],
        f"{folder}/meta.pt (written by rank 0) could not be read (RuntimeError: PytorchStreamReader failed",
        "it is truncated or corrupt. Resume from another checkpoint, or pass ckpt_path=None to start from "
        "scratch.",
    )


@pytest.mark.cases(*LOST_DISTCP)
def test_a_missing_shard_file_is_named_with_its_rank_on_every_rank(cases):
    folder = os.path.realpath(cases[LOST_DISTCP[1]].out / "ckpt")
    assert_named_on_every_rank(
        cases[LOST_DISTCP[2]],
        f"{folder}/__1_0.distcp (rank 1's shards) is missing. Resume from another checkpoint, or pass "
        "ckpt_path=None to start from scratch.",
    )


def test_sharded_save_filter_rule():
    check_sharded_save_filter(False)
    with pytest.raises(AdasumConfigurationError) as info:
        check_sharded_save_filter(True)
    assert str(info.value) == (
        "fsdp_adasum: fabric.save(..., filter=...) is not supported with state_dict_type='sharded' (the "
        "folder holds every shard): drop the filter, or save with state_dict_type='full'."
    )


def test_state_dict_type_rule():
    assert check_state_dict_type("full") == "full" and check_state_dict_type("sharded") == "sharded"
    with pytest.raises(AdasumConfigurationError) as info:
        check_state_dict_type("local")
    assert str(info.value).startswith(
        "fsdp_adasum: state_dict_type='local' is not a checkpoint layout: pass state_dict_type='full'"
    )


# ---------------------------------------------------------------------------------------------------------
# What FSDP users expect (the Trainer): accumulation, clipping, frozen layers, bf16, activation checkpointing

#: Below every group's gradient norm at every step (the tests check): clipping acts at each step.
CLIP_NORM = 0.1
ACCUMULATE = trainer_case("accumulate-2", "--max-steps", "3", "--accumulate", "2")
CLIP = trainer_case("clip", "--max-steps", "3", "--clip-norm", str(CLIP_NORM))
FROZEN = trainer_case("frozen", "--max-steps", "3", "--freeze")
BF16 = trainer_case("bf16", "--max-steps", "3", "--bf16")
PLAIN_BF16 = case(FOUR, "fsdp-train-2x2-bf16", "fsdp", "train", "--shard-size", "2", "--bf16")
CHECKPOINTING = trainer_case("checkpointing", "--max-steps", "3", "--checkpointing")
CONFIGURE_MODEL = trainer_case("configure-model", "--max-steps", "3", "--configure-model")


@pytest.mark.cases(ACCUMULATE)
def test_the_trainer_accumulates_gradients_and_steps_every_kth_batch(cases):
    ranks = cases[ACCUMULATE].ranks
    expected = reference(ranks, 2, accumulate=2)
    assert max_difference(expected, reference(ranks, 2)) > 1e-3  # (3 steps of 2 batches, not 3 of 1)
    for r, res in enumerate(ranks):
        assert res["steps"] == 3 and len(res["batches"]) == 6, r
        assert res["batches"][:2] == [[4 * r + i for i in range(4)], [16 + 4 * r + i for i in range(4)]], r
        assert max_difference(res["end"], expected) <= ATOL, (r, max_difference(res["end"], expected))


@pytest.mark.cases(CLIP)
def test_the_trainer_clips_by_the_whole_models_norm(cases):
    ranks = cases[CLIP].ranks
    expected = reference(ranks, 2, clip=CLIP_NORM)
    assert min(min(norms) for norms in reference.norms) > 2 * CLIP_NORM  # every step of every group clipped
    by_shard = reference(ranks, 2, clip=CLIP_NORM, clip_by="shard")
    unclipped = reference(ranks, 2)
    for r, res in enumerate(ranks):
        assert max_difference(res["end"], expected) <= ATOL, (r, max_difference(res["end"], expected))
        assert max_difference(res["end"], by_shard) > 1e-3, r  # not each shard by its own norm
        assert max_difference(res["end"], unclipped) > 1e-2, r


@pytest.mark.cases(FROZEN)
def test_frozen_parameters_stay_at_the_start(cases):
    ranks = cases[FROZEN].ranks
    frozen = ("0.weight", "0.bias")
    expected = reference(ranks, 2, frozen=frozen)
    for r, res in enumerate(ranks):
        for k in frozen:
            assert torch.equal(res["end"][k], res["start"][k]), (r, k)  # a zero delta, combined: zero
        assert not torch.equal(res["end"]["2.weight"], res["start"]["2.weight"]), r
        assert sorted(res["momentum"]) == ["2.bias", "2.weight"], r  # SGD skips parameters without gradients
        assert max_difference(res["end"], expected) <= ATOL, (r, max_difference(res["end"], expected))


@pytest.mark.cases(BF16, PLAIN_BF16)
def test_bf16_mixed_precision_trains_as_the_plain_loop_with_the_same_policy(cases):
    ranks, plain = cases[BF16].ranks, cases[PLAIN_BF16].ranks
    full_precision = reference(ranks, 2)
    for r, res in enumerate(ranks):
        # forward and backward in bfloat16; the shards, their steps and the Adasum in float32
        assert res["output_dtypes"] == ["torch.bfloat16"], r
        assert (
            res["parameter_dtypes"] == ["torch.float32"] and res["local"]["0.weight"].dtype == torch.float32
        )
        assert res["batches"] == plain[r]["batches"], r
        assert 1e-4 < max_difference(res["end"], full_precision) < 2e-2, (
            r,
            max_difference(res["end"], full_precision),
        )
    assert_same_shards(ranks, plain, "trainer bf16 vs plain bf16")


@pytest.mark.cases(CHECKPOINTING, FIT)
def test_activation_checkpointing_trains_the_same_bits(cases):
    ranks = cases[CHECKPOINTING].ranks
    assert all(res["steps"] == 3 for res in ranks)
    assert_same_shards(ranks, cases[FIT].ranks, "activation checkpointing vs not")


@pytest.mark.cases(CONFIGURE_MODEL, TRAIN[2, 2])
def test_a_module_sharded_in_configure_model_is_sharded_at_the_root_and_takes_group_zeros_shards(cases):
    ranks, plain = cases[CONFIGURE_MODEL].ranks, cases[TRAIN[2, 2]].ranks
    for r, res in enumerate(ranks):
        assert res["sharded"] == ["", "net.0", "net.2"], r  # the user's layers, then the root
        assert all(torch.equal(res["start"][k], v) for k, v in plain[r]["start"].items()), r
    assert_same_shards(ranks, plain, "configure_model vs plain")


# ---------------------------------------------------------------------------------------------------------
# Fabric: Fabric(strategy=FSDPAdasumStrategy(shard_size=2))


def fabric_case(name: str, *args: str):
    return case(TRAINER, f"fsdp-fabric-{name}", "fsdp_fabric", "--shard-size", "2", *args)


FABRIC_FIT = fabric_case("fit-3", "--steps", "3")
FABRIC_SAVED = fabric_case("save-2", "--steps", "2", "--save")
FABRIC_RESUMED = fabric_case("resume-3", "--steps", "3", "--resume", "{fsdp-fabric-save-2}/ckpt")
FABRIC_ACCUMULATE_CLIP = fabric_case(
    "accumulate-clip", "--joint", "--steps", "3", "--accumulate", "2", "--clip-norm", str(CLIP_NORM)
)
FABRIC_STALE = fabric_case("stale-optimizer", "--stale-optimizer", "--steps", "1")
FABRIC_SHARDED_SAVED = fabric_case("sharded-save-2", "--steps", "2", "--save", *SHARDED)
FABRIC_SHARDED_RESUMED = fabric_case(
    "sharded-resume-3", "--steps", "3", "--resume", "{fsdp-fabric-sharded-save-2}/ckpt", *SHARDED
)
FABRIC_SHARDED_1X4 = case(TRAINER, "fsdp-fabric-sharded-resume-1x4", "fsdp_fabric", "--shard-size", "4",
                          "--steps", "3", "--resume", "{fsdp-fabric-sharded-save-2}/ckpt")  # fmt: skip


@pytest.mark.cases(FABRIC_FIT, TRAIN[2, 2], FIT)
def test_fabric_trains_as_the_plain_loop_and_the_trainer_bitwise(cases):
    ranks, plain, trainer = cases[FABRIC_FIT].ranks, cases[TRAIN[2, 2]].ranks, cases[FIT].ranks
    torch.manual_seed(100)
    seeded = tiny_net().state_dict()
    expected = reference(ranks, 2)
    for r, res in enumerate(ranks):
        assert (res["world_size"], res["mesh"]) == (4, [[0, 1], [2, 3]]), r
        assert res["sharded"] == ["", "0", "2"], r  # each layer with parameters, then the root
        assert all(torch.equal(res["start"][k], v) for k, v in seeded.items()), r  # rank 0's (seed 100)
        assert res["batches"] == plain[r]["batches"] == trainer[r]["batches"], r
        assert max_difference(res["end"], expected) <= ATOL, (r, max_difference(res["end"], expected))
    assert_same_shards(ranks, plain, "fabric vs plain")
    assert_same_shards(ranks, trainer, "fabric vs trainer")


@pytest.mark.cases(FABRIC_FIT, FABRIC_SAVED, FABRIC_RESUMED)
def test_fabric_save_and_load_resume_exactly(cases):
    straight, saved, resumed = cases[FABRIC_FIT].ranks, cases[FABRIC_SAVED].ranks, cases[FABRIC_RESUMED].ranks
    path = cases[FABRIC_SAVED].out / "ckpt"
    checkpoint = torch.load(path, weights_only=False)
    assert sorted(checkpoint) == [
        "adasum_save_identity", "adasum_sharded_optimizer_mesh", "model", "optimizer", "step"
    ]  # fmt: skip
    assert (checkpoint["adasum_sharded_optimizer_mesh"], checkpoint["step"]) == ([2, 2], 2)
    identity = checkpoint["adasum_save_identity"]
    assert identity["global_step"] == 2 and len(identity["save_id"]) == 32
    for k, v in checkpoint["model"].items():  # the whole model, as the Trainer's fsdp_adasum saves it
        assert torch.equal(v, saved[0]["end"][k]), k
    for r in range(1, 4):  # every other rank's own optimizer shard beside the file
        own = torch.load(f"{path}.rank{r}-optimizer.pt", weights_only=False)
        assert own["rank"] == r and own["adasum_save_identity"] == identity  # the same save
        momentum = [s["momentum_buffer"] for s in own["optimizer_states"]["optimizer"]["state"].values()]
        assert [tuple(m.shape) for m in momentum] == [(8, 8), (8,), (2, 16), (2,)], r
    for r, res in enumerate(resumed):
        assert res["batches"] == straight[r]["batches"][2:], r
        for k, m in res["resumed_momentum"].items():
            assert torch.equal(m, saved[r]["momentum"][k]), (r, k)
        assert all(torch.equal(res["start"][k], v) for k, v in saved[r]["end"].items()), r
    assert_same_shards(resumed, straight, "fabric resumed vs straight")


@pytest.mark.cases(FABRIC_FIT, FABRIC_SHARDED_SAVED, FABRIC_SHARDED_RESUMED, FABRIC_SHARDED_1X4)
def test_fabric_sharded_checkpoints_resume_exactly_and_on_another_mesh(cases):
    straight, saved = cases[FABRIC_FIT].ranks, cases[FABRIC_SHARDED_SAVED].ranks
    resumed, other = cases[FABRIC_SHARDED_RESUMED].ranks, cases[FABRIC_SHARDED_1X4].ranks
    folder = cases[FABRIC_SHARDED_SAVED].out / "ckpt"
    meta = torch.load(folder / "meta.pt", weights_only=False)
    assert (meta["step"], meta["adasum_sharded_optimizer_mesh"]) == (2, [2, 2])
    assert_same_shards(resumed, straight, "fabric sharded resume vs straight")
    # 1 × 4: one replica group of 4 ranks takes group 0's momentum, resharded; then FSDP2 alone
    momentum = whole_momentum(saved, 0, 2)
    expected = reference(other, 4, momenta=[momentum])
    for r, res in enumerate(other):
        assert res["mesh"] == [[0, 1, 2, 3]] and len(res["batches"]) == 1, r
        assert all(torch.equal(res["start"][k], v) for k, v in saved[0]["end"].items()), r
        for k, m in res["resumed_momentum"].items():
            assert torch.equal(m, torch.chunk(momentum[k], 4)[r]), (r, k)
        assert max_difference(res["end"], expected) <= ATOL, (r, max_difference(res["end"], expected))


@pytest.mark.cases(FABRIC_ACCUMULATE_CLIP)
def test_fabric_accumulates_without_backward_sync_and_clips_by_the_whole_models_norm(cases):
    ranks = cases[FABRIC_ACCUMULATE_CLIP].ranks
    expected = reference(ranks, 2, accumulate=2, clip=CLIP_NORM)
    norms = reference.norms
    assert min(min(n) for n in norms) > 2 * CLIP_NORM
    unclipped = reference(ranks, 2, accumulate=2)
    for r, res in enumerate(ranks):
        assert len(res["batches"]) == 6, r
        # fabric.clip_gradients returned the norm of the group's whole averaged gradient
        assert res["norms"] == pytest.approx([n[r // 2] for n in norms], rel=1e-5), r
        assert max_difference(res["end"], expected) <= ATOL, (r, max_difference(res["end"], expected))
        assert max_difference(res["end"], unclipped) > 1e-2, r


@pytest.mark.cases(FABRIC_STALE)
def test_fabric_refuses_an_optimizer_built_before_the_model_was_sharded(cases):
    message = expected_message(check_optimizer_of_sharded_module, "fsdp_adasum", 4, 4)
    assert "model = fabric.setup_module(model); optimizer = fabric.setup_optimizers(" in message
    assert_refused_on_every_rank(cases[FABRIC_STALE], message)


def test_optimizer_of_sharded_module_rule():
    check_optimizer_of_sharded_module("fsdp_adasum", 0, 4)
    with pytest.raises(AdasumConfigurationError) as info:
        check_optimizer_of_sharded_module("fsdp_adasum", 3, 4)
    assert str(info.value).startswith(
        "fsdp_adasum: the optimizer holds 3 of its 4 parameter(s) from before the model was sharded "
        "(fully_shard replaces every parameter). Set the model up first, then build the optimizer from its "
        "parameters: model = fabric.setup_module(model); "
    )
    with pytest.raises(AdasumConfigurationError, match="has optimizer state already"):
        check_optimizer_of_sharded_module("fsdp_adasum", 0, 4, has_state=True)


@pytest.mark.parametrize("package", ["lightning_fabric", "lightning.fabric"])
def test_fabric_strategy_name(package):
    import importlib

    fabric = importlib.import_module(package)
    strategies = importlib.import_module(f"{package}.strategies")
    copy = "adasum_lightning.fabric" if package == "lightning_fabric" else "adasum_lightning.lightning.fabric"
    cls = importlib.import_module(copy).FSDPAdasumStrategy
    assert strategies.STRATEGY_REGISTRY["fsdp_adasum"]["strategy"] is cls
    strategy = fabric.Fabric(accelerator="cpu", devices=2, strategy="fsdp_adasum").strategy
    assert type(strategy) is cls and strategy.shard_size is None and strategy.num_processes == 2
