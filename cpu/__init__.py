"""MLX's CPU backend, tuned: everything in this folder exists only for it.

Import this package before ``mlx.core`` (every module of the project does,
first): on Linux it puts an optimized BLAS under MLX (:mod:`cpu.blas`).
``loading.load_model`` calls :func:`prepare` on every model it loads. Where
the default device is a GPU, both do nothing that changes a computation.
What each part buys, measured: README.md in this folder.
"""

from cpu import blas  # isort: skip  (first: before anything imports mlx)
from collections.abc import Callable

import mlx.core as mx
from mlx import nn

from cpu import attention, busy, forms

# Other processes' CPU time since this package was imported, then since the
# last prepare: how many cores they leave this process.
_others = busy.OtherProcesses()


def prepare(model: nn.Module, choose_form: Callable[..., str] | None = None) -> None:
    """Make ``model`` (a ``model.T5``) compute as this CPU does fastest:
    OpenBLAS on the cores other processes left free since the last look
    (threads that wait for a busy core make runs several times as long:
    README.md), its float32 weights laid out in the product form timed
    fastest here (:mod:`cpu.forms`; not timed while others are busy), and
    the CPU's softmax for its attention (:mod:`cpu.attention`). The same
    function, within round-off. ``choose_form``: what chooses each form
    (default :func:`cpu.forms.chosen_form`; in a group of processes, rank
    0's choice). Nothing where the default device is not the CPU."""
    global _others
    if mx.default_device() != mx.cpu:
        return
    blas.use_threads(busy.free_cores(_others))
    forms.store_for_cpu(model, busy=_others.were_busy(), choose_form=choose_form)
    _others = busy.OtherProcesses()
    model.use_attention(attention.attention)
