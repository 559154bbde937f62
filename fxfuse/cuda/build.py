"""JIT builds: the runtime module (once per toolchain) and one program module per (program, dtype).

Builds go through ``torch.utils.cpp_extension.load`` (ninja). Each module lives in
``<cache>/<key>/`` where the key hashes everything that changes its binary: the program and dtype,
the contents of csrc/, the codegen version, torch's and CUDA's versions and the target (device
arch, or the host emulator). A build runs in ``<key>.partial/`` under a file lock (stale locks are
broken) and is renamed into place with an ``ok`` marker (its manifest, with the library's SHA-256),
so concurrent processes neither corrupt the cache nor build twice, and a crashed build leaves
nothing that looks finished. A build that was killed or interrupted leaves its units there: the
next build of the key resumes (ninja compiles only the units that did not finish; a GEMM module's
units take a minute or more each), after stopping the compiles a killed builder left running there
(orphans.py). A build that fails removes it. An entry whose library is
missing, differs from its checksum or fails to load is removed and built again once, with a
warning; a cache directory that cannot be written is replaced by a private temporary one, with a
warning.

Targets: ``cuda`` compiles the kernels with nvcc for the current device; ``emulate`` compiles the
same sources as host C++ with FX_EMULATE (csrc/fx_emulate.h) so machines without a GPU can run
them on CPU tensors (tests only).

GEMM modules (the in-GEMM back end, fxfuse/cuda/gemm_codegen.py) compile CUTLASS 3.x kernels for
Hopper (sm_90a) against the headers of the ``nvidia-cutlass`` package (``pip install
"fxfuse[cutlass]"``), or of a CUTLASS checkout named by ``$CUTLASS_PATH``; their key adds the
parameter dtypes, the CUTLASS version and the kernels of the module's menu. A finished module of the
same program holding every kernel asked for serves in place of a build of just those
(``covering_kernels``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import hashlib
import importlib.util
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import threading
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable, Sequence

import torch

from ..ir import Program
from . import codegen, gemm_info
from .errors import BuildError
from .gemm_info import GemmInfoView
from .lock import FileLock, LockTimeout
from .orphans import stop_processes_in


def _find_csrc() -> Path:
    """csrc/ beside the package in a checkout, or fxfuse/csrc where it is installed."""
    here = Path(__file__).resolve().parents[1]
    installed = here / "csrc"
    return installed if (installed / "row_epilogue.cuh").is_file() else here.parent / "csrc"


CSRC = _find_csrc()
SOURCE_SUFFIXES = (".cuh", ".cu", ".cpp", ".h")
RUNTIME_SOURCE = "runtime.cpp"
FX_ABI_VERSION = int(re.search(r"#define FX_ABI_VERSION (\d+)", (CSRC / "fx_abi.h").read_text()).group(1))
ERROR_TAIL_CHARS = 4000


@dataclass(frozen=True)
class Target:
    """What a module is compiled for."""

    mode: str  # "cuda" or "emulate"
    tag: str  # "sm_90a", "sm_80", ... or "emulate"
    nvcc_flags: tuple[str, ...] = ()
    cuda_home: str | None = None


# -- toolchain ------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def find_cuda_home(need_nvcc: bool = True) -> str | None:
    """A CUDA installation with headers (and nvcc when asked). torch's own guess is tried after the
    environment; when nvcc on PATH is a wrapper script its directory is not the toolkit's."""
    from torch.utils import cpp_extension

    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), cpp_extension.CUDA_HOME]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    candidates += ["/usr/local/cuda"]
    for home in candidates:
        if not home:
            continue
        root = Path(home)
        if not (root / "include" / "cuda_runtime.h").is_file():
            continue
        if need_nvcc and not (root / "bin" / "nvcc").is_file():
            continue
        return str(root)
    return None


@functools.lru_cache(maxsize=None)
def nvcc_version(cuda_home: str) -> str:
    try:
        out = subprocess.run(
            [str(Path(cuda_home) / "bin" / "nvcc"), "--version"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.strip().splitlines()[-1] if out.strip() else "unknown"


def arch_flags(major: int, minor: int) -> tuple[str, tuple[str, ...]]:
    """(tag, nvcc flags) for a device of compute capability major.minor. Hopper gets the
    arch-specific sm_90a; other devices their generic sm_XY."""
    if (major, minor) == (9, 0):
        return "sm_90a", ("-gencode=arch=compute_90a,code=sm_90a",)
    return f"sm_{major}{minor}", (f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}",)


def cutlass_include() -> Path | None:
    """CUTLASS's include directory: ``$CUTLASS_PATH/include``, else the headers the
    ``nvidia-cutlass`` wheel ships (``cutlass_library/source/include``; found without importing
    the package, whose Python dependencies the headers do not need)."""
    candidates = []
    if os.environ.get("CUTLASS_PATH"):
        candidates.append(Path(os.environ["CUTLASS_PATH"]) / "include")
    try:
        spec = importlib.util.find_spec("cutlass_library")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / "source" / "include" for p in spec.submodule_search_locations]
    return next((c for c in candidates if (c / "cutlass" / "cutlass.h").is_file()), None)


@functools.lru_cache(maxsize=None)
def cutlass_version(include: Path) -> str:
    text = (include / "cutlass" / "version.h").read_text(errors="replace")
    numbers = [re.search(rf"#define CUTLASS_{part} (\d+)", text) for part in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) if m else "?" for m in numbers)


def cuda_target(device: torch.device | int | None = None) -> Target:
    home = find_cuda_home(need_nvcc=True)
    if home is None:
        raise BuildError("no CUDA toolkit (nvcc and headers) found; set CUDA_HOME")
    major, minor = torch.cuda.get_device_capability(device)
    tag, flags = arch_flags(major, minor)
    return Target("cuda", tag, flags, home)


def emulate_target() -> Target:
    home = find_cuda_home(need_nvcc=False)
    if home is None:
        raise BuildError("the emulator needs CUDA's headers (cuda_bf16.h); set CUDA_HOME")
    return Target("emulate", "emulate", (), home)


# -- cache ----------------------------------------------------------------------------------------


def configured_cache_root() -> Path:
    """``$FXFUSE_CACHE_DIR`` or ``~/.cache/fxfuse``."""
    root = os.environ.get("FXFUSE_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "fxfuse"


_fallback_roots: dict[Path, Path] = {}


def cache_root() -> Path:
    """The configured cache directory, or, where it cannot be created or written, a private
    temporary directory for this process (warned about once)."""
    root = configured_cache_root()
    if root in _fallback_roots:
        return _fallback_roots[root]
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".probe-"):
            pass
        return root
    except OSError as error:
        fallback = Path(tempfile.mkdtemp(prefix="fxfuse-cache-"))
        _fallback_roots[root] = fallback
        warnings.warn(f"fxfuse: cannot write the build cache {root} ({error.strerror or error}); building into "
                      f"{fallback} for this process (set FXFUSE_CACHE_DIR to a writable directory)", RuntimeWarning)
        return fallback


def _sources(csrc: Path) -> list[Path]:
    return sorted(p for p in csrc.iterdir() if p.is_file() and p.suffix in SOURCE_SUFFIXES)


def csrc_digest(csrc: Path = CSRC) -> str:
    """Hash of every source file in csrc/ (names and contents)."""
    h = hashlib.sha256()
    for path in _sources(csrc):
        h.update(path.relative_to(csrc).as_posix().encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def generator_digest() -> str:
    """Hash of the Python that writes the generated sources (code generator, printers, the
    vocabulary): a change there must not reuse modules it generated before."""
    package = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for name in ("cuda/codegen.py", "cuda/gemm_codegen.py", "cuda/gradient.py", "cuda/printer.py",
                 "vocabulary.py", "expr.py", "ir.py"):
        h.update((package / name).read_bytes())
    return h.hexdigest()


def cache_key(kind: str, payload: str, target: Target, csrc: Path = CSRC) -> str:
    """The module's cache key: kind, payload (program and dtype), csrc/, the code generator (its
    version and sources), torch and CUDA versions, the target and the compiler flags."""
    cuda = nvcc_version(target.cuda_home) if target.mode == "cuda" and target.cuda_home else "-"
    parts = [
        kind,
        payload,
        csrc_digest(csrc),
        codegen.CODEGEN_VERSION,
        generator_digest(),
        torch.__version__,
        str(torch.version.cuda),
        cuda,
        target.mode,
        target.tag,
        " ".join(target.nvcc_flags),
        json.dumps(_compiler_flags(target), sort_keys=True),
        json.dumps(_compiler_flags(target, Path("<cutlass>")), sort_keys=True),  # GEMM modules'
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


# -- building -------------------------------------------------------------------------------------

_process_lock = threading.Lock()  # one build at a time in this process (the file lock spans processes)
_whole_lines = False  # build workers side by side print each progress line whole, at its end


def _compiler_flags(target: Target, cutlass: Path | None = None) -> dict:
    """nvcc's and the host compiler's flags: a GEMM module's (``cutlass``: under the correctness
    rule), or a row module's (eager's formulas)."""
    if cutlass is not None:
        # CUTLASS 3.x. The epilogue follows the correctness rule (float32, one rounding at the
        # store), not eager's bits: FMA contraction, a division and a square root of 2 ulp (no
        # IEEE slow path, whose branch per division splits the epilogue into blocks the compiler
        # cannot overlap; measured 1.8x slower on S04's chain), and the hardware's exponential
        # (FX_RULE_MATH, csrc/epilogue_ops.cuh)
        return dict(
            extra_cflags=["-O3", "-std=c++17"],
            extra_cuda_cflags=["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-DNDEBUG", "-lineinfo",
                               "-prec-div=false", "-prec-sqrt=false", "-DFX_RULE_MATH", f"-I{cutlass}",
                               *target.nvcc_flags],
            with_cuda=True,
        )
    if target.mode == "cuda":
        # Eager's formulas, every dtype: no FMA contraction, IEEE division and square root, libm's
        # exponential. A row module reads the GEMM output eager rounded and rounds where eager
        # does, so it may only agree with eager to the bit: one op computed otherwise (a faster
        # exponential, a norm's output left unrounded) lands a few ulps off eager's value, which
        # the ops after it carry past the correctness rule (S04 at 16 rows in bf16: 7-11 elements
        # a draw, BENCHMARKS.md section 35). Only the in-GEMM numerics, float32 from the
        # accumulator and rounded once, are free of eager's bits.
        return dict(
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "--fmad=false", "-lineinfo", *target.nvcc_flags],
            with_cuda=True,
        )
    # -O1: the emulator is for tests; it compiles 1.3-1.4x faster than -O2 and computes the same
    # (no fast-math, no contraction in ISO C++17), so a first test run waits less.
    include = Path(target.cuda_home or "") / "include"
    return dict(extra_cflags=["-O1", "-DFX_EMULATE", f"-I{include}"], with_cuda=False)


def _use_cuda_home(target: Target) -> None:
    """torch's cpp_extension reads its module-level CUDA_HOME; point it at the toolkit found."""
    from torch.utils import cpp_extension

    if target.mode == "cuda" and cpp_extension.CUDA_HOME != target.cuda_home:
        cpp_extension.CUDA_HOME = target.cuda_home


def _tail(text: str) -> str:
    return text if len(text) <= ERROR_TAIL_CHARS else "...\n" + text[-ERROR_TAIL_CHARS:]


def _cached_build(key: str, label: str, compile_into) -> tuple[Path, dict, object]:
    """The finished build directory of ``key`` (building it with ``compile_into(dir) -> (manifest,
    loaded)`` when absent), its manifest, and what compile_into loaded (None on a cache hit)."""
    root = cache_root()
    final = root / key
    manifest = _intact(final, label)
    if manifest is not None:
        return final, manifest, None
    with _process_lock, _locked(root / f"{key}.lock", label) as lock:
        manifest = _intact(final, label)
        if manifest is not None:
            return final, manifest, None
        work = root / f"{key}.partial"  # the key's lock makes it this builder's alone
        resumed = work.is_dir()
        if resumed and lock.took_from_the_dead and (stopped := stop_processes_in(work)):
            print(f"fxfuse: stopped {stopped} compile process(es) a killed build of {label} left running",
                  file=sys.stderr, flush=True)
        work.mkdir(parents=True, exist_ok=True)
        head = f"fxfuse: building {label}{' (resumed)' if resumed else ''} ..."
        if not _whole_lines:
            print(head, end="", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            manifest, loaded = compile_into(work)
        except BaseException as error:
            print(f"{head if _whole_lines else ''} failed", file=sys.stderr, flush=True)
            if isinstance(error, Exception):  # it would fail again; an interrupt keeps the finished units
                shutil.rmtree(work, ignore_errors=True)
            if isinstance(error, BuildError):
                raise
            if isinstance(error, Exception):
                raise BuildError(f"building {label} failed:\n{_tail(str(error))}") from error
            raise
        manifest = {**manifest, "label": label, "seconds": round(time.perf_counter() - start, 2)}
        if "library" in manifest and (work / manifest["library"]).is_file():
            manifest["sha256"] = _file_digest(work / manifest["library"])
        (work / "ok").write_text(json.dumps(manifest))
        if final.exists():  # an unfinished directory from an older layout: replace it
            shutil.rmtree(final, ignore_errors=True)
        os.replace(work, final)
        print(f"{head if _whole_lines else ''} done in {time.perf_counter() - start:.1f} s", file=sys.stderr,
              flush=True)
        return final, manifest, loaded


_ENTRY_NAME = re.compile(r"^[0-9a-f]{32}(\.lock|\.lock\.guard|\.partial|\.tmp-.*)?$")


@dataclass(frozen=True)
class CacheSummary:
    """What ``python -m fxfuse cache`` shows: where the cache is, its size and its entries."""

    root: Path
    bytes: int
    # the manifests' kind ("runtime", "program", "in-GEMM"; "older fxfuse": built by a version that
    # did not record it, never read again since keys changed), or "unfinished" -> count
    entries: dict[str, int]
    selections: int  # measured path choices kept (fxfuse.cuda.engine)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def cache_summary(root: Path | None = None) -> CacheSummary:
    root = configured_cache_root() if root is None else root
    entries: dict[str, int] = {}
    total = 0
    if root.is_dir():
        for path in root.iterdir():
            if not _ENTRY_NAME.match(path.name) and path.name != "selections":
                continue
            total += _size(path)
            if path.is_dir() and _ENTRY_NAME.match(path.name):
                try:
                    kind = json.loads((path / "ok").read_text()).get("kind", "older fxfuse")
                except (OSError, ValueError, AttributeError):
                    kind = "unfinished"
                entries[kind] = entries.get(kind, 0) + 1
    selections = len(list((root / "selections").glob("*.json"))) if (root / "selections").is_dir() else 0
    return CacheSummary(root, total, entries, selections)


def clear_cache(root: Path | None = None) -> int:
    """Remove fxfuse's entries (builds, locks, selections) from the cache directory, nothing else
    that may share it; the bytes freed."""
    root = configured_cache_root() if root is None else root
    freed = 0
    if root.is_dir():
        for path in root.iterdir():
            if _ENTRY_NAME.match(path.name) or path.name == "selections":
                freed += _size(path)
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    return freed


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(final: Path, label: str) -> dict | None:
    """The manifest of a finished entry whose library matches its checksum; None where there is
    no finished entry, or (warned about, then removed) one that is corrupt."""
    marker = final / "ok"
    if not marker.is_file():
        return None
    try:
        manifest = json.loads(marker.read_text())
        library = final / manifest["library"] if "library" in manifest else None
        if library is not None and not library.is_file():
            raise ValueError(f"{library.name} is missing")
        if library is not None and "sha256" in manifest and _file_digest(library) != manifest["sha256"]:
            raise ValueError(f"{library.name} differs from its checksum")
    except (OSError, ValueError, KeyError, TypeError) as error:
        _evict(final, label, str(error))
        return None
    return manifest


def _evict(final: Path, label: str, why: str) -> None:
    """Remove a corrupt cache entry (the next build of its key compiles it again)."""
    warnings.warn(f"fxfuse: the cached build of {label} is corrupt ({why}); rebuilding it", RuntimeWarning)
    marker = final / "ok"
    try:  # the marker first, so that no process takes the rest for a finished entry
        marker.unlink(missing_ok=True)
    except OSError:
        pass
    shutil.rmtree(final, ignore_errors=True)


@contextlib.contextmanager
def _locked(path: Path, label: str):
    try:
        lock = FileLock(path)
        lock.acquire()
    except LockTimeout as error:
        raise BuildError(f"building {label}: {error}") from error
    try:
        yield lock
    finally:
        lock.release()


def _load_extension(name: str, sources: list[Path], directory: Path, target: Target, python_module: bool,
                    cutlass: Path | None = None):
    from torch.utils import cpp_extension

    _use_cuda_home(target)
    include = directory / "include"
    # cpp_extension's own lock file in the directory: one a killed build left would make load wait
    # for it forever (the directory is this process's alone while it holds the key's lock)
    (directory / "lock").unlink(missing_ok=True)
    return cpp_extension.load(
        name=name,
        sources=[str(s) for s in sources],
        extra_include_paths=[str(include)],
        build_directory=str(directory),
        verbose=False,
        is_python_module=python_module,
        **_compiler_flags(target, cutlass),
    )


def _copy_headers(directory: Path, csrc: Path) -> None:
    """The build compiles a snapshot of csrc/, the one its key was computed from."""
    include = directory / "include"
    include.mkdir(parents=True, exist_ok=True)
    for path in _sources(csrc):
        shutil.copy2(path, include / path.name)


def _write_if_changed(path: Path, content: str) -> None:
    """A resumed build's sources keep their times where they are unchanged, so that ninja keeps
    the units compiled from them."""
    if not path.is_file() or path.read_text() != content:
        path.write_text(content)


def _drop_intermediates(directory: Path, csrc: Path) -> None:
    """What loading a finished build does not need: its object files and its snapshot of csrc/
    (the cache key names that csrc/). The generated sources stay, to read. An emulator module's
    entry shrinks from about 930 to 200 KB."""
    for path in directory.glob("*.o"):
        path.unlink(missing_ok=True)
    for path in _sources(csrc):
        (directory / "include" / path.name).unlink(missing_ok=True)


def short_label(program_text: str, dtype: torch.dtype | None = None, width: int = 72) -> str:
    text = program_text if len(program_text) <= width else program_text[: width - 3] + "..."
    return f"{text} [{str(dtype).replace('torch.', '')}]" if dtype is not None else text


@dataclass
class ProgramModule:
    """A loaded program module: its library handle (kept alive), its FxProgramInfo address and its
    cache key (a selection without a GEMM module is keyed on it)."""

    library: ctypes.CDLL
    info: int
    path: Path
    key: str


def _build_generated(key: str, kind: str, label: str, name: str, entry: str, sources: dict[str, str],
                     target: Target, csrc: Path, cutlass: Path | None = None,
                     manifest: dict | None = None) -> tuple[ctypes.CDLL, int, Path]:
    """Compile generated ``sources`` (headers beside csrc/'s, units compiled) into the cache entry
    ``key`` (or find it there; its manifest names the ``kind`` of module, with ``manifest``'s
    entries), load the library and call ``entry``: (library, the info address it returns, the
    library's path), its ABI checked."""

    def compile_into(directory: Path):
        _copy_headers(directory, csrc)
        for file, content in sources.items():
            _write_if_changed(directory / "include" / file if file.endswith(".cuh") else directory / file, content)
        units = [directory / file for file in sources if not file.endswith(".cuh")]
        path = _load_extension(name, units, directory, target, python_module=False, cutlass=cutlass)
        _drop_intermediates(directory, csrc)
        if cutlass is not None:
            probe_size_queries(Path(path), entry, _linked_library_dirs(target))
        return {**(manifest or {}), "library": Path(path).name, "entry": entry, "kind": kind}, None

    for attempt in range(2):  # a cached entry that does not load is built again, once
        directory, held, _ = _cached_build(key, label, compile_into)
        path = directory / held["library"]
        try:
            library = ctypes.CDLL(str(path))
            function = getattr(library, held["entry"])
            function.restype = ctypes.c_void_p
            info = function()
            abi = ctypes.c_int32.from_address(info).value
            if abi != FX_ABI_VERSION:
                raise ValueError(f"ABI {abi}, expected {FX_ABI_VERSION}")
        except (OSError, AttributeError, ValueError) as error:
            if attempt == 0:
                _evict(directory, label, f"cannot load {path.name}: {error}")
                continue
            raise BuildError(f"cannot load {path}: {error}") from error
        return library, info, path
    raise AssertionError("unreachable")


def _linked_library_dirs(target: Target) -> list[str]:
    """The directories cpp_extension links a module against (torch's libraries, the CUDA
    toolkit's): a process that has not imported torch finds libc10.so and the rest only there."""
    from torch.utils import cpp_extension

    _use_cuda_home(target)  # library_paths reads the toolkit's directory from it
    return cpp_extension.library_paths("cuda" if target.mode == "cuda" else "cpu")


def probe_size_queries(library: Path, entry: str, library_dirs: Sequence[str] = ()) -> None:
    """Run a new GEMM module's size queries (supports and workspace, host code CUTLASS checks
    arguments with; gemm_info.query_sizes) in a child process, before any process of the user's
    loads the module: BuildError where they crash (undefined behaviour in host code turns into a
    trap or a segfault), so that such a module falls back like a failed build instead of taking
    the user's process down. The child does not import torch, so the dynamic loader looks for the
    libraries the module links (``library_dirs``) through LD_LIBRARY_PATH."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*library_dirs, *filter(None, [env.get("LD_LIBRARY_PATH")])])
    result = subprocess.run([sys.executable, "-I", gemm_info.__file__, str(library), entry], capture_output=True,
                            text=True, timeout=300, env=env)
    if result.returncode != 0:
        how = f"signal {-result.returncode}" if result.returncode < 0 else f"exit {result.returncode}"
        raise BuildError(f"the size queries of {library.name} failed on the host ({how}):\n{_tail(result.stderr)}")


def program_key(program: Program, dtype: torch.dtype, target: Target, csrc: Path = CSRC) -> str:
    """The cache key of ``program``'s module for ``dtype``."""
    return cache_key("program", f"{program.to_string()}\n{dtype}", target, csrc)


def build_program(program: Program, dtype: torch.dtype, target: Target, csrc: Path = CSRC) -> ProgramModule:
    """Generate, compile (or find in the cache) and load ``program`` for ``dtype``."""
    text = program.to_string()
    key = program_key(program, dtype, target, csrc)
    short = key[:20]
    entry = f"fx_program_info_{short}"
    ext = ".cu" if target.mode == "cuda" else ".cpp"
    try:
        sources = codegen.generate(program, dtype, f"fxm_{short}", entry, ext, one_unit=target.mode == "emulate")
    except codegen.UnsupportedProgram as error:
        raise BuildError(f"unsupported program {text!r} ({dtype}): {error}") from error

    library, info, path = _build_generated(key, "program", short_label(text, dtype), f"fxp_{short}", entry, sources,
                                           target, csrc)
    return ProgramModule(library, info, path, key)


@dataclass
class GemmModule:
    """A loaded GEMM module: its library handle (kept alive), its FxGemmInfo address, its cache
    key (selections are keyed on it) and the kernels of its menu (gemm_codegen.Kernel)."""

    library: ctypes.CDLL
    info: int
    path: Path
    key: str
    kernels: tuple = ()

    @property
    def _view(self) -> GemmInfoView:
        return GemmInfoView.from_address(self.info)

    @property
    def config_names(self) -> tuple[str, ...]:
        view = self._view
        return tuple(view.config_names[i].decode() for i in range(view.num_configs))

    def kernel_of(self, config: int):
        """The kernel (gemm_codegen.Kernel) of configuration ``config``: csrc/gemm_epilogue.cuh
        numbers them kernel * kNumSchedules + schedule, again for a gated module's second tree."""
        from .gemm_codegen import SCHEDULES

        return self.kernels[config // SCHEDULES % len(self.kernels)]

    def supports(self, m: int, n: int, k: int, config: int) -> bool:
        """Whether configuration ``config`` computes an (m, n, k) problem."""
        return bool(self._view.supports(m, n, k, config))


def gemm_target_reason(target: Target) -> str | None:
    """Why GEMM modules cannot be built for ``target`` (None: they can)."""
    if target.mode != "cuda" or target.tag != "sm_90a":
        return f"the in-GEMM kernels are built for Hopper (sm_90a), not {target.tag}"
    if cutlass_include() is None:
        return 'no CUTLASS headers (pip install "fxfuse[cutlass]", or set CUTLASS_PATH)'
    return None


def gemm_program(program: Program, dtype: torch.dtype) -> Program:
    """The program a GEMM module is generated and keyed from: canonical (rounding points dropped)
    where the generator takes it, so that modules are shared across rounding points."""
    from . import gemm_codegen

    return gemm_codegen.canonical(program) if gemm_codegen.build_reason(program, dtype) is None else program


def _gemm_payload(program: Program, dtype: torch.dtype, param_dtypes: tuple[torch.dtype, ...]) -> str:
    params = " ".join(str(d).removeprefix("torch.") for d in param_dtypes)
    return f"{program.to_string()}\n{dtype}\n{params}\ncutlass {cutlass_version(cutlass_include())}"


def gemm_key(program: Program, dtype: torch.dtype, param_dtypes: tuple[torch.dtype, ...], target: Target,
             csrc: Path = CSRC, kernels: tuple | None = None) -> str:
    """The cache key of the GEMM module of ``program`` (as gemm_program gives it). Needs the
    CUTLASS headers (their version is in it)."""
    from . import gemm_codegen

    menu = " ".join(kernel.cpp for kernel in tuple(kernels or gemm_codegen.menu(program)))
    return cache_key("gemm", f"{_gemm_payload(program, dtype, param_dtypes)}\n{menu}", target, csrc)


def gemm_family(program: Program, dtype: torch.dtype, param_dtypes: tuple[torch.dtype, ...], target: Target,
                csrc: Path = CSRC) -> str:
    """The key the GEMM modules of one program share whatever their kernels (``covering_kernels``)."""
    return cache_key("gemm family", _gemm_payload(program, dtype, param_dtypes), target, csrc)


def covering_kernels(family: str, kernels: tuple) -> tuple | None:
    """The kernels of the smallest finished GEMM module of ``family`` in the cache that holds every
    one of ``kernels`` (as that module orders them: its key), or None. A module grown for several
    kinds of call (prefill and decode) or built ahead for many (a prebuild) so serves a process
    whose calls need fewer of its kernels, where building the exact menu would take minutes."""
    wanted = set(kernels)
    held = [menu for menu in _finished_menus(cache_root(), family) if wanted <= set(menu)]
    return min(held, key=len) if held else None


_menus_read: dict[Path, dict[str, tuple[str, tuple] | None]] = {}  # root -> entry -> (family, kernels)


def _finished_menus(root: Path, family: str) -> list[tuple]:
    """The kernel tuples of the finished GEMM modules of ``family`` in ``root``, from their
    manifests, each read once a process (a manifest never changes; entries come and go)."""
    from .gemm_codegen import Kernel

    try:
        names = [name for name in os.listdir(root) if _ENTRY_NAME.fullmatch(name) and "." not in name]
    except OSError:
        return []
    read = _menus_read.setdefault(root, {})
    menus = []
    for name in names:
        if name not in read:
            try:
                manifest = json.loads((root / name / "ok").read_text())
            except (OSError, ValueError):
                continue  # unfinished: read again next time
            try:
                read[name] = (manifest["family"], tuple(Kernel(**k) for k in manifest["kernels"]))
            except (KeyError, TypeError):
                read[name] = None  # not a GEMM module, or of an older layout
        if read[name] is not None and read[name][0] == family and (root / name / "ok").is_file():
            menus.append(read[name][1])
    return menus


def _gemm_entry(program: Program, dtype: torch.dtype, param_dtypes: tuple[torch.dtype, ...], target: Target,
                csrc: Path, kernels: tuple) -> tuple[tuple, str, str]:
    """(kernels, key, family) of the module a build of ``kernels`` for ``program`` (as gemm_program
    gives it) takes: its own where finished, else a finished one holding them all
    (covering_kernels), else its own, to build."""
    key = gemm_key(program, dtype, param_dtypes, target, csrc, kernels)
    family = gemm_family(program, dtype, param_dtypes, target, csrc)
    if not (cache_root() / key / "ok").is_file():
        held = covering_kernels(family, kernels)
        if held is not None:
            return held, gemm_key(program, dtype, param_dtypes, target, csrc, held), family
    return kernels, key, family


def build_gemm(program: Program, dtype: torch.dtype, param_dtypes: tuple[torch.dtype, ...], target: Target,
               csrc: Path = CSRC, kernels: tuple | None = None) -> GemmModule:
    """Generate, compile (or find in the cache) and load the GEMM module of ``program`` for
    ``dtype`` inputs and parameters of ``param_dtypes``, with the kernels of ``kernels``
    (gemm_codegen.Kernel; the program's menu unless given)."""
    from . import gemm_codegen

    reason = gemm_target_reason(target)
    if reason is not None:
        raise BuildError(reason)
    include = cutlass_include()
    program = gemm_program(program, dtype)
    text = program.to_string()
    kernels, key, family = _gemm_entry(program, dtype, param_dtypes, target, csrc,
                                       tuple(kernels or gemm_codegen.menu(program)))
    short = key[:20]
    entry = f"fx_gemm_info_{short}"
    try:
        sources = gemm_codegen.generate(program, dtype, param_dtypes, f"fxg_{short}", entry, kernels,
                                        files=build_jobs())
    except codegen.UnsupportedProgram as error:
        raise BuildError(f"no in-GEMM kernel for {text!r} ({dtype}): {error}") from error

    library, info, path = _build_generated(key, "in-GEMM", "in-GEMM " + short_label(text, dtype), f"fxg_{short}",
                                           entry, sources, target, csrc, cutlass=include,
                                           manifest={"family": family, "kernels": [asdict(k) for k in kernels]})
    return GemmModule(library, info, path, key, kernels)


def runtime_key(target: Target, csrc: Path = CSRC) -> str:
    """The cache key of the runtime module for ``target``."""
    return cache_key("runtime", RUNTIME_SOURCE, target, csrc)


def build_runtime(target: Target, csrc: Path = CSRC) -> ModuleType:
    """Compile (or find in the cache) and import the runtime module for ``target``."""
    key = runtime_key(target, csrc)
    name = f"fxfuse_runtime_{key[:20]}"

    def compile_into(directory: Path):
        _copy_headers(directory, csrc)
        source = directory / RUNTIME_SOURCE
        shutil.copy2(csrc / RUNTIME_SOURCE, source)
        module = _load_extension(name, [source], directory, target, python_module=True)
        _drop_intermediates(directory, csrc)
        return {"library": Path(module.__file__).name, "module": module.__name__, "kind": "runtime"}, module

    label = f"runtime ({target.tag})"
    directory, manifest, module = _cached_build(key, label, compile_into)
    if module is not None:
        return module
    try:
        return _import(manifest["module"], directory / manifest["library"])
    except BuildError as error:  # a cached runtime that does not import: build it again, once
        _evict(directory, label, str(error).splitlines()[0])
    directory, manifest, module = _cached_build(key, label, compile_into)
    return module if module is not None else _import(manifest["module"], directory / manifest["library"])


def _import(name: str, path: Path) -> ModuleType:
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - a broken cache entry or ABI mismatch
        raise BuildError(f"cannot import {path}: {error}") from error
    return module


@contextlib.contextmanager
def cache_dir(path: str | os.PathLike):
    """Temporarily use ``path`` as the cache (tests)."""
    old = os.environ.get("FXFUSE_CACHE_DIR")
    os.environ["FXFUSE_CACHE_DIR"] = str(path)
    try:
        yield Path(path)
    finally:
        if old is None:
            os.environ.pop("FXFUSE_CACHE_DIR", None)
        else:
            os.environ["FXFUSE_CACHE_DIR"] = old


def build_jobs() -> int:
    """The compiles a build runs at once: MAX_JOBS (which prepare_many's workers set for each
    build, and cpp_extension hands ninja), else compile_slots()."""
    try:
        return max(1, int(os.environ["MAX_JOBS"]))
    except (KeyError, ValueError):
        return compile_slots()


# nvcc's peak on a file of four CUTLASS kernels (gemm_codegen.grouped_units: 5.3 GB; 8.3 GB for seven,
# which no file holds)
COMPILE_BYTES = 6 << 30


def compile_slots() -> int:
    """The compiles that may run at once: a core each, no more than memory holds at a CUTLASS
    file's peak (a 16-core host of 64 GB, or any host running as many compiles as cores, would
    otherwise swap or lose compiles to the out-of-memory killer)."""
    return max(1, min(usable_cpus(), usable_memory() // COMPILE_BYTES))


def usable_memory() -> int:
    """The bytes of memory this process's builds may use: the host's, or its cgroup's limit where
    lower (a container's)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return 1 << 62  # unknown: the cores decide
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            total = min(total, int(Path(limit).read_text().split()[0]))
        except (OSError, ValueError, IndexError):  # absent, or "max"
            continue
    return total


def usable_cpus() -> int:
    """The cores this process may run on: its CPU affinity (taskset, a cgroup's cpuset, a batch
    scheduler's allocation), not the host's count, which oversubscribes a share of a large host."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 2


def is_built(program_text: str, dtype: torch.dtype, target: Target,
             param_dtypes: tuple[torch.dtype, ...] | None = None, kernels: tuple | None = None) -> bool:
    """Whether build_in_subprocess's module of these arguments has a finished cache entry, or for
    a GEMM module one holding its kernels (its integrity is checked when it loads): a warm
    compile then starts no build worker, each of which imports torch afresh."""
    if program_text == RUNTIME_SOURCE:
        key = runtime_key(target)
    elif param_dtypes is None:
        key = program_key(Program.parse(program_text), dtype, target)
    elif gemm_target_reason(target) is not None:
        return False  # the worker reports why
    else:
        from . import gemm_codegen

        program = gemm_program(Program.parse(program_text), dtype)
        _, key, _ = _gemm_entry(program, dtype, param_dtypes, target, CSRC, tuple(kernels or gemm_codegen.menu(program)))
    return (cache_root() / key / "ok").is_file()


def build_plan(param_dtypes: list, slots: int, gemm_units: int, workers: int | None = None) -> tuple[int, list[int]]:
    """prepare_many's worker processes (``workers`` where asked), and how many units each of its
    builds compiles at once (its jobs' ``param_dtypes``: None for the runtime and program modules,
    a tuple for a GEMM module of up to ``gemm_units`` units), on ``slots`` compiles at once
    (build.compile_slots). A GEMM module is the long pole of a cold compile (a CUTLASS unit takes
    a minute): where they are fewer than the slots they share them, up to a unit each at once (four
    on 16 cores compiled their units two at a time, in two rounds of a minute, while the program
    modules' short units were long done), and the other modules keep a worker's share. Where they
    are as many as the slots or more (a prebuild of the tests' and the suite's), each takes a
    worker and one compile: its kernels of a kind then share a file (gemm_codegen.grouped_units),
    and CUTLASS's headers are parsed once a kind, not once a unit. On few slots a worker a slot
    keeps them busy through each build's serial steps (ninja and cpp_extension start-up, the
    link)."""
    gemms = sum(params is not None for params in param_dtypes)
    if workers is None:
        workers = slots if slots < 4 or gemms >= slots else slots // 2
    workers = max(1, min(workers, len(param_dtypes)))
    share = max(1, slots // workers)
    gemm_share = max(share, min(gemm_units, slots // max(1, gemms)))
    return workers, [share if params is None else gemm_share for params in param_dtypes]


@dataclass(frozen=True)
class BuildJob:
    """One module for build_many: the runtime (``program`` RUNTIME_SOURCE), a program module, or
    with ``param_dtypes`` a GEMM module of ``kernels`` (None: the program's menu)."""

    program: str
    dtype: torch.dtype
    param_dtypes: tuple[torch.dtype, ...] | None = None
    kernels: tuple | None = None

    def units(self) -> int:
        """Its compile units: a GEMM module's kernels (its main unit aside), a program's one."""
        from . import gemm_codegen

        if self.param_dtypes is None:
            return 1
        return len(self.kernels or gemm_codegen.menu(Program.parse(self.program)))


def build_many(jobs, target: Target, workers: int | None = None, on_built: Callable | None = None) -> dict:
    """Build the modules of ``jobs`` (BuildJob) that are not in the cache, in parallel worker
    processes (``workers``, else build_plan's), the GEMM modules first, most units first (the long
    poles; the short program units fill the workers around them); {job: the error text, or None}.
    ``on_built(job, error, done, total)`` hears of each build as it ends."""
    jobs = list(dict.fromkeys(jobs))
    errors = dict.fromkeys(jobs)
    # only the modules not in the cache go to the workers (each worker imports torch afresh:
    # seconds of a warm compile, for nothing)
    todo = sorted((job for job in jobs if not is_built(job.program, job.dtype, target, job.param_dtypes,
                                                           job.kernels)),
                  key=lambda job: -job.units() if job.param_dtypes is not None else 0)
    if not todo:
        return errors
    gemm_units = max(job.units() for job in todo) + 1
    workers, compiles = build_plan([job.param_dtypes for job in todo], compile_slots(), gemm_units, workers)
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        running = {pool.submit(build_in_subprocess, job.program, job.dtype, target, jobs_at_once, job.param_dtypes,
                               job.kernels): job for job, jobs_at_once in zip(todo, compiles)}
        for done, future in enumerate(concurrent.futures.as_completed(running), 1):
            job = running[future]
            errors[job] = future.result()
            if on_built is not None:
                on_built(job, errors[job], done, len(todo))
    return errors


def build_in_subprocess(program_text: str, dtype: torch.dtype, target: Target, max_jobs: int,
                        param_dtypes: tuple[torch.dtype, ...] | None = None,
                        kernels: tuple | None = None) -> str | None:
    """Build one module into the shared cache (run in a worker process): the runtime, a program
    module, or with ``param_dtypes`` a GEMM module (of the menu ``kernels``, or the production
    one); the error text or None."""
    global _whole_lines
    os.environ["MAX_JOBS"] = str(max_jobs)
    _whole_lines = True
    try:
        if program_text == RUNTIME_SOURCE:
            build_runtime(target)
        elif param_dtypes is not None:
            build_gemm(Program.parse(program_text), dtype, param_dtypes, target, kernels=kernels)
        else:
            build_program(Program.parse(program_text), dtype, target)
    except BuildError as error:
        return str(error)
    return None
