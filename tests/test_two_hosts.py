"""Jobs across two hosts on this machine (``tests/twohosts.py``: network namespaces hostA and hostB).

Horovod (``horovodrun``/``mpirun``, the MNIST example under ``horovod_adasum``) with even and uneven
placement, torchrun with ``ddp_adasum``, and a host lost
in the middle of training for both launchers, with the settings of ``adasum_lightning.failure_detection``.
Every rank's view is checked. Root only (skipped elsewhere, with the reason).
"""

from __future__ import annotations

import csv
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

from adasum_lightning.failure_detection import (
    DDP_PROCESS_GROUP_TIMEOUT,
    ELASTIC_PROCESS_GROUP_TIMEOUT,
    MPI_FAULT_SETTINGS,
    TCP_RETRIES2,
    TORCHRUN_ELASTIC_ARGS,
    TORCHRUN_ELASTIC_ENV,
    TORCHRUN_FAULT_ARGS,
    horovodrun_mpi_args,
    mpi_env,
    tcp_retries2_sysctl,
)
from tests import twohosts
from tests.helpers import load_ranks

pytestmark = [pytest.mark.mpi, pytest.mark.twohosts]

FIT_WORKER = [sys.executable, "-m", "tests.workers.twohost_fit"]
DDP_WORKER = ["-m", "tests.workers.twohost_ddp"]  # after torchrun's own arguments
LOOP_WORKER = ["-m", "tests.workers.twohost_loop"]  # the recipe in a Fabric or a plain loop
#: A lost host must end every process of the job within this many seconds of the cut.
LOST_NODE_LIMIT_S = 60
#: Under the elastic recipe the survivors train again within this many seconds of losing a host.
ELASTIC_RECOVERY_LIMIT_S = 45


def example_args(out: Path, data: Path, *extra: str) -> list[str]:
    """The MNIST example's LightningCLI arguments: ``horovod_adasum`` from examples/mnist.yaml."""
    return [
        "--config", "examples/mnist.yaml", f"--data.data_dir={data}", f"--trainer.default_root_dir={out}",
        "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=1", *extra,
    ]  # fmt: skip


SHORT_FIT = ["--trainer.limit_train_batches=4", "--trainer.max_epochs=1", "--trainer.log_every_n_steps=1"]
#: Long enough to be cut in the middle; each rank reports its step (``step-rank{r}``).
LONG_FIT = ["--trainer.max_epochs=20", "--trainer.callbacks+=tests.workers.twohost_fit.Progress"]


def check(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode != 0:
        pytest.fail(
            f"{what} exited {proc.returncode}\n--- output (end)\n{(proc.stdout + proc.stderr)[-6000:]}"
        )


def wait_for_training(
    out: Path, np: int, procs: Mapping[str, subprocess.Popen], timeout: float = 300
) -> None:
    """Until every rank finished at least 3 training steps (fails if a launcher exits first)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        steps = [int(p.read_text() or 0) for p in out.glob("step-rank[0-9]")]
        if len(steps) == np and min(steps) >= 3:
            return
        ended = {name: p.returncode for name, p in procs.items() if p.poll() is not None}
        if ended:
            pytest.fail(f"launchers ended before training ran: {ended}")
        time.sleep(0.2)
    pytest.fail(f"training did not start within {timeout} s")


def read_log(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


# ---------------------------------------------------------------------------------------------- Horovod
def _fit_on_two_hosts(out: Path, data: Path | None, placement: str, launcher: str) -> list[dict]:
    twohosts.require()
    if data is None:
        pytest.skip("MNIST is not available (no shared copy, no network)")
    with twohosts.two_hosts() as hosts:
        worker = [*FIT_WORKER, str(out), *example_args(out, data, *SHORT_FIT)]
        if launcher == "horovodrun":
            proc = hosts.run("hostA", *hosts.horovodrun_cmd(4, placement), *worker, timeout=300)
        else:  # plain mpirun, the fault settings as OMPI_MCA_* variables in its environment
            env = hosts.env(**mpi_env())
            proc = hosts.run("hostA", *hosts.mpirun_cmd(4, placement), *worker, env=env, timeout=300)
    check(proc, f"{launcher} -H {placement}")
    return load_ranks(out, 4)


@pytest.fixture(scope="module")
def even(tmp_path_factory, mnist_root):
    out = tmp_path_factory.mktemp("even")
    return out, _fit_on_two_hosts(out, mnist_root, "hostA:2,hostB:2", "horovodrun")


@pytest.fixture(scope="module")
def uneven(tmp_path_factory, mnist_root):
    out = tmp_path_factory.mktemp("uneven")
    return out, _fit_on_two_hosts(out, mnist_root, "hostA:1,hostB:3", "mpirun")


def assert_identical_parameters(ranks: list[dict]) -> None:
    for r, res in enumerate(ranks[1:], start=1):
        for name, tensor in ranks[0]["params"].items():
            assert torch.equal(tensor, res["params"][name]), f"{name} differs between rank 0 and rank {r}"


def test_horovod_adasum_across_two_hosts(even):
    out, ranks = even
    # host, local rank, local size, node (Horovod's cross rank = Lightning's node_rank)
    expected = [("hostA", 0, 2, 0), ("hostA", 1, 2, 0), ("hostB", 0, 2, 1), ("hostB", 1, 2, 1)]
    for r, (res, (host, local_rank, local_size, node)) in enumerate(zip(ranks, expected, strict=True)):
        facts = (res["host"], res["rank"], res["size"], res["local_rank"], res["local_size"])
        assert facts == (host, r, 4, local_rank, local_size), r
        assert (res["cross_rank"], res["cross_size"], res["homogeneous"]) == (node, 2, True), r
        trainer = res["trainer"]
        assert (trainer["global_rank"], trainer["local_rank"], trainer["node_rank"]) == (r, local_rank, node)
        assert (trainer["world_size"], trainer["global_step"]) == (4, 4), r
        assert res["strategy"] == "HorovodAdasumStrategy", r
        # Only rank 0 writes the metrics (Lightning gives the other ranks a dummy experiment).
        assert res["logger_experiment"] == ("ExperimentWriter" if r == 0 else "_DummyExperiment"), r
        assert res["val_acc"] == ranks[0]["val_acc"], r
    assert_identical_parameters(ranks)
    assert ranks[0]["log_dir"] == str(out / "lightning_logs" / "version_0")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("metrics.csv")) == [
        "lightning_logs/version_0/metrics.csv"
    ]
    rows = list(csv.DictReader((out / "lightning_logs/version_0/metrics.csv").open()))
    assert [int(row["step"]) for row in rows if row["train_loss"]] == [0, 1, 2, 3]  # once each, not 4×
    assert [float(row["val_acc"]) for row in rows if row["val_acc"]] == [pytest.approx(ranks[0]["val_acc"])]


@pytest.mark.walltime
def test_a_loopback_master_addr_is_refused_on_every_rank(two_hosts, tmp_path, mnist_root):
    """``MASTER_ADDR=127.0.0.1`` exported to a job across two hosts: hostB could not reach rank 0's process
    group there, so the rendezvous would wait. Every rank says so, before any step."""
    if mnist_root is None:
        pytest.skip("MNIST is not available (no shared copy, no network)")
    hosts = two_hosts
    env = hosts.env(MASTER_ADDR="127.0.0.1")
    worker = [*FIT_WORKER, str(tmp_path), *example_args(tmp_path, mnist_root, *SHORT_FIT)]
    cmd = hosts.mpirun_cmd(4, export=("PYTHONPATH", "MASTER_ADDR"))
    start = time.monotonic()
    proc = hosts.run("hostA", *cmd, *worker, env=env, timeout=120)
    assert proc.returncode != 0 and time.monotonic() - start < 60
    out = re.sub(r"\[1,\d\]<std(?:out|err)>:", "", proc.stdout + proc.stderr)
    message = (
        "this job spans several hosts, but MASTER_ADDR=127.0.0.1 is a loopback address, which the other "
        "hosts cannot reach. Unset MASTER_ADDR, or set it to an address of rank 0's host"
    )
    for r in range(4):
        assert f"AdasumConfigurationError on rank {r}: {message}" in out, out[-3000:]
    assert not list(tmp_path.glob("step-rank*"))  # no training step ran


def test_uneven_placement_trains_identically(uneven):
    """``-H hostA:1,hostB:3`` under plain mpirun: local sizes 1 and 3; Horovod's cross communicators then
    group ranks by local rank, so the cross ranks are 0, 1, 0, 0 with sizes 2, 2, 1, 1 (not a node index);
    Adasum still trains and every rank ends with the same parameters."""
    _, ranks = uneven
    expected = [("hostA", 0, 1, 0, 2), ("hostB", 0, 3, 1, 2), ("hostB", 1, 3, 0, 1), ("hostB", 2, 3, 0, 1)]
    for r, (res, exp) in enumerate(zip(ranks, expected, strict=True)):
        assert (
            res["host"],
            res["local_rank"],
            res["local_size"],
            res["cross_rank"],
            res["cross_size"],
        ) == exp
        assert (res["rank"], res["size"], res["homogeneous"]) == (r, 4, False)
        trainer = res["trainer"]
        assert (trainer["global_rank"], trainer["local_rank"], trainer["global_step"]) == (r, exp[1], 4)
    assert_identical_parameters(ranks)


def test_mpi_settings_as_environment_reach_every_rank_and_daemon(uneven):
    """The fault settings exported as ``OMPI_MCA_*`` where mpirun starts reach every rank's environment,
    and mpirun passes them on the command line of the other host's ``orted`` (whose login environment
    does not carry them): that daemon is the one that must notice a lost link on hostB's side."""
    _, ranks = uneven
    for r, res in enumerate(ranks):
        assert res["mca_env"] == mpi_env(), r
        if res["host"] == "hostB":
            assert res["parent"].startswith("orted "), res["parent"]
            for name, value in MPI_FAULT_SETTINGS.items():
                assert f"-mca {name} {value}" in res["parent"], (name, res["parent"])


def test_uneven_placement_node_rank(uneven):
    # The node rank is the host's index among the job's hosts (Horovod's cross rank is not, here: ranks 2
    # and 3 have cross rank 0), and num_nodes counts the hosts.
    _, ranks = uneven
    assert [res["trainer"]["node_rank"] for res in ranks] == [0, 1, 1, 1]
    assert [res["trainer"]["num_nodes"] for res in ranks] == [2, 2, 2, 2]


@pytest.mark.walltime
def test_lost_host_ends_a_horovod_job(two_hosts, tmp_path, mnist_root):
    """The link to hostB goes down mid-training: with ``MPI_FAULT_SETTINGS`` (as horovodrun's
    ``--mpi-args``) every process on both hosts is gone within 60 s, horovodrun exits non-zero and
    mpirun names the lost host. Without them Open MPI's default keepalive waits about 480 s."""
    if mnist_root is None:
        pytest.skip("MNIST is not available (no shared copy, no network)")
    hosts, log = two_hosts, tmp_path / "launcher.log"
    cmd = hosts.horovodrun_cmd(4, mpi_args=[horovodrun_mpi_args()])
    worker = [*FIT_WORKER, str(tmp_path), *example_args(tmp_path, mnist_root, *LONG_FIT)]
    with log.open("w") as out:
        launcher = hosts.popen("hostA", *cmd, *worker, stdout=out, stderr=subprocess.STDOUT, timeout=400)
    try:
        wait_for_training(tmp_path, 4, {"horovodrun": launcher})
        lost = hosts.cut_and_watch({"horovodrun": launcher}, timeout=LOST_NODE_LIMIT_S + 30)
    finally:
        hosts.kill_all()
        launcher.wait(timeout=30)
    print(f"cut -> last exit {lost.seconds} s, rc {lost.returncodes}\n{lost.table()}")
    output = read_log(log)
    assert lost.seconds is not None and lost.seconds < LOST_NODE_LIMIT_S, (lost.survivors, lost.table())
    assert lost.returncodes["horovodrun"] not in (0, None)
    assert "ORTE has lost communication with a remote daemon" in output, output[-3000:]
    assert re.search(r"Remote daemon: \[\[\d+,0\],1\] on node hostB", output), output[-3000:]
    assert not list(tmp_path.glob("rank*.pt"))  # no rank finished


# ---------------------------------------------------------------------------------------------- torchrun
def start_torchrun(
    hosts,
    out: Path,
    *worker_args: str,
    args=(),
    nnodes: str = "2",
    env: Mapping[str, str] | None = None,
    on=twohosts.HOSTS,
    log_suffix: str = "",
    worker=DDP_WORKER,
) -> dict[str, subprocess.Popen]:
    """torchrun (with ``args``, and ``env`` added to its environment) on each host of ``on``, 2 processes
    each; output in ``out/torchrun-<host><log_suffix>.log``."""
    procs = {}
    for host in on:
        with (out / f"torchrun-{host}{log_suffix}.log").open("w") as log:
            procs[host] = hosts.popen(
                host, *hosts.torchrun_cmd(2, args=args, nnodes=nnodes), *worker, str(out), *worker_args,
                stdout=log, stderr=subprocess.STDOUT, timeout=300, env={**hosts.env(), **(env or {})},
            )  # fmt: skip
    return procs


def test_torchrun_ddp_adasum_across_two_hosts(two_hosts, tmp_path):
    procs = start_torchrun(two_hosts, tmp_path, "--strategy", "ddp_adasum", "--epochs", "2")
    for host, proc in procs.items():
        proc.wait(timeout=330)
        log = read_log(tmp_path / f"torchrun-{host}.log")
        assert proc.returncode == 0, f"torchrun on {host} exited {proc.returncode}:\n{log[-6000:]}"
    ranks = load_ranks(tmp_path, 4)
    nodes = {}
    for r, res in enumerate(ranks):
        trainer, env = res["trainer"], res["env"]
        node, local_rank = trainer["node_rank"], trainer["local_rank"]
        nodes.setdefault(res["host"], set()).add(node)
        assert (trainer["global_rank"], res["dist"]["rank"], int(env["RANK"])) == (r, r, r)
        assert r == node * 2 + local_rank and int(env["LOCAL_RANK"]) == local_rank, r
        assert int(env["GROUP_RANK"]) == node and env["LOCAL_WORLD_SIZE"] == "2", r
        assert (trainer["world_size"], trainer["num_nodes"], trainer["num_devices"]) == (4, 2, 2), r
        assert (res["dist"]["world_size"], res["dist"]["backend"]) == (4, "gloo"), r
        assert (res["strategy"], res["environment"]) == ("DDPAdasumStrategy", "TorchElasticEnvironment"), r
        assert trainer["global_step"] == 8, r  # 64 samples / 4 ranks / batch 4 × 2 epochs
    # one node rank per host, 0 and 1 (which host gets 0 is the rendezvous' choice)
    assert sorted(nodes) == ["hostA", "hostB"], nodes
    assert sorted(n for s in nodes.values() for n in s) == [0, 1], nodes
    for key in ("start", "params"):  # rank 0's initial weights reached every rank; identical at the end
        for r, res in enumerate(ranks[1:], start=1):
            for name, tensor in ranks[0][key].items():
                assert torch.equal(tensor, res[key][name]), (key, name, r)
    seen = [set(res["indices"][:16]) for res in ranks]  # first epoch: each rank its own quarter of 64
    assert sum(map(len, seen)) == 64 and set().union(*seen) == set(range(64))


@pytest.mark.walltime
def test_lost_host_ends_a_torchrun_job(two_hosts, tmp_path):
    """The link to hostB goes down mid-training under torchrun + ``ddp_adasum``: with the process-group
    timeout ``DDP_PROCESS_GROUP_TIMEOUT``, ``TORCHRUN_FAULT_ARGS`` and ``net.ipv4.tcp_retries2 =
    TCP_RETRIES2`` on both hosts, every process on both hosts is gone within 60 s and both torchrun agents
    exit non-zero."""
    hosts = two_hosts
    for host in twohosts.HOSTS:
        check(hosts.run(host, *tcp_retries2_sysctl()), f"sysctl on {host}")
        assert hosts.run(host, "sysctl", "-n", "net.ipv4.tcp_retries2").stdout.strip() == str(TCP_RETRIES2)
    timeout = str(DDP_PROCESS_GROUP_TIMEOUT.total_seconds())
    worker_args = ["--strategy", "ddp_adasum", "--epochs", "100000", "--pg-timeout", timeout]
    procs = start_torchrun(hosts, tmp_path, *worker_args, args=TORCHRUN_FAULT_ARGS)
    try:
        wait_for_training(tmp_path, 4, procs)
        lost = hosts.cut_and_watch(procs, timeout=LOST_NODE_LIMIT_S + 30)
    finally:
        hosts.kill_all()
        for proc in procs.values():
            proc.wait(timeout=30)
    print(f"cut -> last exit {lost.seconds} s, rc {lost.returncodes}\n{lost.table()}")
    assert lost.seconds is not None and lost.seconds < LOST_NODE_LIMIT_S, (lost.survivors, lost.table())
    assert all(rc not in (0, None) for rc in lost.returncodes.values()), lost.returncodes
    # hostA's agent reports its failed ranks; hostB's agent lost the rendezvous store on hostA.
    assert "ChildFailedError" in read_log(tmp_path / "torchrun-hostA.log")
    assert "RendezvousConnectionError" in read_log(tmp_path / "torchrun-hostB.log")


def progress(out: Path) -> list[tuple[int, int, int, float]]:
    """Every rank's ``(rank, pid, global step, time)`` lines (``--checkpoint-every`` runs), in time order."""
    rows = []
    for path in out.glob("progress-rank*"):
        rank = int(path.name.removeprefix("progress-rank"))
        for line in path.read_text().splitlines():
            pid, step, when = line.split()
            rows.append((rank, int(pid), int(step), float(when)))
    return sorted(rows, key=lambda row: row[3])


@pytest.mark.walltime
@pytest.mark.parametrize(
    "strategy, sync_every",
    [("ddp_adasum", 1), ("ddp_adasum", 10), ("fsdp_adasum", 1), ("fabric", 1), ("plain", 1)],
)
def test_a_lost_host_costs_the_survivors_one_restart_under_elastic_torchrun(
    two_hosts, tmp_path, strategy, sync_every
):
    """The elastic recipe (docs/elastic.md): ``torchrun --nnodes 1:2 --max-restarts 3`` with
    ``TORCHRUN_ELASTIC_ARGS`` and ``TORCHRUN_ELASTIC_ENV`` on each host, ``ddp_adasum`` with
    ``ELASTIC_PROCESS_GROUP_TIMEOUT``, a ``ModelCheckpoint`` every 5 steps and ``fit(ckpt_path="last")``.
    hostB's link is cut at step 22: hostA's agent restarts its two workers at world size 2 from the last
    checkpoint; they train again within ``ELASTIC_RECOVERY_LIMIT_S`` with at most one checkpoint interval
    lost. With ``ddp_adasum`` hostB then comes back (its agent started again, at step 35): the job grows
    back to world size 4 from the last checkpoint and its 4 ranks reach step 90 identical. With
    ``sync_every=10`` (the cut inside a window; a checkpoint ends one early, on every rank) and with
    ``fsdp_adasum`` (a 2 × 2 mesh, one shard group per host, that loses a replica group; sharded checkpoints,
    resumed on the 1 × 2 mesh), and with the recipe in a Fabric loop (``ddp_adasum``) and in a plain loop
    (``AdasumOptimizer``; ``tests/workers/twohost_loop.py``), the 2 survivors reach step 60 identical. Every
    torchrun still running at the end exits 0."""
    hosts, grow = two_hosts, (strategy, sync_every) == ("ddp_adasum", 1)
    for host in twohosts.HOSTS:
        check(hosts.run(host, *tcp_retries2_sysctl()), f"sysctl on {host}")
    max_steps = 90 if grow else 60
    timeout = str(ELASTIC_PROCESS_GROUP_TIMEOUT.total_seconds())
    loop = strategy in ("fabric", "plain")
    worker_args = [
        "--form" if loop else "--strategy",
        strategy,
        "--pg-timeout",
        timeout,
        "--samples",
        "100000",
    ]
    worker_args += ["--max-steps", str(max_steps), "--checkpoint-every", "5", "--step-seconds", "0.25"]
    worker_args += ["--sync-every", str(sync_every)] if sync_every > 1 else []
    worker_args += ["--state-dict-type", "sharded"] if strategy == "fsdp_adasum" else []
    # the recipe as docs/elastic.md shows it: torchrun --nnodes 1:2 --nproc-per-node 2 --max-restarts 3
    # --shutdown-timeout 5 --rdzv-backend c10d --rdzv-endpoint hostA:29400 --rdzv-id ID --rdzv-conf
    # last_call_timeout=5 -m tests.workers.twohost_ddp OUT ...
    assert TORCHRUN_ELASTIC_ARGS == ("--shutdown-timeout", "5", "--rdzv-conf", "last_call_timeout=5")
    assert TORCHRUN_ELASTIC_ENV == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    command = hosts.torchrun_cmd(2, args=(*TORCHRUN_ELASTIC_ARGS, "--max-restarts", "3"), nnodes="1:2")
    assert command[1:9] == [
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "hostA:29400",
    ]
    assert command[9] == "--rdzv-id" and DDP_WORKER == ["-m", "tests.workers.twohost_ddp"]
    launch = dict(
        args=command[11:], nnodes="1:2", env=TORCHRUN_ELASTIC_ENV, worker=LOOP_WORKER if loop else DDP_WORKER
    )
    procs = start_torchrun(hosts, tmp_path, *worker_args, **launch)
    rejoin = None
    try:
        wait_for_training(tmp_path, 4, procs)
        while max((row[2] for row in progress(tmp_path)), default=0) < 22:  # between two saves
            time.sleep(0.05)
        cut = time.time()
        hosts.cut()
        if grow:  # hostB comes back once the survivors train again: its processes gone, its agent restarted
            before = {row[1] for row in progress(tmp_path) if row[3] < cut}
            while max((r[2] for r in progress(tmp_path) if r[1] not in before), default=0) < 35:
                assert procs["hostA"].poll() is None, read_log(tmp_path / "torchrun-hostA.log")[-6000:]
                time.sleep(0.05)
            hosts.kill_all(hosts=["hostB"])
            procs.pop("hostB").wait(timeout=30)
            hosts.restore()
            rejoin = time.time()
            procs |= start_torchrun(
                hosts, tmp_path, *worker_args, **launch, on=["hostB"], log_suffix="-again"
            )
        for proc in procs.values():
            proc.wait(timeout=240)
    finally:
        hosts.kill_all()
        for proc in procs.values():
            proc.wait(timeout=30)
    logs = {name: read_log(tmp_path / f"torchrun-{name}.log") for name in ("hostA", "hostB-again")}
    for host, proc in procs.items():  # the lost hostB's agent fails (it lost the rendezvous store)
        assert proc.returncode == 0 or host == "hostB", (
            host,
            logs["hostA"][-6000:],
            logs["hostB-again"][-6000:],
        )
    rows = progress(tmp_path)
    before = {pid for _, pid, _, when in rows if when < cut}
    at_cut = max(step for _, _, step, when in rows if when < cut)
    shrunk = [row for row in rows if row[1] not in before and (rejoin is None or row[3] < rejoin)]
    assert sorted({rank for rank, *_ in shrunk}) == [0, 1], shrunk[:4]  # hostA's two workers, restarted
    resumed = min(step for _, _, step, _ in shrunk) - 1  # the first step after the restart, less one
    again = shrunk[0][3] - cut
    print(f"cut at step {at_cut}; resumed from step {resumed}; training again {again:.1f} s after the cut")
    assert at_cut - 5 <= resumed <= at_cut, (at_cut, resumed)  # at most one checkpoint interval lost
    assert again <= ELASTIC_RECOVERY_LIMIT_S, again
    last = tmp_path / "checkpoints" / "last.ckpt"
    name = {"fsdp_adasum": "FSDPAdasumStrategy", "plain": "plain loop"}.get(strategy, "DDPAdasumStrategy")
    line = f"{name}: resumed from {last} at step {resumed} (world size 4 -> 2; torchrun restart 1)"
    assert line in logs["hostA"], logs["hostA"][-6000:]
    world_size, start = 2, resumed
    if grow:
        grown = [row for row in rows if row[3] > rejoin and row[1] not in {r[1] for r in shrunk} | before]
        assert sorted({rank for rank, *_ in grown}) == [0, 1, 2, 3], grown[:8]
        world_size, start = 4, min(step for _, _, step, _ in grown) - 1
        print(f"hostB back: training at world size 4 from step {start}, {grown[0][3] - rejoin:.1f} s after")
        line = f"DDPAdasumStrategy: resumed from {last} at step {start} (world size 2 -> 4; torchrun restart "
        assert re.search(re.escape(line) + r"\d\)", logs["hostA"] + logs["hostB-again"]), logs
    ranks = load_ranks(tmp_path, world_size)
    for r, res in enumerate(ranks):
        assert res["trainer"]["world_size"] == world_size and res["trainer"]["global_step"] == max_steps, r
        # the resumed epoch starts over: rank r reads its shard of the new world from the epoch's start (the
        # same seed and epoch), in batches of 4, for the steps left
        sampler = DistributedSampler(range(100000), num_replicas=world_size, rank=r, shuffle=True, seed=100)
        sampler.set_epoch(0)
        assert res["indices"] == list(sampler)[: 4 * (max_steps - start)], (r, res["indices"][:8])
    assert_identical_parameters(ranks)
