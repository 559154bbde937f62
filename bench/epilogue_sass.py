"""What an in-GEMM epilogue compiles to, without a GPU: a program's GEMM module for one kernel,
compiled for sm_90a with the modules' own flags, and each function's machine code counted.

    python bench/epilogue_sass.py "linear(bias=True) | pointwise(mish(x))" [--dtype bf16]
        [--params bf16,bf16] [--kernel 0] [--keep DIR]

Needs nvcc, cuobjdump (CUDA's, or the nvidia-cuda-cuobjdump wheel's, on PATH) and the CUTLASS
headers. The counts that mattered before (BENCHMARKS.md section 43): branch regions (BSSY, one per
value meant the values' transcendentals ran one after another), shuffles (SHFL: one warp a clock
on an SM), the special-function unit (MUFU), global loads and prefetches (LDG, CCTL), barriers
(BAR), local memory (LDL/STL: spills), and ptxas's registers. Static counts: code for every branch,
not what one launch runs; compare a program before and after a change, then time it on a GPU.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

from fxfuse.cuda import build, gemm_codegen  # noqa: E402
from fxfuse.ir import Program  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# column -> the instructions it counts (SASS opcodes, by prefix)
COUNTED = {"branch regions": ("BSSY",), "shuffles": ("SHFL",), "MUFU": ("MUFU",), "global loads": ("LDG",),
           "prefetches": ("CCTL.E.PF",), "barriers": ("BAR.",), "local memory": ("LDL", "STL")}
INSTRUCTION = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z0-9_.]+)")


def sass_counts(sass: str) -> list[dict]:
    """Per function of ``cuobjdump -sass`` output: its name and instruction counts."""
    functions: list[dict] = []
    for line in sass.splitlines():
        if "Function :" in line:
            functions.append({"function": line.split("Function :")[1].strip(), "instructions": 0,
                              **dict.fromkeys(COUNTED, 0)})
            continue
        found = INSTRUCTION.search(line)
        if found is None or not functions:
            continue
        opcode = found.group(1)
        functions[-1]["instructions"] += 1
        for column, prefixes in COUNTED.items():
            functions[-1][column] += opcode.startswith(prefixes)
    return functions


def short_name(mangled: str) -> str:
    """The kernel's kind from its mangled name: the GEMM, or fxg's pass after it."""
    if "GemmUniversal" in mangled:
        return "GEMM (epilogue inside)"
    found = re.search(r"fxg\d+(\w+?)I", mangled) or re.search(r"_ZN3fxg\d+(\w+)", mangled)
    return found.group(1) if found else mangled[:40]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("program", help="an IR program as the report prints it (Program.to_string)")
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--params", default=None, help="the parameters' dtypes, comma-separated (default: --dtype)")
    parser.add_argument("--kernel", type=int, default=0, help="index into gemm_codegen.KERNELS")
    parser.add_argument("--keep", type=Path, default=None, help="write the sources, object and SASS here")
    args = parser.parse_args()

    dtype = DTYPES[args.dtype]
    program = build.gemm_program(Program.parse(args.program), dtype)
    names = args.params.split(",") if args.params else [args.dtype] * len(program.params)
    cutlass = build.cutlass_include()
    cuobjdump = shutil.which("cuobjdump")
    home = build.find_cuda_home(need_nvcc=True)
    if cutlass is None or home is None or cuobjdump is None:
        print("needs nvcc, cuobjdump and the CUTLASS headers")
        return 2
    sources = gemm_codegen.generate(program, dtype, tuple(DTYPES[n] for n in names), "fxg_sass", "fx_gemm_info_sass",
                                    (gemm_codegen.KERNELS[args.kernel],), files=1)
    work = args.keep or Path(tempfile.mkdtemp(prefix="fxfuse-sass-"))
    work.mkdir(parents=True, exist_ok=True)
    for name, text in sources.items():
        (work / name).write_text(text)
    unit = next(name for name in sources if name.endswith(".cu") and name != "main.cu")
    flags = build._compiler_flags(build.Target("cuda", *build.arch_flags(9, 0)), cutlass)["extra_cuda_cflags"]
    compiled = subprocess.run([f"{home}/bin/nvcc", *flags, f"-I{build.CSRC}", f"-I{work}", "-Xptxas", "-v", "-c",
                               str(work / unit), "-o", str(work / "unit.o")], capture_output=True, text=True)
    if compiled.returncode != 0:
        print(compiled.stderr[-3000:])
        return 1
    registers = re.findall(r"Function properties for (\S+)[\s\S]*?Used (\d+) registers", compiled.stderr)
    sass = subprocess.run([cuobjdump, "-sass", str(work / "unit.o")], capture_output=True, text=True, check=True).stdout
    if args.keep:
        (work / "unit.sass").write_text(sass)
    used = {name: count for name, count in registers}
    rows = [{"kernel": short_name(f["function"]), "registers": used.get(f["function"], "?"),
             **{k: v for k, v in f.items() if k != "function"}} for f in sass_counts(sass)]
    print(f"{program.to_string()} [{args.dtype}], {gemm_codegen.KERNELS[args.kernel].cpp}")
    print(tabulate(rows, headers="keys"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
