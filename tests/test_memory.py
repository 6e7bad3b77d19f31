"""Long prompts in bounded memory: the encoder's self-attention over blocks
of queries gives the same output as over all of them at once, its memory
stops growing with the square of the prompt, and main.py's estimate of
what a prompt takes (the memory check, the server's prompt limit) is within
1.5x of the measured peak from 100 to 10,000 tokens."""

import mlx.core as mx
import numpy as np
import pytest

import model as model_module
from decoder import SpeculativeDecoder
from loading import load_model, load_tokenizer, runtime_bytes

# The decoding tests' main model (4 heads, gated, d_ff 64), and two with
# one head and a wide feed-forward block, whose peak at short prompts is
# the feed-forward's rather than attention's.
MODELS = ["main", "wide_relu", "wide_gated"]
PROMPT_TOKENS = (100, 300, 1000, 3000, 10000)
# Below this, whether MLX reuses an input's buffer for an element-wise
# result varies from run to run: the peak is the largest of a few runs.
NOISY_BELOW, RUNS = 3000, 5


@pytest.fixture(scope="module")
def decoders(converted):
    def load(name: str):
        path = converted(name)
        return path, SpeculativeDecoder(load_model(path), None, load_tokenizer(path))

    return {name: load(name) for name in MODELS}


def test_blocked_encoder_equals_all_at_once(decoders, monkeypatch):
    """A padded batch of 300-token prompts, in blocks of 37 queries (the last
    shorter), against the encoder computing every score at once."""
    model = decoders["main"][1].model
    rng = np.random.default_rng(0)
    inputs = mx.array(rng.integers(3, model.args.vocab_size, (2, 300)))
    mask = mx.array(np.arange(300) < np.array([[300], [170]]))
    whole = model.encode(inputs, mask)
    monkeypatch.setattr(
        model_module, "ENCODER_BLOCK_BYTES", 4 * 2 * model.args.num_heads * 300 * 37
    )
    blocked = model.encode(inputs, mask)
    scale = float(mx.abs(whole).max())
    assert float(mx.abs(whole - blocked).max()) <= 1e-5 * scale


def peak_bytes(decoder, prompt_tokens: int) -> int:
    """Peak memory over what was allocated before, decoding 5 tokens after a
    prompt of ``prompt_tokens`` random tokens."""
    vocab_size = decoder.model.args.vocab_size
    ids = np.random.default_rng(prompt_tokens).integers(3, vocab_size, prompt_tokens)
    peaks = []
    for _ in range(RUNS if prompt_tokens < NOISY_BELOW else 1):
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        decoder.generate(ids.tolist(), max_tokens=5)
        peaks.append(mx.get_peak_memory() - before)
    return max(peaks)


@pytest.mark.parametrize("name", MODELS)
def test_the_estimate_is_within_half_again_of_the_peak(name, decoders):
    path, decoder = decoders[name]
    peaks = {}
    for prompt_tokens in PROMPT_TOKENS:
        peaks[prompt_tokens] = peak_bytes(decoder, prompt_tokens)
        ratio = runtime_bytes(path, prompt_tokens, 5) / peaks[prompt_tokens]
        assert 1 / 1.5 <= ratio <= 1.5, f"{prompt_tokens} tokens: estimate / peak = {ratio:.2f}"
    # From 3,000 tokens the encoder works over blocks: memory grows with the
    # prompt (its activations), not its square: 3.3x the tokens take less
    # than 3.3x the memory, not 11x.
    scores = 4 * decoder.model.args.num_heads * 3000**2
    assert scores > model_module.ENCODER_BLOCK_BYTES
    assert peaks[10000] < 10000 / 3000 * peaks[3000]
