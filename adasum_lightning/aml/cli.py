"""``adasum-aml`` (``python -m adasum_lightning.aml``): submit a Lightning project to Azure ML with Adasum.

::

    adasum-aml submit train.py -- --epochs 3                  # ./train.py of your project, 8 nodes × 4 GPUs
    adasum-aml submit --source-dir ~/proj src/train.py --requirements ~/proj/requirements.txt \
        --input data=azureml:my-data:1 -- fit --data.root=${{inputs.data}}
    adasum-aml submit --dry-run                                # the bundled MNIST example: print the job
    adasum-aml submit --local 2 train.py --input data=./data -- --data-dir '${{inputs.data}}'
    adasum-aml submit --strategy ddp_adasum --stream train.py # a PyTorch job; follow its logs

The Horovod strategies submit an Azure ML MPI job, ``ddp_adasum`` a PyTorch job (docs/azure_ml.md). Exit
codes: 0 success; 1 submission failed (network, authentication, Azure); 2 bad input (nothing was sent); 3
``--stream``: the job ended without completing; otherwise the local run's exit code.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from adasum_lightning.aml.errors import AmlSubmitError, AmlUsageError
from adasum_lightning.aml.job import (
    CHECKPOINT_OUTPUT,
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
    experiment_name_for,
)
from adasum_lightning.aml.workspace import load_workspace_config, redact

PROG = "adasum-aml"
SDK_PACKAGES = {"v1": ("azureml.core", "aml"), "v2": ("azure.ai.ml", "aml-v2")}
PACKAGE_NAMES = {"v1": "azureml-core", "v2": "azure-ai-ml"}
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
            f"--sdk {choice} needs the package {PACKAGE_NAMES[choice]}: "
            f"pip install 'adasum-lightning[{extra}]'"
        )
    return choice


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    """``adasum-aml``'s parser: the ``submit`` command and its argument groups."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Submit a Lightning project to Azure ML with Adasum."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "submit",
        help="submit the job (or --dry-run / --local N)",
        description="Submit SCRIPT of the source directory (default: the bundled MNIST example) with "
        "horovod_adasum (an MPI job), horovod (an MPI job) or ddp_adasum (a PyTorch job) to an Azure ML GPU "
        "cluster. Arguments after '--' (and unknown --trainer.*/--model.*/--data.* options) are passed to "
        "the script; they may name data as ${{inputs.NAME}} / ${{outputs.NAME}}.",
    )
    _add_project_arguments(p.add_argument_group("your project"))
    _add_data_arguments(
        p.add_argument_group("data (the script's arguments name it ${{inputs.NAME}} / ${{outputs.NAME}})")
    )
    _add_cluster_arguments(p.add_argument_group("the cluster and the job"))
    _add_mode_arguments(p.add_argument_group("what submit does: submit (default), --dry-run or --local N"))
    return parser


def _add_project_arguments(p: argparse._ArgumentGroup) -> None:
    """SCRIPT, its source folder, its requirements or environment and how it is given the strategy."""
    p.add_argument(
        "script",
        nargs="?",
        metavar="SCRIPT",
        help="the entry script, a path inside --source-dir relative to it (default: the bundled MNIST "
        "example)",
    )
    p.add_argument(
        "--source-dir",
        help="your project's folder: the job's code snapshot, minus what its .amlignore or .gitignore "
        "excludes (default: the current directory)",
    )
    p.add_argument(
        "--trainer-args",
        choices=("auto", "on", "off"),
        default="auto",
        help="append --trainer.strategy/devices/num_nodes to the script's arguments: on for LightningCLI "
        "scripts, off for others (they read ADASUM_STRATEGY, ADASUM_ACCELERATOR, ADASUM_DEVICES, "
        "ADASUM_NUM_NODES); auto (default): on when the script uses LightningCLI",
    )
    p.add_argument(
        "--requirements",
        metavar="FILE",
        help="your project's pip requirements, installed in the job image",
    )
    p.add_argument(
        "--environment",
        metavar="NAME[:VERSION]",
        help="run in this registered Azure ML environment (NAME:VERSION, azureml:NAME:VERSION or "
        "NAME@latest) instead of building one; it must have adasum-lightning (and Horovod for the Horovod "
        "strategies)",
    )


def _add_data_arguments(p: argparse._ArgumentGroup) -> None:
    """``--input``/``--output`` and their modes and types."""
    p.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME=URI",
        help="data the job reads: azureml://datastores/<ds>/paths/<p>, azureml:<asset>:<version>, https://…, "
        "or a local path with --local (repeatable); the script's arguments name it ${{inputs.NAME}}",
    )
    p.add_argument(
        "--input-mode",
        action="append",
        default=[],
        metavar="NAME=MODE",
        help="ro_mount (default) or download",
    )
    p.add_argument(
        "--input-type",
        action="append",
        default=[],
        metavar="NAME=TYPE",
        help="uri_folder (default) or uri_file",
    )
    p.add_argument(
        "--output",
        action="append",
        default=[],
        metavar="NAME=URI",
        help="a folder the job writes: azureml://datastores/<ds>/paths/<p> (or a local path with --local); "
        "the script's arguments name it ${{outputs.NAME}}",
    )
    p.add_argument(
        "--output-mode",
        action="append",
        default=[],
        metavar="NAME=MODE",
        help="rw_mount (default) or upload",
    )


def _add_cluster_arguments(p: argparse._ArgumentGroup) -> None:
    """The strategy, the workspace, the SDK, the cluster and the job's image and environment."""
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
        "--experiment",
        help=f"experiment (default: your project's folder name; {DEFAULT_EXPERIMENT} for the example)",
    )
    p.add_argument(
        "--low-priority",
        action="store_true",
        help="create the cluster with low-priority (spot) VMs, which Azure may preempt; Azure ML restarts a "
        "preempted job, which resumes from its checkpoints (implies --resume)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help=f"keep Lightning's checkpoints in the job's output {CHECKPOINT_OUTPUT} (a new folder on the "
        f"workspace's blob store, or --output {CHECKPOINT_OUTPUT}=URI) and resume a restarted job from the "
        "last one (LightningCLI scripts: ModelCheckpoint(save_last=True) there and --ckpt_path=last)",
    )
    p.add_argument("--min-nodes", type=int, default=0, help="cluster minimum nodes (default 0: no idle cost)")
    p.add_argument("--max-nodes", type=int, default=None, help="cluster maximum nodes (default: --nodes)")
    p.add_argument(
        "--base-image",
        default=None,
        help=f"base of the image adasum-aml builds (default {DEFAULT_BASE_IMAGE})"
        if DEFAULT_BASE_IMAGE == DEFAULT_DDP_BASE_IMAGE
        else f"base of the image adasum-aml builds (default {DEFAULT_BASE_IMAGE} for the Horovod strategies, "
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
        "(default: a new temporary folder; kept for --dry-run and --local; must be new or empty)",
    )


def _add_mode_arguments(p: argparse._ArgumentGroup) -> None:
    """What ``submit`` does: submit (and ``--stream``), ``--dry-run`` or ``--local N``."""
    p.add_argument(
        "--stream",
        action="store_true",
        help="after submitting, follow the job's logs until it ends; exit 0 when it completed, else 3",
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
    p.add_argument(
        "--local-batches",
        type=int,
        default=4,
        help="training and validation batches per process for --local of a LightningCLI script (default 4)",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="MNIST root of the bundled example for --local (DIR/MNIST/raw; default ./data); a script of "
        "your own takes its data from --input",
    )


def _split_pass_through(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(launcher arguments, training arguments)``: LightningCLI options before ``--`` go to the script.

    An option's bare value (``--trainer.x 2``) goes with it.
    """
    launcher, training = [], []
    argv = list(argv)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith(PASS_THROUGH_PREFIXES):
            training.append(arg)
            if "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                training.append(argv[i + 1])
                i += 1
        else:
            launcher.append(arg)
        i += 1
    return launcher, training


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``; LightningCLI options (``--trainer.x=…``) before ``--`` count as training arguments."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    after = []
    if "--" in argv:
        cut = argv.index("--")
        argv, after = argv[:cut], argv[cut + 1 :]
    argv, passed = _split_pass_through(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(
            f"unrecognized arguments: {' '.join(unknown)} (put training-script arguments after '--')"
        )
    args.training_args = [*passed, *after]
    args.lightning_options = passed
    args.first_script_arg = after[0] if after else None
    return args


def _check_options(args: argparse.Namespace) -> None:
    """Refuse option combinations that contradict each other (before any file is read)."""
    first = getattr(args, "first_script_arg", None)
    if args.script is None and first is not None and first.endswith(".py"):
        raise AmlUsageError(
            f"{first} after '--' would be an argument of the bundled MNIST example: put the script before "
            f"'--' (adasum-aml submit [--source-dir DIR] {first} -- ARGS)"
        )
    if args.script is None:
        _check_staging_dir(args.staging_dir, None)
        for flag, value in (
            ("--source-dir", args.source_dir),
            ("--trainer-args", args.trainer_args != "auto"),
        ):
            if value:
                raise AmlUsageError(
                    f"{flag} applies to a script of your own: pass SCRIPT (a path inside the source "
                    f"directory), or drop {flag} to submit the bundled MNIST example"
                )
    elif args.data_dir is not None:
        raise AmlUsageError(
            "--data-dir is the bundled MNIST example's data folder; give your script its data with --input "
            "NAME=PATH and ${{inputs.NAME}} in its arguments"
        )
    if args.stream and (args.dry_run or args.local is not None):
        raise AmlUsageError("--stream follows a submitted job: drop it for --dry-run and --local")


def _warn_about_the_script(script: str, facts, trainer_args: bool, strategy: str) -> None:
    """Say how the script learns the strategy; warn when it would not find the strategy's name."""
    if trainer_args:
        how = "--trainer.* arguments appended (a LightningCLI script)"
    else:
        how = (
            "no --trainer.* arguments (not a LightningCLI script: it reads ADASUM_STRATEGY, ADASUM_DEVICES, "
            "ADASUM_NUM_NODES; pass --trainer-args on if it builds a LightningCLI elsewhere)"
        )
    print(f"[{PROG}] {script}: {how}", file=sys.stderr, flush=True)
    needs_name = not (trainer_args and strategy == "ddp_adasum")  # ddp_adasum is passed as a class path
    if needs_name and not facts.imports_adasum:
        print(
            f"[{PROG}] warning: {script} does not import adasum_lightning, which registers "
            f"strategy='{strategy}' with Lightning; add `import adasum_lightning` to it (or to a module it "
            "imports), or Lightning stops with 'You selected an invalid strategy name'",
            file=sys.stderr,
            flush=True,
        )


def _check_staging_dir(staging_dir: str | None, source_dir: Path | None) -> None:
    """Refuse a ``--staging-dir`` that is a file, not empty, or inside the source directory."""
    if not staging_dir:
        return
    path = Path(staging_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise AmlUsageError(f"--staging-dir {staging_dir} is a file: pass a new or empty folder")
    if path.is_dir() and any(path.iterdir()):
        raise AmlUsageError(
            f"--staging-dir {staging_dir} is not empty: pass a new or empty folder (adasum-aml deletes "
            "nothing)"
        )
    if source_dir is not None and (path.resolve() == source_dir or source_dir in path.resolve().parents):
        raise AmlUsageError(
            f"--staging-dir {staging_dir} is inside the source directory {source_dir}, so it would be "
            "uploaded with the code: pass a folder outside it"
        )


def job_from_args(args: argparse.Namespace) -> tuple[AmlJob, Path | None]:
    """The validated :class:`AmlJob` and the project's source directory (``None``: the bundled example).

    Raises:
        AmlUsageError: any invalid argument or file.
    """
    from adasum_lightning.aml.project import check_script, parse_bindings, read_requirements, script_facts
    from adasum_lightning.aml.staging import constraints, image_dependencies

    _check_options(args)
    source_dir, script, trainer_args = None, None, True
    if args.script is not None:
        source_dir, script = check_script(args.source_dir or ".", args.script)
        facts = script_facts(source_dir / script)
        trainer_args = {"on": True, "off": False}.get(args.trainer_args, facts.lightning_cli)
        if not trainer_args and getattr(args, "lightning_options", None):
            raise AmlUsageError(
                f"{args.lightning_options[0]} is a LightningCLI option, but {script} is not a LightningCLI "
                "script (it takes no --trainer.* arguments): pass --trainer-args on if it is one, or give "
                "the script its own arguments after '--'"
            )
        _check_staging_dir(args.staging_dir, source_dir)
    if args.local is not None and (args.resume or args.low_priority):
        if not any(o.partition("=")[0] == CHECKPOINT_OUTPUT for o in args.output):
            raise AmlUsageError(
                f"--local with --resume keeps the checkpoints in a folder of yours, kept between runs: pass "
                f"--output {CHECKPOINT_OUTPUT}=DIR"
            )
    data = parse_bindings(
        args.input,
        args.output,
        args.input_mode,
        args.output_mode,
        args.input_type,
        local=args.local is not None,
    )
    requirements = (
        read_requirements(args.requirements, constraints(), image_dependencies()) if args.requirements else ()
    )
    job = AmlJob(
        strategy=args.strategy,
        experiment_name=args.experiment or experiment_name_for(source_dir.name if source_dir else None),
        compute_name=args.cluster,
        vm_size=args.vm_size,
        node_count=args.nodes,
        process_count_per_node=args.gpus_per_node,
        min_nodes=args.min_nodes,
        max_nodes=args.max_nodes,
        training_args=tuple(args.training_args),
        environment_variables=dict(args.env),
        base_image=args.base_image,
        script=script,
        trainer_args=trainer_args,
        data=data,
        requirements=requirements,
        environment=args.environment,
        low_priority=args.low_priority,
        resume=args.resume,
    )
    if script is not None:  # after every check: nothing is printed for bad input but the error
        _warn_about_the_script(script, facts, trainer_args, args.strategy)
    return job, source_dir


def _summary(job: AmlJob, sdk: str, staged) -> str:
    kind = "an MPI job" if job.is_mpi else "a PyTorch job"
    image = (
        f"registered environment {job.environment}"
        if job.environment
        else f"image {job.environment_name}{'-' if sdk == 'v1' else ':'}{staged.environment_version}"
    )
    return (
        f"[{PROG}] SDK {sdk}: {job.script_name} with {job.strategy} as {kind}, {image}, "
        f"{job.node_count} nodes × "
        f"{job.process_count_per_node} processes "
        f"({job.world_size} GPUs) of {job.vm_size} on cluster {job.compute_name} "
        f"({job.min_nodes}–{job.max_nodes} {'low-priority ' if job.low_priority else ''}nodes), "
        f"experiment {job.experiment_name}"
        + (f"; checkpoints in {_checkpoint_uri(job)}, a restart resumes from the last" if job.resume else "")
    )


def _checkpoint_uri(job: AmlJob) -> str:
    return next(b.uri for b in job.data if b.direction == "outputs" and b.name == CHECKPOINT_OUTPUT)


def submit_command(args: argparse.Namespace) -> int:
    """``adasum-aml submit``: validate everything offline, then dry-run, run locally or submit."""
    job, source_dir = job_from_args(args)
    if args.local is not None:
        from adasum_lightning.aml.local import check_local_count, run_local

        check_local_count(job, args.local)
        ignored = [
            flag
            for flag, given in (("--environment", args.environment), ("--requirements", args.requirements))
            if given
        ]
        if ignored:
            print(
                f"[{PROG}] note: --local runs in this Python environment ({sys.executable}); "
                f"{' and '.join(ignored)} apply to the cluster job's image",
                file=sys.stderr,
                flush=True,
            )
        work = (
            Path(args.staging_dir) if args.staging_dir else Path(tempfile.mkdtemp(prefix="adasum-aml-local-"))
        )
        return run_local(
            job,
            args.local,
            work_dir=work,
            source_dir=source_dir,
            data_dir=args.data_dir,
            batches=args.local_batches,
        )
    sdk = resolve_sdk(args.sdk)
    if sdk == "v1":
        print(
            f"[{PROG}] note: SDK v1 (azureml-core) is deprecated and its support ended on 2026-06-30; "
            "pip install 'adasum-lightning[aml-v2]' to use SDK v2",
            file=sys.stderr,
            flush=True,
        )
    config = load_workspace_config(args.config) if (args.config or not args.dry_run) else None

    from adasum_lightning.aml.staging import stage_job

    keep = args.dry_run or bool(args.staging_dir)
    root = Path(args.staging_dir) if args.staging_dir else Path(tempfile.mkdtemp(prefix="adasum-aml-"))
    try:
        staged = stage_job(job, root, source_dir)
        print(_summary(job, sdk, staged), file=sys.stderr, flush=True)
        if sdk == "v1":
            from adasum_lightning.aml import sdk_v1 as backend
        else:
            from adasum_lightning.aml import sdk_v2 as backend
        if args.dry_run:
            built = backend.build(job, staged)
            print(backend.render(built), flush=True)
            print(
                f"[{PROG}] dry run: nothing was sent to Azure; code snapshot {staged.code_dir} "
                f"({len(staged.files)} file{'s' if len(staged.files) != 1 else ''}), build context "
                f"{staged.context_dir or '(none: registered environment)'}",
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
        _, status = backend.submit(job, staged, config, stream=args.stream)
        if args.stream and status != "Completed":
            print(f"{PROG}: the job ended with status {status}", file=sys.stderr)
            return 3
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
