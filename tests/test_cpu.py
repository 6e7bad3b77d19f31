"""The CPU backend's tuning (``cpu/``): its attention computes attention,
and each product form computes the same function; which form a load takes,
and when it times them. Skipped where the default device is a GPU, where
``cpu.prepare`` does nothing. (``test_blas.py`` tests the BLAS under MLX.)"""

import itertools
import os
import subprocess
import sys
import time
import types

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from test_model import CACHE_TOLERANCE, random_ids, tiny_args

import cpu
import cpu.attention as cpu_attention
import model as model_module
from cpu import blas, busy, forms
from loading import load_model

pytestmark = pytest.mark.skipif(
    mx.default_device() != mx.cpu, reason="the CPU backend's tuning; cpu.prepare does nothing here"
)


def row_major(weight: mx.array) -> bool:
    """Whether ``weight``'s rows lie one after another in memory."""
    return np.asarray(weight).flags.c_contiguous


def linears(model) -> list:
    return [m for m in model.modules() if type(m) is nn.Linear]


def test_loading_gives_every_attention_the_cpus():
    """cpu.prepare, which load_model calls, gives each attention of the
    model the CPU's attention function."""
    model = model_module.T5(tiny_args())
    attentions = [m for m in model.modules() if isinstance(m, model_module.Attention)]
    assert len(attentions) == 3 + 2 * 2 and all(
        a.attention is model_module.attention for a in attentions
    )
    cpu.prepare(model)
    assert all(a.attention is cpu_attention.attention for a in attentions)


@pytest.mark.parametrize("shape", [(2, 3, 40), (1, 1, 2), (5, 7, 57), (4, 1, 300)])
def test_softmax_cpu_is_softmax(shape):
    """softmax_cpu matches softmax in float64, masked scores (-inf) included."""
    scores = np.random.default_rng(0).normal(scale=20.0, size=shape).astype(np.float32)
    scores[..., : shape[-1] // 3] = -np.inf  # masked keys, never a whole row
    got = np.array(cpu_attention.softmax_cpu(mx.array(scores)))
    exact = np.exp(scores - scores.max(-1, keepdims=True).astype(np.float64))
    exact /= exact.sum(-1, keepdims=True)
    np.testing.assert_allclose(got, exact, rtol=4e-6, atol=1e-20)


def test_compiled_per_shape_forgets_its_traces_past_its_limit(monkeypatch):
    """A CompiledPerShape traces each new shape once, and once it holds
    MAX_TRACED_SHAPES of them starts over, so that MLX's traces of a
    function compiled per shape do not pile up."""
    monkeypatch.setattr(cpu_attention, "MAX_TRACED_SHAPES", 3)
    traced = []

    def doubled(x):
        traced.append(x.shape)
        return 2 * x

    compiled = cpu_attention.CompiledPerShape(doubled)
    for length in [1, 2, 1, 3, 2, 4, 1]:
        x = mx.ones((2, length))
        assert mx.array_equal(compiled(x), 2 * x)
        assert len(compiled.shapes) <= 3
    # Traced again: (2, 1) after (2, 4) made a fourth shape.
    assert traced == [(2, 1), (2, 2), (2, 3), (2, 4), (2, 1)]


def test_attention_over_one_key_is_its_value():
    """Over a single key, attention gives its value, however many scores
    (here as many as take softmax_cpu's path over more keys)."""
    queries = mx.array(np.random.default_rng(0).normal(size=(2, 64, 16, 8)).astype(np.float32))
    values = mx.array(np.random.default_rng(1).normal(size=(2, 64, 1, 8)).astype(np.float32))
    keys = mx.ones((2, 64, 1, 8))
    assert 2 * 64 * 16 >= cpu_attention.SOFTMAX_CPU_MIN_SCORES
    out = cpu_attention.attention(queries, keys, values, mx.zeros((2, 1, 16, 1)))
    np.testing.assert_allclose(np.array(out), np.broadcast_to(np.array(values), out.shape))


@pytest.mark.parametrize("name", ["relu_tied", "gated_untied"])
def test_every_product_form_computes_the_same_function(name, converted):
    """On the CPU a Linear computes x W^T with W as stored or kept
    transposed in memory (load_model times them and takes the faster):
    each is the checkpoint's function within round-off."""
    plain = load_model(converted(name))  # tiny weights: load_model keeps them plain
    assert all(row_major(m.weight) for m in linears(plain))
    inputs = mx.array(random_ids((2, 9), plain.args.vocab_size, seed=5))
    decoder_inputs = mx.array(random_ids((2, 7), plain.args.vocab_size, seed=6))
    expected = np.array(plain(inputs, decoder_inputs))
    model = load_model(converted(name))
    for module in linears(model):
        module.weight = forms.transposed_in_memory(module.weight)
    assert not any(row_major(m.weight) for m in linears(model))
    np.testing.assert_allclose(
        np.array(model(inputs, decoder_inputs)), expected, rtol=0, atol=CACHE_TOLERANCE
    )


def test_the_fastest_form_must_save_a_tenth_over_the_plain_one():
    assert forms.fastest_form({"plain": 1.0, "transposed": 0.85}) == "transposed"
    # Near-ties keep the plain form, so two loads on one machine compute alike.
    assert forms.fastest_form({"plain": 1.0, "transposed": 0.92}) == "plain"
    assert forms.fastest_form({"plain": 1.0, "transposed": 1.3}) == "plain"


def test_form_times_are_per_product_however_many_a_timing_evaluates(monkeypatch):
    """Each timing evaluates the products of up to TIMED_GRAPH_BYTES of the
    throwaway weights and reports seconds per product, summed over
    TIMED_ROWS: with a clock that advances 1 s per reading, each timing
    takes 1 s for 4 products of a 256 KB weight."""
    monkeypatch.setattr(forms, "TIMED_FORM_BYTES", 4 << 20)
    monkeypatch.setattr(forms, "TIMED_GRAPH_BYTES", 1 << 20)
    clock = types.SimpleNamespace(perf_counter=itertools.count().__next__)
    monkeypatch.setattr(forms, "time", clock)
    times = forms.form_times((256, 256), mx.float32, forms.PRODUCT_FORMS, repeats=3)
    rows = len(forms.TIMED_ROWS)
    assert times == {form: rows * 1 / 4 for form in forms.PRODUCT_FORMS}
    # A weight over TIMED_GRAPH_BYTES is timed one product at a time.
    times = forms.form_times((1024, 512), mx.float32, ("plain",), repeats=3)
    assert times == {"plain": rows * 1.0}


def fake_times_recorded(timed: list):
    """``form_times`` faked: wide weights fastest transposed, the others
    plain; each shape timed is appended to ``timed``."""

    def fake_times(shape, dtype, product_forms):
        timed.append(shape)
        best = "transposed" if shape[0] > shape[1] else "plain"
        return {form: 0.5 if form == best else 1.0 for form in product_forms}

    return fake_times


def quiet_fake_timings(monkeypatch, tmp_path, timed: list) -> None:
    """Fake timings of every weight, on a machine whose busy time is unknown
    (so quiet), remembered in ``tmp_path``."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # fake timings stay in the test
    monkeypatch.setattr(busy, "machine_cpu_seconds", lambda: None)
    monkeypatch.setattr(forms, "TIMED_FORM_MIN_SIZE", 0)
    monkeypatch.setattr(forms, "form_times", fake_times_recorded(timed))


def test_load_model_lays_out_each_shape_in_the_form_timed_fastest(converted, monkeypatch, tmp_path):
    """load_model gives every float32 weight of a shape the form form_times
    found fastest for that shape (here faked: wide weights transposed), and
    the tied embedding, the output projection, its own; a half-precision
    model keeps the plain form."""
    quiet_fake_timings(monkeypatch, tmp_path, [])
    model = load_model(converted("relu_tied"))
    for module in linears(model):
        wide = module.weight.shape[0] > module.weight.shape[1]
        assert row_major(module.weight) != wide
    # [vocabulary, d_model] is wide.
    assert not row_major(model.shared.weight)
    half = load_model(converted("relu_tied", "float16"))
    assert all(row_major(m.weight) for m in linears(half))
    assert row_major(half.shared.weight)


@pytest.mark.parametrize("writable", [True, False], ids=["cache", "unwritable cache"])
def test_forms_are_timed_once_per_machine(writable, converted, monkeypatch, tmp_path):
    """The forms store_for_cpu times are remembered in the cache: a second
    load times nothing and takes the same forms. Where the cache cannot be
    written (XDG_CACHE_HOME a file), every load times them, and the file
    stays as it was."""
    timed = []
    cache = tmp_path / "cache"
    if not writable:
        cache.write_text("mine")
    quiet_fake_timings(monkeypatch, cache, timed)
    loads = [load_model(converted("relu_tied")) for _ in range(2)]
    shapes = {module.weight.shape for module in linears(loads[0])} | {loads[0].shared.weight.shape}
    assert len(timed) == len(shapes) * (1 if writable else 2)
    layouts = [[row_major(m.weight) for m in linears(model)] for model in loads]
    assert layouts[0] == layouts[1]
    if not writable:
        assert cache.read_text() == "mine"


def test_forms_timed_while_other_processes_were_busy_are_not_remembered(
    converted, monkeypatch, tmp_path
):
    """Forms timed while other processes took the CPUs are used by the load
    that timed them, not written to the cache; the next load, with them
    busy since, times nothing and keeps every weight plain."""
    timed = []
    quiet_fake_timings(monkeypatch, tmp_path, timed)
    machine = iter(range(0, 10_000, 10))  # the machine: 10 CPU seconds more at every look
    monkeypatch.setattr(busy, "machine_cpu_seconds", lambda: next(machine))
    quiet = types.SimpleNamespace(were_busy=lambda: False, cores=lambda: 0.0)
    monkeypatch.setattr(cpu, "_others", quiet)  # quiet until the first load began
    loads = [load_model(converted("relu_tied")) for _ in range(2)]
    shapes = {module.weight.shape for module in linears(loads[0])} | {loads[0].shared.weight.shape}
    assert sorted(timed) == sorted(shapes)
    assert not (tmp_path / "t5-spec" / forms.FORMS_FILE).exists()
    for module in linears(loads[0]):
        wide = module.weight.shape[0] > module.weight.shape[1]
        assert row_major(module.weight) != wide
    assert all(row_major(module.weight) for module in linears(loads[1]))


def test_this_process_alone_is_not_other_processes(monkeypatch):
    """This process spinning on a machine whose busy time is all its own
    leaves the others quiet: its own CPU time is not theirs. (The machine's
    time is this process's, so that other processes really running, as a
    test suite beside this one, cannot fail the test.)"""
    monkeypatch.setattr(busy, "machine_cpu_seconds", time.process_time)
    others = busy.OtherProcesses()
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:
        pass
    assert not others.were_busy()


@pytest.mark.skipif(busy.machine_cpu_seconds() is None, reason="no /proc/stat")
def test_another_process_spinning_makes_the_others_busy():
    """A child process spinning for 0.5 s, read through /proc/stat."""
    loop = "import time\nend = time.perf_counter() + 0.5\nwhile time.perf_counter() < end: pass"
    others = busy.OtherProcesses()
    subprocess.run([sys.executable, "-c", loop], check=True, timeout=60)
    assert others.were_busy()


def faked_others(monkeypatch, elsewhere: float | None, elapsed: float) -> busy.OtherProcesses:
    """An OtherProcesses over ``elapsed`` seconds in which other processes
    took ``elsewhere`` CPU seconds (None: the machine's time unknown)."""
    machine = iter([100.0, 100.0 + (elsewhere or 0.0)])
    monkeypatch.setattr(
        busy, "machine_cpu_seconds", lambda: None if elsewhere is None else next(machine)
    )
    monkeypatch.setattr(
        busy,
        "time",
        types.SimpleNamespace(process_time=lambda: 5.0, perf_counter=iter([0.0, elapsed]).__next__),
    )
    return busy.OtherProcesses()


@pytest.mark.parametrize("elsewhere, left", [(None, 0), (0.1, 0), (1.0, 1), (1.6, 2), (50.0, None)])
def test_free_cores_are_those_other_processes_leave(elsewhere, left, monkeypatch):
    """Other processes that kept 0.1, 1 or 1.6 CPUs busy over a second
    leave this process its CPUs less 0, 1 or 2, and always one."""
    cores = len(os.sched_getaffinity(0))
    free = busy.free_cores(faked_others(monkeypatch, elsewhere, elapsed=1.0))
    assert free == (1 if left is None else max(1, cores - left))


@pytest.fixture
def threads_as_started():
    """OpenBLAS's thread count as it started (the loads of earlier tests may
    have lowered it beside busy processes), and again after the test; skips
    where no threaded OpenBLAS computes with more than one."""
    blas.use_threads(len(os.sched_getaffinity(0)))
    started = blas.num_threads()
    if not started or started < 2 or blas.THREADED_PACKAGE not in blas.status():
        pytest.skip(f"no threaded OpenBLAS with 2 threads or more: {blas.status()}")
    yield started
    blas.use_threads(started)


def test_prepare_computes_on_free_cores_and_times_no_form_beside_busy_processes(
    threads_as_started, converted, monkeypatch, tmp_path
):
    """With other processes busy since the last look, a load gives OpenBLAS
    the cores they left (here faked: one) and keeps every weight plain
    without timing a form (seen failing with the forms timed)."""
    for name in blas.THREAD_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    timed = []
    quiet_fake_timings(monkeypatch, tmp_path, timed)
    monkeypatch.setattr(busy, "free_cores", lambda others: 1)
    monkeypatch.setattr(cpu, "_others", types.SimpleNamespace(were_busy=lambda: True))
    model = load_model(converted("relu_tied"))
    assert blas.num_threads() == 1
    assert timed == [] and all(row_major(m.weight) for m in linears(model))
    blas.use_threads(threads_as_started)
    assert blas.num_threads() == threads_as_started


def test_a_thread_count_the_user_set_is_kept(threads_as_started, monkeypatch):
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", str(threads_as_started))
    blas.use_threads(1)
    assert blas.num_threads() == threads_as_started
