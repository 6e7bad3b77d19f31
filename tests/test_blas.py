"""cpu/blas.py: after ``import cpu``, MLX's ``cblas_sgemm`` is few_rows.c's, which
passes products on to the optimized library (or, without few_rows.c, the
optimized library's own).

Each case runs a fresh interpreter, so the import order is the real one, with the
dynamic linker's binding log on (``LD_DEBUG=bindings``): its line "binding file
.../libmlx.so to FILE: normal symbol `cblas_sgemm'" names the file whose
``cblas_sgemm`` every matmul of MLX calls. The child also reports which object
defines ``cblas_sgemm`` and ``cblas_sgemv`` in the global scope (``dladdr``):
the name the dynamic linker knows it by (for the threaded OpenBLAS and
few_rows.c, a file in a temporary directory that is gone by then) and the
file mapped at its base address (``/proc/self/maps``), and the files it has
mapped. The products of few_rows.c's paths are checked in this process
against float64. No timing.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cpu import blas  # isort: skip  (before mlx, as every entry point does)
import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="the BLAS loading is Linux-only"
    ),
    pytest.mark.skipif(
        mx.default_device() != mx.cpu, reason="the CPU backend's BLAS; products run on the GPU here"
    ),
]

CHILD = r"""
import ctypes, json, os, sys
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "mlx-first":
    import mlx.core
elif sys.argv[2] == "readme":  # the README's Python snippet, which never names blas
    from decoder import SpeculativeDecoder
    from loading import load_tokenizer
    from loading import load_model
from cpu import blas
import mlx.core as mx

# Float32 matmuls through cblas_sgemm, one per path of few_rows.c (tiny,
# streamed, padded, passed on), each checked against a sum done by hand.
for rows, inputs, outputs in [(4, 48, 32), (1, 300, 1000), (5, 300, 1000), (64, 300, 1000)]:
    a = mx.arange(rows * inputs, dtype=mx.float32).reshape(rows, inputs) / 1000
    b = mx.ones((outputs, inputs), dtype=mx.float32)
    product = a @ b.T  # as a Linear layer multiplies
    mx.eval(product)
    expected = (a.sum(axis=1, keepdims=True) * mx.ones((1, outputs)))
    assert mx.allclose(product, expected, rtol=1e-5).item()


class DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


with open("/proc/self/maps") as maps:
    # address perms offset device inode path, "(deleted)" after a removed file
    lines = [
        (line.split()[0], os.path.realpath(line.split(maxsplit=5)[5].strip().removesuffix(" (deleted)")))
        for line in maps if " /" in line
    ]
mapped = sorted({path for _, path in lines})


def provider(symbol):  # the name and mapped file of its global definition, or (None, None)
    try:
        address = ctypes.cast(getattr(ctypes.CDLL(None), symbol), ctypes.c_void_p)
    except AttributeError:  # not in the global scope
        return None, None
    info = DlInfo()
    assert ctypes.CDLL(None).dladdr(address, ctypes.byref(info))
    (path,) = {path for start, path in lines if int(start.split("-")[0], 16) == info.dli_fbase}
    return info.dli_fname.decode(), path


(provider_name, global_provider), (_, sgemv_provider) = provider("cblas_sgemm"), provider("cblas_sgemv")
print(json.dumps({
    "loaded": blas.loaded_library(),
    "status": blas.status(),
    "threads": blas.num_threads(),
    "few_rows_counts": blas.few_rows_counts(),
    "provider_name": provider_name,
    "global_provider": global_provider,
    "sgemv_provider": sgemv_provider,
    "mapped": mapped,
}))
"""


THREAD_SETTINGS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "GOTO_NUM_THREADS")
AVX512 = "avx512f" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
# A C compiler: without one, cpu/blas.py leaves few_rows.c out.
HAS_COMPILER = bool(os.environ.get("CC") or shutil.which("cc"))


def run_child(
    tmp_path: Path,
    order: str = "blas-first",
    disable: bool = False,
    threads=None,
    few_rows: bool = True,
    compiler: str | None = None,
    cache: Path | None = None,
):
    """Run CHILD; return its report, the file libmlx.so bound ``cblas_sgemm`` to, and stderr.

    ``threads``, if given, is the child's ``OPENBLAS_NUM_THREADS``; no thread
    setting is passed on otherwise. ``few_rows=False`` sets ``T5_SPEC_NO_FEW_ROWS``;
    ``compiler`` is the child's ``CC``, ``cache`` its ``XDG_CACHE_HOME``.
    """
    drop = ("T5_SPEC_NO_BLAS", "T5_SPEC_NO_FEW_ROWS", *THREAD_SETTINGS)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    if disable:
        env["T5_SPEC_NO_BLAS"] = "1"
    if not few_rows:
        env["T5_SPEC_NO_FEW_ROWS"] = "1"
    if compiler is not None:
        env["CC"] = compiler
    if cache is not None:
        env["XDG_CACHE_HOME"] = str(cache)
    if threads is not None:
        env["OPENBLAS_NUM_THREADS"] = str(threads)
    log = tmp_path / "ld"
    env |= {"LD_DEBUG": "bindings", "LD_DEBUG_OUTPUT": str(log)}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT), order],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    # The log is LD_DEBUG_OUTPUT.<pid>, one file per process.
    bindings = re.compile(
        r"binding file (\S*/libmlx\.so) \[\d+\] to (\S+) \[\d+\]: .*`cblas_sgemm'"
    )
    targets = set()
    for path in tmp_path.glob("ld.*"):
        for line in path.read_text(errors="replace").splitlines():
            if match := bindings.search(line):
                targets.add(os.path.realpath(match.group(2)))
    assert len(targets) == 1, f"libmlx.so's cblas_sgemm bound to {targets or 'nothing'}"
    return report, targets.pop(), result.stderr


def is_bundled(path: str) -> bool:
    """MLX's own reference BLAS, mlx_cpu.libs/libblas-*.so."""
    return Path(path).parent.name == "mlx_cpu.libs" and Path(path).name.startswith("libblas")


def check_optimized(report: dict, mlx_sgemm: str, stderr: str, few_rows: bool) -> None:
    """MLX calls few_rows.c's ``cblas_sgemm`` (if ``few_rows``) or the
    optimized library's, the one the global scope resolves; the optimized
    library defines the global ``cblas_sgemv`` (few_rows.c calls it)."""
    loaded = report["loaded"]
    assert loaded is not None, (
        f"no optimized BLAS was loaded ({report['status']}); "
        f"pip install -r requirements.txt installs one. stderr:\n{stderr}"
    )
    loaded = os.path.realpath(loaded)
    assert mlx_sgemm == os.path.realpath(report["provider_name"])
    assert report["sgemv_provider"] == loaded
    assert loaded in report["mapped"]
    assert not is_bundled(loaded)
    assert report["threads"] >= 1
    if few_rows:
        assert Path(report["global_provider"]).name == "libfew_rows.so"
        assert report["status"].endswith("few-row products by few_rows.c")
        # Every path took the product made for it, and each was right.
        assert min(report["few_rows_counts"].values()) >= 1, report["few_rows_counts"]
    else:
        assert report["global_provider"] == loaded
        assert report["few_rows_counts"] is None
    assert stderr == ""


def test_mlx_calls_the_optimized_cblas(tmp_path):
    report, mlx_sgemm, stderr = run_child(tmp_path)
    check_optimized(report, mlx_sgemm, stderr, few_rows=HAS_COMPILER)
    # MLX's reference libblas is still mapped (libmlx.so needs it), just not called.
    assert any(is_bundled(path) for path in report["mapped"])


def test_the_python_api_gets_the_optimized_cblas(tmp_path):
    """``from decoder import ...; from model import load_model``, as the README shows."""
    report, mlx_sgemm, stderr = run_child(tmp_path, order="readme")
    check_optimized(report, mlx_sgemm, stderr, few_rows=HAS_COMPILER)


def test_an_explicit_thread_count_is_kept(tmp_path):
    """``OPENBLAS_NUM_THREADS=1`` set by the user: the OpenBLAS computes with one thread."""
    report, mlx_sgemm, stderr = run_child(tmp_path, threads=1)
    check_optimized(report, mlx_sgemm, stderr, few_rows=HAS_COMPILER)
    assert report["threads"] == 1


IDLE_CHILD = r"""
import json, os, sys, threading, time
sys.path.insert(0, sys.argv[1])
from cpu import blas
import mlx.core as mx

def runnable_threads():
    # Threads of this process but the one reading, runnable or running ("R"):
    # a spinning thread is runnable whether or not a busy machine lets it run.
    me, runnable = str(threading.get_native_id()), 0
    for thread in os.listdir("/proc/self/task"):
        try:
            stat = open(f"/proc/self/task/{thread}/stat").read()
        except OSError:  # the thread ended
            continue
        runnable += thread != me and stat.rsplit(")", 1)[1].split()[0] == "R"
    return runnable

a = mx.ones((512, 512))
mx.eval(a @ a)  # on every OpenBLAS thread
cpu, start, samples = time.process_time(), time.perf_counter(), []
while time.perf_counter() - start < 0.2:
    samples.append(runnable_threads())
    time.sleep(0.01)
print(json.dumps({
    "threads": blas.num_threads(),
    "idle_cpu": time.process_time() - cpu,
    "runnable": samples,
    "environment": os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
}))
"""


@pytest.mark.parametrize("timeout", [None, "30"], ids=["ours", "the user's"])
def test_openblas_threads_sleep_soon_after_a_product(timeout):
    """OpenBLAS's idle threads spin 2^28 cycles (about 0.1 s) by default
    before they sleep, taking cores that MLX's threads need between
    products: cpu/blas.py loads it with a short timeout, and leaves the
    environment as it was. A timeout set by the user is kept: 2^30 cycles
    spin through the child's 0.2 s sleep. Spinning is read from the
    threads' states, which a machine other jobs keep busy leaves as they
    are (it lowers only the CPU time a spinning thread gets)."""
    drop = ("T5_SPEC_NO_BLAS", blas.THREAD_TIMEOUT_ENV, *THREAD_SETTINGS)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    if timeout is not None:
        env[blas.THREAD_TIMEOUT_ENV] = timeout
    result = subprocess.run(
        [sys.executable, "-c", IDLE_CHILD, str(ROOT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(result.stdout.splitlines()[-1])
    if report["threads"] is None or report["threads"] < 2:
        pytest.skip("no threaded OpenBLAS: no thread to idle")
    assert report["environment"] == timeout
    spinning = sum(count > 0 for count in report["runnable"])
    if timeout is None:
        assert report["idle_cpu"] < 0.05
        assert spinning <= 1, report["runnable"]
    else:
        assert spinning >= len(report["runnable"]) / 2, report["runnable"]


def test_without_few_rows_mlx_calls_openblas_itself(tmp_path):
    report, mlx_sgemm, stderr = run_child(tmp_path, few_rows=False)
    check_optimized(report, mlx_sgemm, stderr, few_rows=False)
    assert "T5_SPEC_NO_FEW_ROWS is set" in report["status"]


@pytest.mark.parametrize("compiler", ["missing", "failing silently"])
def test_without_a_compiler_mlx_calls_openblas_itself(compiler, tmp_path):
    """No compiler, or one that fails with nothing but a blank line to say."""
    path = tmp_path / "cc"
    if compiler == "failing silently":
        path.write_text("#!/bin/sh\necho >&2\nexit 1\n")
        path.chmod(0o755)
    report, mlx_sgemm, stderr = run_child(tmp_path, compiler=str(path))
    check_optimized(report, mlx_sgemm, stderr, few_rows=False)
    assert "few_rows.c not used" in report["status"]


@pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler")
def test_few_rows_is_compiled_once_then_loaded_from_the_cache(tmp_path):
    """Compiling few_rows.c took 0.8-0.9 s of every process's start (Zen 4):
    the first process compiles it into the cache, later ones load it from there."""
    compiles, wrapper = tmp_path / "compiles", tmp_path / "cc"
    real = os.environ.get("CC") or shutil.which("cc")
    wrapper.write_text(
        f'#!/bin/sh\ncase "$*" in *few_rows.c*) echo compiled >> "{compiles}";; esac\n'
        f'exec "{real}" "$@"\n'
    )
    wrapper.chmod(0o755)
    for run in range(2):
        directory = tmp_path / f"run-{run}"
        directory.mkdir()
        report, mlx_sgemm, stderr = run_child(directory, compiler=str(wrapper), cache=tmp_path)
        check_optimized(report, mlx_sgemm, stderr, few_rows=True)
        assert compiles.read_text().split() == ["compiled"]
    [library] = tmp_path.glob("t5-spec/few_rows-*/libfew_rows.so")
    assert os.path.realpath(report["global_provider"]) == os.path.realpath(library)
    assert [path.name for path in (tmp_path / "t5-spec").iterdir()] == [library.parent.name]


def test_a_cache_that_cannot_be_written_is_done_without(tmp_path):
    """XDG_CACHE_HOME names a file: few_rows.c is compiled for the process alone."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("mine")
    report, mlx_sgemm, stderr = run_child(tmp_path, cache=blocker)
    check_optimized(report, mlx_sgemm, stderr, few_rows=HAS_COMPILER)
    assert blocker.read_text() == "mine"


def test_disabled_keeps_the_bundled_reference_blas(tmp_path):
    report, mlx_sgemm, stderr = run_child(tmp_path, disable=True)
    assert report["loaded"] is None
    assert report["threads"] is None
    assert "T5_SPEC_NO_BLAS" in report["status"]
    assert is_bundled(mlx_sgemm), mlx_sgemm
    # The bundled library is private to libmlx.so: nothing defines cblas_sgemm globally.
    assert report["global_provider"] is None
    assert report["provider_name"] is None
    assert stderr == ""


def test_too_late_after_mlx_says_so(tmp_path):
    report, mlx_sgemm, stderr = run_child(tmp_path, order="mlx-first")
    assert report["loaded"] is None
    assert is_bundled(mlx_sgemm), mlx_sgemm
    assert "import cpu before mlx" in stderr


# few_rows.c is compiled for this CPU (or without AVX-512, as the test below
# asks): with AVX-512 its own kernels stream up to 128 or 64 rows; without,
# row counts that are not a multiple of 8 are padded and the others passed on.
OWN_KERNELS = blas.few_rows_own_kernels()
OWN = "streamed" if OWN_KERNELS else "padded"
OWN_OR_PASSED_ON = "streamed" if OWN_KERNELS else "passed on"
# (rows, inputs, outputs, A transposed, B transposed, the path few_rows.c
# takes: one name, or (that of the product, that of addmm, which reads C))
PRODUCTS = [
    (3, 40, 50, False, True, "tiny"),
    (3, 40, 50, True, False, "tiny"),
    # With AVX-512, attention's shapes: inputs a multiple of 16 (4 columns
    # at a time, then 1), or outputs (64 columns at a time, then 16).
    (3, 64, 50, False, True, "tiny"),
    (3, 50, 80, False, False, "tiny"),
    (1, 300, 1000, False, True, "streamed"),
    (2, 300, 1001, False, True, "streamed"),  # the last column after the blocks of 4
    # Long rows: up to 128 with AVX-512 (few_rows.c's own kernel, 4 rows at a
    # time), else 2 (sgemv).
    (4, 1024, 301, False, True, OWN),
    (7, 1024, 301, False, True, OWN),  # a group of 4 rows and one of 3
    (12, 1100, 300, False, True, OWN),
    (13, 1024, 300, False, True, OWN),
    (128, 1024, 300, False, True, OWN_OR_PASSED_ON),
    (129, 1024, 300, False, True, "passed on"),
    (3, 300, 1000, False, True, "padded"),  # short rows: up to 2
    (2, 300, 1000, True, True, "passed on"),  # only A B^T streams
    # B as it is (a weight stored transposed): broadcast by few_rows.c's own
    # kernel up to 64 rows, unless C is read. Columns in blocks of 64, then
    # of 16 (1000: 15 blocks, 2 vectors), the last n % 16 tiny.
    (2, 300, 1000, False, False, (OWN, "padded")),
    (7, 257, 1000, False, False, (OWN, "padded")),
    (12, 300, 1024, False, False, (OWN, "padded")),
    (13, 300, 1000, False, False, (OWN, "padded")),  # more than 8: longer blocks of B
    (32, 70, 1000, False, False, (OWN_OR_PASSED_ON, "passed on")),
    (5, 1500, 48, False, False, (OWN, "padded")),  # three vectors, no block of 64
    (64, 70, 1000, False, False, (OWN_OR_PASSED_ON, "passed on")),
    (65, 300, 1000, False, False, "passed on"),
    (5, 300, 1000, False, True, "padded"),
    (5, 300, 1000, True, True, "passed on"),  # a transposed A is not padded
    (64, 300, 1000, False, True, "passed on"),
]


@pytest.mark.parametrize(
    "alpha, beta", [(1.0, None), (0.5, 2.0), (0.5, 0.0)], ids=["matmul", "addmm", "scaled"]
)
@pytest.mark.parametrize("rows, inputs, outputs, a_transposed, b_transposed, path", PRODUCTS)
def test_every_path_of_few_rows_computes_the_product(
    rows, inputs, outputs, a_transposed, b_transposed, path, alpha, beta
):
    """``alpha op(A) op(B) + beta C`` against float64, with A and B as MLX
    passes them when they are transposed views, through the path named."""
    if blas.few_rows_counts() is None:
        pytest.skip(f"few_rows.c is not in use: {blas.status()}")
    rng = np.random.default_rng(rows * inputs + outputs)
    a = rng.standard_normal((rows, inputs)).astype(np.float32)
    b = rng.standard_normal((inputs, outputs)).astype(np.float32)
    c = rng.standard_normal((rows, outputs)).astype(np.float32)
    a_mx = mx.array(a.T.copy()).T if a_transposed else mx.array(a)
    b_mx = mx.array(b.T.copy()).T if b_transposed else mx.array(b)
    before = blas.few_rows_counts()
    if beta is None:
        product = a_mx @ b_mx
    else:
        product = mx.addmm(mx.array(c), a_mx, b_mx, alpha=alpha, beta=beta)
    product = np.array(product)
    counts = blas.few_rows_counts()
    if isinstance(path, tuple):
        path = path[bool(beta)]
    assert counts[path] == before[path] + 1, (before, counts)
    expected = alpha * a.astype(np.float64) @ b.astype(np.float64) + (beta or 0.0) * c
    # float32 rounding of sums of `inputs` products
    scale = np.abs(a).astype(np.float64) @ np.abs(b) + np.abs(c)
    assert np.abs(product - expected).max() <= 1e-6 * inputs**0.5 * scale.max()


@pytest.mark.skipif(not AVX512, reason="this CPU runs only the build without AVX-512")
def test_every_path_of_few_rows_without_avx512(tmp_path):
    """The paths above in a build without AVX-512, as on a CPU that lacks it
    (a Zen 3): the same test in a child process that asks for that build."""
    if blas.few_rows_counts() is None:
        pytest.skip(f"few_rows.c is not in use: {blas.status()}")
    env = {**os.environ, blas.FEW_ROWS_NO_AVX512_ENV: "1", "XDG_CACHE_HOME": str(tmp_path)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    command += ["-k", "test_every_path_of_few_rows_computes_the_product or own_kernels"]
    child = subprocess.run(
        command, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 0, child.stdout[-3000:]
    assert f"{1 + 3 * len(PRODUCTS)} passed" in child.stdout, child.stdout[-3000:]


def test_few_rows_own_kernels_follow_the_build():
    """few_rows.c's own kernels run where it was built with AVX-512, and not
    where it was asked to build without."""
    if blas.few_rows_counts() is None:
        pytest.skip(f"few_rows.c is not in use: {blas.status()}")
    if blas.THREADED_PACKAGE not in blas.status():
        pytest.skip(f"not the threaded OpenBLAS, whose pool the kernels run on: {blas.status()}")
    without = os.environ.get(blas.FEW_ROWS_NO_AVX512_ENV, "") not in ("", "0")
    assert blas.few_rows_own_kernels() == (AVX512 and not without)
