"""Offline test fixtures: a tiny SentencePiece tokenizer and random-init T5 checkpoints.

Everything here is built at test time (no downloads) and is deterministic for a given seed.

Notes on transformers 5.23 that these helpers work around:

* ``T5Tokenizer`` is the ``tokenizers``-backed class; ``T5Tokenizer(vocab_file=...)`` silently
  ignores the file and builds a 4-token vocab. ``T5Tokenizer.from_pretrained(dir)`` on a directory
  holding ``spiece.model`` does convert the SentencePiece model correctly.
* ``T5Config.__post_init__`` pops ``tie_word_embeddings`` into ``scale_decoder_outputs`` (``False``
  means the T5 v1.1 behaviour: no ``d_model**-0.5`` scaling before ``lm_head``) and then forces
  ``tie_word_embeddings = True``. A model built in code therefore always shares ``lm_head`` with
  ``shared`` and ``save_pretrained`` writes only ``shared.weight``. When a checkpoint holds both
  ``lm_head.weight`` and ``shared.weight`` with different values, ``from_pretrained`` logs a warning
  and keeps them separate (``PreTrainedModel.tie_weights``), which untied checkpoints rely on.
* ``generate()`` with the KV cache crashes (IndexError in ``cache_utils``) when
  ``num_decoder_layers > num_layers``: the cache is sized from ``num_layers``. ``greedy_tokens``
  therefore runs its own cache-free greedy loop.
* ``save_pretrained`` always writes safetensors; ``safe_serialization`` is no longer a parameter.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import random
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import ParamSpec, TypeVar

import sentencepiece as spm
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration, T5Tokenizer
from transformers.utils import logging as hf_logging

PAD_ID = 0
EOS_ID = 1
UNK_ID = 2
DECODER_START_ID = 0

WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILES = (
    "spiece.model",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
ROUND_TRIP_TEXT = "translate English to German: the house is small."

# Random-init T5 copies its input / emits token 0 forever: the residual stream is dominated by the
# token embedding (std 1.0) and the sublayer outputs barely move it. These factors (relative to the
# HF init std of each weight) make the sublayers and the position-dependent attention dominate, so
# greedy decoding wanders over many tokens (relu models additionally get zero-mean wo rows, see
# _sharpen). About 75-90% of inits pass check_varied first time (seeds 0-19, relu/tied,
# gated-gelu/untied, d_kv=16 with 3 decoder layers); build_checkpoint re-draws the others.
# Dropping QK_SCALE makes argmax decisions less fragile (1% weight noise flips ~7% of greedy
# tokens instead of ~35%) but changes every checkpoint the existing tests were tuned on.
ATTN_OUT_SCALE = 8.0  # SelfAttention.o / EncDecAttention.o
FF_OUT_SCALE = 8.0  # DenseReluDense.wo
REL_BIAS_SCALE = 40.0  # relative_attention_bias (init std d_model**-0.5 -> ~7 for d_model=32)
QK_SCALE = 3.0  # q and k: sharper attention patterns
# The checkpoints whose logits are compared with an exact reference (conftest.PARITY) keep q
# and k as initialised. With QK_SCALE their attention is so sharp that float32 round-off alone
# moves logits of RMS 1 by up to 1.4e-4 (ours) and 8.6e-5 (transformers' float32), against
# transformers in float64, depending on the BLAS kernels: such a fixture tests its own
# conditioning, not the port. With 1.0: up to 2.7e-6 and 2.3e-6, and each parity test's
# positions still have 20-28 distinct argmaxes (tests/numerics_sweep.py, on a Zen 3 EPYC).
# Quantized models against their float64 twins: 1.6e-5 of the logits' scale, with 1.0 8e-7.
PARITY_QK_SCALE = 1.0
MIN_DISTINCT_PER_PROMPT = 5  # check_varied thresholds (over 20 greedy tokens)
MIN_DISTINCT_OVERALL = 12
MAX_INIT_ATTEMPTS = 10
INIT_ATTEMPT_SEED_STRIDE = 1_000

# Relative std of the Gaussian noise that turns a main checkpoint into its draft. Measured
# draft/main argmax agreement (4 DEMO_PROMPTS x 30 teacher-forced tokens, main seeds 0-7):
# relu/tied 0.69-0.87 (mean 0.78), gated-gelu/untied 0.66-0.79 (mean 0.73); noise 0.004 gives
# ~0.8, 0.01 ~0.6, 0.05 ~0.2.
DEFAULT_DRAFT_NOISE = 0.005

DEMO_PROMPTS = (
    "translate English to German: the house is small.",
    "Le chat est très petit.",
    "summarize: the dog sees the apple in the green garden.",
    "Das Auto war sehr alt.",
)


def _words(text: str) -> tuple[str, ...]:
    """Split a space-separated word list."""
    return tuple(text.split())


_EN_NOUNS = _words(
    "house cat dog friend child man woman city tree car book river garden teacher doctor bird "
    "window table school street"
)
_EN_OBJECTS = _words(
    "apple letter bridge mountain garden station question answer morning evening summer winter "
    "music picture"
)
_EN_ADJECTIVES = _words(
    "small big green happy old new red quiet bright dark warm cold tall short young"
)
_EN_VERBS = _words("is was seems looks becomes remains")
_DE_NOUNS = _words(
    "Haus Katze Hund Freund Kind Mann Frau Stadt Baum Auto Buch Fluss Garten Lehrer Arzt Vogel "
    "Fenster Tisch Schule Straße"
)
_DE_OBJECTS = _words(
    "Apfel Brief Brücke Berg Bahnhof Frage Antwort Morgen Abend Sommer Winter Musik Bild"
)
_DE_ADJECTIVES = _words("klein groß grün glücklich alt neu rot ruhig hell dunkel warm kalt jung")
_DE_VERBS = _words("ist war scheint wird bleibt")
_FR_NOUNS = _words(
    "maison chat chien ami enfant homme femme ville arbre voiture livre rivière jardin professeur "
    "médecin oiseau fenêtre table école rue"
)
_FR_OBJECTS = _words(
    "pomme lettre pont montagne gare question réponse matin soir été hiver musique image"
)
_FR_ADJECTIVES = _words(
    "petit grand vert heureux vieux nouveau rouge calme clair sombre chaud froid jeune"
)
_FR_VERBS = _words("est était semble devient reste")


def training_sentences(n_rounds: int = 100, seed: int = 0) -> list[str]:
    """Deterministic English/German/French-ish sentences (seven per round)."""
    rng = random.Random(seed)
    pick = rng.choice
    sentences = []
    for _ in range(n_rounds):
        sentences += [
            (
                f"translate English to German: "
                f"the {pick(_EN_NOUNS)} {pick(_EN_VERBS)} {pick(_EN_ADJECTIVES)}."
            ),
            (
                f"translate English to French: "
                f"the {pick(_EN_NOUNS)} {pick(_EN_VERBS)} {pick(_EN_ADJECTIVES)}."
            ),
            (
                f"summarize: the {pick(_EN_NOUNS)} sees the {pick(_EN_OBJECTS)} in the "
                f"{pick(_EN_ADJECTIVES)} {pick(_EN_OBJECTS)}."
            ),
            f"Das {pick(_DE_NOUNS)} {pick(_DE_VERBS)} sehr {pick(_DE_ADJECTIVES)}.",
            (
                f"Der {pick(_DE_NOUNS)} sieht den {pick(_DE_OBJECTS)} am {pick(_DE_ADJECTIVES)}en "
                f"{pick(_DE_OBJECTS)}."
            ),
            f"Le {pick(_FR_NOUNS)} {pick(_FR_VERBS)} très {pick(_FR_ADJECTIVES)}.",
            (
                f"Nous regardons la {pick(_FR_OBJECTS)} "
                f"avec le {pick(_FR_NOUNS)} {pick(_FR_ADJECTIVES)}."
            ),
        ]
    return sentences


def train_tokenizer(out_dir: Path, vocab_size: int = 200) -> None:
    """Train a T5-style SentencePiece unigram model and save it plus HF tokenizer files.

    The built-in corpus supports ``vocab_size`` up to 256.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_bytes = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_sentences()),
        model_writer=model_bytes,
        vocab_size=vocab_size,
        model_type="unigram",
        pad_id=PAD_ID,
        eos_id=EOS_ID,
        unk_id=UNK_ID,
        bos_id=-1,
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
    )
    (out_dir / "spiece.model").write_bytes(model_bytes.getvalue())
    # Loading from the directory converts spiece.model; the constructor would ignore vocab_file.
    tokenizer = T5Tokenizer.from_pretrained(out_dir, extra_ids=0)
    tokenizer.save_pretrained(out_dir)
    _check_tokenizer(out_dir, vocab_size)


def _check_tokenizer(tokenizer_dir: Path, vocab_size: int) -> None:
    """Assert the saved tokenizer reloads offline and matches SentencePiece plus EOS."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    processor = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / "spiece.model"))
    ids = tokenizer(ROUND_TRIP_TEXT).input_ids
    expected = processor.encode(ROUND_TRIP_TEXT) + [EOS_ID]
    if ids != expected or len(ids) < 5 or UNK_ID in ids:
        raise AssertionError(f"tokenizer round trip failed: {ids} != {expected}")
    if len(tokenizer) != vocab_size or tokenizer.pad_token_id != PAD_ID:
        raise AssertionError(
            f"unexpected tokenizer: len={len(tokenizer)}, pad={tokenizer.pad_token_id}"
        )


def tokenizer_vocab_size(tokenizer_dir: Path) -> int:
    """Number of pieces in ``tokenizer_dir/spiece.model``."""
    return spm.SentencePieceProcessor(
        model_file=str(Path(tokenizer_dir) / "spiece.model")
    ).get_piece_size()


def copy_tokenizer(src_dir: Path, dst_dir: Path) -> None:
    """Copy the tokenizer files that exist in ``src_dir`` into ``dst_dir``."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (Path(src_dir) / name).is_file():
            shutil.copyfile(Path(src_dir) / name, dst_dir / name)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _one_thread(func: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``func`` with one torch thread: these models are tiny, and two threads on a busy
    2-core machine made a checkpoint build take 15 s instead of 0.4 s."""

    @functools.wraps(func)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return func(*args, **kwargs)
        finally:
            torch.set_num_threads(previous)

    return wrapper


def _sharpen(model: T5ForConditionalGeneration, qk_scale: float = QK_SCALE) -> None:
    """Scale init weights in place so greedy decoding does not collapse (see constants)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".SelfAttention.o.weight", ".EncDecAttention.o.weight")):
                param.mul_(ATTN_OUT_SCALE)
            elif name.endswith(".wo.weight"):
                if not model.config.is_gated_act:
                    # relu(.) has a positive mean, so wo would add an input-independent vector
                    # each layer, pulling every step towards the same token: make rows zero-mean.
                    param.sub_(param.mean(dim=1, keepdim=True))
                param.mul_(FF_OUT_SCALE)
            elif name.endswith(".relative_attention_bias.weight"):
                param.mul_(REL_BIAS_SCALE)
            elif name.endswith((".q.weight", ".k.weight")):
                param.mul_(qk_scale)


@_one_thread
def build_checkpoint(
    out_dir: Path,
    *,
    feed_forward_proj: str = "relu",
    tied: bool = True,
    num_layers: int = 2,
    num_decoder_layers: int | None = None,
    num_heads: int = 4,
    d_kv: int = 8,
    d_model: int = 32,
    d_ff: int = 64,
    vocab_size: int | None = None,
    seed: int = 0,
    tokenizer_dir: Path | None = None,
    ensure_varied: bool = True,
    qk_scale: float = QK_SCALE,
) -> Path:
    """Save a random-init T5 checkpoint (safetensors + config + tokenizer) and return ``out_dir``.

    ``tied=False`` writes a separate ``lm_head.weight`` and ``"tie_word_embeddings": false``
    (T5 v1.1 layout, normally paired with ``feed_forward_proj="gated-gelu"``). ``qk_scale``
    multiplies the query and key projections (see ``QK_SCALE`` and ``PARITY_QK_SCALE``). With
    ``ensure_varied`` the init is re-drawn (seed + 1000 * attempt) until ``check_varied`` passes.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        train_tokenizer(out_dir)
    else:
        copy_tokenizer(Path(tokenizer_dir), out_dir)
    if vocab_size is None:
        vocab_size = tokenizer_vocab_size(out_dir)

    config = T5Config(
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=d_kv,
        d_ff=d_ff,
        num_layers=num_layers,
        num_decoder_layers=num_decoder_layers,
        num_heads=num_heads,
        feed_forward_proj=feed_forward_proj,
        tie_word_embeddings=tied,
        dropout_rate=0.0,
        decoder_start_token_id=DECODER_START_ID,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
    )
    # Prompts can only be checked when every tokenizer id is a valid embedding row.
    checkable = ensure_varied and vocab_size >= tokenizer_vocab_size(out_dir)
    for attempt in range(MAX_INIT_ATTEMPTS if checkable else 1):
        _save_random_init(
            out_dir, config, seed + attempt * INIT_ATTEMPT_SEED_STRIDE, tied=tied, qk_scale=qk_scale
        )
        if not checkable:
            break
        try:
            check_varied(out_dir)
            break
        except AssertionError:
            if attempt == MAX_INIT_ATTEMPTS - 1:
                raise
    return out_dir


def _save_random_init(
    out_dir: Path, config: T5Config, seed: int, *, tied: bool, qk_scale: float
) -> None:
    """Save one sharpened random init of ``config`` (plus a separate lm_head when untied)."""
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(config).eval()
    _sharpen(model, qk_scale)
    with _quiet_transformers():
        model.save_pretrained(out_dir)
    if not tied:
        generator = torch.Generator().manual_seed(seed + 10_000)
        # Logits of the size a tied model gives (std 1.0 with d_model**-0.5 scaling):
        # larger ones make float32 round-off alone exceed the 1e-4 parity tolerance.
        lm_head = torch.randn(config.vocab_size, config.d_model, generator=generator)
        _write_untied(out_dir, lm_head * config.d_model**-0.5)


def _write_untied(hf_dir: Path, lm_head: torch.Tensor) -> None:
    """Add ``lm_head.weight`` to the safetensors file and mark config.json as untied."""
    tensors = load_file(hf_dir / WEIGHTS_FILE)
    tensors["lm_head.weight"] = lm_head.to(tensors["shared.weight"].dtype).contiguous()
    save_file(tensors, hf_dir / WEIGHTS_FILE, metadata={"format": "pt"})
    config_path = hf_dir / "config.json"
    config = json.loads(config_path.read_text())
    # Hub T5 v1.1 configs carry only this key; transformers 5 derives scale_decoder_outputs from it.
    config["tie_word_embeddings"] = False
    config.pop("scale_decoder_outputs", None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def is_untied(hf_dir: Path) -> bool:
    """Whether the checkpoint's config.json says ``tie_word_embeddings: false``."""
    return (
        json.loads((Path(hf_dir) / "config.json").read_text()).get("tie_word_embeddings") is False
    )


@_one_thread
def build_draft(
    main_dir: Path, out_dir: Path, *, noise: float = DEFAULT_DRAFT_NOISE, seed: int = 1
) -> Path:
    """Save a noisy copy of ``main_dir`` (same config and tokenizer) in ``out_dir``; return it.

    Each float tensor ``w`` becomes ``w + noise * w.std() * N(0, 1)``; constant tensors (the
    all-ones layer norms) are left unchanged. A separate ``lm_head.weight`` stays separate.
    """
    main_dir, out_dir = Path(main_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    noisy = {}
    for name, tensor in sorted(load_file(main_dir / WEIGHTS_FILE).items()):
        if tensor.is_floating_point() and tensor.numel() > 1:
            scale = noise * tensor.float().std()
            perturbation = torch.randn(tensor.shape, generator=generator) * scale
            tensor = (tensor.float() + perturbation).to(tensor.dtype)
        noisy[name] = tensor.contiguous()
    save_file(noisy, out_dir / WEIGHTS_FILE, metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        if (main_dir / name).is_file():
            shutil.copyfile(main_dir / name, out_dir / name)
    copy_tokenizer(main_dir, out_dir)
    return out_dir


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Temporarily silence transformers logging (e.g. the expected "will NOT tie" warning)."""
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)
        hf_logging.enable_progress_bar()


def load_hf(hf_dir: Path, dtype: torch.dtype = torch.float32) -> T5ForConditionalGeneration:
    """Load a checkpoint with transformers in ``dtype`` (float64: the exact function, as far
    as float32 tests can tell), eval mode."""
    with _quiet_transformers():
        model = T5ForConditionalGeneration.from_pretrained(hf_dir, dtype=dtype)
    return model.eval()


def assert_within(what: str, error: float, bound: float) -> None:
    """Assert ``error <= bound``, and print both on a ``numerics:`` line, which
    ``tests/numerics_sweep.py`` collects to report the largest errors per BLAS kernel set."""
    print(f"\nnumerics: {what}: error {error:.3e} bound {bound:.3e}")
    assert error <= bound, f"{what}: error {error:.3e} > bound {bound:.3e}"


def encode(hf_dir: Path, text: str) -> list[int]:
    """Token ids (ending with EOS) of ``text`` using the checkpoint's tokenizer."""
    return AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)(text).input_ids


ModelOrDir = T5ForConditionalGeneration | Path


def _as_model(model: ModelOrDir) -> T5ForConditionalGeneration:
    return model if isinstance(model, T5ForConditionalGeneration) else load_hf(Path(model))


@_one_thread
@torch.no_grad()
def greedy_tokens(
    model: ModelOrDir, prompt_ids: Sequence[int], n: int, *, stop_at_eos: bool = True
) -> list[int]:
    """Greedy-decode up to ``n`` tokens (without the decoder start token; EOS included if hit).

    Uses full recomputation instead of the HF KV cache, so it also works when
    ``num_decoder_layers > num_layers``.
    """
    hf_model = _as_model(model)
    encoder_outputs = hf_model.get_encoder()(input_ids=torch.tensor([list(prompt_ids)]))
    decoder_ids = [DECODER_START_ID]
    for _ in range(n):
        logits = hf_model(
            encoder_outputs=encoder_outputs,
            decoder_input_ids=torch.tensor([decoder_ids]),
            use_cache=False,
        ).logits
        decoder_ids.append(int(logits[0, -1].argmax()))
        if stop_at_eos and decoder_ids[-1] == EOS_ID:
            break
    return decoder_ids[1:]


@_one_thread
@torch.no_grad()
def teacher_forced_argmax(
    model: ModelOrDir, prompt_ids: Sequence[int], target: Sequence[int]
) -> list[int]:
    """Argmax next token at each position of ``target`` (decoder input: start + target[:-1])."""
    hf_model = _as_model(model)
    decoder_ids = [DECODER_START_ID, *target[:-1]]
    logits = hf_model(
        input_ids=torch.tensor([list(prompt_ids)]),
        decoder_input_ids=torch.tensor([decoder_ids]),
        use_cache=False,
    ).logits
    return logits[0].argmax(-1).tolist()


def _prompt_ids(hf_dir: Path, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    return [tokenizer(p).input_ids if isinstance(p, str) else list(p) for p in prompts]


@_one_thread
def check_varied(
    hf_dir: Path, prompts: Sequence[str | Sequence[int]] = DEMO_PROMPTS, n: int = 20
) -> None:
    """Raise AssertionError if greedy outputs of ``hf_dir`` look degenerate.

    Degenerate: EOS as first token, identical outputs for different prompts, fewer than
    ``MIN_DISTINCT_OVERALL`` distinct tokens overall, or any prompt whose ``n`` greedy tokens hold
    fewer than ``MIN_DISTINCT_PER_PROMPT`` distinct ones (a repeating 1-2 token loop).
    """
    model = load_hf(Path(hf_dir))
    outputs = [greedy_tokens(model, ids, n) for ids in _prompt_ids(Path(hf_dir), prompts)]
    problems = []
    if any(out[0] == EOS_ID for out in outputs):
        problems.append("EOS as first token")
    if len({tuple(out) for out in outputs}) < len(outputs):
        problems.append("identical outputs for different prompts")
    if len({tok for out in outputs for tok in out}) < MIN_DISTINCT_OVERALL:
        problems.append(f"fewer than {MIN_DISTINCT_OVERALL} distinct tokens overall")
    if any(len(set(out)) < MIN_DISTINCT_PER_PROMPT for out in outputs):
        problems.append(f"a prompt with fewer than {MIN_DISTINCT_PER_PROMPT} distinct tokens")
    if problems:
        raise AssertionError(f"degenerate greedy outputs ({', '.join(problems)}): {outputs}")


@_one_thread
def agreement_rate(
    main_dir: Path, draft_dir: Path, prompts: Sequence[str | Sequence[int]], n_tokens: int
) -> float:
    """Fraction of positions where the draft's argmax equals the main model's greedy token.

    Both models are teacher-forced on the main model's greedy output (``n_tokens`` per prompt,
    stopping early at EOS).
    """
    main, draft = load_hf(Path(main_dir)), load_hf(Path(draft_dir))
    agree = total = 0
    for ids in _prompt_ids(Path(main_dir), prompts):
        target = greedy_tokens(main, ids, n_tokens)
        predicted = teacher_forced_argmax(draft, ids, target)
        agree += sum(p == t for p, t in zip(predicted, target, strict=True))
        total += len(target)
    return agree / total


def linear_round_costs(draft_cost: float) -> list[float]:
    """Round costs for "auto" (``auto.best_num_draft``) of g = 0 ..
    MAX_AUTO_DRAFT draft tokens when a draft step costs ``draft_cost`` main
    steps and a verify pass over any number of tokens costs one."""
    from auto import MAX_AUTO_DRAFT

    return [1.0 + draft_cost * g for g in range(MAX_AUTO_DRAFT + 1)]


def auto_costs(draft_cost: float) -> dict[str, list[float]]:
    """``linear_round_costs`` for model drafts, free lookup drafts."""
    return {"model": linear_round_costs(draft_cost), "lookup": linear_round_costs(0.0)}


def cheap_drafts(decoder, draft_cost: float = 0.1) -> None:
    """Make ``decoder``'s "auto" weigh a draft step as ``draft_cost`` main
    steps and a verify pass over any number of tokens as one, not as
    calibrated. The tiny test draft model costs as much as its main model,
    so calibrated costs would rightly make auto draft little, and a test of
    drafting would test plain steps."""
    costs = auto_costs(draft_cost)
    decoder.auto.measure_costs = lambda *args, **kwargs: costs
