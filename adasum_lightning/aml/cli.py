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
import importlib
import importlib.util
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from adasum_lightning.aml import job as aml_job
from adasum_lightning.aml.errors import AmlSubmitError, AmlUsageError, say
from adasum_lightning.aml.job import CHECKPOINT_OUTPUT, AmlJob
from adasum_lightning.aml.workspace import load_workspace_config, redact

PROG = "adasum-aml"
#: Per SDK: its module, the pip extra that brings it, its package.
SDKS = {"v1": ("azureml.core", "aml", "azureml-core"), "v2": ("azure.ai.ml", "aml-v2", "azure-ai-ml")}
#: Unknown options passed through to the training script without ``--`` (LightningCLI groups).
PASS_THROUGH_PREFIXES = tuple(
    "--trainer. --model. --data. --seed_everything --optimizer --lr_scheduler".split()
)
#: :class:`AmlJob` fields given by the option of the same name.
_SAME_NAME_FIELDS = "strategy vm_size min_nodes max_nodes base_image environment low_priority resume".split()


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
            if _installed(SDKS[sdk][0]):
                return sdk
        raise AmlUsageError(
            "no Azure ML SDK is installed: pip install 'adasum-lightning[aml-v2]' (SDK v2, recommended) or "
            "'adasum-lightning[aml]' (SDK v1, azureml-core; support ended 2026-06-30)"
        )
    module, extra, package = SDKS[choice]
    if not _installed(module):
        raise AmlUsageError(
            f"--sdk {choice} needs the package {package}: pip install 'adasum-lightning[{extra}]'"
        )
    return choice


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return key, value


_SUBMIT_HELP = (
    "Submit SCRIPT of the source directory (default: the bundled MNIST example) with horovod_adasum or "
    "horovod (an MPI job) or ddp_adasum (a PyTorch job) to an Azure ML GPU cluster. Arguments after '--' "
    "(and unknown --trainer.*/--model.*/--data.* options) are passed to the script; they may name data as "
    "${{inputs.NAME}} / ${{outputs.NAME}}."
)
_SUBMIT_EPILOG = (
    "--trainer-args on (auto: when the script uses LightningCLI) appends "
    "--trainer.strategy/devices/num_nodes; others read ADASUM_STRATEGY, ADASUM_ACCELERATOR, ADASUM_DEVICES, "
    "ADASUM_NUM_NODES. --environment (NAME:VERSION, azureml:NAME:VERSION, NAME@latest) must have "
    "adasum-lightning (and Horovod). URIs: azureml://datastores/<ds>/paths/<p>, azureml:<asset>:<version> or "
    "https://… (inputs), local paths with --local. --resume keeps Lightning's checkpoints in the output "
    f"{CHECKPOINT_OUTPUT} (a new folder on the workspace's blob store, or --output {CHECKPOINT_OUTPUT}=URI), "
    "and a restarted job resumes from the last."
)


def build_parser() -> argparse.ArgumentParser:
    """``adasum-aml``'s parser: the ``submit`` command and its argument groups (details in the epilog)."""
    j, pow2, many = aml_job, "a power of 2 for horovod_adasum", {"action": "append", "default": []}
    parser = argparse.ArgumentParser(PROG, description="Submit a Lightning project to Azure ML with Adasum.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("submit", help="submit the job (or --dry-run / --local N)", description=_SUBMIT_HELP)
    p.epilog = _SUBMIT_EPILOG
    a = p.add_argument_group("your project").add_argument
    a("script", nargs="?", metavar="SCRIPT", help="entry script in --source-dir (default: the MNIST example)")
    a("--source-dir", help="the code snapshot, minus what .amlignore or .gitignore excludes (default: .)")
    a("--trainer-args", choices=("auto", "on", "off"), default="auto", help="append --trainer.* arguments")
    a("--requirements", metavar="FILE", help="your project's pip requirements, installed in the job image")
    a("--environment", metavar="NAME[:VERSION]", help="a registered Azure ML environment to run in")
    a = p.add_argument_group("data (the script's arguments name it ${{inputs.NAME}} / ${{outputs.NAME}})")
    a = a.add_argument
    a("--input", **many, metavar="NAME=URI", help="data the job reads (repeatable)")
    a("--input-mode", **many, metavar="NAME=MODE", help="ro_mount (default) or download")
    a("--input-type", **many, metavar="NAME=TYPE", help="uri_folder (default) or uri_file")
    a("--output", **many, metavar="NAME=URI", help="a folder the job writes (repeatable)")
    a("--output-mode", **many, metavar="NAME=MODE", help="rw_mount (default) or upload")
    a = p.add_argument_group("the cluster and the job").add_argument
    a(
        "--strategy",
        default=j.DEFAULT_STRATEGY,
        help=f"{', '.join(j.STRATEGIES)} (default {j.DEFAULT_STRATEGY})",
    )
    a("--config", help="workspace config (default: ./config_aml.json, ./config.json, ./.azureml/config.json)")
    a("--sdk", default="auto", help="auto (v2 when installed, else v1), v1 (azureml-core) or v2")
    a("--nodes", type=int, default=j.DEFAULT_NODE_COUNT, help=f"nodes (default 8; {pow2})")
    a(
        "--gpus-per-node",
        type=int,
        default=j.DEFAULT_PROCESSES_PER_NODE,
        help=f"GPUs per node (default 4; {pow2})",
    )
    a("--vm-size", default=j.DEFAULT_VM_SIZE, help=f"Azure VM size (default {j.DEFAULT_VM_SIZE})")
    a("--cluster", default=j.DEFAULT_CLUSTER, help=f"AmlCompute cluster name (default {j.DEFAULT_CLUSTER})")
    a("--experiment", help=f"default: your project's folder name, or {j.DEFAULT_EXPERIMENT}")
    a("--low-priority", action="store_true", help="a cluster of low-priority (spot) VMs; implies --resume")
    a("--resume", action="store_true", help="keep checkpoints; a restarted job resumes from the last one")
    a("--min-nodes", type=int, default=0, help="cluster minimum nodes (default 0: no idle cost)")
    a("--max-nodes", type=int, help="cluster maximum nodes (default: --nodes)")
    a("--base-image", help=f"base of the image adasum-aml builds (default {j.DEFAULT_BASE_IMAGE})")
    a("--env", **many, type=_env_pair, metavar="NAME=VALUE", help="a job variable (repeatable; no secrets)")
    a(
        "--staging-dir",
        help="a new or empty folder for the code snapshot and build context (default: temporary)",
    )
    g = p.add_argument_group("what submit does: submit (default), --dry-run or --local N")
    g.add_argument(
        "--stream", action="store_true", help="follow the job's logs; exit 0 when it completed, else 3"
    )
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the job built offline (v1 JSON, v2 YAML)")
    mode.add_argument("--local", type=int, metavar="N", help=f"run the job here on N CPU processes ({pow2})")
    g.add_argument("--local-batches", type=int, default=4, help="batches per process for --local (default 4)")
    g.add_argument("--data-dir", help="the MNIST example's data for --local (DIR/MNIST/raw; default ./data)")
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``; LightningCLI options before ``--`` go to the script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    own, passed, after, i = [], [], argv[cut + 1 :], 0
    while i < cut:
        lightning = argv[i].startswith(PASS_THROUGH_PREFIXES)
        with_value = lightning and "=" not in argv[i] and i + 1 < cut and not argv[i + 1].startswith("-")
        (passed if lightning else own).extend(argv[i : i + 1 + with_value])
        i += 1 + with_value
    parser = build_parser()
    args, unknown = parser.parse_known_args(own)
    if unknown:
        parser.error(
            f"unrecognized arguments: {' '.join(unknown)} (put training-script arguments after '--')"
        )
    args.training_args, args.lightning_options = [*passed, *after], passed
    args.first_script_arg = after[0] if after else None
    return args


def _check_options(args: argparse.Namespace) -> None:
    """Refuse option combinations that contradict each other (before any file is read)."""
    first = getattr(args, "first_script_arg", None) or ""
    if args.script is None and first.endswith(".py"):
        raise AmlUsageError(
            f"{first} after '--' would be an argument of the bundled MNIST example: put the script before "
            f"'--' (adasum-aml submit [--source-dir DIR] {first} -- ARGS)"
        )
    if args.script is None:
        _check_staging_dir(args.staging_dir, None)
        flag = "--source-dir" if args.source_dir else "--trainer-args" if args.trainer_args != "auto" else ""
        if flag:
            raise AmlUsageError(
                f"{flag} applies to a script of your own: pass SCRIPT (a path inside the source directory), "
                f"or drop {flag} to submit the bundled MNIST example"
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
    how = (
        "--trainer.* arguments appended (a LightningCLI script)"
        if trainer_args
        else "no --trainer.* arguments (not a LightningCLI script: it reads ADASUM_STRATEGY, ADASUM_DEVICES, "
        "ADASUM_NUM_NODES; pass --trainer-args on if it builds a LightningCLI elsewhere)"
    )
    say(f"{script}: {how}", sys.stderr)
    needs_name = not (trainer_args and strategy == "ddp_adasum")  # ddp_adasum is passed as a class path
    if needs_name and not facts.imports_adasum:
        say(
            f"warning: {script} does not import adasum_lightning, which registers strategy='{strategy}' with "
            "Lightning; add `import adasum_lightning` to it (or to a module it imports), or Lightning stops "
            "with 'You selected an invalid strategy name'",
            sys.stderr,
        )


def _check_staging_dir(staging_dir: str | None, source_dir: Path | None) -> None:
    """Refuse a ``--staging-dir`` that is a file, not empty, or inside the source directory."""
    if not staging_dir:
        return
    path = Path(staging_dir).expanduser()
    problem = "is a file" if path.exists() and not path.is_dir() else ""
    problem = problem or ("is not empty" if path.is_dir() and any(path.iterdir()) else "")
    if problem:
        raise AmlUsageError(
            f"--staging-dir {staging_dir} {problem}: pass a new or empty folder (adasum-aml deletes nothing)"
        )
    if source_dir is not None and source_dir in (path.resolve(), *path.resolve().parents):
        raise AmlUsageError(
            f"--staging-dir {staging_dir} is inside the source directory {source_dir}, so it would be "
            "uploaded with the code: pass a folder outside it"
        )


def job_from_args(args: argparse.Namespace) -> tuple[AmlJob, Path | None]:
    """The validated :class:`AmlJob` and the project's source directory (``None``: the bundled example)."""
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
    modes = (args.input_mode, args.output_mode, args.input_type)
    data = parse_bindings(args.input, args.output, *modes, local=args.local is not None)
    pins = (constraints(), image_dependencies()) if args.requirements else ()
    job = AmlJob(
        **{name: getattr(args, name) for name in _SAME_NAME_FIELDS},
        experiment_name=args.experiment or aml_job.experiment_name_for(source_dir and source_dir.name),
        compute_name=args.cluster,
        node_count=args.nodes,
        process_count_per_node=args.gpus_per_node,
        training_args=tuple(args.training_args),
        environment_variables=dict(args.env),
        script=script,
        trainer_args=trainer_args,
        data=data,
        requirements=read_requirements(args.requirements, *pins) if args.requirements else (),
    )
    if script is not None:  # after every check: nothing is printed for bad input but the error
        _warn_about_the_script(script, facts, trainer_args, args.strategy)
    return job, source_dir


def _summary(job: AmlJob, sdk: str, staged) -> str:
    kind = "an MPI job" if job.is_mpi else "a PyTorch job"
    image = f"image {job.environment_name}{'-' if sdk == 'v1' else ':'}{staged.environment_version}"
    if job.environment:
        image = f"registered environment {job.environment}"
    text = (
        f"SDK {sdk}: {job.script_name} with {job.strategy} as {kind}, {image}, {job.node_count} nodes × "
        f"{job.process_count_per_node} processes ({job.world_size} GPUs) of {job.vm_size} on cluster "
        f"{job.compute_name} ({job.cluster_nodes}), experiment {job.experiment_name}"
    )
    if job.resume:
        uri = next(b.uri for b in job.data if b.direction == "outputs" and b.name == CHECKPOINT_OUTPUT)
        text += f"; checkpoints in {uri}, a restart resumes from the last"
    return text


def submit_command(args: argparse.Namespace) -> int:
    """``adasum-aml submit``: validate everything offline, then dry-run, run locally or submit."""
    job, source_dir = job_from_args(args)
    if args.local is not None:
        from adasum_lightning.aml.local import run_local

        aml_job.check_process_count(args.local, "--local", "--local", job.strategy)
        ignored = " and ".join(f for f in ("--environment", "--requirements") if getattr(args, f[2:]))
        if ignored:
            say(
                f"note: --local runs in this Python environment ({sys.executable}); {ignored} apply to the "
                "cluster job's image",
                sys.stderr,
            )
        work = Path(args.staging_dir or tempfile.mkdtemp(prefix="adasum-aml-local-"))
        return run_local(job, args.local, work, source_dir, args.data_dir, args.local_batches)
    sdk = resolve_sdk(args.sdk)
    if sdk == "v1":
        say(
            "note: SDK v1 (azureml-core) is deprecated and its support ended on 2026-06-30; pip install "
            "'adasum-lightning[aml-v2]' to use SDK v2",
            sys.stderr,
        )
    config = load_workspace_config(args.config) if (args.config or not args.dry_run) else None

    from adasum_lightning.aml.staging import stage_job

    root = Path(args.staging_dir or tempfile.mkdtemp(prefix="adasum-aml-"))
    try:
        staged = stage_job(job, root, source_dir)
        say(_summary(job, sdk, staged), sys.stderr)
        backend = importlib.import_module(f"adasum_lightning.aml.sdk_{sdk}")
        if args.dry_run:
            print(backend.render(backend.build(job, staged)), flush=True)
            files = f"{len(staged.files)} file{'s' if len(staged.files) != 1 else ''}"
            context = staged.context_dir or "(none: registered environment)"
            say(
                f"dry run: nothing was sent to Azure; code snapshot {staged.code_dir} ({files}), build "
                f"context {context}",
                sys.stderr,
            )
            return 0
        say(f"workspace {config.workspace_name} of {config.resource_group} ({config.source})", sys.stderr)
        _, status = backend.submit(job, staged, config, stream=args.stream)
        if args.stream and status != "Completed":
            print(f"{PROG}: the job ended with status {status}", file=sys.stderr)
            return 3
        return 0
    finally:
        if not (args.dry_run or args.staging_dir):
            shutil.rmtree(root, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default: ``sys.argv[1:]``) and return the exit code (see module doc)."""
    args = parse_args(argv)
    try:
        return submit_command(args)  # the one command
    except (AmlUsageError, AmlSubmitError) as err:
        usage = isinstance(err, AmlUsageError)
        print(f"{PROG}: {'error' if usage else 'submit failed'}: {redact(str(err))}", file=sys.stderr)
        return 2 if usage else 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
