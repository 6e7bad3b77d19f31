"""Build a main/draft T5 pair for benchmarking speculative decoding without downloads.

    python benchmarks/build_benchmark_pair.py --out benchmark_models [--train-steps N] [--seed S]
    python benchmarks/build_benchmark_pair.py --out benchmark_models --draft TRAINED/hf-draft
    python benchmarks/build_benchmark_pair.py --out benchmark_models --random-t5-shapes
    python benchmarks/build_benchmark_pair.py --out benchmark_models --write-prompts N

The second form grows the main model from a draft trained by an earlier build (its
``hf-draft``, such as the project's shared one) instead of training one: the build then
takes a few minutes. The third form, run after the first, writes random-weight checkpoints
of the real T5-base and T5-small shapes: for timing regular decoding against transformers,
where only the shapes matter. The fourth, also run after the first, writes ``prompts-N.txt``: N prompts of
the pair's own training style (``write_prompts``), for the batch benchmark.

Real checkpoints (T5-XXL drafted by T5-small) cannot be downloaded here, and random-init T5
models are no substitute: they fall into loops of one or two tokens, and two of them agree far
more often than real models do. This script builds a pair that behaves like a real one:

1. **Text.** English prose available offline: the stdlib's ``pydoc_data.topics`` (the help
   pages of the language reference) and the docstrings of the stdlib's own modules, read with
   ``ast`` (nothing is imported). Paragraphs are split into sentences. The draft is trained
   on 1,500 of them (about 60k tokens), few enough to be learned nearly by heart in a short
   run (see ``TRAIN_PARAGRAPHS``); a few percent of the rest are held out.
2. **Tokenizer.** A SentencePiece unigram model trained on that text with T5's special ids
   (pad 0, eos 1, unk 2, no bos), trained on all but the held-out paragraphs and saved as a
   transformers ``T5Tokenizer``.
3. **Draft.** A small T5 (original-T5 layout: ReLU feed-forward, tied embeddings) trained with
   torch on three T5-style seq2seq tasks whose outputs are real text of 20-60 tokens:
   ``continue: <sentences>`` -> the sentence(s) that follow,
   ``restore: <sentences with words dropped and swapped>`` -> the original sentences, and
   ``fill: <sentences with words replaced by _>`` -> the original sentences.
4. **Main.** The trained draft *grown* into a model with many more parameters and the same
   ``d_model``: more attention heads, wider feed-forward blocks and extra layers. All new
   weights are random; every new output projection (attention ``o`` columns of new heads,
   feed-forward ``wo`` columns of new units, ``o``/``wo`` of new layers) is multiplied by one
   factor ``scale``. At ``scale = 0`` the main model computes exactly the draft's function
   (acceptance 1); larger values perturb it. ``scale`` is tuned by bisection so that greedy
   speculative decoding accepts about 75% of the draft's tokens, as T5-XXL with T5-small does
   in Leviathan et al. (arXiv 2211.17192).
5. **Measurement.** Both checkpoints are saved in Hugging Face format (``hf-main``,
   ``hf-draft``), converted with ``convert.py`` to float32 MLX directories (``main``,
   ``draft``), and the acceptance rate is measured with this repository's
   ``SpeculativeDecoder`` on ten prompts of the training style (fresh corruptions of the
   training paragraphs), other than the ones the scale was tuned on.

The build is deterministic for a given ``--seed`` (on the same machine and library versions)
and takes about 20 minutes on 2 otherwise idle CPU cores, most of it training the draft.
The trained draft is saved with its settings (``hf-draft/training.json``); a later run with
the same settings reuses it unless ``--retrain`` is given. Acceptance during tuning is
computed in torch, exactly as greedy speculative decoding would count it, from where the
draft's teacher-forced argmax agrees with the main model's greedy output (see
``speculative_counts``).
"""

from __future__ import annotations

import argparse
import ast
import filecmp
import functools
import hashlib
import json
import math
import random
import re
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

# The example's modules live one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sentencepiece as spm
import torch
from transformers import T5Config, T5ForConditionalGeneration, T5Tokenizer
from transformers.utils import logging as hf_logging

import convert
from cli import ArgumentParser

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2  # T5's special ids; the decoder starts from PAD_ID
VOCAB_SIZE = 3000
MAX_SOURCE_TOKENS = 64  # prompt length cap (tokens, EOS included)
MIN_TARGET_TOKENS, MAX_TARGET_TOKENS = 20, 60  # target length range (EOS excluded)
HELD_OUT_FRACTION = 0.04  # paragraphs kept out of training (for the held-out loss)
# The draft is trained on this many paragraphs (about 60k tokens), few enough that a short run
# sees each about 25 times and learns much of them by heart. That is what makes its
# greedy output real text: a small seq2seq model trained for minutes has not yet learned to
# copy from its input, and on text it has not memorised greedy decoding falls into loops
# ("the same as the same as ..."). Evaluation prompts therefore come from these paragraphs,
# with fresh corruptions; on unseen text the pair behaves like an undertrained model.
TRAIN_PARAGRAPHS = 1500

# Corruption of the "restore:" task: each word is dropped / swapped with its neighbour with
# these probabilities. The "fill:" task replaces words with "_" with probability MASK_PROB.
DROP_PROB, SWAP_PROB, MASK_PROB = 0.15, 0.10, 0.20
# How often each task is drawn during training.
TASK_WEIGHTS = {"continue": 0.2, "restore": 0.45, "fill": 0.35}
LEARNING_RATE, WARMUP_STEPS = 1.5e-3, 100  # AdamW peak rate, linear warm-up steps

TARGET_ALPHA = 0.75  # acceptance rate the scale factor is tuned for
MAX_NEW_TOKENS = 64  # tokens generated per prompt when measuring acceptance
TUNE_NUM_DRAFT = 4  # num_draft used while tuning (alpha barely depends on it)
SIMULATED_NUM_DRAFTS = (3, 4, 5)  # num_draft values whose acceptance is computed in torch
MEASURE_NUM_DRAFTS = (3, 5)  # num_draft values measured with this repository's MLX decoder
NUM_TUNE_PROMPTS = 48  # prompts used to tune the scale factor
NUM_EVAL_PROMPTS = 10  # other prompts, used for the final measurement
NUM_LONG_PROMPTS, LONG_PROMPT_TOKENS = 5, 400  # prompts-long.txt, for prompt processing
BISECTION_STEPS = 7
# Written beside the trained draft; a later run with the same settings reuses the draft.
TRAINING_RECORD = "training.json"


@dataclass(frozen=True)
class Shape:
    """The size of a T5 model; the vocabulary and ``d_model`` are shared by the pair."""

    d_model: int
    d_kv: int
    num_heads: int
    d_ff: int
    num_layers: int  # in the encoder and in the decoder

    def config(self, vocab_size: int = VOCAB_SIZE) -> T5Config:
        """A transformers config for this shape (original T5: ReLU, tied, scaled outputs)."""
        return T5Config(
            vocab_size=vocab_size,
            d_model=self.d_model,
            d_kv=self.d_kv,
            d_ff=self.d_ff,
            num_layers=self.num_layers,
            num_decoder_layers=self.num_layers,
            num_heads=self.num_heads,
            feed_forward_proj="relu",
            dropout_rate=0.0,
            decoder_start_token_id=PAD_ID,
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
        )


# The draft is a scaled-down T5-small (d_model 512, 8 heads, d_ff 2048, 6 + 6 layers) that
# trains in minutes on two cores. The main model keeps d_model and grows everything else;
# it reads about 10x the draft's weight bytes per decoding step (T5-XXL/T5-small: ~180x,
# which would make the main model too slow to benchmark on a CPU).
DRAFT_SHAPE = Shape(d_model=256, d_kv=64, num_heads=4, d_ff=1024, num_layers=4)
MAIN_SHAPE = Shape(d_model=256, d_kv=64, num_heads=16, d_ff=8192, num_layers=8)

# The real T5-base and T5-small shapes, with T5's 32128-entry output layer, built with random
# weights by --random-t5-shapes: timing regular decoding against transformers needs a real
# model's shape, not its weights. (Ids beyond the 3000-piece tokenizer decode to nothing.)
RANDOM_T5_SHAPES = {
    "t5-base": Shape(d_model=768, d_kv=64, num_heads=12, d_ff=3072, num_layers=12),
    "t5-small": Shape(d_model=512, d_kv=64, num_heads=8, d_ff=2048, num_layers=6),
}
T5_VOCAB_SIZE = 32128


def log(message: str) -> None:
    """Print a progress line immediately."""
    print(message, flush=True)


# ----------------------------------------------------------------------------------------------
# Text


def _prose_paragraphs(text: str) -> list[str]:
    """The prose paragraphs of a reStructuredText-like document, each on one line.

    Indented blocks (code, grammar, tables, nested lists), headings and fragments that do
    not look like sentences are skipped.
    """
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.strip("\n").split("\n")
        if any(line.startswith((" ", "\t")) for line in lines) or ">>>" in block:
            continue
        paragraph = " ".join(line.strip() for line in lines)
        paragraph = re.sub(r"\s+", " ", paragraph).strip()
        if len(paragraph) < 60 or not paragraph[0].isupper() or not paragraph.endswith("."):
            continue
        paragraphs.append(paragraph)
    return paragraphs


@functools.cache
def collect_paragraphs() -> tuple[str, ...]:
    """English prose that ships with Python: the pydoc help topics and stdlib docstrings
    (read once per process)."""
    from pydoc_data.topics import topics

    texts = [topics[key] for key in sorted(topics)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"test", "tests", "idle_test", "site-packages", "lib2to3", "turtledemo"}
    for path in sorted(stdlib.rglob("*.py")):
        if skipped.intersection(path.relative_to(stdlib).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                docstring = ast.get_docstring(node)
                if docstring:
                    texts.append(docstring)
    paragraphs = [p for text in texts for p in _prose_paragraphs(text)]
    return tuple(dict.fromkeys(paragraphs))  # drop duplicates, keep order


def split_sentences(paragraph: str) -> list[str]:
    """Split a paragraph after '.', '!' or '?' followed by a capitalised word."""
    return [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"'(*])", paragraph) if s]


# ----------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(paragraphs: Sequence[str], out_dir: Path) -> T5Tokenizer:
    """Train a T5-style SentencePiece model on ``paragraphs``; save it to ``out_dir``.

    transformers 5's ``T5Tokenizer(vocab_file=...)`` ignores the file, so the tokenizer is
    loaded with ``from_pretrained`` from a directory holding ``spiece.model``, which converts
    it; ``save_pretrained`` then writes ``tokenizer.json`` so it reloads offline.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = out_dir / "spiece"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(paragraphs),
        model_prefix=str(model_path),
        vocab_size=VOCAB_SIZE,
        model_type="unigram",
        pad_id=PAD_ID,
        eos_id=EOS_ID,
        unk_id=UNK_ID,
        bos_id=-1,
        character_coverage=1.0,
        max_sentence_length=16384,
        num_threads=1,  # deterministic
        minloglevel=2,
    )
    (out_dir / "spiece.vocab").unlink()
    tokenizer = T5Tokenizer.from_pretrained(str(out_dir), extra_ids=0)
    tokenizer.save_pretrained(str(out_dir))
    if len(tokenizer) != VOCAB_SIZE or tokenizer.pad_token_id != PAD_ID:
        raise RuntimeError(f"unexpected tokenizer: {len(tokenizer)} tokens")
    return tokenizer


# ----------------------------------------------------------------------------------------------
# Training tasks


@dataclass(frozen=True)
class Example:
    """One seq2seq pair: the prompt text and the target text."""

    source: str
    target: str


class TaskSampler:
    """Draws training examples of the three tasks from tokenised paragraphs.

    ``continue:`` gives one or two sentences and asks for the following sentence(s);
    ``restore:`` gives sentences with some words dropped and some neighbours swapped, and
    ``fill:`` sentences with some words replaced by "_"; both ask for the original. Targets
    are whole sentences totalling 20-60 tokens.
    """

    def __init__(self, paragraphs: Sequence[str], processor: spm.SentencePieceProcessor) -> None:
        self.processor = processor
        self.continuations: list[tuple[str, str]] = []  # (context, continuation)
        self.spans: list[str] = []  # targets of the restore and fill tasks
        for paragraph in paragraphs:
            sentences = split_sentences(paragraph)
            lengths = [len(ids) for ids in processor.encode(sentences)]
            for start in range(len(sentences)):
                end = _span_end(lengths, start)
                if end is None:
                    continue
                self.spans.append(" ".join(sentences[start:end]))
                if start > 0:
                    first = start - 2 if start >= 2 and lengths[start - 1] < 24 else start - 1
                    context = " ".join(sentences[first:start])
                    self.continuations.append((context, " ".join(sentences[start:end])))

    def sample(self, rng: random.Random, task: str | None = None) -> Example:
        """A random example of ``task`` (default: drawn with TASK_WEIGHTS)."""
        if task is None:
            task = rng.choices(list(TASK_WEIGHTS), weights=list(TASK_WEIGHTS.values()))[0]
        if task == "continue":
            context, continuation = rng.choice(self.continuations)
            return Example(f"continue: {context}", continuation)
        span = rng.choice(self.spans)
        if task == "restore":
            return Example(f"restore: {corrupt(span, rng)}", span)
        return Example(f"fill: {mask_words(span, rng)}", span)

    def encode(self, examples: Sequence[Example]) -> tuple[torch.Tensor, ...]:
        """Padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 on padding)."""
        return _collate(self._tokenize(examples))

    def batches(self, rng: random.Random, batch_size: int, count: int) -> list[tuple]:
        """``count`` batches of fresh examples, grouped by length so that little of each
        batch is padding, in random order."""
        pairs = self._tokenize([self.sample(rng) for _ in range(batch_size * count)])
        pairs.sort(key=lambda pair: (len(pair[1]), len(pair[0])))
        batches = [_collate(pairs[i : i + batch_size]) for i in range(0, len(pairs), batch_size)]
        rng.shuffle(batches)
        return batches

    def _tokenize(self, examples: Sequence[Example]) -> list[tuple[list[int], list[int]]]:
        """Source and target ids (each ending with EOS), cut to the length limits."""
        sources = self.processor.encode([e.source for e in examples])
        targets = self.processor.encode([e.target for e in examples])
        return [
            (source[-(MAX_SOURCE_TOKENS - 1) :] + [EOS_ID], target[:MAX_TARGET_TOKENS] + [EOS_ID])
            for source, target in zip(sources, targets, strict=True)
        ]


def _collate(pairs: Sequence[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, ...]:
    """Padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 on padding)."""
    input_ids, attention_mask = pad([source for source, _ in pairs], PAD_ID)
    labels, _ = pad([target for _, target in pairs], -100)
    return input_ids, attention_mask, labels


def _span_end(lengths: Sequence[int], start: int) -> int | None:
    """The end of the shortest run of sentences from ``start`` with 20-60 tokens, if any."""
    total = 0
    for end in range(start, len(lengths)):
        total += lengths[end]
        if total > MAX_TARGET_TOKENS:
            return None
        if total >= MIN_TARGET_TOKENS:
            return end + 1
    return None


def corrupt(text: str, rng: random.Random) -> str:
    """Drop each word with probability DROP_PROB and swap neighbours with SWAP_PROB."""
    words = [w for w in text.split() if rng.random() >= DROP_PROB] or text.split()
    i = 0
    while i < len(words) - 1:
        if rng.random() < SWAP_PROB:
            words[i], words[i + 1] = words[i + 1], words[i]
            i += 1
        i += 1
    return " ".join(words)


def mask_words(text: str, rng: random.Random) -> str:
    """Replace each word with "_" with probability MASK_PROB."""
    return " ".join("_" if rng.random() < MASK_PROB else word for word in text.split())


def pad(sequences: Sequence[Sequence[int]], value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ``sequences`` to one length; returns the ids and the 0/1 mask."""
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), value, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        mask[row, : len(sequence)] = 1
    return ids, mask


def evaluation_prompts(sampler: TaskSampler, rng: random.Random, count: int) -> list[str]:
    """``count`` prompts of the training style, cycling through the tasks, drawn from
    ``sampler``, with fresh corruptions; no target text is used twice."""
    prompts: list[str] = []
    seen: set[str] = set()
    while len(prompts) < count:
        task = list(TASK_WEIGHTS)[len(prompts) % len(TASK_WEIGHTS)]
        example = sampler.sample(rng, task)
        if example.target not in seen:
            seen.add(example.target)
            prompts.append(example.source)
    return prompts


# ----------------------------------------------------------------------------------------------
# Draft training


def train_draft(
    sampler: TaskSampler,
    steps: int,
    batch_size: int,
    seed: int,
    learning_rate: float = LEARNING_RATE,
    warmup: int = WARMUP_STEPS,
) -> tuple[T5ForConditionalGeneration, dict]:
    """Train the draft from scratch; returns it (eval mode) and training statistics.

    AdamW with linear warm-up and linear decay to 10% of the peak rate, gradient clipping at
    1.0, no dropout (the run is far too short to overfit the whole corpus).
    """
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(DRAFT_SHAPE.config())
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=learning_rate, betas=(0.9, 0.98), weight_decay=0.01
    )

    def rate(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.1, 1 - 0.9 * (step - warmup) / max(1, steps - warmup))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    rng = random.Random(seed)
    start = time.perf_counter()
    running, history = None, []
    log_every = max(1, min(50, steps // 20))
    pool: list[tuple] = []
    for step in range(1, steps + 1):
        if not pool:
            pool = sampler.batches(rng, batch_size, 16)
        input_ids, attention_mask, labels = pool.pop()
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if step % log_every == 0 or step == steps:
            elapsed = time.perf_counter() - start
            history.append((step, running))
            log(
                f"  step {step:5d}/{steps}  loss {running:.3f}  "
                f"lr {scheduler.get_last_lr()[0]:.2e}  {elapsed:6.0f}s  "
                f"(eta {elapsed / step * (steps - step):4.0f}s)"
            )
    model.eval()
    stats = {
        "steps": steps,
        "batch_size": batch_size,
        "seconds": time.perf_counter() - start,
        "final_loss": running,
        "history": history,
    }
    return model, stats


@torch.no_grad()
def held_out_loss(
    model: T5ForConditionalGeneration, sampler: TaskSampler, seed: int, batches: int = 8
) -> float:
    """Mean loss on examples drawn from ``sampler`` (built from held-out paragraphs)."""
    rng = random.Random(seed)
    losses = []
    for _ in range(batches):
        input_ids, attention_mask, labels = sampler.encode([sampler.sample(rng) for _ in range(32)])
        losses.append(
            model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.item()
        )
    return sum(losses) / len(losses)


# ----------------------------------------------------------------------------------------------
# Growing the main model


def layer_plan(old_layers: int, new_layers: int) -> list[int | None]:
    """Which draft layer each main layer copies (None: a new layer), new ones spread evenly.

    Layer 0 is always the draft's first layer: it holds the relative position bias that T5
    shares with all layers of a stack.
    """
    plan: list[int | None] = []
    added = 0
    total = old_layers + new_layers
    for old in range(old_layers):
        plan.append(old)
        # After old layer i, insert new layers until i+1 / old_layers of them are in.
        due = round(new_layers * (old + 1) / old_layers)
        while added < due and len(plan) < total:
            plan.append(None)
            added += 1
    return plan


def grow(
    draft: T5ForConditionalGeneration, shape: Shape, scale: float, seed: int
) -> T5ForConditionalGeneration:
    """The main model: ``draft`` with more heads, wider feed-forward blocks and more layers.

    The new parts are copies of the draft's own parts, placed where they were not: a new head
    copies a head of a random draft layer (of the same stack and attention type), a new
    feed-forward unit copies a unit (``wi`` row and ``wo`` column) of a random draft layer,
    and a new layer copies a random draft layer. Their contributions to the residual stream
    (the new ``o`` and ``wo`` columns) are multiplied by ``scale`` times a random gain per head
    or unit, drawn from N(0, 1). So the perturbation speaks the draft's language: it moves
    the logits in directions the draft itself uses, and the main model hesitates between
    plausible tokens instead of drifting to arbitrary ones, as random weights would make it.
    The relative position bias of a new head is that of the head it copies. With
    ``scale = 0`` the result computes the draft's function exactly.
    """
    old = draft.config
    if shape.d_model != old.d_model or shape.d_kv != old.d_kv:
        raise ValueError("growing keeps d_model and d_kv")
    generator = torch.Generator().manual_seed(seed)
    source = {name: tensor.detach() for name, tensor in draft.state_dict().items()}
    d_kv, old_heads, old_layers = old.d_kv, old.num_heads, old.num_layers

    def randint(high: int, size: int) -> list[int]:
        return torch.randint(high, (size,), generator=generator).tolist()

    def gains(size: int) -> torch.Tensor:
        return scale * torch.randn(size, generator=generator)

    # Bias column h is shared by head slot h of every layer of a stack, so a new head slot
    # copies the same draft head index in every layer (from a layer drawn per layer).
    slot_heads = list(range(old_heads)) + randint(old_heads, shape.num_heads - old_heads)
    grown = {"shared.weight": source["shared.weight"].clone()}
    for stack in ("encoder", "decoder"):

        def tensor(layer: int, position: int, leaf: str, stack: str = stack) -> torch.Tensor:
            return source[f"{stack}.block.{layer}.layer.{position}.{leaf}"]

        grown[f"{stack}.final_layer_norm.weight"] = source[f"{stack}.final_layer_norm.weight"]
        bias_name = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        grown[bias_name] = source[bias_name][:, slot_heads].clone()
        attention = ["SelfAttention"] + (["EncDecAttention"] if stack == "decoder" else [])
        ff_index = len(attention)
        for index, copied in enumerate(layer_plan(old_layers, shape.num_layers - old_layers)):
            base = copied if copied is not None else randint(old_layers, 1)[0]
            prefix = f"{stack}.block.{index}.layer"

            for position, module in enumerate(attention):
                grown[f"{prefix}.{position}.layer_norm.weight"] = tensor(
                    base, position, "layer_norm.weight"
                ).clone()
                layers = [base] * old_heads + randint(old_layers, len(slot_heads) - old_heads)
                heads = [
                    slice(h * d_kv, (h + 1) * d_kv) for h in slot_heads
                ]  # rows of q/k/v, columns of o
                for p in "qkv":
                    grown[f"{prefix}.{position}.{module}.{p}.weight"] = torch.cat(
                        [
                            tensor(lay, position, f"{module}.{p}.weight")[h]
                            for lay, h in zip(layers, heads, strict=True)
                        ]
                    )
                head_gain = gains(len(slot_heads))
                if copied is not None:
                    head_gain[:old_heads] = 1.0  # the draft's own heads
                grown[f"{prefix}.{position}.{module}.o.weight"] = torch.cat(
                    [
                        tensor(lay, position, f"{module}.o.weight")[:, h] * gain
                        for lay, h, gain in zip(layers, heads, head_gain.tolist(), strict=True)
                    ],
                    dim=1,
                )
            grown[f"{prefix}.{ff_index}.layer_norm.weight"] = tensor(
                base, ff_index, "layer_norm.weight"
            ).clone()
            extra = shape.d_ff - old.d_ff
            unit_layers = torch.tensor([base] * old.d_ff + randint(old_layers, extra))
            units = torch.tensor(list(range(old.d_ff)) + randint(old.d_ff, extra))
            wi = torch.stack(
                [tensor(lay, ff_index, "DenseReluDense.wi.weight") for lay in range(old_layers)]
            )
            wo = torch.stack(
                [tensor(lay, ff_index, "DenseReluDense.wo.weight") for lay in range(old_layers)]
            )
            unit_gain = gains(shape.d_ff)
            if copied is not None:
                unit_gain[: old.d_ff] = 1.0  # the draft's own units
            grown[f"{prefix}.{ff_index}.DenseReluDense.wi.weight"] = wi[unit_layers, units]
            grown[f"{prefix}.{ff_index}.DenseReluDense.wo.weight"] = (
                wo[unit_layers, :, units].T * unit_gain
            )
    for stack in ("encoder", "decoder"):
        grown[f"{stack}.embed_tokens.weight"] = grown["shared.weight"]
    grown["lm_head.weight"] = grown["shared.weight"]

    with torch.device("meta"):
        main = T5ForConditionalGeneration(shape.config())
    main = main.to_empty(device="cpu")
    missing, unexpected = main.load_state_dict(grown, strict=False)
    if unexpected or any(not name.endswith("embed_tokens.weight") for name in missing):
        raise RuntimeError(f"grown state does not fit: missing {missing}, unexpected {unexpected}")
    main.tie_weights()
    return main.eval()


# ----------------------------------------------------------------------------------------------
# Acceptance, computed in torch


@torch.no_grad()
def greedy_outputs(
    model: T5ForConditionalGeneration, prompts: Sequence[Sequence[int]], max_tokens: int
) -> list[list[int]]:
    """Greedy outputs (EOS included when reached, no start token) for a batch of prompts."""
    input_ids, attention_mask = pad(prompts, PAD_ID)
    generated = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_tokens,
        do_sample=False,
        num_beams=1,
    )
    outputs = []
    for row in generated[:, 1:].tolist():
        outputs.append(row[: row.index(EOS_ID) + 1] if EOS_ID in row else row)
    return outputs


@torch.no_grad()
def draft_agreement(
    draft: T5ForConditionalGeneration,
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
) -> list[list[bool]]:
    """For every position of every main output, whether the draft's argmax, given the main
    model's tokens before it (as in speculative decoding), is the main model's token."""
    input_ids, attention_mask = pad(prompts, PAD_ID)
    decoder_ids, _ = pad([[PAD_ID, *out[:-1]] for out in outputs], PAD_ID)
    logits = draft(
        input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_ids
    ).logits
    predicted = logits.argmax(-1).tolist()
    return [
        [p == t for p, t in zip(row, out, strict=False)]
        for row, out in zip(predicted, outputs, strict=True)
    ]


def speculative_counts(agree: Sequence[bool], num_draft: int, max_tokens: int) -> tuple[int, int]:
    """(accepted, rejected) draft tokens of greedy speculative decoding, as ``decoder.py``
    counts them, given where the draft agrees with the main model's greedy output.

    Each round the draft proposes ``min(num_draft, max_tokens - generated - 1)`` tokens; the
    agreeing prefix is accepted and the main model adds one token, so a round starting at
    position ``i`` accepts the run of agreements from ``i`` and rejects at most one token.
    (Proposals past the end-of-sequence token are not modelled.)
    """
    generated = accepted = rejected = 0
    length = len(agree)
    while generated < min(max_tokens, length):
        proposed = min(num_draft, max_tokens - generated - 1)
        run = 0
        while run < proposed and generated + run < length and agree[generated + run]:
            run += 1
        accepted += run
        rejected += int(run < proposed)
        generated += run + 1
    return accepted, rejected


def acceptance(
    main: T5ForConditionalGeneration,
    draft: T5ForConditionalGeneration,
    prompts: Sequence[Sequence[int]],
    num_draft: int,
) -> tuple[float, list[list[int]]]:
    """Greedy acceptance rate accepted / (accepted + rejected) over ``prompts``, and the main
    model's outputs."""
    outputs = greedy_outputs(main, prompts, MAX_NEW_TOKENS)
    accepted = rejected = 0
    for agree in draft_agreement(draft, prompts, outputs):
        a, r = speculative_counts(agree, num_draft, MAX_NEW_TOKENS)
        accepted += a
        rejected += r
    return accepted / max(1, accepted + rejected), outputs


def tune_scale(
    draft: T5ForConditionalGeneration, prompts: Sequence[Sequence[int]], seed: int
) -> tuple[float, float]:
    """Search for the growth scale whose acceptance is closest to TARGET_ALPHA.

    Acceptance falls from 1 at scale 0 as the scale grows: a bracket is found by doubling or
    halving the scale, then bisected geometrically. Acceptance on a finite prompt set is not
    exactly monotone in the scale, so the best scale tried is returned.
    Returns (scale, alpha).
    """
    tried: list[tuple[float, float]] = []

    def alpha_at(scale: float) -> float:
        alpha, _ = acceptance(grow(draft, MAIN_SHAPE, scale, seed), draft, prompts, TUNE_NUM_DRAFT)
        log(f"  scale {scale:.4f}: alpha {alpha:.3f}")
        tried.append((scale, alpha))
        return alpha

    low, high = 0.0, 0.25
    while alpha_at(high) > TARGET_ALPHA and high < 64:
        low, high = high, 2 * high
    if low == 0:
        low = high / 2
        while alpha_at(low) <= TARGET_ALPHA and low > 1e-4:
            low, high = low / 2, low
    for _ in range(BISECTION_STEPS):
        middle = math.sqrt(low * high)
        if alpha_at(middle) > TARGET_ALPHA:
            low = middle
        else:
            high = middle
    return min(tried, key=lambda pair: abs(pair[1] - TARGET_ALPHA))


@torch.no_grad()
def check_identity(
    draft: T5ForConditionalGeneration,
    grown: T5ForConditionalGeneration,
    prompts: Sequence[Sequence[int]],
) -> None:
    """Raise unless ``grown`` (at scale 0) gives the draft's logits: growing keeps the function."""
    input_ids, attention_mask = pad(prompts, PAD_ID)
    decoder_ids = input_ids[:, :8].clone()
    decoder_ids[:, 0] = PAD_ID
    logits = [
        model(
            input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_ids
        ).logits
        for model in (draft, grown)
    ]
    error = (logits[0] - logits[1]).abs().max().item()
    if error > 1e-3:
        raise RuntimeError(f"the grown model at scale 0 differs from the draft by {error}")
    log(f"  at scale 0 the grown model equals the draft (max logit difference {error:.1e})")


def is_looping(tokens: Sequence[int]) -> bool:
    """Whether the last 16 tokens of an output repeat a cycle of one or two tokens."""
    tail = list(tokens[-16:])
    return len(tail) == 16 and (len(set(tail)) <= 2)


# ----------------------------------------------------------------------------------------------
# Sizes


def parameter_counts(model: T5ForConditionalGeneration) -> dict[str, int]:
    """Parameter counts: total, decoder side, and those read per decoding step.

    Embeddings are tied, so ``shared`` (also the output projection) is counted once. The
    decoder side is the decoder stack plus ``shared``. Per decoding step the model reads the
    decoder stack except the cross-attention keys and values (computed once per prompt) and
    the whole output projection; the embedding lookup reads one row.
    """
    shared = model.shared.weight.numel()
    encoder = sum(p.numel() for n, p in model.encoder.named_parameters() if "embed" not in n)
    decoder = sum(p.numel() for n, p in model.decoder.named_parameters() if "embed" not in n)
    cross_kv = sum(
        p.numel()
        for n, p in model.decoder.named_parameters()
        if ".EncDecAttention.k." in n or ".EncDecAttention.v." in n
    )
    return {
        "total": shared + encoder + decoder,
        "encoder": encoder,
        "decoder_side": decoder + shared,
        "per_step": decoder - cross_kv + shared,
    }


# ----------------------------------------------------------------------------------------------
# Saving and measuring with the MLX decoder


def save_checkpoint(model: T5ForConditionalGeneration, tokenizer_dir: Path, out: Path) -> None:
    """Save a Hugging Face checkpoint (safetensors, config, tokenizer) to ``out``."""
    model.save_pretrained(str(out))
    tokenizer = T5Tokenizer.from_pretrained(str(tokenizer_dir), extra_ids=0)
    tokenizer.save_pretrained(str(out))
    shutil.copyfile(tokenizer_dir / "spiece.model", out / "spiece.model")  # for sentencepiece


def build_random_t5(out: Path, seed: int) -> None:
    """Random-weight checkpoints of the real T5 shapes (``RANDOM_T5_SHAPES``), with the
    pair's tokenizer: ``hf-<name>-random`` (Hugging Face) and ``<name>-random`` (MLX)."""
    tokenizer_dir = out / "hf-draft"
    if not (tokenizer_dir / "spiece.model").is_file():
        raise SystemExit(f"error: {tokenizer_dir} has no tokenizer; build the pair first")
    for name, shape in RANDOM_T5_SHAPES.items():
        log(f"{name} shape {shape}, random weights")
        torch.manual_seed(seed)
        model = T5ForConditionalGeneration(shape.config(T5_VOCAB_SIZE)).eval()
        save_checkpoint(model, tokenizer_dir, out / f"hf-{name}-random")
        convert.convert(str(out / f"hf-{name}-random"), out / f"{name}-random", "float32")


def measure_mlx(
    main_dir: Path, draft_dir: Path, prompts: Sequence[str], num_drafts: Sequence[int]
) -> tuple[dict[int, dict], list[str], list[str]]:
    """Greedy speculative decoding of ``prompts`` with this repository's decoder.

    Returns per num_draft the summed counts and acceptance rate, the main model's texts
    (speculative greedy output equals it) and the draft model's own greedy texts.
    """
    from decoder import SpeculativeDecoder
    from loading import load_model, load_tokenizer

    main, draft = load_model(main_dir), load_model(draft_dir)
    tokenizer = load_tokenizer(main_dir)
    results: dict[int, dict] = {}
    texts: list[str] = []
    for num_draft in num_drafts:
        decoder = SpeculativeDecoder(main, draft, tokenizer, num_draft=num_draft)
        totals = dict.fromkeys(("tokens", "n_draft", "n_accepted", "n_rejected", "n_steps"), 0)
        totals["seconds"] = 0.0
        texts = []
        for prompt in prompts:
            result = decoder.speculative_decode(prompt, max_tokens=MAX_NEW_TOKENS)
            totals["tokens"] += len(result.tokens)
            for field in ("n_draft", "n_accepted", "n_rejected", "n_steps"):
                totals[field] += getattr(result, field)
            totals["seconds"] += result.elapsed
            texts.append(result.text)
        tested = totals["n_accepted"] + totals["n_rejected"]
        totals["alpha"] = totals["n_accepted"] / max(1, tested)
        results[num_draft] = totals
        log(
            f"  num_draft {num_draft}: alpha {totals['alpha']:.3f} "
            f"({totals['n_accepted']} accepted, {totals['n_rejected']} rejected, "
            f"{totals['n_draft']} proposed), {totals['tokens']} tokens in "
            f"{totals['n_steps']} main passes, {totals['seconds']:.0f}s"
        )
    draft_alone = SpeculativeDecoder(draft, None, tokenizer)
    draft_texts = [draft_alone.generate(p, max_tokens=MAX_NEW_TOKENS).text for p in prompts]
    return results, texts, draft_texts


# ----------------------------------------------------------------------------------------------
# Main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command-line options."""
    parser = ArgumentParser(
        description="Build a trained draft T5 and a main T5 grown from it, for benchmarking."
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--train-steps", type=int, default=3000, help="draft training steps (default 3000)"
    )
    parser.add_argument("--batch-size", type=int, default=16, help="training batch size")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--retrain",
        action="store_true",
        help="train the draft even if OUT/hf-draft holds one trained with the same settings",
    )
    parser.add_argument(
        "--draft",
        type=Path,
        metavar="DIR",
        help="grow the main model from this trained draft instead of training one (about 20 "
        "minutes saved): an earlier build's hf-draft folder, such as the project's shared one, "
        "trained with this run's --seed, --train-steps and --batch-size; copied into "
        "OUT/hf-draft",
    )
    parser.add_argument(
        "--random-t5-shapes",
        action="store_true",
        help="instead of the pair, build random-weight T5-base and T5-small shaped checkpoints "
        "(for timing against transformers); needs the pair's tokenizer in OUT/hf-draft",
    )
    parser.add_argument(
        "--write-prompts",
        type=int,
        metavar="N",
        help="instead of the pair, write OUT/prompts-N.txt: N prompts of the pair's training "
        "style, none of them a tuning prompt (the batch benchmark's); needs the built pair",
    )
    args = parser.parse_args(argv)
    if args.train_steps < 1 or args.batch_size < 1:
        parser.error("--train-steps and --batch-size must be >= 1")
    if args.write_prompts is not None and args.write_prompts < 1:
        parser.error("--write-prompts must be >= 1")
    if args.draft is not None and (args.retrain or args.random_t5_shapes or args.write_prompts):
        parser.error(
            "--draft builds the pair from a trained draft: it goes with none of "
            "--retrain, --random-t5-shapes and --write-prompts"
        )
    return args


def adopt_draft(source: Path, target: Path, settings: dict) -> None:
    """Put the trained draft at ``source`` (an earlier build's hf-draft) at
    ``target``, where this build reuses it: ``ValueError`` unless it was
    trained with ``settings``, or if ``target`` holds another draft (left
    as it is)."""
    record = source / TRAINING_RECORD
    if not record.is_file():
        raise ValueError(
            f"--draft {source}: no {TRAINING_RECORD} there; give the hf-draft folder of a build"
        )
    trained = json.loads(record.read_text())["settings"]
    differing = [name for name in settings if trained.get(name) != settings[name]]
    if differing:
        raise ValueError(
            f"--draft {source} was trained with other settings ({', '.join(differing)}: "
            + ", ".join(f"{name} {trained.get(name)}" for name in differing)
            + "); give those to this build, or train a draft (no --draft)"
        )
    if target.exists():
        names = sorted(path.name for path in source.iterdir())
        same, _, _ = filecmp.cmpfiles(source, target, names, shallow=False)
        if len(same) == len(names):
            return
        raise ValueError(f"{target} already holds another draft; give --out a new directory")
    shutil.copytree(source, target)


def long_prompts(
    paragraphs: Sequence[str], processor: spm.SentencePieceProcessor, count: int, rng: random.Random
) -> list[str]:
    """``count`` ``restore:`` prompts of at least LONG_PROMPT_TOKENS tokens, each a run of
    consecutive paragraphs, corrupted: long inputs for timing prompt processing, and an
    output that copies its input, as T5's real tasks often do."""
    prompts = []
    for _ in range(count):
        start, end = rng.randrange(len(paragraphs)), 0
        prompt = ""
        while len(processor.encode(prompt)) < LONG_PROMPT_TOKENS:
            end += 1
            passage = " ".join(paragraphs[(start + i) % len(paragraphs)] for i in range(end))
            prompt = f"restore: {corrupt(passage, rng)}"
        prompts.append(prompt)
    return prompts


def split_text(rng: random.Random) -> tuple[list[str], ...]:
    """All paragraphs, shuffled with ``rng``; those held out of training; the
    rest (the tokenizer's text); and the draft's training paragraphs."""
    paragraphs = list(collect_paragraphs())
    rng.shuffle(paragraphs)
    held_out_count = int(len(paragraphs) * HELD_OUT_FRACTION)
    held_out, rest = paragraphs[:held_out_count], paragraphs[held_out_count:]
    return paragraphs, held_out, rest, rest[:TRAIN_PARAGRAPHS]


def write_prompts(out: Path, seed: int, count: int) -> Path:
    """Write OUT/prompts-COUNT.txt: ``count`` prompts of the pair's training
    style that the build did not tune the scale on, for benchmarks that need
    more than prompts.txt's NUM_EVAL_PROMPTS (the batch benchmark). They are
    prompts.txt's first, then more drawn the same way after the build's
    tuning prompts (fresh corruptions, targets not used before), as the build
    with ``seed`` and the tokenizer saved in OUT/hf-draft would draw them."""
    spiece = out / "hf-draft" / "spiece.model"
    if not spiece.is_file():
        raise SystemExit(f"error: {spiece} is missing; build the pair first")
    rng = random.Random(seed)
    _, _, _, training = split_text(rng)
    sampler = TaskSampler(training, spm.SentencePieceProcessor(model_file=str(spiece)))
    built = NUM_TUNE_PROMPTS + NUM_EVAL_PROMPTS
    drawn = evaluation_prompts(sampler, rng, built + max(0, count - NUM_EVAL_PROMPTS))
    built_prompts = out / "prompts.txt"
    if (
        built_prompts.is_file()
        and built_prompts.read_text().splitlines() != drawn[:NUM_EVAL_PROMPTS]
    ):
        raise SystemExit(
            f"error: {built_prompts} differs from the prompts drawn again; "
            "was the pair built with another --seed?"
        )
    prompts = (drawn[:NUM_EVAL_PROMPTS] + drawn[built:])[:count]
    path = out / f"prompts-{count}.txt"
    path.write_text("".join(f"{prompt}\n" for prompt in prompts))
    log(f"wrote {count} prompts to {path}")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Build the pair into ``--out``: hf-draft, hf-main, draft, main, build_summary.json,
    prompts.txt and prompts-long.txt."""
    args = parse_args(argv)
    build_start = time.perf_counter()
    torch.set_num_threads(2)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.random_t5_shapes:
        build_random_t5(out, args.seed)
        return 0
    if args.write_prompts:
        write_prompts(out, args.seed, args.write_prompts)
        return 0
    rng = random.Random(args.seed)

    log("1/6 collecting text")
    paragraphs, held_out, rest, training = split_text(rng)
    log(
        f"  {len(paragraphs)} paragraphs, {sum(map(len, paragraphs)) / 1e6:.2f}M characters; "
        f"the draft learns {len(training)} ({sum(map(len, training)) / 1e6:.2f}M characters), "
        f"{len(held_out)} are held out"
    )

    log(f"2/6 training a SentencePiece tokenizer ({VOCAB_SIZE} pieces)")
    tokenizer_dir = Path(tempfile.mkdtemp(prefix="tokenizer-", dir=out))
    tokenizer = train_tokenizer(rest, tokenizer_dir)
    processor = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / "spiece.model"))
    sampler = TaskSampler(training, processor)
    held_out_sampler = TaskSampler(held_out, processor)
    pairs = f"{len(sampler.continuations)} continuation pairs, {len(sampler.spans)} spans"
    log(f"  {pairs} to restore or fill")
    prompts = evaluation_prompts(sampler, rng, NUM_TUNE_PROMPTS + NUM_EVAL_PROMPTS)
    tune_prompts, eval_prompts = prompts[NUM_EVAL_PROMPTS:], prompts[:NUM_EVAL_PROMPTS]
    tune_ids = [tokenizer(p).input_ids for p in tune_prompts]

    paths = {name: out / name for name in ("hf-main", "hf-draft", "main", "draft")}
    settings = {
        "seed": args.seed,
        "train_steps": args.train_steps,
        "batch_size": args.batch_size,
        "draft_shape": asdict(DRAFT_SHAPE),
        "vocab_size": VOCAB_SIZE,
        "train_paragraphs": TRAIN_PARAGRAPHS,
        "task_weights": TASK_WEIGHTS,
        "learning_rate": LEARNING_RATE,
        "warmup_steps": WARMUP_STEPS,
        "corpus_sha256": hashlib.sha256("\n".join(paragraphs).encode()).hexdigest(),
    }
    if args.draft is not None:
        try:
            adopt_draft(args.draft, paths["hf-draft"], settings)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    record = paths["hf-draft"] / TRAINING_RECORD
    reused = False
    if (
        not args.retrain
        and record.is_file()
        and json.loads(record.read_text())["settings"] == settings
    ):
        log(f"3/6 reusing the draft trained with the same settings in {paths['hf-draft']}")
        draft = T5ForConditionalGeneration.from_pretrained(str(paths["hf-draft"])).eval()
        train_stats = json.loads(record.read_text())["training"]
        reused = True
    else:
        log(f"3/6 training the draft {DRAFT_SHAPE} for {args.train_steps} steps")
        draft, train_stats = train_draft(sampler, args.train_steps, args.batch_size, args.seed)
        train_stats["held_out_loss"] = held_out_loss(draft, held_out_sampler, args.seed)
        save_checkpoint(draft, tokenizer_dir, paths["hf-draft"])
        record.write_text(json.dumps({"settings": settings, "training": train_stats}, indent=2))
    log(
        f"  trained in {train_stats['seconds']:.0f}s, loss {train_stats['final_loss']:.3f}, "
        f"held-out loss {train_stats['held_out_loss']:.3f}"
    )
    for prompt, output in zip(tune_prompts[:2], greedy_outputs(draft, tune_ids[:2], 64)):
        text = tokenizer.decode(output, skip_special_tokens=True)
        log(f"  draft sample: {prompt}\n             -> {text}")

    log(f"4/6 growing the main model {MAIN_SHAPE}; tuning the scale for alpha {TARGET_ALPHA}")
    check_identity(draft, grow(draft, MAIN_SHAPE, 0.0, args.seed), tune_ids[:4])
    scale, tuned_alpha = tune_scale(draft, tune_ids, args.seed)
    main_model = grow(draft, MAIN_SHAPE, scale, args.seed)
    log(f"  scale {scale:.4f}: alpha {tuned_alpha:.3f} on {len(tune_ids)} tuning prompts")

    log("5/6 saving Hugging Face checkpoints and converting them to MLX (float32)")
    save_checkpoint(main_model, tokenizer_dir, paths["hf-main"])
    for file in tokenizer_dir.iterdir():
        file.unlink()
    tokenizer_dir.rmdir()
    convert.convert(str(paths["hf-main"]), paths["main"], "float32")
    convert.convert(str(paths["hf-draft"]), paths["draft"], "float32")

    log("6/6 measuring acceptance on the evaluation prompts")
    eval_ids = [tokenizer(p).input_ids for p in eval_prompts]
    torch_outputs = greedy_outputs(main_model, eval_ids, MAX_NEW_TOKENS)
    agreement = draft_agreement(draft, eval_ids, torch_outputs)
    simulated = {}
    for num_draft in SIMULATED_NUM_DRAFTS:
        accepted, rejected = map(
            sum, zip(*(speculative_counts(a, num_draft, MAX_NEW_TOKENS) for a in agreement))
        )
        simulated[num_draft] = accepted / max(1, accepted + rejected)
        log(f"  torch, num_draft {num_draft}: alpha {simulated[num_draft]:.3f}")
    log(f"  with the MLX decoder ({MAX_NEW_TOKENS} tokens per prompt):")
    results, main_texts, draft_texts = measure_mlx(
        paths["main"], paths["draft"], eval_prompts, MEASURE_NUM_DRAFTS
    )
    torch_texts = [tokenizer.decode(out, skip_special_tokens=True) for out in torch_outputs]
    same = sum(a == b for a, b in zip(torch_texts, main_texts, strict=True))
    log(f"  MLX greedy text equals transformers' for {same}/{len(eval_prompts)} prompts")

    counts = {"main": parameter_counts(main_model), "draft": parameter_counts(draft)}
    report(counts, train_stats, scale, tuned_alpha, simulated, results)
    output_stats(eval_prompts, torch_outputs, main_texts, draft_texts)
    total = time.perf_counter() - build_start
    reuse_note = f" (reusing a draft trained in {train_stats['seconds'] / 60:.1f} min)"
    log(f"total build time {total / 60:.1f} min{reuse_note if reused else ''}; models in {out}")
    summary = {
        "seed": args.seed,
        "draft_shape": asdict(DRAFT_SHAPE),
        "main_shape": asdict(MAIN_SHAPE),
        "parameters": counts,
        "training": train_stats,
        "draft_reused": reused,
        "scale": scale,
        "tuned_alpha": tuned_alpha,
        "simulated_alpha": {str(k): v for k, v in simulated.items()},
        "measured": {str(k): v for k, v in results.items()},
        "eval_prompts": eval_prompts,
        "main_outputs": main_texts,
        "draft_outputs": draft_texts,
        "build_seconds": total,
    }
    (out / "build_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    # The prompts benchmark.py should use with this pair (--prompts): its own task style.
    (out / "prompts.txt").write_text("".join(f"{prompt}\n" for prompt in eval_prompts))
    long = long_prompts(training, processor, NUM_LONG_PROMPTS, rng)
    (out / "prompts-long.txt").write_text("".join(f"{prompt}\n" for prompt in long))
    return 0


def report(
    counts: dict[str, dict[str, int]],
    train_stats: dict,
    scale: float,
    tuned_alpha: float,
    simulated: dict[int, float],
    results: dict[int, dict],
) -> None:
    """Print the final summary: sizes, training and acceptance."""
    log("\n=== summary ===")
    for name, shape in (("draft", DRAFT_SHAPE), ("main", MAIN_SHAPE)):
        c = counts[name]
        log(
            f"{name:5s} {shape}: {c['total'] / 1e6:.2f}M parameters, "
            f"{c['total'] * 4 / 1e6:.0f} MB float32; decoder side {c['decoder_side'] / 1e6:.2f}M, "
            f"read per decoding step {c['per_step'] / 1e6:.2f}M"
        )
    for key, label in (
        ("total", "all weights"),
        ("decoder_side", "decoder side (decoder + embedding)"),
        ("per_step", "read per decoding step"),
    ):
        log(f"main/draft weight bytes, {label}: {counts['main'][key] / counts['draft'][key]:.1f}x")
    log(
        f"draft training: {train_stats['steps']} steps of {train_stats['batch_size']} in "
        f"{train_stats['seconds'] / 60:.1f} min, final loss {train_stats['final_loss']:.3f}, "
        f"held-out loss {train_stats['held_out_loss']:.3f}"
    )
    log(f"growth scale {scale:.4f} (alpha {tuned_alpha:.3f} on the tuning prompts)")
    for num_draft, alpha in simulated.items():
        line = f"num_draft {num_draft}: alpha {alpha:.3f} (torch)"
        if num_draft in results:
            r = results[num_draft]
            line += (
                f", {r['alpha']:.3f} (MLX decoder: {r['n_accepted']} accepted, "
                f"{r['n_rejected']} rejected, {r['tokens'] / max(1, r['n_steps']):.2f} tokens "
                "per main pass)"
            )
        log(line)


def output_stats(
    prompts: Sequence[str],
    main_tokens: Sequence[Sequence[int]],
    main_texts: Sequence[str],
    draft_texts: Sequence[str],
) -> None:
    """Print how varied the main model's outputs are, and three samples."""
    looping = sum(is_looping(tokens) for tokens in main_tokens)
    lengths = [len(tokens) for tokens in main_tokens]
    distinct = [len(set(tokens)) / max(1, len(tokens)) for tokens in main_tokens]
    log(
        f"main outputs: {min(lengths)}-{max(lengths)} tokens, "
        f"{sum(distinct) / len(distinct):.0%} distinct tokens on average, "
        f"{looping}/{len(main_tokens)} ending in a loop of one or two tokens"
    )
    for prompt, main_text, draft_text in list(zip(prompts, main_texts, draft_texts))[:3]:
        log(f"\nprompt: {prompt}\nmain:   {main_text}\ndraft:  {draft_text}")


if __name__ == "__main__":
    sys.exit(main())
