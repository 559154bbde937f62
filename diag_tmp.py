import sys, traceback, torch
sys.path.insert(0, "tests/gpu"); sys.path.insert(0, ".")


def main():
    import fxfuse.cuda as fxcuda
    import test_cuda_kernels as T
    from programs import PROGRAMS
    torch.backends.cuda.matmul.allow_tf32 = False
    cases = [("gemm_gate_silu", torch.float32), ("gelu_dropout", torch.bfloat16), ("gelu_dropout", torch.float32),
             ("dropout_residual_layer", torch.float16), ("dropout_traced_bf16", torch.bfloat16)]
    print(fxcuda.prepare_many([(PROGRAMS[n], d) for n, d in cases]))
    for name, dtype in cases:
        program = PROGRAMS[name]
        for cpu_too in (False, True):
            try:
                T.check(program, dtype, *T.inputs(program, dtype, 7, 1000, 300, 0), cpu_too=cpu_too)
                print("OK", name, dtype, "cpu_too", cpu_too)
            except Exception:
                print("FAIL", name, dtype, "cpu_too", cpu_too, program.to_string())
                print("".join(traceback.format_exc().splitlines(True)[-14:]))


if __name__ == "__main__":
    main()
