"""Checks of Horovod's GPU (NCCL) wheel that need no GPU (``make gpu-wheel``, ``tests/test_gpu_wheel.py``).

The wheel built by ``patches/build_horovod.sh --gpu`` (CUDA compiler from the registry's wheels) is installed
into a scratch virtual environment and inspected:

- ``hvd.nccl_built()`` (the NCCL version code), ``hvd.mpi_built()``, ``hvd.cuda_built()``;
- ``import horovod.torch`` and ``hvd.init()`` + a CPU Adasum allreduce work on a machine without a GPU;
- the Adasum path for GPU tensors is the hierarchical NCCL one: Horovod's ``CreateOperationManager``
  (horovod/common/operations.cc) constructs ``AdasumGpuAllreduceOp`` only when built with
  ``HAVE_NCCL && HOROVOD_GPU_ALLREDUCE == 'N'``, ahead of ``AdasumMPIAllreduceOp``; that op takes every
  non-CPU tensor (``Enabled``: ``device != CPU_DEVICE_ID``) and runs ``NcclHierarchical``
  (horovod/common/ops/adasum_gpu_operations.cc: NCCL reduce-scatter in the node, MPI Adasum across nodes,
  NCCL allgather). The check disassembles ``CreateOperationManager`` and requires the call to that
  constructor, and requires ``AdasumGpuAllreduceOp::NcclHierarchical`` to be defined;
- the CUDA kernels are in the library's fat binary for each compute capability asked for (SASS), plus PTX
  for the newest;
- nothing in the library or in what the process loads comes from a CUDA toolkit outside the wheels
  (``/usr/local/cuda``).

The scratch environment is a venv (no pip) whose ``.pth`` file puts this interpreter's site-packages (torch,
Horovod's Python dependencies) after its own: the wheel installed there shadows any Horovod of this
environment, and torch (5.5 GB) is not installed a second time.

Run ``python tests/gpu_wheel.py [WHEEL]`` (default: the cached wheel for this environment): one line per
check, the last ``nccl_built=True <wheel>``; exit status 1 when a check fails.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = ROOT / "patches" / "build_horovod.sh"
#: Compute capabilities of the Azure ML GPU VM sizes: T4, A100, A10/A40, L4, H100.
CUDA_CC_LIST = (75, 80, 86, 89, 90)
#: Install locations a build from the wheels must not touch.
SYSTEM_CUDA_RE = re.compile(r"/usr/local/cuda|/usr/lib/cuda|/opt/cuda")
ADASUM_GPU_CTOR = "horovod::common::AdasumGpuAllreduceOp::AdasumGpuAllreduceOp("
ADASUM_MPI_CTOR = "horovod::common::AdasumMPIAllreduceOp::AdasumMPIAllreduceOp("
NCCL_HIERARCHICAL = "horovod::common::AdasumGpuAllreduceOp::NcclHierarchical("

_PROBE = r"""
import json, os, sys
import torch
import horovod
import horovod.torch as hvd
from horovod.torch import mpi_lib_v2

out = {
    "horovod_file": horovod.__file__,
    "library": mpi_lib_v2.__file__,
    "nccl_built": hvd.nccl_built(),
    "mpi_built": bool(hvd.mpi_built()),
    "gloo_built": bool(hvd.gloo_built()),
    "cuda_built": bool(hvd.cuda_built()),
    "cuda_available": torch.cuda.is_available(),
    "torch_cuda": torch.version.cuda,
}
hvd.init()
x = torch.tensor([1.0, 2.0, 3.0, 4.0])
out["size"] = hvd.size()
out["cpu_adasum"] = hvd.allreduce(x, op=hvd.Adasum, name="probe").tolist()
with open("/proc/self/maps") as maps:
    out["loaded"] = sorted({line.split()[-1] for line in maps
                            if any(n in line for n in ("libnccl", "libcudart", "libcuda.", "mpi_lib_v2"))})
hvd.shutdown()
print("PROBE " + json.dumps(out))
"""


def cached_wheel(python: str | Path = sys.executable) -> Path | None:
    """The GPU wheel cached for ``python``'s torch and Python versions, or None (builds nothing)."""
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--gpu", "--cached-only", "--python", str(python)],
        capture_output=True,
        text=True,
    )
    if proc.returncode == 3:
        return None
    if proc.returncode != 0:
        raise RuntimeError(f"build_horovod.sh --cached-only failed:\n{proc.stdout}{proc.stderr}")
    return Path(proc.stdout.strip().splitlines()[-1])


def scratch_env(wheel: Path, dest: Path) -> Path:
    """A venv in ``dest`` with ``wheel`` installed and this interpreter's packages behind it; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    python = dest / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # The wheel first: with the .pth in place pip would see this environment's Horovod and skip it.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--disable-pip-version-check",
            str(wheel),
        ],
        check=True,
    )
    base = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(purelib, "_adasum_base_env.pth").write_text("\n".join(sorted(base)) + "\n", encoding="utf-8")
    return python


def clean_env() -> dict[str, str]:
    """This environment without any CUDA toolkit: no CUDA_HOME/CUDA_PATH/LD_LIBRARY_PATH, no folder with an
    nvcc on PATH, and Open MPI allowed to run as root."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CUDA_HOME", "CUDA_PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "CUDAToolkit_ROOT")
    }
    env["PATH"] = os.pathsep.join(
        d for d in env.get("PATH", "").split(os.pathsep) if d and not Path(d, "nvcc").exists()
    )
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    return env


def probe(python: Path) -> dict:
    """Import horovod.torch in ``python`` (no GPU needed), init (one MPI process), a CPU Adasum allreduce;
    what it reports."""
    proc = subprocess.run(
        [str(python), "-c", _PROBE],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=tempfile.gettempdir(),
        timeout=300,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[len("PROBE ") :])
    raise RuntimeError(f"the probe failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def fatbin_archs(library: Path) -> tuple[list[int], list[int]]:
    """The compute capabilities in ``library``'s CUDA fat binaries: (SASS ones, PTX ones).

    Each fat binary (magic 0xBA55ED50: u32 magic, u16 version, u16 header size, u64 size) holds entries
    (u16 kind: 1 PTX, 2 ELF/SASS; u16; u32 header size; u64 payload size; ...; u32 sm at offset 28)."""
    data = library.read_bytes()
    magic = struct.pack("<I", 0xBA55ED50)
    sass, ptx = set(), set()
    i = data.find(magic)
    while i != -1:
        _version, header, size = struct.unpack_from("<HHQ", data, i + 4)
        off, end = i + header, i + header + size
        while off < end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, off)
            (sm,) = struct.unpack_from("<I", data, off + 28)
            (sass if kind == 2 else ptx if kind == 1 else set()).add(sm)
            off += entry_header + payload
        i = data.find(magic, end)
    return sorted(sass), sorted(ptx)


def _symbols(library: Path) -> str:
    return subprocess.run(["nm", "-C", str(library)], capture_output=True, text=True, check=True).stdout


def operation_manager_calls(library: Path) -> list[str]:
    """Demangled call targets of Horovod's ``CreateOperationManager`` in ``library``."""
    names = subprocess.run(["nm", str(library)], capture_output=True, text=True, check=True).stdout
    mangled = [
        line.split()[-1]
        for line in names.splitlines()
        if "CreateOperationManager" in line and ".cold" not in line
    ]
    if not mangled:
        raise RuntimeError(f"no CreateOperationManager in {library}")
    asm = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", f"--disassemble={mangled[0]}", str(library)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    targets = [m.group(1) for m in re.finditer(r"\bcall\s+[0-9a-f]+ <([^>+]*)", asm)]
    demangled = subprocess.run(
        ["c++filt"], input="\n".join(targets), capture_output=True, text=True, check=True
    )
    return demangled.stdout.splitlines()


def dynamic_section(library: Path) -> tuple[list[str], str]:
    """``library``'s NEEDED entries and RUNPATH."""
    out = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\).*\[(.*)\]", out)
    runpath = re.findall(r"\((?:RUNPATH|RPATH)\).*\[(.*)\]", out)
    return needed, ":".join(runpath)


@dataclass
class Check:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'ok' if self.ok else 'FAILED'}: {self.name}: {self.detail}"


def run_checks(wheel: Path, workdir: Path) -> tuple[dict, list[Check]]:
    """Install ``wheel`` into a scratch venv under ``workdir`` and run every check; (probe report, checks)."""
    python = scratch_env(wheel, workdir / "venv")
    report = probe(python)
    library = Path(report["library"])
    checks = [
        Check(
            "installed in the scratch environment",
            str(workdir) in report["horovod_file"],
            report["horovod_file"],
        ),
        Check("hvd.nccl_built()", report["nccl_built"] > 0, f"NCCL version code {report['nccl_built']}"),
        Check("hvd.mpi_built()", report["mpi_built"], str(report["mpi_built"])),
        Check("hvd.cuda_built()", report["cuda_built"], str(report["cuda_built"])),
        Check(
            "import horovod.torch and hvd.init() without a GPU",
            not report["cuda_available"]
            and report["size"] == 1
            and report["cpu_adasum"] == [1.0, 2.0, 3.0, 4.0],
            f"torch.cuda.is_available()={report['cuda_available']}, size {report['size']}, "
            f"CPU Adasum {report['cpu_adasum']}",
        ),
    ]
    calls = operation_manager_calls(library)
    symbols = _symbols(library)
    gpu_op = any(c.startswith(ADASUM_GPU_CTOR) for c in calls)
    mpi_op = any(c.startswith(ADASUM_MPI_CTOR) for c in calls)
    checks.append(
        Check(
            "Adasum on GPU tensors is the hierarchical NCCL op",
            gpu_op and mpi_op and NCCL_HIERARCHICAL in symbols,
            "CreateOperationManager constructs AdasumGpuAllreduceOp"
            + ("" if gpu_op else " NOT")
            + " and AdasumMPIAllreduceOp"
            + ("" if mpi_op else " NOT")
            + "; AdasumGpuAllreduceOp::NcclHierarchical "
            + ("defined" if NCCL_HIERARCHICAL in symbols else "MISSING"),
        )
    )
    sass, ptx = fatbin_archs(library)
    checks.append(
        Check(
            "CUDA kernels for T4, A100, A10/A40, L4, H100",
            set(CUDA_CC_LIST) <= set(sass) and max(CUDA_CC_LIST) in ptx,
            f"SASS sm_{', sm_'.join(map(str, sass))}; PTX compute_{', compute_'.join(map(str, ptx))}",
        )
    )
    needed, runpath = dynamic_section(library)
    outside = [p for p in [runpath, *report["loaded"]] if SYSTEM_CUDA_RE.search(p)]
    checks.append(
        Check(
            "no CUDA toolkit outside the wheels",
            not outside and "libnccl.so.2" in needed,
            f"NEEDED {', '.join(n for n in needed if 'cud' in n or 'nccl' in n)}; loaded "
            + ", ".join(
                Path(p).name + " from " + str(Path(p).parent) for p in report["loaded"] if "mpi_lib" not in p
            )
            + (f"; OUTSIDE: {outside}" if outside else ""),
        )
    )
    return report, checks


def main(argv: list[str]) -> int:
    wheel = Path(argv[0]) if argv else cached_wheel()
    if wheel is None:
        print("no cached GPU wheel: run `make gpu-wheel` (patches/build_horovod.sh --gpu --no-install)")
        return 1
    with tempfile.TemporaryDirectory(prefix="adasum-gpu-wheel-") as tmp:
        _, checks = run_checks(wheel, Path(tmp))
    for check in checks:
        print(check.line())
    if not all(c.ok for c in checks):
        return 1
    print(f"nccl_built=True {wheel}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
