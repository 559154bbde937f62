"""The pipeline depth of each in-GEMM kernel, read off the built types without a GPU (a script).

    python tests/gpu/gemm_pipeline.py [--only NAME ...] [--dtype bfloat16]

For each program of tests/gpu/programs.py that has an in-GEMM module, compiles a host program that
prints, per kernel of the menu (gemm_codegen.menu), the mainloop's stages and the shared memory
of the mainloop and the epilogue. CUTLASS gives the mainloop what the epilogue leaves of 227 KiB:
an epilogue that stages more than it needs costs a mainloop stage (BENCHMARKS.md, section 24).
Needs nvcc and CUTLASS's headers (CUTLASS_PATH or the nvidia-cutlass wheel).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fxfuse.cuda import gemm_codegen  # noqa: E402
from fxfuse.cuda.build import CSRC, cutlass_include, find_cuda_home  # noqa: E402
from programs import PROGRAMS  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def probe_source(kernels: int, gated: bool) -> str:
    """A host program printing each kernel's stages and shared memory (of the gated tree too)."""
    progs = ["Prog", "GatedProg"] if gated else ["Prog"]
    calls = "\n".join(f'  show<fxg_p::{prog}, {i}>("{prog} {i}");' for prog in progs for i in range(kernels))
    return f"""#include "gemm_program.cuh"
#include <cstdio>
template <class P, int I> void show(const char* name) {{
  using G = fxg::GemmFor<P, fxg_p::Menu::At<I>>;
  printf("%-12s mainloop stages %d (%d bytes), epilogue %d bytes\\n", name,
         static_cast<int>(G::Mainloop::DispatchPolicy::Stages), static_cast<int>(sizeof(typename G::Mainloop::SharedStorage)),
         static_cast<int>(sizeof(typename G::Epilogue::SharedStorage)));
}}
int main() {{
{calls}
}}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="program names (default: every one with an in-GEMM module)")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    args = parser.parse_args()
    home, include = find_cuda_home(need_nvcc=True), cutlass_include()
    if home is None or include is None:
        print("needs nvcc and CUTLASS's headers")
        return 2
    dtype = DTYPES[args.dtype]
    torch.backends.cuda.matmul.allow_tf32 = True  # float32: the TF32 modules
    names = args.only or [n for n, p in PROGRAMS.items() if gemm_codegen.unsupported_reason(p, dtype) is None]
    failed = 0
    for name in names:
        program = PROGRAMS[name]
        params = (gemm_codegen.kernel_param_dtype(dtype),) * len(program.params)
        sources = gemm_codegen.generate(program, dtype, params, "fxg_p", "fx_gemm_info_p")
        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp)
            (directory / "gemm_program.cuh").write_text(sources["gemm_program.cuh"])
            kernels = sum(file.startswith("config_") for file in sources)  # a unit a kernel
            (directory / "probe.cu").write_text(probe_source(kernels, "gated_0.cu" in sources))
            build = subprocess.run([str(Path(home) / "bin" / "nvcc"), "-std=c++17", "--expt-relaxed-constexpr",
                                    "-O0", "-gencode=arch=compute_90a,code=sm_90a", f"-I{CSRC}", f"-I{include}",
                                    f"-I{directory}", str(directory / "probe.cu"), "-o", str(directory / "probe")],
                                   capture_output=True, text=True)
            if build.returncode != 0:
                failed += 1
                print(f"{name}: FAILED\n{build.stderr[-2000:]}")
                continue
            run = subprocess.run([str(directory / "probe")], capture_output=True, text=True)
            print(f"{name} ({program.to_string()})")
            print("".join(f"  {line}\n" for line in run.stdout.splitlines()), end="", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
