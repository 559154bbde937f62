"""Builds: cache keys, build failures, the file lock and its stale-lock recovery, concurrency."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fxfuse.cuda import build, gemm_codegen
from fxfuse.cuda.build import BuildError, Target, arch_flags, cache_key, csrc_digest
from fxfuse.cuda.lock import FileLock, LockTimeout
from programs import PROGRAMS

TARGET = Target("cuda", "sm_90a", ("-gencode=arch=compute_90a,code=sm_90a",), None)


@pytest.fixture
def csrc_copy(tmp_path):
    copy = tmp_path / "csrc"
    shutil.copytree(build.CSRC, copy)
    return copy


def test_cache_key_changes_with_csrc(csrc_copy):
    before = cache_key("program", "p\ntorch.float32", TARGET, csrc_copy)
    assert before == cache_key("program", "p\ntorch.float32", TARGET, csrc_copy)
    path = csrc_copy / "row_epilogue.cuh"
    path.write_text(path.read_text() + "\n// a change\n")
    assert cache_key("program", "p\ntorch.float32", TARGET, csrc_copy) != before
    (csrc_copy / "new_header.cuh").write_text("// new\n")
    assert csrc_digest(csrc_copy) != csrc_digest(build.CSRC)


def test_cache_key_changes_with_program_dtype_and_target():
    keys = {
        cache_key("program", "a\ntorch.float32", TARGET),
        cache_key("program", "b\ntorch.float32", TARGET),
        cache_key("program", "a\ntorch.bfloat16", TARGET),
        cache_key("program", "a\ntorch.float32", Target("cuda", "sm_80", ("-gencode=arch=compute_80,code=sm_80",), None)),
        cache_key("program", "a\ntorch.float32", Target("emulate", "emulate")),
    }
    assert len(keys) == 5


def test_row_modules_compute_eagers_formulas_and_gemm_modules_the_rules():
    """A row module rounds where eager rounds, so it computes eager's formulas in every dtype: libm's
    exponential, IEEE division, no FMA contraction (FX_RULE_MATH off). A GEMM module computes in
    float32 from the accumulator and rounds once: the rule's exponential and 2-ulp division."""
    from fxfuse.cuda.build import _compiler_flags

    cuda = Target("cuda", "sm_90a", ("-gencode=arch=compute_90a,code=sm_90a",), None)
    row, gemm = _compiler_flags(cuda)["extra_cuda_cflags"], _compiler_flags(cuda, Path("/cutlass"))["extra_cuda_cflags"]
    assert "-DFX_RULE_MATH" not in row and "--fmad=false" in row and "-prec-div=false" not in row
    assert "-DFX_RULE_MATH" in gemm and "-prec-div=false" in gemm and "--fmad=false" not in gemm
    assert "-DFX_RULE_MATH" not in _compiler_flags(Target("emulate", "emulate"))["extra_cflags"]


def test_arch_flags():
    assert arch_flags(9, 0) == ("sm_90a", ("-gencode=arch=compute_90a,code=sm_90a",))
    assert arch_flags(8, 6) == ("sm_86", ("-gencode=arch=compute_86,code=sm_86",))


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FXFUSE_CACHE_DIR", str(tmp_path / "c"))
    assert build.cache_root() == tmp_path / "c"
    monkeypatch.delenv("FXFUSE_CACHE_DIR")
    assert build.cache_root() == Path.home() / ".cache" / "fxfuse"


# -- the lock ---------------------------------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_lock_of_a_dead_process_is_broken(tmp_path):
    lock = tmp_path / "x.lock"
    lock.write_text(f"{_dead_pid()} {time.time()!r} {os.uname().nodename} deadbeef\n")
    start = time.monotonic()
    with FileLock(lock, timeout=5):
        assert "deadbeef" not in lock.read_text()
    assert time.monotonic() - start < 2
    assert not lock.exists()


def test_old_lock_of_a_live_process_is_broken(tmp_path):
    lock = tmp_path / "x.lock"
    lock.write_text(f"{os.getppid()} {time.time() - 3600!r} {os.uname().nodename} cafe\n")
    with FileLock(lock, timeout=5, stale_after=600):
        assert "cafe" not in lock.read_text()


def test_garbage_lock_is_broken(tmp_path):
    lock = tmp_path / "x.lock"
    lock.write_text("not a lock")
    with FileLock(lock, timeout=5):
        pass


def test_fresh_lock_of_a_live_process_is_waited_for(tmp_path):
    lock = tmp_path / "x.lock"
    lock.write_text(f"{os.getppid()} {time.time()!r} {os.uname().nodename} live\n")
    with pytest.raises(LockTimeout):
        with FileLock(lock, timeout=0.5, poll=0.05):
            pass
    assert "live" in lock.read_text()  # not ours to remove


def test_release_leaves_a_lock_that_was_taken_over(tmp_path):
    lock = tmp_path / "x.lock"
    held = FileLock(lock, timeout=5)
    held.acquire()
    lock.write_text(f"{os.getppid()} {time.time()!r} {os.uname().nodename} other\n")  # broken + retaken
    held.release()
    assert "other" in lock.read_text()


def _hold(path: str, seconds: float, queue) -> None:
    with FileLock(path, timeout=30):
        queue.put(("in", time.monotonic()))
        time.sleep(seconds)
        queue.put(("out", time.monotonic()))


def test_lock_excludes_other_processes(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_hold, args=(str(tmp_path / "x.lock"), 0.3, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    events = sorted((queue.get(timeout=5) for _ in range(6)), key=lambda e: e[1])
    assert [e[0] for e in events] == ["in", "out"] * 3  # never two holders at once


def _build_once(root: str, counter: str, queue) -> None:
    os.environ["FXFUSE_CACHE_DIR"] = root

    def compile_into(directory: Path):
        with open(counter, "a") as f:
            f.write("built\n")
        time.sleep(0.5)
        (directory / "artifact").write_text("ok")
        return {"library": "artifact"}, None

    path, manifest, _ = build._cached_build("k" * 32, "test", compile_into)
    queue.put((str(path), manifest["library"]))


def test_concurrent_builds_of_one_key_build_once(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    counter = tmp_path / "count"
    procs = [ctx.Process(target=_build_once, args=(str(tmp_path / "cache"), str(counter), queue)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    results = [queue.get(timeout=5) for _ in range(3)]
    assert counter.read_text().count("built") == 1
    assert len({r[0] for r in results}) == 1
    final = Path(results[0][0])
    assert (final / "ok").is_file() and (final / "artifact").read_text() == "ok"
    assert not list((tmp_path / "cache").glob("*.partial"))


def _sleeping_in(directory: Path) -> subprocess.Popen:
    """A process working in ``directory`` (set before Popen returns), as ninja's compilers do."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], cwd=directory)


def _polls_as_the_build_compiles(key: str, procs: list[subprocess.Popen]) -> list[int | None]:
    """Build ``key`` (a stub module's compile); each of ``procs``' ``poll()`` as its compile began
    (None: still running, -9: killed). The processes are killed afterwards."""
    seen = []

    def compile_into(directory: Path):
        seen.extend(proc.poll() for proc in procs)
        (directory / "artifact").write_text("ok")
        return {"library": "artifact"}, None

    try:
        build._cached_build(key, "a module", compile_into)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return seen


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes through /proc (Linux)")
def test_a_build_taking_over_from_a_dead_builder_first_stops_the_compiles_it_left_running(tmp_path, monkeypatch,
                                                                                          capsys):
    """A builder killed outright leaves ninja and its compilers running in ``<key>.partial``. The
    build that breaks the dead builder's lock stops them before it resumes there (no two compiles of
    one object file; none writing on into the finished entry), and nothing working elsewhere."""
    monkeypatch.setenv("FXFUSE_CACHE_DIR", str(tmp_path))
    key = "a" * 32
    work = tmp_path / f"{key}.partial"
    (work / "sub").mkdir(parents=True)
    (tmp_path / f"{key}.lock").write_text(f"{_dead_pid()} {time.time()!r} {os.uname().nodename} dead\n")
    procs = [_sleeping_in(place) for place in (work, work / "sub", tmp_path)]
    assert _polls_as_the_build_compiles(key, procs) == [-9, -9, None]
    assert "stopped 2 compile process(es) a killed build of a module left running" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes through /proc (Linux)")
def test_a_build_breaking_a_live_builders_old_lock_stops_nothing(tmp_path, monkeypatch):
    """Only a dead builder's compiles are stopped: a lock broken for its age, its holder alive,
    says nothing of what runs in the directory."""
    monkeypatch.setenv("FXFUSE_CACHE_DIR", str(tmp_path))
    key = "b" * 32
    work = tmp_path / f"{key}.partial"
    work.mkdir()
    (tmp_path / f"{key}.lock").write_text(f"{os.getppid()} {time.time() - 7200!r} {os.uname().nodename} old\n")
    assert _polls_as_the_build_compiles(key, [_sleeping_in(work)]) == [None]


def test_failed_build_leaves_nothing_and_raises(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FXFUSE_CACHE_DIR", str(tmp_path))

    def compile_into(directory: Path):
        raise RuntimeError("Error building extension 'x':\n" + "noise\n" * 2000 + "x.cu(1): error: the real message")

    with pytest.raises(BuildError, match="the real message"):
        build._cached_build("f" * 32, "broken program", compile_into)
    assert not (tmp_path / ("f" * 32)).exists() and not list(tmp_path.glob("*.partial"))
    assert "fxfuse: building broken program ... failed" in capsys.readouterr().err


# -- real builds through torch.utils.cpp_extension (host compiler, emulate target) ------------------


@pytest.fixture
def emulate_target():
    if not (shutil.which("g++") or shutil.which("c++")) or build.find_cuda_home(need_nvcc=False) is None:
        pytest.skip("needs a host C++ compiler and CUDA's headers")
    return build.emulate_target()


def test_broken_source_raises_build_error_with_the_compiler_message(tmp_path, monkeypatch, csrc_copy, emulate_target):
    monkeypatch.setenv("FXFUSE_CACHE_DIR", str(tmp_path / "cache"))
    path = csrc_copy / "row_epilogue.cuh"
    path.write_text(path.read_text() + "\nthis is not C++;\n")
    with pytest.raises(BuildError) as info:
        build.build_program(PROGRAMS["s01_scale_leaky"], torch.float32, emulate_target, csrc=csrc_copy)
    assert "error" in str(info.value).lower() and "this is not C++" in str(info.value)


def test_build_prints_one_progress_line_and_is_cached(tmp_path, monkeypatch, capsys, emulate_target):
    monkeypatch.setenv("FXFUSE_CACHE_DIR", str(tmp_path / "cache"))
    program = PROGRAMS["s13_sub_mul_relu"]
    first = build.build_program(program, torch.float32, emulate_target)
    err = capsys.readouterr().err
    assert err.count("fxfuse: building ") == 1 and " done in " in err and "[float32]" in err
    again = build.build_program(program, torch.float32, emulate_target)
    assert capsys.readouterr().err == ""
    assert again.path == first.path and again.info == first.info


def test_a_cached_module_keeps_its_library_and_generated_sources_not_its_objects(tmp_path, monkeypatch,
                                                                                emulate_target):
    monkeypatch.setenv("FXFUSE_CACHE_DIR", str(tmp_path / "cache"))
    module = build.build_program(PROGRAMS["s13_sub_mul_relu"], torch.float32, emulate_target)
    entry = module.path.parent
    assert module.path.is_file() and (entry / "ok").is_file()
    assert (entry / "module.cpp").is_file() and (entry / "include" / "program.cuh").is_file()
    assert not list(entry.rglob("*.o"))
    assert not [p for p in (entry / "include").iterdir() if p.name != "program.cuh"]  # csrc/ is the key's


def test_an_interrupted_build_resumes_without_compiling_its_finished_units_again(tmp_path, monkeypatch, capsys,
                                                                                 emulate_target):
    """A build interrupted after ninja compiled its units (Ctrl-C, or a process killed at a time
    limit) leaves them in ``<key>.partial``; the next build of the module resumes there, past the
    lock file cpp_extension left in it, and compiles none of them again."""
    monkeypatch.setenv("FXFUSE_CACHE_DIR", str(tmp_path / "cache"))
    program, drop = PROGRAMS["s13_sub_mul_relu"], build._drop_intermediates

    def interrupted(directory, csrc):
        raise KeyboardInterrupt

    from torch.utils import cpp_extension

    # each build as in a process of its own: cpp_extension has built nothing of that name there
    monkeypatch.setattr(cpp_extension.JIT_EXTENSION_VERSIONER, "entries", {})
    monkeypatch.setattr(build, "_drop_intermediates", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build.build_program(program, torch.float32, emulate_target)
    (partial,) = (tmp_path / "cache").glob("*.partial")
    units = {path.name: path.stat().st_mtime_ns for path in partial.glob("*.o")}
    assert units
    (partial / "lock").write_text("")  # cpp_extension's, as a killed build leaves it
    compiled = {}

    def dropping(directory, csrc):
        compiled.update({path.name: path.stat().st_mtime_ns for path in directory.glob("*.o")})
        drop(directory, csrc)

    monkeypatch.setattr(build, "_drop_intermediates", dropping)
    monkeypatch.setattr(cpp_extension.JIT_EXTENSION_VERSIONER, "entries", {})
    capsys.readouterr()
    module = build.build_program(program, torch.float32, emulate_target)
    assert compiled == units  # the same object files, not compiled again
    assert "(resumed)" in capsys.readouterr().err
    assert (module.path.parent / "ok").is_file() and not list((tmp_path / "cache").glob("*.partial"))


def test_unsupported_program_raises_build_error(emulate_target):
    from fxfuse import expr as E
    from fxfuse.ir import Gemm, Pointwise, Program, Reduce

    program = Program(Gemm(True), (Reduce("sum"), Pointwise(E.mul(E.X, E.param(0)))), ("col",))
    with pytest.raises(BuildError, match="unsupported program"):
        build.build_program(program, torch.float32, emulate_target)


def test_prepare_many_builds_in_worker_processes(emulate_target):
    from fxfuse import expr as E
    from fxfuse.cuda.engine import Engine
    from fxfuse.ir import Gemm, Pointwise, Program, Reduce

    engine = Engine(lambda device: emulate_target)
    bad = Program(Gemm(True), (Reduce("sum"), Pointwise(E.mul(E.X, E.param(0)))), ("col",))
    items = [(PROGRAMS["s13_sub_mul_relu"], torch.float32), (PROGRAMS["s10_div_gelu"], torch.float32), (bad, torch.float32)]
    failed = engine.prepare_many(items, torch.device("cpu"), workers=2)
    assert list(failed) == [(bad.to_string(), torch.float32)]
    x, w, b = torch.randn(3, 8), torch.randn(16, 8), torch.randn(16)
    assert engine.forward_kernels(PROGRAMS["s10_div_gelu"].to_string(), x, w, b, []) is not None


def test_prepare_many_of_cached_modules_starts_no_build_worker(emulate_target, monkeypatch):
    """A warm compile finds every module in the cache: prepare_many loads them without starting a
    build worker (each would import torch afresh: seconds of the compile, for nothing)."""
    import concurrent.futures

    from fxfuse.cuda.engine import Engine

    items = [(PROGRAMS["s13_sub_mul_relu"], torch.float32), (PROGRAMS["s10_div_gelu"], torch.float32)]
    assert not Engine(lambda device: emulate_target).prepare_many(items, torch.device("cpu"), workers=2)
    assert all(build.is_built(p.to_string(), d, emulate_target) for p, d in items)
    assert build.is_built(build.RUNTIME_SOURCE, torch.float32, emulate_target)
    assert not build.is_built("linear(bias=True) | pointwise(x * 3.25)", torch.float16, emulate_target)  # never built
    # a GEMM module the target cannot build: its worker reports why
    assert not build.is_built(PROGRAMS["s01_scale_leaky"].to_string(), torch.bfloat16, emulate_target, (torch.bfloat16,))

    def no_worker(*args, **kwargs):
        raise AssertionError("a build worker started")

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", no_worker)
    warm = Engine(lambda device: emulate_target)
    assert not warm.prepare_many(items, torch.device("cpu"), workers=2)
    x, w, b = torch.randn(3, 8), torch.randn(16, 8), torch.randn(16)
    assert warm.forward_kernels(PROGRAMS["s10_div_gelu"].to_string(), x, w, b, []) is not None


def test_few_gemm_modules_share_the_cores_a_unit_each():
    """A cold compile's long pole is its GEMM modules (a CUTLASS unit takes a minute): where they
    are fewer than the compile slots, they share them up to a unit each at once, and the runtime
    and program modules keep a worker's share."""
    from fxfuse.cuda.build import build_plan

    gemm, other = (torch.bfloat16,), None
    # four chains on 16 cores: the runtime, four GEMM modules of five units, four programs
    assert build_plan([other] + [gemm] * 4 + [other] * 4, 16, 5) == (8, [2] + [4] * 4 + [2] * 4)
    assert build_plan([gemm], 16, 5) == (1, [16])  # a worker's share is never cut
    assert build_plan([gemm, other], 16, 5) == (2, [8, 8])
    assert build_plan([gemm, other], 16, 5, workers=1) == (1, [16, 16])  # the workers asked for
    assert build_plan([other] * 3, 2, 1) == (2, [1, 1, 1])  # few cores: a worker each


def test_many_gemm_modules_take_a_worker_and_a_compile_each():
    """As many GEMM modules as compile slots or more (a prebuild of the tests' and the suite's):
    each takes a worker and one compile, so that a module's kernels of a kind share one file and
    CUTLASS's headers are parsed once a kind, not once a compile."""
    from fxfuse.cuda.build import build_plan

    gemm, other = (torch.bfloat16,), None
    assert build_plan([gemm] * 140 + [other] * 250, 64, 8) == (64, [1] * 390)
    assert build_plan([gemm] * 64, 64, 8) == (64, [1] * 64)
    assert build_plan([gemm] * 40 + [other] * 100, 64, 8) == (32, [2] * 140)  # fewer: two a worker


def test_compiles_at_once_are_as_many_as_memory_holds_at_a_cutlass_files_peak(monkeypatch):
    """A compile slot is a core and COMPILE_BYTES of memory: a host of many cores and little
    memory (or a container's limit) runs fewer compiles than cores, never swapping."""
    from fxfuse.cuda import build

    monkeypatch.delenv("MAX_JOBS", raising=False)
    monkeypatch.setattr(build, "usable_cpus", lambda: 16)
    monkeypatch.setattr(build, "usable_memory", lambda: 512 << 30)
    assert build.compile_slots() == build.build_jobs() == 16
    monkeypatch.setattr(build, "usable_memory", lambda: 64 << 30)
    assert build.compile_slots() == build.build_jobs() == 64 // 6
    monkeypatch.setattr(build, "usable_memory", lambda: 4 << 30)
    assert build.compile_slots() == 1
    monkeypatch.setenv("MAX_JOBS", "3")  # prepare_many's workers set it for each build
    assert build.build_jobs() == 3


def test_the_memory_builds_may_use_is_the_cgroups_limit_where_lower(tmp_path, monkeypatch):
    from fxfuse.cuda import build

    host = build.usable_memory()
    limit = tmp_path / "memory.max"
    real_path = build.Path

    def cgroup_file(path):
        return real_path(limit) if str(path) == "/sys/fs/cgroup/memory.max" else real_path(tmp_path / "absent")

    monkeypatch.setattr(build, "Path", cgroup_file)
    limit.write_text("max\n")
    assert build.usable_memory() == host
    limit.write_text(f"{8 << 30}\n")
    assert build.usable_memory() == min(host, 8 << 30)


def test_builds_count_the_cores_the_process_may_run_on_not_the_hosts(monkeypatch):
    """A build given a share of a large host (taskset, a cgroup's cpuset, a batch scheduler) sizes
    its workers and units by that share, not by every core of the host."""
    from fxfuse.cuda import build

    monkeypatch.setattr(build.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(build.os, "sched_getaffinity", lambda pid: set(range(16, 32)), raising=False)
    assert build.usable_cpus() == 16
    monkeypatch.delattr(build.os, "sched_getaffinity")
    assert build.usable_cpus() == 64  # a platform without affinity: the host's count


# -- a cache that heals -------------------------------------------------------------------------------


def _artifact_build(counter: Path):
    def compile_into(directory: Path):
        counter.write_text(counter.read_text() + "built\n" if counter.exists() else "built\n")
        (directory / "artifact").write_text("the library")
        return {"library": "artifact"}, None

    return compile_into


@pytest.mark.parametrize("damage", ["changed", "missing"])
def test_a_corrupt_entry_is_rebuilt_once_with_a_warning(tmp_path, monkeypatch, damage):
    monkeypatch.setenv("FXFUSE_CACHE_DIR", str(tmp_path / "cache"))
    counter = tmp_path / "count"
    final, manifest, _ = build._cached_build("e" * 32, "a module", _artifact_build(counter))
    assert len(manifest["sha256"]) == 64
    if damage == "changed":
        (final / "artifact").write_text("the librar")  # a truncated file
    else:
        (final / "artifact").unlink()
    with pytest.warns(RuntimeWarning, match="cached build of a module is corrupt"):
        final, _, _ = build._cached_build("e" * 32, "a module", _artifact_build(counter))
    assert (final / "artifact").read_text() == "the library"
    assert counter.read_text().count("built") == 2
    build._cached_build("e" * 32, "a module", _artifact_build(counter))  # healed: a plain hit
    assert counter.read_text().count("built") == 2


def test_an_unwritable_cache_falls_back_to_a_private_directory(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FXFUSE_CACHE_DIR", str(blocker / "cache"))  # its parent is a file
    with pytest.warns(RuntimeWarning, match="cannot write the build cache"):
        root = build.cache_root()
    assert root.is_dir() and root != blocker / "cache"
    assert build.cache_root() == root  # warned once, the same directory for the process
    final, _, _ = build._cached_build("f" * 32, "a module", _artifact_build(tmp_path / "count"))
    assert final.parent == root


def test_a_cached_module_that_does_not_load_is_rebuilt(tmp_path, emulate_target):
    """A library that matches its checksum but does not load (say, written by another toolchain):
    built, damaged, then loaded by fresh processes (one that loaded a library of that name keeps
    it)."""
    program = PROGRAMS["s13_sub_mul_relu"]
    code = ("import sys, torch; from fxfuse.cuda import build; from fxfuse.ir import Program; "
            "print(build.build_program(Program.parse(sys.argv[1]), torch.float32, build.emulate_target()).path)")

    def build_in_a_new_process():
        return subprocess.run([sys.executable, "-c", code, program.to_string()], capture_output=True, text=True,
                              timeout=600, env={**os.environ, "FXFUSE_CACHE_DIR": str(tmp_path / "cache")})

    built = build_in_a_new_process()
    assert built.returncode == 0, built.stderr
    library = Path(built.stdout.strip().splitlines()[-1])
    manifest = json.loads((library.parent / "ok").read_text())
    library.write_bytes(b"not a shared library")
    manifest["sha256"] = build._file_digest(library)
    (library.parent / "ok").write_text(json.dumps(manifest))
    again = build_in_a_new_process()
    assert again.returncode == 0, again.stderr
    assert "is corrupt (cannot load" in again.stderr and "rebuilding it" in again.stderr
    assert Path(again.stdout.strip().splitlines()[-1]) == library and library.read_bytes()[:4] == b"\x7fELF"


FAKE_GEMM_MODULE = r"""
#include "fx_abi.h"
static const char* const kNames[] = {"first", "second"};
static int32_t answers(int64_t, int64_t, int64_t, int32_t) { return 1; }
static int32_t crashes(int64_t, int64_t, int64_t, int32_t config) {
  return config == 1 ? *static_cast<volatile int32_t*>(nullptr) : 1;  // a fault in one configuration's query
}
static int64_t no_workspace(int64_t, int64_t, int64_t, int32_t, int32_t) { return 0; }
static const FxGemmInfo kAnswers = {FX_ABI_VERSION, 0, 0, 0, 0, 0, 0, nullptr, nullptr, 0, 2, 2, kNames,
                                    &answers, &no_workspace, nullptr};
static const FxGemmInfo kCrashes = {FX_ABI_VERSION, 0, 0, 0, 0, 0, 0, nullptr, nullptr, 0, 2, 2, kNames,
                                    &crashes, &no_workspace, nullptr};
extern "C" const FxGemmInfo* fx_answers() { return &kAnswers; }
extern "C" const FxGemmInfo* fx_crashes() { return &kCrashes; }
"""


def test_a_gemm_module_whose_size_queries_crash_fails_its_build_instead_of_the_users_process(tmp_path):
    """A new GEMM module's size queries run in a child process before the module is loaded: one
    that crashes there (undefined behaviour in host code) is a failed build, which falls back to
    the row path; one that answers passes."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("needs a host C++ compiler")
    (tmp_path / "fake.cpp").write_text(FAKE_GEMM_MODULE)
    library = tmp_path / "fake.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O0", f"-I{build.CSRC}", str(tmp_path / "fake.cpp"), "-o",
                    str(library)], check=True)
    build.probe_size_queries(library, "fx_answers")
    with pytest.raises(BuildError, match=r"size queries of fake.so failed on the host \(signal 11\)"):
        build.probe_size_queries(library, "fx_crashes")


def test_a_gemm_modules_size_queries_find_the_torch_libraries_it_links(tmp_path, monkeypatch):
    """The size queries' child does not import torch, yet a module cpp_extension built links
    libc10.so and the rest from torch's own directory: the child is pointed at the directories
    the module was linked against, so a module that answers is not taken for a failed build."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("needs a host C++ compiler")
    (tmp_path / "fake.cpp").write_text(FAKE_GEMM_MODULE)
    library = tmp_path / "fake.so"
    torch_lib = build._linked_library_dirs(build.Target("emulate", "emulate"))[0]
    subprocess.run([compiler, "-shared", "-fPIC", "-O0", f"-I{build.CSRC}", str(tmp_path / "fake.cpp"), "-o",
                    str(library), "-Wl,--no-as-needed", f"-L{torch_lib}", "-lc10"], check=True)
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    with pytest.raises(BuildError, match="libc10.so"):  # what a process without torch's directory sees
        build.probe_size_queries(library, "fx_answers")
    build.probe_size_queries(library, "fx_answers", [torch_lib])


def test_the_tests_prebuild_builds_a_float32_chains_gemm_module_only_for_the_tests_that_allow_tf32(
        tmp_path, monkeypatch):
    """A float32 GEMM module is TF32: the suite tests' float32 compiles run with TF32 off (cuBLAS
    and the row pass), so the prebuild builds none for them, only for the test that allows TF32,
    with the kernels for its calls alone. (Every trace stood in for by one program.)"""
    import prebuild
    from bench.prebuild_suite import write_traced

    program, f32, bf16 = PROGRAMS["s01_scale_leaky"], torch.float32, torch.bfloat16
    monkeypatch.setattr(prebuild, "TRACED", tmp_path)
    plans = prebuild.trace_plans(suite=True)
    assert [tf32 for _, tf32 in plans].count(True) == 1
    for plan, tf32 in plans:  # float32 calls of 8 rows where TF32 is allowed, of 1024 elsewhere
        rows = 8 if tf32 else 1024
        write_traced(tmp_path / f"{prebuild.sources_digest(plan)}.json", {(program, f32), (program, bf16)},
                     {(program, f32, (), rows), (program, bf16, (), 1024)})
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)  # as prebuild.main sets it
    gemms = {job.dtype: job.kernels for job in prebuild.traced_jobs(suite=True) if job.param_dtypes is not None}
    assert gemms[bf16] == gemm_codegen.menu(program, gemm_codegen.rows_served(1024))
    assert gemms[f32] == gemm_codegen.menu(program, gemm_codegen.rows_served(8))


def test_the_tests_prebuild_traces_the_model_tests_compiles_with_the_gemm_modules_they_ask_for(tmp_path):
    """The operand and pooling tests compile their MODELS in float32 and bfloat16: the prebuild
    traces them (traced on the CPU here) for their row modules, and a GEMM module for each chain
    whose calls may take one, none for a weight stored (K, N) (GPT-2's Conv1D)."""
    import prebuild
    import test_operands_cuda
    from bench.prebuild_suite import programs_of, read_traced

    prebuild.trace_models(tmp_path / "models.json", device="cpu")
    pairs, gemms = read_traced(tmp_path / "models.json")
    assert {dtype for _, dtype in pairs} == {torch.float32, torch.bfloat16}
    with_module = {(program, dtype) for program, dtype, *_ in gemms}
    conv1d, conv1d_gemms = programs_of(test_operands_cuda.Conv1DMlp(), test_operands_cuda.x_alone(), "cpu")
    assert conv1d and conv1d <= pairs and not conv1d_gemms and not conv1d & with_module
    assert with_module and with_module <= pairs
    assert any("pool" in program.to_string() for program, _ in pairs)  # the pooling tests' models


@pytest.mark.parametrize("dtypes, tf32", [("fp32", False), ("tf32", True), ("bf16,tf32", True)])
def test_the_suite_prebuild_builds_as_compiles_under_the_benchmarks_dtype_do(dtypes, tf32, monkeypatch):
    """bench.py's tf32 runs compile float32 models with TF32 allowed, and only then does a float32
    chain get its (TF32) GEMM module: the prebuild for them builds with TF32 allowed, so that the
    benchmark's compiles find those modules built; for its fp32 runs it builds none."""
    import fxfuse.cuda as fxcuda
    from bench import prebuild_suite

    settings = []
    monkeypatch.setattr(prebuild_suite, "suite_programs", lambda *args, **kwargs: (set(), set()))
    monkeypatch.setattr(fxcuda, "prepare_many", lambda *args, **kwargs:
                        settings.append(torch.backends.cuda.matmul.allow_tf32) or {})
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(sys, "argv", ["prebuild_suite.py", "--sizes", "full", "--dtypes", dtypes, "--rows", "S01"])
    assert prebuild_suite.main() == 0
    assert settings == [tf32] and torch.backends.cuda.matmul.allow_tf32 is False  # restored after
