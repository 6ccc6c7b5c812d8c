"""``adasum-aml`` (also ``python -m adasum_lightning.aml``): submit the MNIST example to Azure ML.

::

    adasum-aml submit --config config_aml.json                 # 8 nodes × 4 GPUs, SDK v2 if installed
    adasum-aml submit --sdk v1 --dry-run                       # print the v1 run configuration (JSON)
    adasum-aml submit --sdk v2 --dry-run                       # print the v2 job (YAML)
    adasum-aml submit --local 2 --data-dir ../shared/data      # the job's command, 2 CPU processes
    adasum-aml submit --strategy ddp_adasum --dry-run          # a PyTorch job: no MPI, no Horovod
    adasum-aml submit -- --trainer.max_epochs=2 --model.lr=0.02   # pass-through training arguments

``--strategy horovod_adasum`` (default) and ``horovod`` submit an Azure ML MPI job; ``ddp_adasum`` a
PyTorch job (Azure ML starts one process per GPU and sets the torch.distributed variables).

Exit codes: 0 success; 1 submission failed (network, authentication, Azure); 2 bad input (the message
names the fix; nothing was sent to Azure); otherwise the local run's exit code.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from adasum_lightning.aml.job import (
    DEFAULT_BASE_IMAGE,
    DEFAULT_CLUSTER,
    DEFAULT_DDP_BASE_IMAGE,
    DEFAULT_EXPERIMENT,
    DEFAULT_NODE_COUNT,
    DEFAULT_PROCESSES_PER_NODE,
    DEFAULT_STRATEGY,
    DEFAULT_VM_SIZE,
    STRATEGIES,
    AmlJob,
    AmlSubmitError,
    AmlUsageError,
)
from adasum_lightning.aml.workspace import load_workspace_config, redact

PROG = "adasum-aml"
SDK_PACKAGES = {"v1": ("azureml.core", "aml"), "v2": ("azure.ai.ml", "aml-v2")}
#: Unknown options passed through to the training script without ``--`` (LightningCLI groups).
PASS_THROUGH_PREFIXES = (
    "--trainer.",
    "--model.",
    "--data.",
    "--seed_everything",
    "--optimizer",
    "--lr_scheduler",
)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def resolve_sdk(choice: str) -> str:
    """``"v1"`` or ``"v2"`` for ``--sdk choice`` (``auto``: v2 when installed, else v1), checked installed.

    Raises:
        AmlUsageError: unknown choice, or the SDK's package is missing (names the pip extra to install).
    """
    if choice not in ("auto", "v1", "v2"):
        raise AmlUsageError(f"unknown SDK {choice!r}: use --sdk auto, --sdk v1 or --sdk v2")
    if choice == "auto":
        for sdk in ("v2", "v1"):
            if _installed(SDK_PACKAGES[sdk][0]):
                return sdk
        raise AmlUsageError(
            "no Azure ML SDK is installed: pip install 'adasum-lightning[aml-v2]' (SDK v2, recommended) or "
            "'adasum-lightning[aml]' (SDK v1, azureml-core; support ended 2026-06-30)"
        )
    module, extra = SDK_PACKAGES[choice]
    if not _installed(module):
        raise AmlUsageError(
            f"--sdk {choice} needs the package {module.rsplit('.', 1)[0].replace('.', '-')}: "
            f"pip install 'adasum-lightning[{extra}]'"
        )
    return choice


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own usage errors: exit 2 with the usage line, as usual
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Submit the adasum-lightning MNIST example to Azure ML.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser(
        "submit",
        help="submit the job (or --dry-run / --local N)",
        description="Submit the MNIST example with horovod_adasum (an MPI job), horovod (an MPI job) or "
        "ddp_adasum (a PyTorch job) to an Azure ML GPU cluster. Arguments after "
        "'--' (and unknown --trainer.*/--model.*/--data.* options) are passed to the training script.",
    )
    p.add_argument(
        "--strategy",
        default=DEFAULT_STRATEGY,
        help=f"{', '.join(STRATEGIES)} (default {DEFAULT_STRATEGY}): the Horovod strategies run as an "
        "Azure ML MPI job, ddp_adasum as a PyTorch job (no MPI, no Horovod)",
    )
    p.add_argument(
        "--config",
        help="workspace config: the seed's config_aml.json or Azure ML's config.json "
        "(default: ./config_aml.json, ./config.json, ./.azureml/config.json)",
    )
    p.add_argument("--sdk", default="auto", help="auto (v2 when installed, else v1), v1 (azureml-core) or v2")
    p.add_argument(
        "--nodes",
        type=int,
        default=DEFAULT_NODE_COUNT,
        help="nodes (default 8; a power of 2 for horovod_adasum)",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=DEFAULT_PROCESSES_PER_NODE,
        help="processes (GPUs) per node (default 4; a power of 2 for horovod_adasum)",
    )
    p.add_argument("--vm-size", default=DEFAULT_VM_SIZE, help=f"Azure VM size (default {DEFAULT_VM_SIZE})")
    p.add_argument(
        "--cluster", default=DEFAULT_CLUSTER, help=f"AmlCompute cluster name (default {DEFAULT_CLUSTER})"
    )
    p.add_argument(
        "--experiment", default=DEFAULT_EXPERIMENT, help=f"experiment (default {DEFAULT_EXPERIMENT})"
    )
    p.add_argument("--min-nodes", type=int, default=0, help="cluster minimum nodes (default 0: no idle cost)")
    p.add_argument("--max-nodes", type=int, default=None, help="cluster maximum nodes (default: --nodes)")
    p.add_argument(
        "--base-image",
        default=None,
        help=f"job image base (default {DEFAULT_BASE_IMAGE} for the Horovod strategies, "
        f"{DEFAULT_DDP_BASE_IMAGE} for ddp_adasum)",
    )
    p.add_argument(
        "--env",
        action="append",
        type=_env_pair,
        default=[],
        metavar="NAME=VALUE",
        help="extra job environment variable (repeatable; no secrets)",
    )
    p.add_argument(
        "--staging-dir",
        help="where to write the code snapshot and build context "
        "(default: a new temporary folder; kept for --dry-run)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--dry-run",
        action="store_true",
        help="build the SDK objects offline and print the job (v1: JSON, v2: YAML); no credentials",
    )
    mode.add_argument(
        "--local",
        type=int,
        metavar="N",
        help="run the job's command here with N CPU processes: under horovodrun for the Horovod strategies "
        "(a power of 2 for horovod_adasum), started as an Azure ML PyTorch job starts them for ddp_adasum",
    )
    p.add_argument("--local-batches", type=int, default=4, help="batches per process for --local (default 4)")
    p.add_argument(
        "--data-dir", default="data", help="MNIST root for --local (DIR/MNIST/raw; default ./data)"
    )
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``; unknown LightningCLI options (``--trainer.x=…``) count as training arguments."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    after = []
    if "--" in argv:
        cut = argv.index("--")
        argv, after = argv[:cut], argv[cut + 1 :]
    args, unknown = parser.parse_known_args(argv)
    bad = [a for a in unknown if a.startswith("-") and not a.startswith(PASS_THROUGH_PREFIXES)]
    # A bare word is accepted only as the value of the pass-through option before it (--trainer.x 2).
    bad += [
        a
        for i, a in enumerate(unknown)
        if not a.startswith("-") and not (i > 0 and unknown[i - 1].startswith(PASS_THROUGH_PREFIXES)
                                          and "=" not in unknown[i - 1])
    ]  # fmt: skip
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)} (put training-script arguments after '--')")
    args.training_args = [*unknown, *after]
    return args


def job_from_args(args: argparse.Namespace) -> AmlJob:
    """The validated :class:`AmlJob` for parsed arguments (raises :class:`AmlUsageError`)."""
    return AmlJob(
        strategy=args.strategy,
        experiment_name=args.experiment,
        compute_name=args.cluster,
        vm_size=args.vm_size,
        node_count=args.nodes,
        process_count_per_node=args.gpus_per_node,
        min_nodes=args.min_nodes,
        max_nodes=args.max_nodes,
        training_args=tuple(args.training_args),
        environment_variables=dict(args.env),
        base_image=args.base_image,
    )


def _summary(job: AmlJob, sdk: str) -> str:
    kind = "an MPI job" if job.is_mpi else "a PyTorch job"
    return (
        f"[{PROG}] SDK {sdk}: {job.strategy} as {kind}, {job.node_count} nodes × "
        f"{job.process_count_per_node} processes "
        f"({job.world_size} GPUs) of {job.vm_size} on cluster {job.compute_name} "
        f"({job.min_nodes}–{job.max_nodes} nodes), experiment {job.experiment_name}"
    )


def submit_command(args: argparse.Namespace) -> int:
    """``adasum-aml submit``: validate everything offline, then dry-run, run locally or submit."""
    job = job_from_args(args)
    if args.local is not None:
        from adasum_lightning.aml.local import check_local_count, run_local

        check_local_count(job, args.local)
        work = (
            Path(args.staging_dir) if args.staging_dir else Path(tempfile.mkdtemp(prefix="adasum-aml-local-"))
        )
        return run_local(job, args.local, work_dir=work, data_dir=args.data_dir, batches=args.local_batches)
    sdk = resolve_sdk(args.sdk)
    config = load_workspace_config(args.config) if (args.config or not args.dry_run) else None

    from adasum_lightning.aml.staging import stage_job

    keep = args.dry_run or bool(args.staging_dir)
    root = Path(args.staging_dir) if args.staging_dir else Path(tempfile.mkdtemp(prefix="adasum-aml-"))
    try:
        staged = stage_job(job, root)
        print(_summary(job, sdk), file=sys.stderr, flush=True)
        if sdk == "v1":
            from adasum_lightning.aml import sdk_v1 as backend
        else:
            from adasum_lightning.aml import sdk_v2 as backend
        if args.dry_run:
            built = backend.build(job, staged)
            print(backend.render(built), flush=True)
            print(
                f"[{PROG}] dry run: nothing was sent to Azure; code snapshot {staged.code_dir}, "
                f"build context {staged.context_dir}",
                file=sys.stderr,
                flush=True,
            )
            return 0
        print(
            f"[{PROG}] workspace {config.workspace_name} (resource group {config.resource_group}) "
            f"from {config.source}",
            file=sys.stderr,
            flush=True,
        )
        backend.submit(job, staged, config)
        return 0
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default: ``sys.argv[1:]``) and return the exit code (see module doc)."""
    args = parse_args(argv)
    try:
        if args.command == "submit":
            return submit_command(args)
    except AmlUsageError as err:
        print(f"{PROG}: error: {redact(str(err))}", file=sys.stderr)
        return 2
    except AmlSubmitError as err:
        print(f"{PROG}: submit failed: {redact(str(err))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
