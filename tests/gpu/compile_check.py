"""Compile-check generated sources with nvcc, without a GPU (a script, not a test).

    python tests/gpu/compile_check.py [--dtypes float32,bfloat16,float16] [--only NAME ...] [-j 4]
                                      [--registers]

Generates the program modules of tests/gpu/programs.py and runs ``nvcc -c`` on every unit for
sm_90a with the flags torch's cpp_extension uses, plus the runtime binding with the host compiler.
Prints ptxas spill lines (with --registers, every kernel's registers too) and exits non-zero on any
failure.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fxfuse.cuda import build, codegen  # noqa: E402
from fxfuse.cuda.build import CSRC, find_cuda_home  # noqa: E402
from programs import PROGRAMS  # noqa: E402

TORCH_NVCC_FLAGS = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
    "--compiler-options",
    "-fPIC",
]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def nvcc_unit(nvcc: str, unit: Path, include: Path, std: str) -> tuple[Path, int, str]:
    """One unit with the flags fxfuse builds a row module's with for sm_90a (build._compiler_flags)."""
    target = build.Target("cuda", *build.arch_flags(9, 0))
    flags = build._compiler_flags(target)["extra_cuda_cflags"]
    cmd = [nvcc, "-c", str(unit), "-o", str(unit.with_suffix(".o")), f"-std={std}", *flags, f"-I{include}",
           "-Xptxas", "-v", *TORCH_NVCC_FLAGS]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return unit, proc.returncode, proc.stdout + proc.stderr


def summarize_ptxas(log: str, registers: bool = False) -> list[str]:
    lines, kernel = [], None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '_ZN2fx\d+(\w+?)I", line)
        if m:
            kernel = m.group(1)
            params = re.search(r"ProgE(\w+?)EEvNS_4Args", line)
            kernel += " " + (params.group(1) if params else "")
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and kernel and int(m.group(1)) > 0:
            lines.append(f"    spills: {kernel}: {line.strip()}")
        m = re.search(r"Used (\d+) registers", line)
        if m and kernel and registers:
            lines.append(f"    registers: {kernel}: {m.group(1)}")
    return lines


def check_runtime(cuda_home: str) -> tuple[int, str]:
    torch_include = Path(torch.__file__).parent / "include"
    cmd = ["c++", "-c", "-std=c++20", "-O1", "-fPIC", "-DTORCH_EXTENSION_NAME=fxfuse_runtime_check",
           "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE", f"-I{torch_include}", f"-I{torch_include}/torch/csrc/api/include",
           f"-I{sysconfig.get_paths()['include']}", f"-I{cuda_home}/include", f"-I{CSRC}",
           str(CSRC / "runtime.cpp"), "-o", os.devnull]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode, proc.stderr


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--std", default="c++20")
    parser.add_argument("--no-runtime", action="store_true")
    parser.add_argument("--registers", action="store_true", help="print every kernel's registers")
    parser.add_argument("-j", type=int, default=build.usable_cpus())
    args = parser.parse_args()
    cuda_home = find_cuda_home(True)
    if cuda_home is None:
        print("no nvcc found")
        return 2
    nvcc = str(Path(cuda_home) / "bin" / "nvcc")
    names = args.only or list(PROGRAMS)
    failures = 0
    with tempfile.TemporaryDirectory() as tmp, futures.ThreadPoolExecutor(args.j) as pool:
        if not args.no_runtime:
            rt = pool.submit(check_runtime, cuda_home)
        jobs = []
        for name in names:
            for dname in args.dtypes.split(","):
                directory = Path(tmp) / f"{name}-{dname}"
                (directory / "include").mkdir(parents=True)
                for path in CSRC.iterdir():
                    (directory / "include" / path.name).write_bytes(path.read_bytes())
                sources = codegen.generate(PROGRAMS[name], DTYPES[dname], f"fxm_{name}", f"fx_entry_{name}")
                for file, text in sources.items():
                    (directory / ("include" if file.endswith(".cuh") else "") / file).write_text(text)
                for file in sources:
                    if file.endswith(".cu"):
                        jobs.append((name, dname, pool.submit(nvcc_unit, nvcc, directory / file, directory / "include",
                                                              args.std)))
        start = time.time()
        for name, dname, job in jobs:
            unit, rc, log = job.result()
            status = "ok" if rc == 0 else "FAILED"
            print(f"{status:6} {name} [{dname}] {unit.name}")
            for line in summarize_ptxas(log, args.registers):
                print(line)
            if rc:
                failures += 1
                print(log[-4000:])
        print(f"{len(jobs)} units in {time.time() - start:.0f} s, {failures} failed")
        if not args.no_runtime:
            rc, log = rt.result()
            print(f"runtime.cpp: {'ok' if rc == 0 else 'FAILED'}")
            if rc:
                failures += 1
                print(log[-4000:])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
