"""Loading converted models: finding them by name, reading their weights
(split across a group of processes, where there is one), checking that a
draft goes with its main model and that both fit in memory, and building a
``SpeculativeDecoder`` from them. ``main.py``, ``server.py`` and the
benchmarks load through here; from Python, ``load`` is the one call:

    from loading import load
    decoder = load("t5-11b", "t5-small", num_draft=5)

The commands import this module only once their arguments are checked
(``cli.py``): it imports MLX, transformers' tokenizers come on first use.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

# First: the fast BLAS on Linux must load before mlx (see cpu/__init__.py).
import cpu  # isort: skip
import mlx.core as mx

from auto import MAX_AUTO_DRAFT
from cache import KVCache
from cli import format_bytes, quiet_transformers, script_command
from cpu.attention import SOFTMAX_CPU_MIN_SCORES
from decoder import SpeculativeDecoder
from distributed import rank_zero_forms
from drafting import check_draft_compatible
from layout import (
    LEGACY_WEIGHTS_FILE,
    MODELS_DIRECTORY,
    REPOSITORY_MODELS,
    WEIGHTS_FILE,
    conversions_of,
    free_output,
    is_checkpoint,
    is_converted,
)
from model import (
    T5,
    ModelArgs,
    check_divisible,
    encoder_block_size,
    parameter_bytes,
    quantize,
    slice_positions,
)

# --- Finding models ----------------------------------------------------------


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


# --- Tokenizers and pairs ----------------------------------------------------


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
        # time, a large part of a short command's (docs/benchmark-log.md, 2026-11-26).
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
    args = [load_config(path) for path in (main_path, draft_path)]
    vocabs = [load_tokenizer(path).get_vocab() for path in (main_path, draft_path)]
    check_draft_compatible(*args, str(main_path), str(draft_path), *vocabs)


# --- Weights -----------------------------------------------------------------


# A self-attention's projections, in the order SelfAttention.qkv_proj stacks them.
STACKED_PROJECTIONS = ("query_proj", "key_proj", "value_proj")


def stacked_projections(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """``weights`` (by parameter name) with each self-attention's query, key
    and value projections stacked into its ``qkv_proj`` (see
    ``SelfAttention``), as convert.py writes them; lazily. A quantized
    layer's weight, scales and biases are stacked alike: its groups lie
    along the inputs, so each output row keeps its own."""
    stacked = dict(weights)
    pattern = re.compile(r"(.+\.self_attn)\.query_proj\.(weight|scales|biases)")
    for name in weights:
        if match := pattern.fullmatch(name):
            layer, kind = match.groups()
            names = [f"{layer}.{projection}.{kind}" for projection in STACKED_PROJECTIONS]
            if all(name in stacked for name in names):  # else loading says what is missing
                parts = [stacked.pop(name) for name in names]
                stacked[f"{layer}.qkv_proj.{kind}"] = mx.concatenate(parts, axis=0)
    return stacked


def weights_file(path: str | Path) -> Path:
    """The weights of the converted model at ``path``: its ``WEIGHTS_FILE``
    (safetensors), or the ``LEGACY_WEIGHTS_FILE`` (.npz) of an earlier
    conversion; ``FileNotFoundError`` if it has neither.

    MLX reads each member of an .npz through Python, and the last reader's
    reference can be dropped on MLX's I/O thread after the interpreter has
    begun to exit: a script that loads such a model and ends at once may
    abort (SIGABRT, "terminate called without an active exception"), which
    safetensors, faster to load too, avoids (docs/converting.md)."""
    for name in (WEIGHTS_FILE, LEGACY_WEIGHTS_FILE):
        if (Path(path) / name).is_file():
            return Path(path) / name
    raise FileNotFoundError(f"{Path(path) / WEIGHTS_FILE} does not exist")


def load_config(path: str | Path) -> ModelArgs:
    """The ``ModelArgs`` in ``path/config.json``; ``ValueError`` if unreadable."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} does not exist")
    try:
        return ModelArgs.from_dict(json.loads(config_file.read_text()))
    except (ValueError, TypeError) as error:  # bad JSON, missing or odd fields
        raise ValueError(
            f"cannot read {config_file}: {error}; convert the model again with convert.py"
        ) from None


def load_model(
    path: str | Path,
    group: mx.distributed.Group | None = None,
    choose_form: Callable[..., str] | None = None,
) -> T5:
    """Load a model directory written by ``convert.py``, quantized or not:
    with a ``group``, only this process's share of it, split across the
    group (``model.T5.shard``); ``choose_form``: the CPU's choice
    of product forms (``cpu.prepare``).

    Raises ``FileNotFoundError`` if a file is missing and ``ValueError`` if
    the weights are unreadable or do not fit the configuration.
    """
    path = Path(path)
    args = load_config(path)
    file = weights_file(path)
    if file.name == LEGACY_WEIGHTS_FILE:
        print(
            f"note: {file} is the format of earlier conversions, which can abort the "
            f"process as it exits; convert the model again to write {WEIGHTS_FILE}",
            file=sys.stderr,
        )
    try:
        weights = mx.load(str(file))
        if file.name == LEGACY_WEIGHTS_FILE:
            weights = stacked_projections(weights)
        model = T5(args)
        if args.quantization:
            # The layers convert.py quantized are those whose weights have scales.
            scaled = {name.removesuffix(".scales") for name in weights if name.endswith(".scales")}
            quantize(model, args.quantization, scaled)
        model.load_weights(list(weights.items()))
        del weights  # the model holds them now: each weight cpu.prepare copies is freed
        if group is not None:
            model.shard(group)
        cpu.prepare(model, choose_form)
        mx.eval(model.parameters())
    except (ValueError, RuntimeError) as error:
        reason = " ".join(str(error).split())  # MLX's message spans lines
        raise ValueError(
            f"cannot load the weights in {file}: {reason}; convert the model again with convert.py"
        ) from None
    return model


# --- Memory ------------------------------------------------------------------


def available_memory() -> int:
    """Bytes MLX can use: the recommended working set on Apple silicon, else
    the physical memory."""
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


def held_bytes(
    paths: list[Path], prompt_tokens: int, max_tokens: int, shards: int = 1
) -> tuple[list[float], list[float]]:
    """What this process holds of each model at ``paths`` (the main model's
    directory, then the draft's, if any): its weights' bytes, and the bytes
    one row decoding a prompt of ``prompt_tokens`` tokens up to
    ``max_tokens`` needs besides (``runtime_bytes``); the main model split
    into ``shards`` (one process's share of its weights and caches)."""
    share = [1 / shards] + [1] * (len(paths) - 1)
    weights = [weights_file(path).stat().st_size * part for path, part in zip(paths, share)]
    rows = [
        runtime_bytes(path, prompt_tokens, max_tokens) * part for path, part in zip(paths, share)
    ]
    return weights, rows


def largest(fits: Callable[[int], bool], low: int, high: int) -> int:
    """The largest n in [``low``, ``high``] that ``fits``, which holds at
    ``low`` and, once it fails, fails for every larger n."""
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def check_memory(
    model_name: str,
    paths: list[Path],
    prompt_tokens: int,
    max_tokens: int,
    batch_size: int = 1,
    shards: int = 1,
) -> None:
    """Raise ``MemoryError``, saying what would fit, when the models at
    ``paths`` (``held_bytes``) would not fit in memory together, decoding
    ``batch_size`` prompts of up to ``prompt_tokens`` tokens at once."""
    weights, per_row = held_bytes(paths, prompt_tokens, max_tokens, shards)
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
        rows = held_bytes(paths, prompt_tokens, tokens, shards)[1]
        return sum(weights) + batch_size * sum(rows) <= available

    if fits(1):  # the cache for the tokens asked for is what does not fit
        most = largest(fits, 1, max_tokens - 1)
        raise MemoryError(
            f"{message}: the decoder cache for --max-tokens {max_tokens} does not fit; "
            f"--max-tokens {most} fits"
        )
    main_args = load_config(paths[0])
    if main_args.quantization is None:
        four_bit = parameter_bytes(main_args, mx.bfloat16, FOUR_BIT) / shards
        message += f"; with 4-bit weights the main model needs {format_bytes(four_bit)}"
        if needed - weights[0] + four_bit <= available:
            source = "<its checkpoint>" if Path(model_name).is_dir() else model_name
            message += f", which fits: {script_command('convert.py')} --model {source} -q"
        else:
            message += ", still too much"
    elif len(paths) > 1 and weights[0] + runtime[0] <= available:
        message += "; the main model alone fits: --draft-model-name none --prompt-lookup 3"
    raise MemoryError(message)


def prompt_token_limit(paths: list[Path], max_tokens: int, batch_size: int, shards: int = 1) -> int:
    """The longest prompt, in tokens, for which ``batch_size`` rows at
    ``max_tokens`` fit in memory (``held_bytes``), and which costs the rows
    beside it at most half their speed (``cost_token_limit``): a server's
    limit."""
    available = available_memory()

    def fits(tokens: int) -> bool:
        weights, rows = held_bytes(paths, tokens, max_tokens, shards)
        return sum(weights) + batch_size * sum(rows) <= available

    if not fits(1):
        raise MemoryError(
            f"{' and '.join(map(str, paths))} leave no memory for a batch of {batch_size}"
        )
    return min(largest(fits, 1, 1 << 20), cost_token_limit(load_config(paths[0])))


def cost_token_limit(args: ModelArgs) -> int:
    """The longest prompt whose cross-attention costs a decoded token no
    more multiply-adds than the rest of the main model's step
    (``ModelArgs.decode_work``). Its encoding is sliced between the rounds
    (``BatchGenerator``), but once it joins, every row's cross-attention
    widens to its length until it leaves: the rows beside it then decode
    at no less than about half their speed. Never below ``COST_LIMIT_FLOOR``."""
    per_prompt_token = args.num_decoder_layers * 2 * args.num_heads * args.d_kv
    return max(COST_LIMIT_FLOOR, args.decode_work // per_prompt_token)


# A small model's step is mostly fixed costs that multiply-adds do not
# count: cost_token_limit accepts prompts up to this length whatever the model.
COST_LIMIT_FLOOR = 2048


# --- Loading -----------------------------------------------------------------


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
    if group is None:
        models = [load_model(path) for path in paths]
    else:
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


def load_checked(
    model_name: str,
    paths: list[Path],
    *,
    prompt_tokens: int,
    max_tokens: int,
    batch_size: int,
    group: mx.distributed.Group | None = None,
    tokenizer=None,
    **decoding,
) -> SpeculativeDecoder:
    """What ``main.py`` and ``server.py`` do to load the models at ``paths``
    (``model_paths`` of ``model_name`` and its draft): check that
    ``batch_size`` rows of ``prompt_tokens`` and ``max_tokens`` fit
    (``check_memory``, counting this process's share of a main model split
    across ``group``), say what loads on standard error, then load
    (``load_decoder``, with ``decoding``'s num_draft, delta and prompt_lookup)."""
    shards = group.size() if group is not None else 1
    check_memory(model_name, paths, prompt_tokens, max_tokens, batch_size, shards)
    for path, role in zip(paths, ("", "draft ")):
        across = f" (split across {shards} processes)" if shards > 1 and not role else ""
        print(f"Loading {role}{path}{across}", file=sys.stderr)
    return load_decoder(paths, tokenizer, group=group, **decoding)


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
