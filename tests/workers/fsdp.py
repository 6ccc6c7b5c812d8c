"""Worker (torchrun): Adasum across replica groups with FSDP2 inside each (``AdasumOptimizer(mesh=...)``);
every rank saves OUT/rank{r}.pt.

usage: torchrun --nproc-per-node N -m tests.workers.fsdp OUT {train,allreduce,refusals} [--shard-size S]

- ``train``: the tiny net (Linear(8,16)-Tanh-Linear(16,4), seed 100 on every rank) sharded by ``fully_shard``
  per layer and at the root over ``mesh["shard"]`` of a ``(N // S, S)`` mesh; SGD (lr 0.1, momentum 0.9) in
  ``AdasumOptimizer(mesh=mesh)``; ``--steps`` steps, rank r's batch at step t the samples
  ``(t·N + r)·4 … +3`` of ``IndexedData(64)`` (another batch on every rank). Saves the full parameters at the
  start and the end, the local shards of the parameters and of the momentum, the batches and the
  AdasumOptimizer warnings (``--same-data-per-group``: every group reads group 0's batches; ``--bf16``:
  ``fully_shard(..., mp_policy=MixedPrecisionPolicy(bfloat16, float32))``; ``--compression``: the
  optimizer's), the bytes of the buffers the Adasum step keeps beside those of this rank's shards of the
  parameters, and whether the sharded gradients
  were released (None) after each step (they receive the partner's deltas). With S = 1 the
  same training also runs unsharded with ``AdasumOptimizer`` (no mesh), saved as ``plain_end``.
- ``allreduce``: ``sharded_adasum_step`` of a float32 (5, 3), a float32 (1, 3) (an empty shard beyond the
  first rank) and a float64 (7,) parameter, sharded in FSDP2's dim-0 chunks and at zero before a local step
  that writes whole tensors drawn per replica group (seed 10 + group): the step leaves their Adasum; saves the
  whole tensors and this rank's shards after the step.
- ``refusals``: the messages of the refused configurations (a 1-D mesh, misnamed dimensions, local SGD with a
  mesh, a model not sharded, ``process_group`` with ``mesh``).
"""

import argparse
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from adasum_lightning import AdasumOptimizer
from adasum_lightning.allreduce import release_workspace
from adasum_lightning.errors import AdasumConfigurationError
from adasum_lightning.mesh import replica_groups
from adasum_lightning.sharded import _step_buffer_bytes, sharded_adasum_step
from tests.workers import cases
from tests.workers.samples import IndexedData, tiny_net

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("job", choices=("train", "allreduce", "refusals"))
p.add_argument("--shard-size", type=int, default=2)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--bf16", action="store_true", help="FSDP2's MixedPrecisionPolicy(bfloat16, reduce float32)")
p.add_argument("--compression", default=None, choices=("bf16", "fp16"))
p.add_argument(
    "--same-data-per-group", action="store_true", help="every replica group reads group 0's batches"
)
args = p.parse_args(cases.argv())
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
BATCH, LR, MOMENTUM = 4, 0.1, 0.9

cases.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
S = args.shard_size
R = world // S


def mesh_2d():
    return init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))


def sharded_net(mesh):
    torch.manual_seed(100)  # the same initial weights on every rank: each keeps its own chunk of them
    net = tiny_net()
    kwargs = {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32)} if args.bf16 else {}
    for layer in net:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh["shard"], **kwargs)
    fully_shard(net, mesh=mesh["shard"], **kwargs)
    return net


def full(net, mesh) -> dict:
    """The full parameters: the local shards gathered over the shard group, concatenated along dim 0.

    Not ``DTensor.full_tensor()``: DTensor caches its sharding decisions by mesh, and meshes compare equal by
    layout, so an earlier case's mesh of the same layout (its groups destroyed by the case runner) would be
    the one used.
    """
    shards = [q.to_local().detach().clone() for q in net.parameters()]
    gathered = [None] * S
    dist.all_gather_object(gathered, shards, group=mesh.get_group("shard"))
    names = [k for k, _ in net.named_parameters()]
    return {k: torch.cat([g[i] for g in gathered]) for i, k in enumerate(names)}


def batch_indices(step: int) -> list[int]:
    first = (step * world + (rank % S if args.same_data_per_group else rank)) * BATCH
    return [(first + i) % 64 for i in range(BATCH)]


def train(net, optimizer, released: list[bool] | None = None) -> list[list[int]]:
    data = IndexedData(64)
    batches = []
    for step in range(args.steps):
        idx = batch_indices(step)
        batches.append(idx)
        loss = F.cross_entropy(net(data.x[idx]).float(), data.y[idx])
        loss.backward()
        optimizer.step()
        if released is not None:
            released.append(all(q.grad is None for q in net.parameters()))
        optimizer.zero_grad()
    return batches


def run_train() -> dict:
    mesh = mesh_2d()
    net = sharded_net(mesh)
    if rank >= S:  # replica groups other than 0 start elsewhere: the wrapper gives them group 0's values
        with torch.no_grad():
            for q in net.parameters():
                q.to_local().add_(1.0)
    sgd = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    optimizer = AdasumOptimizer(sgd, mesh=mesh, compression=args.compression)
    start = full(net, mesh)
    release_workspace()  # an earlier case's buffers of this process: count this training's alone
    released: list[bool] = []
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        batches = train(net, optimizer, released)
    names = [k for k, _ in net.named_parameters()]
    result = {
        "start": start,
        "end": full(net, mesh),
        "local": {k: q.to_local().detach().clone() for k, q in net.named_parameters()},
        "momentum": {
            k: optimizer.state[q]["momentum_buffer"].to_local().clone()
            for k, q in zip(names, net.parameters(), strict=True)
        },
        "batches": batches,
        "mesh": mesh.mesh.tolist(),
        "warned": [str(w.message) for w in warned if str(w.message).startswith("AdasumOptimizer")],
        "step_buffer_bytes": _step_buffer_bytes(),
        "shard_bytes": sum(q.to_local().numel() * q.element_size() for q in net.parameters()),
        "released": released,
    }
    if S == 1:  # the same training unsharded, every rank a replica: AdasumOptimizer without a mesh
        torch.manual_seed(100)
        plain = tiny_net()
        plain_opt = AdasumOptimizer(torch.optim.SGD(plain.parameters(), lr=LR, momentum=MOMENTUM))
        train(plain, plain_opt)
        result["plain_end"] = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    return result


def chunk(t: torch.Tensor, j: int) -> torch.Tensor:
    """FSDP2's shard j of S: torch.chunk along dim 0, empty beyond the last chunk."""
    parts = torch.chunk(t, S, dim=0)
    return parts[j].clone() if j < len(parts) else t[:0].clone()


def run_allreduce() -> dict:
    mesh = mesh_2d()
    rep, shard = replica_groups(mesh)
    group, j = rank // S, rank % S
    gen = torch.Generator().manual_seed(10 + group)
    whole = [
        torch.randn(5, 3, generator=gen),
        torch.randn(1, 3, generator=gen),
        torch.randn(7, generator=gen, dtype=torch.float64),
    ]
    shards = [chunk(t, j) for t in whole]
    params = [
        DTensor.from_local(torch.zeros_like(s), mesh["shard"], [Shard(0)], shape=t.shape, stride=t.stride())
        for s, t in zip(shards, whole, strict=True)
    ]

    def local_step() -> None:  # θ_after − θ_before = this group's shards
        for p, s in zip(params, shards, strict=True):
            p.to_local().copy_(s)

    sharded_adasum_step(params, local_step, rep, shard)
    return {"whole": whole, "shards": [p.to_local().clone() for p in params], "group": group, "position": j}


def refused(build) -> str:
    try:
        build()
    except AdasumConfigurationError as err:
        return str(err)
    return "not refused"


def run_refusals() -> dict:
    mesh = mesh_2d()
    net = sharded_net(mesh)
    sgd = torch.optim.SGD(net.parameters(), lr=LR)
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("replicate",))
    swapped = init_device_mesh("cpu", (R, S), mesh_dim_names=("shard", "replicate"))
    plain = tiny_net()
    return {
        "one_d": refused(lambda: AdasumOptimizer(sgd, mesh=flat)),
        "misnamed": refused(lambda: AdasumOptimizer(sgd, mesh=swapped)),
        "sync_every": refused(lambda: AdasumOptimizer(sgd, mesh=mesh, sync_every=2)),
        "mean": refused(lambda: AdasumOptimizer(sgd, mesh=mesh, combine="mean")),
        "unsharded": refused(lambda: AdasumOptimizer(torch.optim.SGD(plain.parameters(), lr=LR), mesh=mesh)),
        "process_group": refused(lambda: AdasumOptimizer(sgd, dist.group.WORLD, mesh=mesh)),
    }


job = {"train": run_train, "allreduce": run_allreduce, "refusals": run_refusals}[args.job]
torch.save({"rank": rank, "world_size": world, **job()}, out / f"rank{rank}.pt")
cases.destroy_process_group()
