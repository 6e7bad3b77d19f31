"""Product forms: how each float32 weight lies in memory for the CPU's products.

OpenBLAS and few_rows.c compute ``x W^T`` faster or slower depending on
whether ``W`` lies as stored or transposed, by shape and CPU. At load,
:func:`store_for_cpu` times both forms for each shape of weight (on throwaway
weights) and lays the model's weights out in the faster; the choice is kept
in a cache per machine, so later loads time nothing.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.core as mx
from mlx import nn

from cpu import blas
from cpu.busy import OtherProcesses

# The ways a float32 ``nn.Linear`` can compute ``x W^T`` on the CPU: with
# ``W`` as stored, or laid out as its transpose. Which is faster depends on
# the weight's shape and on the CPU: with few_rows.c's AVX-512 broadcast
# kernel, weights with 256 inputs are faster transposed, without it slower
# (cpu/README.md, docs/benchmark-log.md, 2026-11-27).
PRODUCT_FORMS = ("plain", "transposed")
# Rows at which store_for_cpu times the forms: a decoder step of one prompt,
# and of a batch or a verify pass.
TIMED_ROWS = (1, 8)
# Weights smaller than this (in elements) keep the plain form: their
# products take a few microseconds, too few to matter. The 256 x 256
# projections of the benchmark pair's draft are timed, since transposed
# they make its passes faster (docs/benchmark-log.md, 2026-11-26).
TIMED_FORM_MIN_SIZE = 1 << 16
# Another form replaces the plain one only when it takes at most this share
# of its time, so that near-ties do not make two loads of a model on one
# machine compute differently.
FORM_MARGIN = 0.9


def fastest_form(times: dict[str, float]) -> str:
    """The form in ``times`` (seconds per form) to compute with: the fastest,
    unless it saves less than ``1 - FORM_MARGIN`` of the plain form's time."""
    fastest = min(times, key=times.get)
    return fastest if times[fastest] <= FORM_MARGIN * times["plain"] else "plain"


# store_for_cpu times each form over this many bytes of weights, taken in
# turn, so that each product reads its weight from memory as a decoder pass
# does, not from a cache (last-level caches here: 32 MB)...
TIMED_FORM_BYTES = 64 << 20
# ...and each timing evaluates the products of up to this many bytes of them
# in one graph: evaluating a graph costs tens of microseconds here, more
# than a small weight's product.
TIMED_GRAPH_BYTES = 16 << 20


def form_times(
    shape: tuple[int, int], dtype: mx.Dtype, forms: Sequence[str], repeats: int = 7
) -> dict[str, float]:
    """Seconds of ``x W^T`` for a weight of ``shape`` in each of ``forms``
    (``PRODUCT_FORMS``) at each of ``TIMED_ROWS`` rows, summed over the rows:
    medians of ``repeats`` timings, the forms interleaved, on throwaway
    weights of ``TIMED_FORM_BYTES`` in all, ``TIMED_GRAPH_BYTES`` of them
    a timing."""
    weight_bytes = math.prod(shape) * dtype.size
    count = max(1, TIMED_FORM_BYTES // weight_bytes)
    per_timing = max(1, min(count, TIMED_GRAPH_BYTES // weight_bytes))
    turn = itertools.count()
    weights = [mx.ones(shape, dtype) for _ in range(count)]
    stored_transposed = [mx.contiguous(w.T) for w in weights] if "transposed" in forms else []
    mx.eval(weights, stored_transposed)
    products = {
        "plain": lambda x, i: x @ weights[i].T,
        "transposed": lambda x, i: x @ stored_transposed[i],
    }
    totals = dict.fromkeys(forms, 0.0)
    for rows in TIMED_ROWS:
        x = mx.ones((rows, shape[1]), dtype)
        times = {form: [] for form in forms}
        for _ in range(repeats):
            for form in forms:
                taken = [next(turn) % count for _ in range(per_timing)]
                tic = time.perf_counter()
                mx.eval([products[form](x, i) for i in taken])
                times[form].append((time.perf_counter() - tic) / per_timing)
        for form in forms:
            totals[form] += statistics.median(times[form])
    return totals


# The forms store_for_cpu chose, by blas.machine_key, shape, type and forms
# timed, in blas.cache_directory(): timing them takes most of a model's
# load (docs/linux.md).
FORMS_FILE = "forms.json"


def chosen_form(
    shape: tuple[int, int], dtype: mx.Dtype, forms: Sequence[str], busy: bool = False
) -> str:
    """``fastest_form`` of ``form_times`` for a weight of ``shape``: timed
    once per machine and thread count and remembered in the cache (when it
    can be written), so that later loads take the same form at once. A
    choice timed while other processes kept the CPUs busy
    (``OtherProcesses``) is taken but not remembered: the next load times it
    again. When they were ``busy`` already, a choice not in the cache is the
    plain form, untimed: timings taken beside them are unfit to choose by."""
    directory = blas.cache_directory()
    threads = blas.num_threads()
    key = f"{blas.machine_key()} {threads} {shape[0]}x{shape[1]} {dtype} {'/'.join(forms)}"
    chosen = read_forms(directory)
    if key not in chosen:
        if busy:
            return "plain"
        others = OtherProcesses()
        chosen[key] = fastest_form(form_times(shape, dtype, forms))
        if directory is not None and not others.were_busy():
            write_forms(directory, {**read_forms(directory), key: chosen[key]})
    return chosen[key]


def read_forms(directory: Path | None) -> dict[str, str]:
    """The forms remembered in ``directory``; none if it holds no readable file."""
    try:
        forms = json.loads((directory / FORMS_FILE).read_text())
    except (TypeError, OSError, ValueError):  # no directory, no file, a broken one
        return {}
    return forms if isinstance(forms, dict) else {}


def write_forms(directory: Path, forms: dict[str, str]) -> None:
    """Replace ``directory``'s forms file with ``forms`` whole, or leave it
    as it is if it cannot be written."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        descriptor, staging = tempfile.mkstemp(suffix=".tmp", dir=directory)
    except OSError:
        return
    try:
        with os.fdopen(descriptor, "w") as file:
            json.dump(forms, file, indent=0)
        os.replace(staging, directory / FORMS_FILE)
    except OSError:
        os.unlink(staging)


def store_for_cpu(
    model: nn.Module, busy: bool = False, choose_form: Callable[..., str] | None = None
) -> None:
    """Choose, for each shape of float32 weight of ``model``'s ``nn.Linear``
    layers, the form of ``x W^T`` that this CPU computes fastest
    (``PRODUCT_FORMS``, timed by :func:`form_times`), and lay out its
    weights for it; the embedding ``model.shared`` too when it is the output
    projection (``model.args.tie_word_embeddings``). Shapes do not change,
    only where elements lie and the order OpenBLAS sums in, so every form
    computes the same function within round-off. In place, one weight at a
    time: memory grows by one weight while laying out, by twice
    ``TIMED_FORM_BYTES`` (or two weights) while timing. Each shape is timed
    once per machine (``chosen_form``), and not at all while other processes
    are ``busy``. ``choose_form``: what chooses, with the signature of
    ``chosen_form`` (its default).

    Half-precision products are not OpenBLAS's: they keep the plain form."""
    by_shape = {}
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.dtype == mx.float32:
            by_shape.setdefault(module.weight.shape, []).append(module)
    if model.args.tie_word_embeddings and type(model.shared) is nn.Embedding:
        by_shape.setdefault(model.shared.weight.shape, []).append(model.shared)
    choose = choose_form or chosen_form
    for modules in by_shape.values():
        weight = modules[0].weight
        if weight.dtype != mx.float32 or weight.size < TIMED_FORM_MIN_SIZE:
            continue
        if choose(weight.shape, weight.dtype, PRODUCT_FORMS, busy) == "transposed":
            for module in modules:
                module.weight = transposed_in_memory(module.weight)


def transposed_in_memory(weight: mx.array) -> mx.array:
    """``weight``, same shape, laid out as its transpose: [out, in] read as
    [in, out] row by row."""
    transposed = mx.contiguous(weight.T)
    mx.eval(transposed)
    return transposed.T
