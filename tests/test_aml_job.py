"""Azure ML launcher, without any SDK object: the job description, the config file, the CLI's bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from adasum_lightning import failure_detection
from adasum_lightning.aml import cli
from adasum_lightning.aml.errors import AmlSubmitError, AmlUsageError
from adasum_lightning.aml.job import (
    DEFAULT_TRAINING_ARGS,
    AmlJob,
    check_process_count,
    lookup_vm_size,
)
from adasum_lightning.aml.project import parse_bindings
from adasum_lightning.aml.workspace import check_network, find_config_file, load_workspace_config, redact
from tests.aml_support import no_network  # noqa: F401  (fixture)
from tests.helpers import ROOT

pytestmark = pytest.mark.usefixtures("no_network")

SUB = "0a1b2c3d-4e5f-6789-abcd-ef0123456789"
SEED_CONFIG = {"subscription_id": SUB, "resource_group": "rg-adasum", "workspace_name": "ws-adasum"}


def write(path, content):
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


#: The topology variables of the default job (horovod_adasum, 8 nodes × 4 GPUs, one GPU per process).
TOPOLOGY = {
    "ADASUM_STRATEGY": "horovod_adasum",
    "ADASUM_ACCELERATOR": "gpu",
    "ADASUM_DEVICES": "1",
    "ADASUM_NUM_NODES": "8",
}


# -- the job description -------------------------------------------------------------------------------
def test_defaults_keep_the_seed_topology_on_a_current_vm_size():
    job = AmlJob()
    assert (job.node_count, job.process_count_per_node, job.world_size) == (8, 4, 32)
    assert (job.min_nodes, job.max_nodes) == (0, 8)
    assert job.vm_size == "Standard_NC64as_T4_v3" and lookup_vm_size(job.vm_size).gpus == 4
    assert job.base_image == "nvidia/cuda:13.0.0-runtime-ubuntu22.04"  # Horovod builds without a devel image
    assert job.strategy == "horovod_adasum" and job.is_mpi
    assert dict(job.environment_variables) == {
        "OMP_NUM_THREADS": "1",
        "NCCL_DEBUG": "WARN",
        "PYTHONUNBUFFERED": "1",
        **TOPOLOGY,  # what a script without --trainer.* arguments reads
        **failure_detection.mpi_env(),  # Open MPI's fault settings, for Azure ML's mpirun
    }
    cmd = job.training_command()
    assert cmd[:3] == ["python", "mnist.py", "fit"]
    for arg in ("--trainer.strategy=horovod_adasum", "--trainer.devices=1", "--trainer.accelerator=gpu"):
        assert arg in cmd
    assert "--data.data_dir=data" in cmd  # downloaded on each node


def test_training_args_come_last_and_are_quoted():
    job = AmlJob(
        training_args=["--trainer.max_epochs=2", "--model.lr=0.02", "--trainer.default_root_dir=a b"]
    )
    assert job.training_command()[-3:] == [
        "--trainer.max_epochs=2",
        "--model.lr=0.02",
        "--trainer.default_root_dir=a b",
    ]
    assert job.training_command()[3 : 3 + len(DEFAULT_TRAINING_ARGS) - 1] == list(DEFAULT_TRAINING_ARGS[1:])
    assert job.command_line().endswith("--model.lr=0.02 '--trainer.default_root_dir=a b'")


def test_vm_size_is_case_insensitive_and_canonicalised():
    assert AmlJob(vm_size="standard_nc96ads_a100_v4").vm_size == "Standard_NC96ads_A100_v4"


@pytest.mark.parametrize(
    "size, when",
    [("Standard_NC24", "2023-08-31"), ("Standard_NC24s_v3", "2025-09-30"), ("standard_nd24s", "2023-08-31")],
)
def test_retired_vm_sizes_are_refused_with_the_reason(size, when):
    with pytest.raises(AmlUsageError, match=rf"retired by Azure on {when}.*--vm-size Standard_NC64as_T4_v3"):
        AmlJob(vm_size=size)


def test_unknown_vm_size_lists_current_ones():
    with pytest.raises(AmlUsageError, match=r"unknown VM size 'Standard_XYZ'.*Standard_NC96ads_A100_v4"):
        AmlJob(vm_size="Standard_XYZ")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"node_count": 6}, r"node_count=6 is not a power of 2.*--nodes 4 or --nodes 8"),
        (
            {"process_count_per_node": 3},
            r"process_count_per_node=3 is not a power of 2.*--gpus-per-node 2 or",
        ),
        ({"node_count": 0}, r"node_count must be a positive integer, got 0"),
        ({"node_count": -4}, r"node_count must be a positive integer, got -4"),
        ({"node_count": True}, r"node_count must be a positive integer, got True"),
        ({"process_count_per_node": 2.0}, r"process_count_per_node must be a positive integer, got 2.0"),
        ({"vm_size": "Standard_NC24ads_A100_v4"}, r"has 1 GPU\(s\).*--gpus-per-node 1"),
        ({"max_nodes": 4}, r"max_nodes must be an integer ≥ node_count \(8\), got 4"),
        ({"min_nodes": -1}, r"min_nodes must be an integer ≥ 0"),
        ({"min_nodes": 9}, r"min_nodes 9 exceeds max_nodes 8"),
        ({"compute_name": "9cluster"}, r"cluster name '9cluster' is invalid.*--cluster"),
        ({"compute_name": "a-very-long-cluster-name"}, r"2–16 characters"),
        ({"experiment_name": "my experiment"}, r"experiment name 'my experiment' is invalid.*--experiment"),
        ({"environment_variables": {"AZURE_CLIENT_SECRET": "x"}}, r"looks like a secret"),
        ({"environment_variables": {"STORAGE_KEY": "x"}}, r"looks like a secret"),
        ({"environment_variables": {"1BAD": "x"}}, r"environment variable name '1BAD' is invalid"),
        ({"base_image": "two words"}, r"--base-image"),
    ],
)
def test_invalid_jobs_are_refused_with_the_fix(kwargs, message):
    with pytest.raises(AmlUsageError, match=message):
        AmlJob(**kwargs)


def test_extra_environment_variables_merge_over_the_defaults():
    job = AmlJob(environment_variables={"NCCL_DEBUG": "INFO", "HOROVOD_LOG_LEVEL": "debug"})
    assert dict(job.environment_variables) == {
        "OMP_NUM_THREADS": "1",
        "NCCL_DEBUG": "INFO",
        "PYTHONUNBUFFERED": "1",
        **TOPOLOGY,
        **failure_detection.mpi_env(),
        "HOROVOD_LOG_LEVEL": "debug",
    }
    # a fault setting can be overridden like any other variable
    name = next(iter(failure_detection.mpi_env()))
    assert AmlJob(environment_variables={name: "60"}).environment_variables[name] == "60"


# -- the strategies: MPI jobs (Horovod) and PyTorch jobs (ddp_adasum) ---------------------------------------
def test_ddp_adasum_job_runs_lightning_ddp_on_the_topology():
    job = AmlJob(strategy="ddp_adasum", node_count=3, process_count_per_node=4)
    assert not job.is_mpi and job.world_size == 12 and job.devices == 4
    assert job.base_image == "nvidia/cuda:13.0.0-runtime-ubuntu22.04"  # nothing is compiled in its image
    assert job.environment_name == "adasum-lightning-ddp"
    timeout = str(failure_detection.DDP_PROCESS_GROUP_TIMEOUT)
    assert (
        job.training_command()
        == [
            "python",
            "mnist.py",
            "fit",
            "--trainer.strategy=adasum_lightning.DDPAdasumStrategy",
            f"--trainer.strategy.timeout={timeout}",
            "--trainer.accelerator=gpu",
            "--trainer.devices=4",  # Lightning's ranks: NODE_RANK × devices + LOCAL_RANK
            "--trainer.num_nodes=3",  # world size: num_nodes × devices
            *DEFAULT_TRAINING_ARGS[4:],
        ]
    )
    # no Open MPI settings in a job without MPI
    assert dict(job.environment_variables) == {
        "OMP_NUM_THREADS": "1",
        "NCCL_DEBUG": "WARN",
        "PYTHONUNBUFFERED": "1",
        "ADASUM_STRATEGY": "ddp_adasum",
        "ADASUM_ACCELERATOR": "gpu",
        "ADASUM_DEVICES": "4",
        "ADASUM_NUM_NODES": "3",
    }


def test_horovod_job_averages_with_one_gpu_per_mpi_process():
    job = AmlJob(strategy="horovod", node_count=3)  # any node count: no Adasum pairing
    assert job.is_mpi and job.environment_name == "adasum-lightning-horovod-nccl"
    assert job.training_command()[3:6] == [
        "--trainer.strategy=horovod",
        "--trainer.accelerator=gpu",
        "--trainer.devices=1",
    ]
    assert failure_detection.mpi_env().items() <= dict(job.environment_variables).items()


@pytest.mark.parametrize("strategy", ["ddp_adasum", "horovod"])
def test_only_horovod_adasum_needs_powers_of_two(strategy):
    job = AmlJob(strategy=strategy, node_count=6, process_count_per_node=3)
    assert job.world_size == 18
    check_process_count(3, "--local", "--local", job.strategy)  # --local 3 too
    with pytest.raises(
        AmlUsageError,
        match=r"--local=3 is not a power of 2.*Use --local 2 or --local 4, or --strategy ddp_adasum",
    ):
        check_process_count(3, "--local", "--local", AmlJob().strategy)


def test_training_args_may_repeat_the_topology_and_change_the_ddp_timeout():
    args = ["--trainer.devices=4", "--trainer.num_nodes", "8", "--trainer.strategy.timeout=0:05:00"]
    job = AmlJob(strategy="ddp_adasum", training_args=args)
    assert job.training_command()[-4:] == args  # last value wins in LightningCLI: the timeout is 5 min
    AmlJob(training_args=["--trainer.devices=1"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"strategy": "ddp"},
            r"unknown strategy 'ddp': use --strategy horovod_adasum .* --strategy ddp_adasum",
        ),
        (
            {"strategy": "ddp_adasum", "training_args": ["--trainer.devices=2"]},
            r"--trainer.devices=2 contradicts the job's topology \(--trainer.devices=4\).*--gpus-per-node 2",
        ),
        (
            {"strategy": "ddp_adasum", "training_args": ["--trainer.num_nodes", "2"]},
            r"--trainer.num_nodes=2 contradicts .*hangs or duplicates ranks.*--nodes 2",
        ),
        (
            {"strategy": "ddp_adasum", "training_args": ["--trainer.devices=auto"]},
            r"--trainer.devices=auto contradicts .*--gpus-per-node N",
        ),
        (
            {"training_args": ["--trainer.strategy=ddp_adasum"]},
            r"chosen with --strategy .*remove --trainer.strategy and pass --strategy horovod_adasum or",
        ),
        (
            {"strategy": "ddp_adasum", "training_args": ["--trainer.strategy", "ddp"]},
            r"not with --trainer.strategy",
        ),
        (
            {"training_args": ["--trainer.devices=4"]},
            r"each MPI process of a --strategy horovod_adasum job drives one GPU.*--gpus-per-node N",
        ),
        (
            {"strategy": "ddp_adasum", "environment_variables": {"MASTER_PORT": "29500"}},
            r"MASTER_PORT is set by Azure ML in every process of a PyTorch job.*remove --env MASTER_PORT",
        ),
        (
            {"strategy": "ddp_adasum", "environment_variables": {"OMPI_MCA_btl": "tcp"}},
            r"OMPI_MCA_btl has no effect in a --strategy ddp_adasum job \(no MPI, no Horovod\)",
        ),
        (
            {"strategy": "ddp_adasum", "environment_variables": {"HOROVOD_FUSION_THRESHOLD": "0"}},
            r"HOROVOD_FUSION_THRESHOLD has no effect.*--strategy horovod_adasum",
        ),
        (
            {"strategy": "ddp_adasum", "process_count_per_node": 8},
            r"has 4 GPU\(s\).*--gpus-per-node 4",
        ),
    ],
)
def test_bad_strategy_combinations_are_refused_with_the_fix(kwargs, message):
    with pytest.raises(AmlUsageError, match=message):
        AmlJob(**kwargs)


@pytest.mark.parametrize("strategy", ["horovod_adasum", "horovod"])
def test_horovod_strategies_take_a_runtime_image(strategy):
    # Horovod is compiled with the CUDA compiler from the registry's wheels (make gpu-wheel): no nvcc needed
    job = AmlJob(strategy=strategy, base_image="nvidia/cuda:13.0.0-runtime-ubuntu24.04")
    assert job.base_image == "nvidia/cuda:13.0.0-runtime-ubuntu24.04"


def test_ddp_adasum_takes_any_base_image():
    job = AmlJob(strategy="ddp_adasum", base_image="nvidia/cuda:13.0.0-devel-ubuntu24.04")
    assert job.base_image == "nvidia/cuda:13.0.0-devel-ubuntu24.04"


@pytest.mark.parametrize("package", ["pytorch_lightning", "lightning.pytorch"])
def test_lightning_cli_parses_the_ddp_adasum_strategy_with_its_timeout(package, tmp_path):
    """The job's strategy arguments, parsed by the package's LightningCLI as the job's script would (a
    subprocess: one Lightning package per process), give DDPAdasumStrategy with the launch settings' timeout;
    the strategy *name* takes no --trainer.strategy.timeout."""
    job = AmlJob(strategy="ddp_adasum")
    script = tmp_path / "parse.py"
    script.write_text(
        f"import sys\nfrom {package}.cli import LightningCLI\n"
        f"from {package}.demos.boring_classes import BoringDataModule, BoringModel\n"
        "import adasum_lightning\n"
        "cli = LightningCLI(BoringModel, BoringDataModule, run=False, args=sys.argv[1:], "
        "save_config_callback=None)\n"
        "s = cli.trainer.strategy\n"
        "print('PARSED', type(s).__module__, type(s).__name__, s.strategy_name, repr(s._timeout))\n"
    )
    local = [
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--trainer.num_nodes=1",
        "--trainer.logger=false",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(script), *job.strategy_args(), *local],
        capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    namespace = "trainer" if package == "pytorch_lightning" else "lightning"
    expected = repr(failure_detection.DDP_PROCESS_GROUP_TIMEOUT)
    assert (
        f"PARSED adasum_lightning.{namespace}.ddp_adasum DDPAdasumStrategy ddp_adasum {expected}"
        in proc.stdout
    )
    by_name = ["--trainer.strategy=ddp_adasum", "--trainer.strategy.timeout=0:00:30", *local]
    proc = subprocess.run(
        [sys.executable, str(script), *by_name],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode != 0 and "Expected a dot import path string: ddp_adasum" in proc.stderr


# -- the workspace config file ------------------------------------------------------------------------
def test_seed_config_file(tmp_path):
    cfg = load_workspace_config(write(tmp_path / "config_aml.json", SEED_CONFIG))
    assert (cfg.subscription_id, cfg.resource_group, cfg.workspace_name) == (SUB, "rg-adasum", "ws-adasum")
    assert cfg.source == str(tmp_path / "config_aml.json")


def test_standard_config_json_with_extra_keys_and_scope(tmp_path):
    cfg = load_workspace_config(write(tmp_path / "config.json", {**SEED_CONFIG, "friendly_name": "x"}))
    assert cfg.workspace_name == "ws-adasum"
    scope = (
        f"/subscriptions/{SUB}/resourceGroups/rg2/providers/Microsoft.MachineLearningServices/workspaces/ws2"
    )
    cfg = load_workspace_config(write(tmp_path / "scope.json", {"Scope": scope}))
    assert (cfg.subscription_id, cfg.resource_group, cfg.workspace_name) == (SUB, "rg2", "ws2")


def test_default_config_search_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        AmlUsageError, match=r"no workspace config file: none of config_aml.json, config.json"
    ):
        find_config_file()
    write(tmp_path / "config.json", SEED_CONFIG)
    assert find_config_file() == tmp_path / "config.json"
    write(tmp_path / "config_aml.json", SEED_CONFIG)
    assert find_config_file() == tmp_path / "config_aml.json"


@pytest.mark.parametrize(
    "content, message",
    [
        (None, r"does not exist\. Create it as"),
        ('{"subscription_id": "x",', r"is not valid JSON \(.* at line 1, column"),
        ("[1, 2]", r"holds a JSON list, not an object"),
        ({"subscription_id": SUB}, r"lacks 'resource_group', 'workspace_name'\. Add them"),
        ({**SEED_CONFIG, "workspace_name": ""}, r"'workspace_name' must be a non-empty string"),
        ({**SEED_CONFIG, "resource_group": 7}, r"'resource_group' must be a non-empty string, got 7"),
        ({**SEED_CONFIG, "subscription_id": "my-sub"}, r"subscription_id 'my-sub' is not a GUID"),
        ({"Scope": "/subscriptions/x"}, r"'Scope' is not an Azure ML workspace id"),
    ],
)
def test_bad_config_files(tmp_path, content, message):
    path = tmp_path / "config_aml.json"
    if content is not None:
        write(path, content)
    with pytest.raises(AmlUsageError, match=message) as info:
        load_workspace_config(path)
    assert str(path) in str(info.value)


# -- network check and redaction ----------------------------------------------------------------------
@pytest.mark.walltime
def test_offline_network_check_fails_fast_with_a_clear_message(monkeypatch):
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    start = time.monotonic()
    with pytest.raises(AmlSubmitError, match=r"cannot reach management\.azure\.com:443 .*--dry-run"):
        check_network()
    assert time.monotonic() - start < 5


def test_network_check_goes_through_the_proxy_without_showing_its_password(monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://user:pw-1234@proxy.example:3128")
    with pytest.raises(AmlSubmitError) as info:
        check_network()
    assert "through the proxy proxy.example:3128" in str(info.value) and "pw-1234" not in str(info.value)


def test_redact_removes_secrets(monkeypatch):
    monkeypatch.setenv("AZURE_CLIENT_SECRET", "s3cr3t-value")
    text = redact(
        "client_secret=abc token: eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.sig used s3cr3t-value"
    )
    assert "s3cr3t-value" not in text and "eyJhbGci" not in text and "abc" not in text
    assert redact("node_count 8") == "node_count 8"


# -- the command line: bad input exits 2 before any SDK call ------------------------------------------
@pytest.fixture
def no_sdk_calls(monkeypatch):
    """Fail the test if the CLI stages, builds or submits anything."""
    from adasum_lightning.aml import local, sdk_v1, sdk_v2, staging

    def boom(*args, **kwargs):
        raise AssertionError("an SDK object was built or submitted after bad input")

    for module, names in ((sdk_v1, ("build", "connect", "submit")), (sdk_v2, ("build", "connect", "submit"))):
        for name in names:
            monkeypatch.setattr(module, name, boom)
    monkeypatch.setattr(staging, "stage_job", boom)
    monkeypatch.setattr(local, "stage_code", boom)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nodes", "6", "--dry-run"], "node_count=6 is not a power of 2"),
        (["--gpus-per-node", "3", "--dry-run"], "process_count_per_node=3 is not a power of 2"),
        (["--vm-size", "Standard_NC24", "--dry-run"], "retired by Azure on 2023-08-31"),
        (["--sdk", "v3", "--dry-run"], "unknown SDK 'v3': use --sdk auto, --sdk v1 or --sdk v2"),
        (["--config", "missing.json"], "missing.json does not exist"),
        (["--config", "bad.json", "--dry-run"], "is not valid JSON"),
        (["--config", "nokeys.json", "--dry-run"], "lacks 'resource_group', 'workspace_name'"),
        ([], "no workspace config file"),
        (["--local", "3"], "--local=3 is not a power of 2"),
        (["--env", "MY_TOKEN=abc", "--dry-run"], "looks like a secret"),
        (["--config", ".", "--dry-run"], "is a directory, not a JSON file. Pass the file itself: --config"),
        (
            ["--gpus-per-node", "8", "--dry-run"],
            "a VM size with 8 GPUs or more (--vm-size Standard_ND96asr_v4)",
        ),
        (["--strategy", "bogus", "--dry-run"], "unknown strategy 'bogus': use --strategy horovod_adasum"),
        (
            ["--strategy", "ddp_adasum", "--dry-run", "--", "--trainer.num_nodes=2"],
            "--trainer.num_nodes=2 contradicts the job's topology (--trainer.num_nodes=8)",
        ),
        (["--strategy", "ddp_adasum", "--env", "RANK=0", "--dry-run"], "RANK is set by Azure ML"),
        (["--dry-run", "--trainer.strategy=ddp_adasum"], "not with --trainer.strategy"),
        (
            ["--strategy", "ddp_adasum", "--local", "0"],
            "--local must be a positive integer, got 0: fix --local",
        ),
        (
            ["--nodes", "6", "--strategy", "horovod_adasum", "--dry-run"],
            "or --strategy ddp_adasum (any count)",
        ),
        (
            ["--strategy", "ddp_adasum", "--local", "2", "--resume"],
            "--local with --resume keeps the checkpoints in a folder of yours, kept between runs: pass "
            "--output checkpoints=DIR",
        ),
    ],
)
def test_bad_input_exits_2_naming_the_fix(argv, message, tmp_path, monkeypatch, capsys, no_sdk_calls):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "bad.json", "{not json")
    write(tmp_path / "nokeys.json", {"subscription_id": SUB})
    assert cli.main(["submit", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("adasum-aml: error: ") and message in err
    assert "abc" not in err


@pytest.mark.parametrize("sdk, extra", [("v1", "aml"), ("v2", "aml-v2")])
def test_missing_sdk_package_names_the_extra(sdk, extra, monkeypatch, capsys, no_sdk_calls):
    monkeypatch.setattr(cli, "_installed", lambda module: False)
    assert cli.main(["submit", "--sdk", sdk, "--dry-run"]) == 2
    assert f"pip install 'adasum-lightning[{extra}]'" in capsys.readouterr().err
    assert cli.main(["submit", "--dry-run"]) == 2
    assert "no Azure ML SDK is installed" in capsys.readouterr().err


def test_auto_prefers_v2_and_falls_back_to_v1(monkeypatch):
    monkeypatch.setattr(cli, "_installed", lambda module: True)
    assert cli.resolve_sdk("auto") == "v2"
    monkeypatch.setattr(cli, "_installed", lambda module: module == "azureml.core")
    assert cli.resolve_sdk("auto") == "v1"


@pytest.mark.parametrize(
    "argv",
    [
        ["--dry-run", "--local", "2"],
        ["--nodes", "four"],
        ["--bogus-option"],
        ["--env", "NOEQUALS"],
        ["--input"],
    ],
)
def test_argument_errors_exit_2(argv, capsys, no_sdk_calls):
    with pytest.raises(SystemExit) as info:
        cli.main(["submit", *argv])
    assert info.value.code == 2
    assert re.search(r"^adasum-aml( submit)?: error: ", capsys.readouterr().err, re.M)


def test_training_arguments_pass_through():
    args = cli.parse_args(["submit", "--nodes", "4", "--trainer.max_epochs=2", "--", "--model.lr", "0.02"])
    job, source_dir = cli.job_from_args(args)
    assert job.node_count == 4 and source_dir is None and job.max_nodes == 4
    assert job.training_command()[-3:] == ["--trainer.max_epochs=2", "--model.lr", "0.02"]
    # an option's value may follow it before '--' too, and keeps its place
    args = cli.parse_args(["submit", "--trainer.max_epochs", "3", "--dry-run", "--data.data_dir=x"])
    assert args.training_args == ["--trainer.max_epochs", "3", "--data.data_dir=x"]


def test_console_script_and_module_entry_point():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert "adasum-aml = adasum_lightning.aml.cli:main" in cfg["options.entry_points"]["console_scripts"]
    # Bad input: rejected before any SDK import or network use, by both entry points in fresh interpreters.
    script = Path(sys.executable).with_name("adasum-aml")
    for launcher in ([str(script)], [sys.executable, "-m", "adasum_lightning.aml"]):
        proc = subprocess.run(
            [*launcher, "submit", "--nodes", "12", "--dry-run"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        assert "node_count=12 is not a power of 2" in proc.stderr and "--nodes 8 or --nodes 16" in proc.stderr


def test_low_priority_resumes_from_a_checkpoint_output_of_its_own():
    job = AmlJob(low_priority=True, strategy="ddp_adasum")
    assert job.resume
    ((name, uri, direction, mode),) = [(b.name, b.uri, b.direction, b.mode) for b in job.data]
    assert (name, direction, mode) == ("checkpoints", "outputs", "rw_mount")
    assert re.fullmatch(
        r"azureml://datastores/workspaceblobstore/paths/adasum-checkpoints/adasum-lightning-mnist/[0-9-]+",
        uri,
    )
    assert job.training_command()[-4:] == [
        "--trainer.callbacks+=ModelCheckpoint",
        "--trainer.callbacks.dirpath=${{outputs.checkpoints}}",
        "--trainer.callbacks.save_last=true",
        "--ckpt_path=last",
    ]
    given = AmlJob(resume=True, data=parse_bindings(outputs=["checkpoints=azureml://datastores/ds/paths/ck"]))
    assert [b.uri for b in given.data] == ["azureml://datastores/ds/paths/ck"]
    assert "--ckpt_path=last" not in AmlJob().training_command()


def test_resume_of_a_script_without_trainer_arguments_needs_the_folder_in_its_arguments():
    with pytest.raises(
        AmlUsageError,
        match=re.escape(
            "train.py is not a LightningCLI script, so adasum-aml cannot point its Trainer there: pass the "
            "folder to it (-- --checkpoint-dir '${{outputs.checkpoints}}')"
        ),
    ):
        AmlJob(script="train.py", trainer_args=False, resume=True)
    job = AmlJob(
        script="train.py",
        trainer_args=False,
        resume=True,
        training_args=["--ckpt-dir=${{outputs.checkpoints}}"],
    )
    assert job.training_command() == ["python", "train.py", "--ckpt-dir=${{outputs.checkpoints}}"]
