"""Make MLX use an optimized BLAS on Linux: import ``cpu`` before ``mlx.core``.

The Linux ``mlx[cpu]`` wheel links the netlib reference BLAS it bundles
(``mlx_cpu.libs/libblas-*.so``): a 1024x1024 float32 matmul runs at a few
GFLOP/s. MLX calls ``cblas_sgemm`` by name, and the dynamic linker resolves
that name in the process's global scope before it looks at the libraries MLX
brought along. So an optimized library that exports ``cblas_sgemm`` and is
loaded with ``RTLD_GLOBAL`` *before* ``mlx.core`` is imported is the one MLX
calls. Importing the ``cpu`` package does that (see :func:`load`)::

    import cpu  # noqa: F401  (first: it must run before anything imports mlx)
    import mlx.core as mx

Where the library comes from, first found wins:

1. OpenBLAS 0.3.33, threaded, from the ``ngsolve-openblas`` wheel. It exports
   unprefixed ``cblas_*`` names but needs ``libgfortran.so.5``, which a fresh
   machine lacks. The ``scs`` wheel carries a Fortran runtime
   (``scs.libs/libgfortran-*.so.5*``, renamed by auditwheel, so it does not
   match that name). The OpenBLAS looks for its libraries in its own
   directory (``RPATH $ORIGIN``), so it is loaded through symbolic links in a
   private temporary directory, ``libgfortran.so.5`` beside it, which is
   removed once loaded (nothing is written elsewhere; nothing is compiled).
2. The OpenBLAS 0.3.15 inside the ``scs`` wheel (single-threaded), with its
   own Fortran runtime. (``scs``, a convex solver, is never imported.)
3. A system OpenBLAS, ``libopenblas.so.0`` (Debian: ``apt install libopenblas0``).

Wheels are found through their installed files (``importlib.metadata``),
wherever the environment is; both are in requirements.txt on Linux x86_64.
(``scipy-openblas32`` and numpy's copy prefix their names,
``scipy_cblas_sgemm``, which MLX never calls.) The threaded OpenBLAS reads
``OPENBLAS_NUM_THREADS`` (else ``OMP_NUM_THREADS``, else it takes every core)
when it is loaded, so set it before importing this module.

Idle threads. After a product, OpenBLAS's threads spin for
``2^OPENBLAS_THREAD_TIMEOUT`` CPU cycles before they sleep: 2^28 (about
0.1 s) unless that is set. A decoder pass is a chain of short products
between MLX's own operations, so they would spin through all of it, on
cores that MLX's threads need. OpenBLAS is loaded with a timeout of
``THREAD_TIMEOUT`` (unless ``OPENBLAS_THREAD_TIMEOUT`` is set), only
while it loads: the environment is left as it was, for other processes.

If neither is found, one line on stderr says how to get one, and MLX runs on
its reference BLAS. Nothing happens on macOS, where MLX uses Accelerate.

Few-row products. MLX computes every float32 product with ``cblas_sgemm``,
one-row ones too (a decoder step over one token), and a batched product one
matrix at a time; OpenBLAS is slow on both: its call costs more than a tiny
product, it copies the whole weight into its packed layout before it
multiplies, and row counts that are not a multiple of 8 cost as much as the
next multiple of 8 or more. ``few_rows.c`` defines a ``cblas_sgemm`` that
computes tiny products itself, streams products over up to 128 rows through
each weight once, where it lies, on OpenBLAS's threads (with AVX-512; else
one ``cblas_sgemv`` per row, up to 2), pads other few-row products to a
multiple of 8 rows, and passes everything else to OpenBLAS.
With a C compiler (``$CC``, else ``cc``), it is compiled for this CPU
(0.8-0.9 s on a Zen 4) into ``$XDG_CACHE_HOME/t5-spec`` (else
``~/.cache/t5-spec``), under a name made of a hash of the source, the
compiler, its version and the CPU, so that later processes load it without
compiling again, as MLX keeps the kernels it compiles; where that directory
cannot be written, into a private temporary directory that goes once the
library is loaded. It is loaded with ``RTLD_GLOBAL`` just before the
OpenBLAS, so that MLX's ``cblas_sgemm`` binds to it. Without a compiler,
MLX calls OpenBLAS directly. (MLX itself
compiles its fused CPU kernels with the system's C++ compiler.) Set
``T5_SPEC_NO_FEW_ROWS=1`` to skip it, or ``T5_SPEC_FEW_ROWS_NO_AVX512=1`` to
compile it without AVX-512, as for a CPU that lacks it (a Zen 3), so that a
machine with AVX-512 can check both builds.

Set ``T5_SPEC_NO_BLAS=1`` to skip all this and keep MLX's bundled reference
BLAS (to compare, or to rule the optimized library out).

If ``mlx.core`` is already imported, this comes too late: Python loads
extension modules with ``RTLD_NOW``, so MLX's ``cblas_sgemm`` was bound when it
was imported. Then :func:`load` loads nothing and says so on stderr.

:func:`loaded_library` gives the path of the library loaded, for reports and
tests, :func:`num_threads` its thread count, :func:`few_rows_counts` how many
products took each path of ``few_rows.c``; :func:`status` describes the
outcome in one line.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DISABLE_ENV = "T5_SPEC_NO_BLAS"
FEW_ROWS_DISABLE_ENV = "T5_SPEC_NO_FEW_ROWS"
FEW_ROWS_SOURCE = Path(__file__).with_name("few_rows.c")
FEW_ROWS_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared")
FEW_ROWS_NO_AVX512_ENV = "T5_SPEC_FEW_ROWS_NO_AVX512"
FEW_ROWS_LIBRARY = "libfew_rows.so"
# The paths of few_rows.c, in the order of its counters.
FEW_ROWS_PATHS = ("tiny", "streamed", "padded", "passed on")
THREADED_PACKAGE = "ngsolve-openblas"
# Carries the Fortran runtime the threaded OpenBLAS needs, and an OpenBLAS of its own.
PACKAGE = "scs"
INSTALL_HINT = 'pip install "ngsolve-openblas==0.3.33.post1" "scs==3.3.1"'
# The name the threaded OpenBLAS asks the dynamic linker for (DT_NEEDED).
FORTRAN_RUNTIME = "libgfortran.so.5"
SYSTEM_NAMES = ("libopenblas.so.0", "libopenblas.so")
# Runtime libraries auditwheel vendors beside the OpenBLAS, in dependency order.
VENDORED_RUNTIMES = ("libquadmath", "libgfortran")
THREAD_TIMEOUT_ENV = "OPENBLAS_THREAD_TIMEOUT"
# log2 of the CPU cycles OpenBLAS's idle threads spin before they sleep: its
# least, so that they leave the cores to MLX between products; whole calls
# take less time than with OpenBLAS's 28, and no more than with 10 or 14
# (docs/benchmark-log.md, 2026-11-26).
THREAD_TIMEOUT = "4"

_loaded: str | None = None
_status = "not attempted"
_attempted = False
_few_rows: ctypes.CDLL | None = None
_openblas: ctypes.CDLL | None = None  # the library few_rows.c passes products on to
_few_rows_status = ""
_thread_timeout: str | None = None  # OPENBLAS_THREAD_TIMEOUT when OpenBLAS loaded
_started_threads: int | None = None  # OpenBLAS's threads before use_threads changed them


def loaded_library() -> str | None:
    """The path of the optimized CBLAS :func:`load` put in the global scope, or None."""
    return _loaded


def num_threads() -> int | None:
    """How many threads the loaded OpenBLAS computes with, or None if none was loaded."""
    if _loaded is None:
        return None
    return ctypes.CDLL(_loaded).openblas_get_num_threads()


# The variables the threaded OpenBLAS reads its thread count from, first found wins.
THREAD_SETTINGS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")


def use_threads(count: int) -> None:
    """Compute with ``count`` threads from now on (OpenBLAS and few_rows.c),
    at most as many as OpenBLAS started with; nothing if the user chose a
    count (``THREAD_SETTINGS``) or no threaded OpenBLAS is loaded."""
    global _started_threads
    if _loaded is None or any(os.environ.get(name) for name in THREAD_SETTINGS):
        return
    library = ctypes.CDLL(_loaded)
    if not hasattr(library, "openblas_set_num_threads"):
        return
    _started_threads = _started_threads or num_threads()
    count = max(1, min(count, _started_threads))
    library.openblas_set_num_threads(count)
    if _few_rows is not None:
        pool = getattr(_openblas, "gotoblas_pthread", None)
        threads = count if pool is not None else 1
        _few_rows.few_rows_use(_openblas.cblas_sgemm, _openblas.cblas_sgemv, pool, threads)


def status() -> str:
    """One line: which BLAS MLX uses, and why."""
    return _status + _few_rows_status


def few_rows_own_kernels() -> bool | None:
    """Whether ``few_rows.c`` computes few-row products with its own kernels
    (built with AVX-512, on OpenBLAS's threads), or None if it is not in use."""
    return None if _few_rows is None else bool(_few_rows.few_rows_own_kernels())


def few_rows_counts() -> dict[str, int] | None:
    """How many products took each path of ``few_rows.c`` so far, or None
    if it is not in use."""
    if _few_rows is None:
        return None
    counts = (ctypes.c_long * len(FEW_ROWS_PATHS)).in_dll(_few_rows, "few_rows_counts")
    return dict(zip(FEW_ROWS_PATHS, counts))


def _say(message: str) -> None:
    print(f"note: {message}", file=sys.stderr)


def _package_libraries(package: str, prefix: str = "libopenblas") -> list[Path]:
    """Shared libraries named ``prefix*.so*`` in the wheel of ``package``, if it is installed."""
    import importlib.metadata  # here: importing it takes tens of ms, needed on Linux only

    try:
        files = importlib.metadata.files(package) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return sorted(
        Path(str(file.locate()))
        for file in files
        if file.name.startswith(prefix) and ".so" in file.name
    )


def _exports_cblas(name: str) -> bool:
    """Whether ``name`` loads and defines ``cblas_sgemm``, loaded locally (no global effect)."""
    try:
        return hasattr(ctypes.CDLL(name), "cblas_sgemm")
    except OSError:
        return False


def _load_global(name: str) -> bool:
    """Put ``name`` (a path or a soname) in the global scope if it provides ``cblas_sgemm``.

    It is checked first with a local load, so that a library without the
    unprefixed name never enters the global scope; loading it again with
    ``RTLD_GLOBAL`` promotes the same copy.
    """
    if not _exports_cblas(name):
        return False
    _load_few_rows(ctypes.CDLL(name))  # first: the global scope's first cblas_sgemm wins
    ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    return True


def _load_few_rows(openblas: ctypes.CDLL) -> None:
    """Compile ``few_rows.c``, load it with ``RTLD_GLOBAL`` and hand it
    ``openblas``'s functions; on failure, say why in the status and leave
    MLX to call OpenBLAS directly."""
    global _few_rows, _few_rows_status, _openblas
    if os.environ.get(FEW_ROWS_DISABLE_ENV, "") not in ("", "0"):
        _few_rows_status = (
            f"; {FEW_ROWS_DISABLE_ENV} is set: few-row products as OpenBLAS does them"
        )
        return
    compiler = os.environ.get("CC") or shutil.which("cc")
    if not compiler:
        _few_rows_status = (
            "; no C compiler (cc) for few_rows.c: few-row products as OpenBLAS does them"
        )
        return
    try:
        few_rows = _load_compiled(compiler)
    except (OSError, subprocess.SubprocessError) as error:
        # The compiler's first line of complaint, else the error itself.
        detail = (getattr(error, "stderr", None) or b"").decode(errors="replace").strip()
        reason = detail.splitlines()[0] if detail else str(error)
        _few_rows_status = (
            f"; few_rows.c not used ({reason}): few-row products as OpenBLAS does them"
        )
        return
    # Without OpenBLAS's thread pool (a single-threaded build), streamed products use one thread.
    pool = getattr(openblas, "gotoblas_pthread", None)
    threads = openblas.openblas_get_num_threads() if pool is not None else 1
    few_rows.few_rows_use(openblas.cblas_sgemm, openblas.cblas_sgemv, pool, threads)
    _few_rows, _openblas = few_rows, openblas
    _few_rows_status = "; few-row products by few_rows.c"


def cache_directory() -> Path | None:
    """Where what is compiled or timed once per machine is kept between
    processes; None without a home."""
    try:
        root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    except RuntimeError:  # no home directory to be found
        return None
    return Path(root) / "t5-spec"


@functools.cache  # fixed once blas has loaded: one hash per process, not per weight shape
def machine_key() -> str:
    """A hash of what decides how fast a product runs here, its thread
    count aside (which ``use_threads`` may change): the CPU, the BLAS MLX
    calls, its kernels (``OPENBLAS_CORETYPE``) and idle threads' timeout,
    few_rows.c's build and MLX's version. It names timings kept in the
    cache (``cpu.forms.store_for_cpu``)."""
    import importlib.metadata

    few_rows = _few_rows._name if _few_rows is not None else None
    kernels = os.environ.get("OPENBLAS_CORETYPE")
    mlx_version = importlib.metadata.version("mlx")
    parts = (
        _cpu_identity(),
        status(),
        kernels,
        few_rows,
        mlx_version,
        _thread_timeout,
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:20]


def _cpu_identity() -> bytes:
    """The first processor's description in /proc/cpuinfo: its model and
    flags are what ``-march=native`` compiles for."""
    try:
        return Path("/proc/cpuinfo").read_bytes().split(b"\n\n")[0]
    except OSError:
        return b""


def _load_compiled(compiler: str) -> ctypes.CDLL:
    """``few_rows.c`` compiled with ``compiler`` for this CPU and loaded with
    ``RTLD_GLOBAL``: from the cache (``_cached_build``), else compiled for
    this process alone."""
    cached = _cached_build(compiler)
    if cached is not None:
        return ctypes.CDLL(str(cached), mode=ctypes.RTLD_GLOBAL)
    with tempfile.TemporaryDirectory(prefix="t5-spec-few-rows-") as private:
        _compile(compiler, Path(private) / FEW_ROWS_LIBRARY)
        return ctypes.CDLL(str(Path(private) / FEW_ROWS_LIBRARY), mode=ctypes.RTLD_GLOBAL)


def _cached_build(compiler: str) -> Path | None:
    """The library in the cache: as a process compiled it before from the
    same source with the same compiler on the same CPU, else compiled
    there now; None when the cache cannot be written."""
    directory = cache_directory()
    if directory is None:
        return None
    cached = directory / f"few_rows-{_build_key(compiler)}" / FEW_ROWS_LIBRARY
    if cached.is_file():
        return cached
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".few_rows-", dir=directory))
    except OSError:
        return None
    try:
        _compile(compiler, staging / FEW_ROWS_LIBRARY)
        # The whole directory at once: no process sees half a library.
        # If another process renamed its own first, this one fails.
        with contextlib.suppress(OSError):
            staging.rename(cached.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return cached


def _build_key(compiler: str) -> str:
    """A hash of what the compiled library depends on: the source, the
    compiler and its version, the flags and the CPU."""
    version = subprocess.run(
        [compiler, "--version"], check=False, capture_output=True, timeout=60
    ).stdout
    key = hashlib.sha256()
    for part in (FEW_ROWS_SOURCE.read_bytes(), compiler, _flags(), version, _cpu_identity()):
        key.update(repr(part).encode())
    return key.hexdigest()[:20]


def _flags() -> tuple[str, ...]:
    """The compiler's flags: ``FEW_ROWS_FLAGS``, without AVX-512 if asked."""
    without_avx512 = os.environ.get(FEW_ROWS_NO_AVX512_ENV, "") not in ("", "0")
    return FEW_ROWS_FLAGS + (("-mno-avx512f",) if without_avx512 else ())


def _compile(compiler: str, library: Path) -> None:
    """Compile ``few_rows.c`` into ``library``; ``CalledProcessError`` on failure."""
    command = [compiler, *_flags(), "-o", str(library), str(FEW_ROWS_SOURCE)]
    subprocess.run(command, check=True, capture_output=True, timeout=120)


def _load_runtimes(directory: Path) -> None:
    """Load the Fortran runtime auditwheel vendored in ``directory`` (locally)."""
    for runtime in VENDORED_RUNTIMES:
        for path in sorted(directory.glob(f"{runtime}*.so*")):
            try:
                ctypes.CDLL(str(path))
            except OSError:
                pass


def _from_threaded_package() -> str | None:
    """The ``THREADED_PACKAGE`` OpenBLAS, with ``PACKAGE``'s Fortran runtime as its own.

    The library finds ``libgfortran.so.5`` in its own directory ($ORIGIN), so it
    is loaded through a symbolic link in a temporary directory where that name
    is a link to the vendored runtime (loaded first, with its libquadmath).
    Once loaded, neither file is looked up again, and the directory goes.
    """
    libraries = _package_libraries(THREADED_PACKAGE)
    runtimes = _package_libraries(PACKAGE, "libgfortran")
    if not runtimes:  # a system libgfortran.so.5 would do
        return next((str(path) for path in libraries if _load_global(str(path))), None)
    _load_runtimes(runtimes[0].parent)
    for library in libraries:
        try:
            with tempfile.TemporaryDirectory(prefix="t5-spec-blas-") as directory:
                link = Path(directory) / library.name
                link.symlink_to(library)
                (Path(directory) / FORTRAN_RUNTIME).symlink_to(runtimes[0])
                if _load_global(str(link)):
                    return str(library)
        except OSError:  # no writable temporary directory
            return None
    return None


def _from_package() -> str | None:
    for library in _package_libraries(PACKAGE):
        _load_runtimes(library.parent)
        if _load_global(str(library)):
            return str(library)
    return None


def _providing_file(library: str) -> str:
    """The file the dynamic linker loaded for ``library`` (a soname), via dladdr."""

    class DlInfo(ctypes.Structure):
        _fields_ = [
            ("dli_fname", ctypes.c_char_p),
            ("dli_fbase", ctypes.c_void_p),
            ("dli_sname", ctypes.c_char_p),
            ("dli_saddr", ctypes.c_void_p),
        ]

    try:
        address = ctypes.cast(ctypes.CDLL(library).cblas_sgemm, ctypes.c_void_p)
        info = DlInfo()
        if ctypes.CDLL(None).dladdr(address, ctypes.byref(info)) and info.dli_fname:
            return os.path.realpath(info.dli_fname.decode())
    except (OSError, AttributeError):
        pass
    return library


def _from_system() -> str | None:
    for name in SYSTEM_NAMES:
        if _load_global(name):
            return _providing_file(name)
    return None


@contextlib.contextmanager
def _short_thread_timeout():
    """``OPENBLAS_THREAD_TIMEOUT`` set to ``THREAD_TIMEOUT`` for the
    OpenBLAS loaded within (it reads it as it loads), unless it is set
    already; the environment as it was afterwards."""
    global _thread_timeout
    if THREAD_TIMEOUT_ENV in os.environ:
        _thread_timeout = os.environ[THREAD_TIMEOUT_ENV]
        yield
        return
    _thread_timeout = THREAD_TIMEOUT
    os.environ[THREAD_TIMEOUT_ENV] = THREAD_TIMEOUT
    try:
        yield
    finally:
        del os.environ[THREAD_TIMEOUT_ENV]


def load() -> str | None:
    """Load the optimized CBLAS with ``RTLD_GLOBAL`` (once); return its path or None.

    Runs on import. Later calls return the first outcome.
    """
    global _loaded, _status, _attempted
    if _attempted:
        return _loaded
    _attempted = True
    if not sys.platform.startswith("linux"):
        _status = f"{sys.platform}: MLX's own BLAS (Accelerate on macOS)"
        return None
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        _status = f"{DISABLE_ENV} is set: MLX's bundled reference BLAS"
        return None
    if "mlx.core" in sys.modules:
        _status = "mlx.core was imported before cpu: MLX's bundled reference BLAS"
        _say(f"{_status}; import cpu before mlx for the optimized BLAS")
        return None
    sources = (
        (_from_threaded_package, f"OpenBLAS from the {THREADED_PACKAGE} package"),
        (_from_package, f"OpenBLAS from the {PACKAGE} package"),
        (_from_system, "system OpenBLAS"),
    )
    for source, description in sources:
        with _short_thread_timeout():
            _loaded = source()
        if _loaded is not None:
            _status = f"{description}: {_loaded}"
            return _loaded
    _status = "no optimized BLAS found: MLX's bundled reference BLAS"
    _say(
        f"MLX is using its slow reference BLAS; for fast CPU matmuls, {INSTALL_HINT} "
        f"(or a system OpenBLAS: apt install libopenblas0); {DISABLE_ENV}=1 hides this"
    )
    return None


load()
