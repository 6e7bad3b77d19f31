"""blas.py: after ``import blas``, MLX's ``cblas_sgemm`` is the optimized library's.

Each case runs a fresh interpreter, so the import order is the real one, with the
dynamic linker's binding log on (``LD_DEBUG=bindings``): its line "binding file
.../libmlx.so to FILE: normal symbol `cblas_sgemm'" names the file whose
``cblas_sgemm`` every matmul of MLX calls. The child also reports which object
defines the ``cblas_sgemm`` of the global scope (``dladdr``): the name the
dynamic linker knows it by (for the threaded OpenBLAS, a symbolic link in a
temporary directory that is gone by then) and the file mapped at its base
address (``/proc/self/maps``), and the files it has mapped. No timing.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the BLAS loading is Linux-only"
)

CHILD = r"""
import ctypes, json, os, sys
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "mlx-first":
    import mlx.core
elif sys.argv[2] == "readme":  # the README's Python snippet, which never names blas
    from decoder import SpeculativeDecoder, load_tokenizer
    from model import load_model
import blas
import mlx.core as mx

# A float32 matmul, through cblas_sgemm, checked against a sum done by hand.
a = mx.arange(64 * 48, dtype=mx.float32).reshape(64, 48) / 1000
b = mx.ones((48, 32), dtype=mx.float32)
product = a @ b
mx.eval(product)
expected = (a.sum(axis=1, keepdims=True) * mx.ones((1, 32)))
assert mx.allclose(product, expected, rtol=1e-5).item()


class DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


with open("/proc/self/maps") as maps:
    lines = [line.split() for line in maps if " /" in line]
mapped = sorted({os.path.realpath(line[-1]) for line in lines})

process = ctypes.CDLL(None)
try:
    address = ctypes.cast(process.cblas_sgemm, ctypes.c_void_p)
except AttributeError:  # no cblas_sgemm in the global scope
    provider_name = global_provider = None
else:
    info = DlInfo()
    assert process.dladdr(address, ctypes.byref(info))
    provider_name = info.dli_fname.decode()
    (global_provider,) = {
        os.path.realpath(line[-1]) for line in lines
        if int(line[0].split("-")[0], 16) == info.dli_fbase
    }

print(json.dumps({
    "loaded": blas.loaded_library(),
    "status": blas.status(),
    "threads": blas.num_threads(),
    "provider_name": provider_name,
    "global_provider": global_provider,
    "mapped": mapped,
}))
"""


THREAD_SETTINGS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "GOTO_NUM_THREADS")


def run_child(tmp_path: Path, order: str = "blas-first", disable: bool = False, threads=None):
    """Run CHILD; return its report, the file libmlx.so bound ``cblas_sgemm`` to, and stderr.

    ``threads``, if given, is the child's ``OPENBLAS_NUM_THREADS``; no thread
    setting is passed on otherwise.
    """
    drop = ("T5_SPEC_NO_BLAS", *THREAD_SETTINGS)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    if disable:
        env["T5_SPEC_NO_BLAS"] = "1"
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


def test_mlx_calls_the_optimized_cblas(tmp_path):
    report, mlx_sgemm, stderr = run_child(tmp_path)
    loaded = report["loaded"]
    assert loaded is not None, (
        f"no optimized BLAS was loaded ({report['status']}); "
        f"pip install -r requirements.txt installs one. stderr:\n{stderr}"
    )
    loaded = os.path.realpath(loaded)
    # What MLX calls, what the global scope resolves, and what blas.py loaded: one file.
    assert mlx_sgemm == os.path.realpath(report["provider_name"])
    assert report["global_provider"] == loaded
    assert loaded in report["mapped"]
    assert not is_bundled(loaded)
    assert report["threads"] >= 1
    # MLX's reference libblas is still mapped (libmlx.so needs it), just not called.
    assert any(is_bundled(path) for path in report["mapped"])
    assert stderr == ""


def test_the_python_api_gets_the_optimized_cblas(tmp_path):
    """``from decoder import ...; from model import load_model``, as the README shows."""
    report, mlx_sgemm, stderr = run_child(tmp_path, order="readme")
    assert report["loaded"] is not None, report["status"]
    assert mlx_sgemm == os.path.realpath(report["provider_name"])
    assert report["global_provider"] == os.path.realpath(report["loaded"])
    assert not is_bundled(mlx_sgemm)
    assert stderr == ""


def test_an_explicit_thread_count_is_kept(tmp_path):
    """``OPENBLAS_NUM_THREADS=1`` set by the user: the OpenBLAS computes with one thread."""
    report, mlx_sgemm, stderr = run_child(tmp_path, threads=1)
    assert report["loaded"] is not None, report["status"]
    assert report["threads"] == 1
    assert mlx_sgemm == os.path.realpath(report["provider_name"])
    assert stderr == ""


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
    assert "import blas before mlx" in stderr
