"""Loading converted models: finding them by name, checking that a draft
goes with its main model and that both fit in memory, and building a
``SpeculativeDecoder`` from them. ``main.py``, ``server.py`` and the
benchmarks load through here; from Python, ``load`` is the one call:

    from loading import load
    decoder = load("t5-11b", "t5-small", num_draft=5)

MLX, transformers and the models are imported only when something loads, so
that a command checks its arguments (``cli.py``) before those slow imports.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from layout import (
    MODELS_DIRECTORY,
    REPOSITORY,
    REPOSITORY_MODELS,
    WEIGHTS_FILE,
    conversions_of,
    free_output,
    is_checkpoint,
    is_converted,
)

if TYPE_CHECKING:
    import mlx.core as mx

    from decoder import SpeculativeDecoder


def names_a_path(name: str) -> bool:
    """Whether ``name`` can only be a path, not a model name or a Hugging
    Face hub id (``owner/name``): absolute, starting with ``.`` or ``~``,
    with more than one ``/``, or below a directory that exists."""
    parts = Path(name).parts
    return (
        Path(name).is_absolute()
        or name.startswith((".", "~"))
        or name.count("/") > 1
        or (len(parts) > 1 and Path(parts[0]).is_dir())
    )


def from_here(path: Path) -> str:
    """``path`` as a user types it in the current directory: relative where
    it lies below it, else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def script_command(script: str) -> str:
    """How to run this repository's ``script`` (``convert.py``, ``main.py``)
    in advice a user copies, from the current directory: this Python, then
    the script (``.venv/bin/python convert.py`` in the checkout after the
    README's quick start; absolute paths elsewhere)."""
    return f"{from_here(Path(sys.executable))} {from_here(REPOSITORY / script)}"


def resolve_model(name: str | Path) -> Path:
    """The directory of a model convert.py wrote: ``name`` itself, the
    conversion of that name in ``mlx_models/`` of the current directory or
    of this repository (``convert.py --model t5-small`` writes
    ``mlx_models/t5-small``) or, for a Hugging Face checkpoint directory,
    its one conversion in mlx_models/ (said on standard error). Otherwise
    ``FileNotFoundError`` saying what to do: for a name, the convert.py
    command to run; for a path, what is missing there."""
    name = str(name)
    stored = name.replace("/", "-")
    for path in (Path(name), Path(MODELS_DIRECTORY) / stored, REPOSITORY_MODELS / stored):
        if is_converted(path):
            return path
    if not is_checkpoint(Path(name)):
        if Path(name).exists():
            raise FileNotFoundError(
                f"{name} is not a model: neither converted by convert.py (config.json and "
                f"{WEIGHTS_FILE}) nor a Hugging Face checkpoint (config.json and weights)"
            )
        if names_a_path(name):
            raise FileNotFoundError(f"model {name!r} not found: no such directory")
        places = [Path.cwd() / MODELS_DIRECTORY / stored, REPOSITORY_MODELS / stored]
        if places[0].resolve() == places[1].resolve():  # run from the checkout
            places = places[:1]
        raise FileNotFoundError(
            f"model {name!r} is not converted: no converted model at "
            f"{' nor at '.join(map(str, places))}; for a Hugging Face hub id, run: "
            f"{script_command('convert.py')} --model {name}"
        )
    conversions = conversions_of(Path(name))
    if len(conversions) == 1:
        print(
            f"{name} is a Hugging Face checkpoint: using its conversion {conversions[0]}",
            file=sys.stderr,
        )
        return conversions[0]
    if conversions:
        raise FileNotFoundError(
            f"{name} is a Hugging Face checkpoint converted more than once "
            f"({', '.join(map(str, conversions))}): give one of those instead"
        )
    out = free_output(Path(name))
    raise FileNotFoundError(
        f"{name} is a Hugging Face checkpoint, not converted yet; run: {script_command('convert.py')} "
        f"--model {shlex.quote(name)} --out {shlex.quote(str(out))}, then give {out} in its place"
    )


def quiet_transformers() -> None:
    """Silence transformers' advisory warnings, such as that PyTorch was not
    found: only its tokenizers are used, which need no PyTorch (the README's
    install has none). Takes effect when transformers is first imported."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


# What transformers itself sets as model_max_length when a tokenizer has no limit.
NO_LENGTH_LIMIT = int(1e30)

# Tokenizer classes that T5TokenizerFast loads as AutoTokenizer would (from
# tokenizer.json): T5 and mT5 save these.
T5_TOKENIZERS = ("T5Tokenizer", "T5TokenizerFast")


def load_tokenizer(path: str | Path):
    """The Hugging Face tokenizer saved beside a converted model. It sets no
    length limit: T5's relative positions have none, and prompts are bounded
    by memory (``check_memory``) and the server's own limit, not by the 512
    tokens T5 was trained on, which transformers would warn about."""
    quiet_transformers()
    # Without its files, transformers would quietly build a default T5
    # tokenizer from config.json and every word would become <unk>.
    if not any((Path(path) / name).is_file() for name in ("tokenizer.json", "spiece.model")):
        raise FileNotFoundError(f"{path} has no tokenizer; convert the model again with convert.py")
    try:
        config = json.loads((Path(path) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if config.get("tokenizer_class") in T5_TOKENIZERS and (Path(path) / "tokenizer.json").is_file():
        # The same tokenizer as AutoTokenizer's, in under half its import
        # time, a large part of a short command's (docs/benchmarks.md, 2026-11-26).
        from transformers import T5TokenizerFast

        tokenizer = T5TokenizerFast.from_pretrained(str(path))
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.model_max_length = NO_LENGTH_LIMIT
    return tokenizer


def check_draft_directories(main_path: str | Path, draft_path: str | Path) -> None:
    """``check_draft_compatible`` for two converted model directories,
    reading only their configs and tokenizers, before any weights are loaded."""
    from drafting import check_draft_compatible
    from model import load_config

    args = [load_config(path) for path in (main_path, draft_path)]
    vocabs = [load_tokenizer(path).get_vocab() for path in (main_path, draft_path)]
    check_draft_compatible(*args, str(main_path), str(draft_path), *vocabs)


def available_memory() -> int:
    """Bytes MLX can use: the recommended working set on Apple silicon, else
    the physical memory."""
    import cpu  # noqa: F401  # isort: skip  (on Linux, the BLAS MLX must load first)
    import mlx.core as mx

    info = mx.device_info()
    if "max_recommended_working_set_size" in info:
        return info["max_recommended_working_set_size"]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# Peak bytes of encoder self-attention per byte of one block's float32
# scores (the scores, the mask, softmax's intermediates), measured on the
# CPU: about 1 to 1.5 in MLX's fused attention (fewer scores than
# cpu.attention.SOFTMAX_CPU_MIN_SCORES), 7 to 7.5 through cpu.attention.softmax_cpu.
# A GPU's attention is always the fused one (its peak there not measured).
FUSED_ATTENTION_PEAK_FACTOR = 1.5
ATTENTION_PEAK_FACTOR = 8
# Values per token and unit of d_ff alive in the feed-forward block: its
# hidden layer (the activation reuses it), and for gated models the two
# products and their activated product. tests/test_memory.py checks the
# estimate against measured peaks.
FEED_FORWARD_VALUES = 1
GATED_FEED_FORWARD_VALUES = 3.5


def runtime_bytes(path: Path, prompt_tokens: int, max_tokens: int) -> int:
    """An estimate of what a converted model needs besides its weights, per
    row: the decoder's self- and cross-attention caches, and the larger of
    the encoder's two peaks for a prompt of ``prompt_tokens`` (their sum
    when the encoder takes the prompt in one block): self-attention
    (its queries, keys and values, and one block's scores: the encoder
    works over blocks of queries whose scores take at most
    ``model.ENCODER_BLOCK_BYTES``, so memory grows with the prompt, not its
    square) and the feed-forward block's hidden layer (over the same block
    of positions, ``model.T5.encode_slices``)."""
    import cpu  # noqa: F401  # isort: skip  (on Linux, the BLAS MLX must load first)
    import mlx.core as mx

    from auto import MAX_AUTO_DRAFT
    from cache import KVCache
    from cpu.attention import SOFTMAX_CPU_MIN_SCORES
    from model import encoder_block_size, load_config, slice_positions

    args = load_config(path)
    config = json.loads((path / "config.json").read_text())
    value_bytes = 2 if config.get("dtype", "float32") in ("bfloat16", "float16") else 4
    inner = args.num_heads * args.d_kv
    decoded = KVCache.step * math.ceil((max_tokens + MAX_AUTO_DRAFT + 1) / KVCache.step)
    cache = 2 * args.num_decoder_layers * (prompt_tokens + decoded) * inner
    residual = 2 * prompt_tokens * args.d_model  # the layer's input and its norm
    projection, feed_forward_work = args._layer_work
    block_size = min(
        encoder_block_size(1, args.num_heads, prompt_tokens),
        slice_positions(prompt_tokens, 1, 4 * projection + feed_forward_work),
    )
    # Queries, keys, values and the output; over blocks also their
    # contiguous copies and the output's blocks.
    attention_values = prompt_tokens * inner * (4 if block_size == prompt_tokens else 8)
    scores = args.num_heads * block_size * prompt_tokens
    factor = FUSED_ATTENTION_PEAK_FACTOR
    if mx.default_device() == mx.cpu and scores >= SOFTMAX_CPU_MIN_SCORES:
        factor = ATTENTION_PEAK_FACTOR
    attention = attention_values * value_bytes + factor * 4 * scores
    gated = args.feed_forward_proj.startswith("gated-")
    hidden = GATED_FEED_FORWARD_VALUES if gated else FEED_FORWARD_VALUES
    feed_forward = hidden * block_size * args.d_ff * value_bytes
    # A block's attention and feed-forward block are one computation, whose two peaks can overlap.
    encoder = attention + feed_forward
    return int((cache + residual) * value_bytes + encoder)


# What check_memory proposes when the models do not fit: convert.py -q's default.
FOUR_BIT = {"group_size": 64, "bits": 4, "mode": "affine"}


def format_bytes(size: float) -> str:
    """``size`` bytes in GB, or in MB below 0.1 GB."""
    return f"{size / 1e9:.3f} GB" if size >= 1e8 else f"{size / 1e6:.2f} MB"


def check_memory(
    model_name: str,
    paths: list[Path],
    prompt_tokens: int,
    max_tokens: int,
    batch_size: int = 1,
    shards: int = 1,
) -> None:
    """Raise ``MemoryError``, saying what would fit, when the models at
    ``paths`` (the main model's directory, then the draft's, if any) would not
    fit in memory together, decoding ``batch_size`` prompts of up to
    ``prompt_tokens`` tokens at once; the main model split into ``shards``
    (one process's share of its weights and caches: see ``distributed.py``)."""
    import cpu  # noqa: F401  # isort: skip  (on Linux, the BLAS MLX must load first)
    import mlx.core as mx

    from model import load_config, parameter_bytes, weights_file

    share = [1 / shards] + [1] * (len(paths) - 1)
    weights = [weights_file(path).stat().st_size * part for path, part in zip(paths, share)]
    per_row = [
        runtime_bytes(path, prompt_tokens, max_tokens) * part for path, part in zip(paths, share)
    ]
    runtime = [batch_size * row for row in per_row]
    needed, available = sum(weights) + sum(runtime), available_memory()
    if needed <= available:
        return
    batch = f" for a batch of {batch_size}" if batch_size > 1 else ""
    message = (
        f"{' and '.join(map(str, paths))} {'need' if len(paths) > 1 else 'needs'} about "
        f"{format_bytes(needed)}{batch}, more than the {format_bytes(available)} this "
        "machine has for MLX"
    )
    fitting = int((available - sum(weights)) // sum(per_row))
    if fitting >= 1:  # a smaller batch fits
        raise MemoryError(f"{message}; --batch-size {fitting} fits")

    def fits(tokens: int) -> bool:
        rows = sum(
            runtime_bytes(path, prompt_tokens, tokens) * part for path, part in zip(paths, share)
        )
        return sum(weights) + batch_size * rows <= available

    if fits(1):  # the cache for the tokens asked for is what does not fit
        most, too_many = 1, max_tokens
        while too_many - most > 1:
            middle = (most + too_many) // 2
            most, too_many = (middle, too_many) if fits(middle) else (most, middle)
        raise MemoryError(
            f"{message}: the decoder cache for --max-tokens {max_tokens} does not fit; "
            f"--max-tokens {most} fits"
        )
    main_args = load_config(paths[0])
    if main_args.quantization is None:
        four_bit = parameter_bytes(main_args, mx.bfloat16, FOUR_BIT) * share[0]
        message += f"; with 4-bit weights the main model needs {format_bytes(four_bit)}"
        if needed - weights[0] + four_bit <= available:
            source = "<its checkpoint>" if Path(model_name).is_dir() else model_name
            message += f", which fits: {script_command('convert.py')} --model {source} -q"
        else:
            message += ", still too much"
    elif len(paths) > 1 and weights[0] + runtime[0] <= available:
        message += "; the main model alone fits: --draft-model-name none --prompt-lookup 3"
    raise MemoryError(message)


def model_paths(model: str | Path, draft_model: str | Path | None) -> list[Path]:
    """The directories of ``model`` and of ``draft_model`` (None: no draft
    model), found by ``resolve_model``, once the draft is checked to speak
    the main model's vocabulary (``IncompatibleDraftError``)."""
    paths = [resolve_model(model)]
    if draft_model is not None:
        paths.append(resolve_model(draft_model))
        check_draft_directories(*paths)
    return paths


def load_decoder(
    paths: list[Path],
    tokenizer=None,
    *,
    num_draft: int | str = 5,
    delta: float = 0.0,
    prompt_lookup: int = 0,
    group: mx.distributed.Group | None = None,
) -> SpeculativeDecoder:
    """A ``SpeculativeDecoder`` of the models at ``paths`` (``model_paths``:
    the main model's directory, then the draft's, if any), with the main
    model's tokenizer (``tokenizer``, when loaded already). With a
    ``group`` of processes (``distributed.init_group``), each loads only
    its share of the main model, split across them, and the draft model
    whole; their choices that depend on timing are rank 0's."""
    from decoder import SpeculativeDecoder
    from model import load_config, load_model

    if group is None:
        models = [load_model(path) for path in paths]
    else:
        from distributed import check_divisible, rank_zero_forms

        check_divisible(load_config(paths[0]), group.size(), str(paths[0]))
        choose_form = rank_zero_forms(group)
        models = [load_model(paths[0], group, choose_form)]
        models += [load_model(path, None, choose_form) for path in paths[1:]]
    return SpeculativeDecoder(
        models[0],
        models[1] if len(models) > 1 else None,
        tokenizer or load_tokenizer(paths[0]),
        num_draft=num_draft,
        delta=delta,
        prompt_lookup=prompt_lookup,
        group=group,
    )


def load(
    model: str | Path,
    draft_model: str | Path | None = None,
    *,
    num_draft: int | str = 5,
    delta: float = 0.0,
    prompt_lookup: int = 0,
) -> SpeculativeDecoder:
    """A ``SpeculativeDecoder`` for ``model`` drafted by ``draft_model``
    (None: no draft model; then drafts come from ``prompt_lookup``, or none),
    each a name given to convert.py or a converted directory
    (``resolve_model``). The pair is checked before any weights load."""
    return load_decoder(
        model_paths(model, draft_model),
        num_draft=num_draft,
        delta=delta,
        prompt_lookup=prompt_lookup,
    )
