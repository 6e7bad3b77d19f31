"""The MLX T5 computes the same function as transformers' T5 (torch)."""

import gc
import weakref
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from fixtures import assert_within, load_hf
from mlx import nn
from mlx.utils import tree_flatten
from transformers.models.t5.modeling_t5 import T5Attention

import model as model_module
from cpu.attention import SOFTMAX_CPU_MIN_SCORES
from loading import load_model
from model import relative_position_bucket

PARITY_CONFIGS = ["relu_tied", "gated_untied", "deep_decoder", "wide_heads"]

# Our float32 logits may be as far from the exact function (transformers in float64) as
# 1e-4, a relative 1e-4 on these fixtures' logits (RMS about 1, asserted), or as
# ROUNDOFF_FACTOR times transformers' own float32 logits are, whichever is larger: a port
# computes in float32 as well as transformers does, but need not do better, and how far float32
# lands depends on the order in which the CPU's BLAS kernels sum. Our error over transformers'
# error, measured by tests/numerics_sweep.py on a Zen 3 EPYC (OpenBLAS kernel sets Zen, Haswell
# and Sandybridge, 1 and 2 threads, and MLX's reference BLAS): at most 1.40 on these fixtures,
# and 2.51 on sharper ones (fixtures.QK_SCALE), whose float32 round-off is 50 times larger
# (ours up to 1.4e-4). The factor is twice the larger ratio, rounded.
PARITY_TOLERANCE = 1e-4
ROUNDOFF_FACTOR = 5.0
# Cached and full decoding are two float32 computations of the same logits, summed in
# different orders (BLAS kernels differ by row count): both within round-off of the exact ones.
# Measured by the sweep: at most 1.7e-6 on these fixtures (2.5e-5 on the sharper ones).
CACHE_TOLERANCE = 1e-4


def random_ids(shape, vocab_size, seed):
    # Ids from 3 up: no padding, EOS or unknown token inside the inputs.
    return np.random.default_rng(seed).integers(3, vocab_size, size=shape)


def transformers_logits(
    hf_dir: Path,
    dtype: torch.dtype,
    inputs: np.ndarray,
    mask: np.ndarray,
    decoder_inputs: np.ndarray,
) -> np.ndarray:
    """Logits of the checkpoint in ``hf_dir`` computed by transformers in ``dtype``, as float64."""
    with torch.no_grad():
        return (
            load_hf(hf_dir, dtype)(
                input_ids=torch.tensor(inputs),
                attention_mask=torch.tensor(mask),
                decoder_input_ids=torch.tensor(decoder_inputs),
            )
            .logits.double()
            .numpy()
        )


# On the CPU a 150-token prompt's encoder attention takes cpu.attention's softmax
# path (2 x 4 heads x 150 x 150 scores), an 11-token one the built-in softmax;
# "150/37": the encoder attends over blocks of 37 queries (the last shorter),
# as it does for long prompts, each block's position bias a view of one table.
@pytest.mark.parametrize("prompt_length, block", [(11, None), (150, None), (150, 37)])
@pytest.mark.parametrize("name", PARITY_CONFIGS)
def test_logits_match_transformers(
    name, prompt_length, block, hf_checkpoint, converted, monkeypatch
):
    model = load_model(converted(name))
    vocab_size = model.args.vocab_size
    encoder_scores = 2 * model.args.num_heads * prompt_length**2
    assert (encoder_scores >= SOFTMAX_CPU_MIN_SCORES) == (prompt_length == 150)
    assert 4 * encoder_scores <= model_module.ENCODER_BLOCK_BYTES  # one block unless asked
    if block is not None:
        block_bytes = 4 * 2 * model.args.num_heads * prompt_length * block
        monkeypatch.setattr(model_module, "ENCODER_BLOCK_BYTES", block_bytes)
    inputs = random_ids((2, prompt_length), vocab_size, seed=1)
    decoder_inputs = random_ids((2, 17), vocab_size, seed=2)
    decoder_inputs[:, 0] = 0
    # The second prompt is shorter: padding must not change its logits.
    mask = np.ones_like(inputs)
    mask[1, prompt_length * 2 // 3 :] = 0
    exact, transformers32 = (
        transformers_logits(hf_checkpoint(name), dtype, inputs, mask, decoder_inputs)
        for dtype in (torch.float64, torch.float32)
    )
    logits = np.array(model(mx.array(inputs), mx.array(decoder_inputs), mx.array(mask)))
    assert logits.shape == exact.shape
    # Logits of moderate size: the absolute tolerance is a relative one.
    assert 0.5 < np.sqrt(np.mean(exact**2)) < 2
    transformers_error = np.abs(transformers32 - exact).max()
    print(
        f"\nnumerics: transformers-float32 {name}-{prompt_length}: error {transformers_error:.3e}"
    )
    assert_within(
        f"parity {name}-{prompt_length}",
        np.abs(logits - exact).max(),
        max(PARITY_TOLERANCE, ROUNDOFF_FACTOR * transformers_error),
    )
    # The fixture is not degenerate: positions disagree on their argmax.
    assert len(set(exact.argmax(-1).ravel().tolist())) > 3


def test_untied_fixture_uses_its_own_output_projection(converted):
    model = load_model(converted("gated_untied"))
    assert not model.args.tie_word_embeddings
    assert not model.args.scale_decoder_outputs
    assert not mx.array_equal(model.lm_head.weight, model.shared.weight)


def tiny_args(**changes) -> model_module.ModelArgs:
    """The hyper-parameters of a tiny T5 built in memory, never trained."""
    sizes = {"vocab_size": 100, "d_model": 16, "d_kv": 4, "d_ff": 32, "num_heads": 2}
    return model_module.ModelArgs(**sizes, num_layers=3, num_decoder_layers=2, **changes)


@pytest.mark.parametrize("gated, tied", [(False, True), (True, False)])
def test_work_per_token_counts_the_weights_each_token_multiplies(gated, tied):
    args = tiny_args(feed_forward_proj="gated-gelu" if gated else "relu", tie_word_embeddings=tied)
    sizes = {name: weight.size for name, weight in tree_flatten(model_module.T5(args).parameters())}
    products = {name: size for name, size in sizes.items() if "proj" in name or ".ff.w" in name}
    prompt_side = ("cross_attn.key_proj", "cross_attn.value_proj")
    encoder = sum(size for name, size in products.items() if name.startswith("encoder."))
    cross = sum(
        size
        for name, size in products.items()
        if name.removesuffix(".weight").endswith(prompt_side)
    )
    decoder = sum(size for name, size in products.items() if name.startswith("decoder.")) - cross
    output = sizes["shared.weight" if tied else "lm_head.weight"]
    assert args.prompt_work == encoder + cross
    assert args.decode_work == decoder + output


def test_rows_functions_compile_once_for_any_rows():
    """A RowsFunction traces its function once for every number of rows."""
    traced = []

    def doubled(rows):
        traced.append(rows.shape[0])
        return 2 * rows

    compiled = model_module.RowsFunction(lambda module, rows: doubled(rows), nn.Module())
    for rows in [1, 3, 600, 2]:
        x = mx.ones((rows, 4))
        assert mx.array_equal(compiled(x), 2 * x)
    assert len(traced) == 1


def test_rows_functions_read_their_modules_weights_at_every_call():
    block = nn.Module()
    block.linear = nn.Linear(4, 3, bias=False)
    compiled = model_module.RowsFunction(lambda module, rows: module.linear(rows), block)
    x = mx.ones((2, 4))
    mx.eval(compiled(x))
    block.linear.weight = mx.full((3, 4), 2.0)  # as cpu.prepare replaces a weight by its new layout
    assert mx.array_equal(compiled(x), mx.full((2, 3), 8.0))


@pytest.mark.parametrize("block", [None, 37], ids=["one block", "blocks of 37"])
def test_encoder_masks_reach_attention_as_plain_arrays(block, converted, monkeypatch):
    """Every mask the encoder gives attention is an array of its own whose
    strides all run forwards: cuDNN's fused attention refused the block
    mask's view of the bias table (a stride of -1) in half precision.
    (Seen failing with that view.)"""
    model = load_model(converted("relu_tied"))
    if block is not None:
        monkeypatch.setattr(
            model_module, "ENCODER_BLOCK_BYTES", 4 * 2 * model.args.num_heads * 150 * block
        )
    masks = []

    def recording(queries, keys, values, mask):
        masks.append(mask)
        return model_module.attention(queries, keys, values, mask)

    model.use_attention(recording)
    inputs = random_ids((2, 150), model.args.vocab_size, seed=1)
    mask = np.ones_like(inputs)
    mask[1, 100:] = 0
    for padding in (mx.array(mask), None):
        masks.clear()
        mx.eval(model.encode(mx.array(inputs), padding))
        assert len(masks) == model.args.num_layers * (1 if block is None else 5)
        for each in masks:
            mx.eval(each)
            assert min(memoryview(each).strides) >= 0, memoryview(each).strides


def test_a_dropped_model_is_freed_at_once(converted):
    """Nothing keeps a model that decoded alive once it is dropped (its
    layers' RowsFunctions hold them weakly), even with Python's cyclic
    collector off: a cycle would keep its weights until the collector ran."""
    gc.disable()
    try:
        model = load_model(converted("relu_tied"))
        inputs = mx.array(random_ids((2, 9), model.args.vocab_size, seed=5))
        mx.eval(model(inputs, mx.array(random_ids((2, 7), model.args.vocab_size, seed=6))))
        layer = weakref.ref(model.decoder.layers[0])
        del model
        assert layer() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("bidirectional", [True, False])
def test_position_buckets_match_transformers(bidirectional):
    distances = np.arange(-700, 700)
    expected = T5Attention._relative_position_bucket(
        torch.tensor(distances), bidirectional=bidirectional, num_buckets=32, max_distance=128
    ).numpy()
    buckets = relative_position_bucket(mx.array(distances), bidirectional, 32, 128)
    np.testing.assert_array_equal(np.array(buckets), expected)


def decode_step_by_step(model, inputs, decoder_inputs, chunks):
    """Logits from feeding the decoder ``decoder_inputs`` in pieces of the given sizes."""
    cache = model.make_cache(model.encode(inputs))
    logits, start = [], 0
    for size in chunks:
        logits.append(model.decode(decoder_inputs[:, start : start + size], cache))
        start += size
    assert cache.offset == decoder_inputs.shape[1]
    return mx.concatenate(logits, axis=1)


@pytest.mark.parametrize("name", ["relu_tied", "gated_untied"])
def test_cached_decoding_equals_full_sequence(name, converted):
    model = load_model(converted(name))
    inputs = mx.array(random_ids((1, 12), model.args.vocab_size, seed=3))
    decoder_inputs = mx.array(random_ids((1, 20), model.args.vocab_size, seed=4))
    full = model(inputs, decoder_inputs)
    one_at_a_time = decode_step_by_step(model, inputs, decoder_inputs, [1] * 20)
    uneven = decode_step_by_step(model, inputs, decoder_inputs, [1, 4, 2, 6, 7])
    for chunking, logits in (("steps", one_at_a_time), ("uneven", uneven)):
        error = mx.abs(logits - full).max().item()
        assert_within(f"cache {name}-{chunking}", error, CACHE_TOLERANCE)


def test_trim_then_decode_equals_never_feeding_those_tokens(converted):
    model = load_model(converted("relu_tied"))
    inputs = mx.array(random_ids((1, 10), model.args.vocab_size, seed=5))
    prefix = mx.array(random_ids((1, 7), model.args.vocab_size, seed=6))
    wrong = mx.array(random_ids((1, 5), model.args.vocab_size, seed=7))
    right = mx.array(random_ids((1, 4), model.args.vocab_size, seed=8))

    cache = model.make_cache(model.encode(inputs))
    model.decode(prefix, cache)
    model.decode(wrong, cache)
    cache.trim(5)
    assert cache.offset == 7
    assert all(layer.lengths == [7] for layer in cache.self_attn)
    after_trim = model.decode(right, cache)

    expected = model(inputs, mx.concatenate([prefix, right], axis=1))[:, 7:]
    assert_within("cache trim", mx.abs(after_trim - expected).max().item(), CACHE_TOLERANCE)


def test_cache_grows_past_its_first_chunk(converted):
    model = load_model(converted("relu_tied"))
    inputs = mx.array(random_ids((1, 6), model.args.vocab_size, seed=9))
    # 300 positions: the cache grows chunk by chunk (KVCache.step), also inside a pass.
    decoder_inputs = mx.array(random_ids((1, 300), model.args.vocab_size, seed=10))
    chunked = decode_step_by_step(model, inputs, decoder_inputs, [250, 1, 49])
    error = mx.abs(chunked - model(inputs, decoder_inputs)).max().item()
    assert_within("cache past-first-chunk", error, CACHE_TOLERANCE)


def test_float16_stays_finite_where_activations_overflow(converted, monkeypatch):
    """T5 v1.0 residual streams outgrow float16; clamping keeps logits finite."""
    reference = load_model(converted("overflowing"))
    inputs = mx.array(random_ids((1, 12), reference.args.vocab_size, seed=11))
    decoder_inputs = mx.array(random_ids((1, 6), reference.args.vocab_size, seed=12))
    # In float32 the fixture's residual stream really leaves float16's range.
    hidden = reference.shared(inputs)
    layer_mask = reference.encoder.position_bias(mx.arange(12)[None], mx.arange(12))
    hidden = reference.encoder.layers[0](hidden, layer_mask)
    assert mx.abs(hidden).max().item() > float(mx.finfo(mx.float16).max)

    half = load_model(converted("overflowing", dtype="float16"))
    assert mx.isfinite(half(inputs, decoder_inputs)).all().item()
    # Without the clamp the same computation overflows, so the check above can fail.
    monkeypatch.setattr(model_module, "clamp_float16", lambda x: x)
    assert not mx.isfinite(half(inputs, decoder_inputs)).all().item()


def test_bfloat16_is_close_to_float32(converted):
    model32 = load_model(converted("relu_tied"))
    model16 = load_model(converted("relu_tied", dtype="bfloat16"))
    assert model16.dtype == mx.bfloat16
    inputs = mx.array(random_ids((1, 12), model32.args.vocab_size, seed=13))
    decoder_inputs = mx.array(random_ids((1, 8), model32.args.vocab_size, seed=14))
    logits32 = model32(inputs, decoder_inputs)
    logits16 = model16(inputs, decoder_inputs).astype(mx.float32)
    assert mx.isfinite(logits16).all().item()
    # bfloat16 keeps 8 bits of mantissa and these random models amplify
    # round-off, so ask for logits that move together, not equal ones.
    correlation = np.corrcoef(np.array(logits16).ravel(), np.array(logits32).ravel())[0, 1]
    assert correlation > 0.95


def test_encoding_slice_by_slice_is_the_whole_encoding(converted, monkeypatch):
    """``prompt_cache_slices`` stepped a slice at a time gives ``prompt_cache``'s
    cache exactly (the same products), over many slices of a padded pass and
    a pass of its own; and slices of 7 positions are the single block's
    encoding within float32 round-off of other product shapes."""
    model = load_model(converted("relu_tied"))
    prompts = [random_ids((60,), model.args.vocab_size, seed) for seed in (20, 21)]
    prompts = [p.tolist() for p in prompts] + [[5, 6, 1]]
    whole = model.prompt_cache(prompts)
    projection, feed_forward = model.args._layer_work
    # Two rows of 7 positions a slice in the padded pass of the 60-token prompts.
    monkeypatch.setattr(model_module, "ENCODER_SLICE_WORK", 2 * 7 * (4 * projection + feed_forward))
    expected = model.prompt_cache(prompts)
    slices = model.prompt_cache_slices(prompts)
    count = 0
    while True:
        try:
            next(slices)
            count += 1
        except StopIteration as end:
            sliced = end.value
            break
    # 9 blocks of positions, twice per layer, in the 60-token pass alone.
    assert count >= 2 * 9 * model.args.num_layers
    assert sliced.prompt_lengths == whole.prompt_lengths == [60, 60, 3]
    for (keys, values), (expected_keys, expected_values), (whole_keys, whole_values) in zip(
        sliced.cross_keys_values, expected.cross_keys_values, whole.cross_keys_values
    ):
        assert mx.array_equal(keys, expected_keys) and mx.array_equal(values, expected_values)
        for array, reference in ((keys, whole_keys), (values, whole_values)):
            scale = float(mx.abs(reference).max())
            assert float(mx.abs(array - reference).max()) <= 1e-5 * scale


@pytest.mark.parametrize("block", [None, 7], ids=["one block", "blocks of 7"])
def test_the_sliced_encoder_is_the_layers_plain_equations(block, converted, monkeypatch):
    """``encode`` (each layer's ``slices``) equals the layers called plainly
    (``EncoderLayer.__call__``: T5's equations over every position at once),
    on a padded batch, in one block and in blocks of 7 queries (the last
    shorter), within float32 round-off of other product shapes."""
    model = load_model(converted("gated_untied"))
    inputs = mx.array(random_ids((2, 30), model.args.vocab_size, seed=22))
    mask = mx.arange(30) < mx.array([[30], [19]])
    if block is not None:
        projection, feed_forward = model.args._layer_work
        work = 2 * block * (4 * projection + feed_forward)
        monkeypatch.setattr(model_module, "ENCODER_SLICE_WORK", work)
    sliced = model.encode(inputs, mask)
    x = model.embed(inputs)
    bias = model.encoder.position_bias(mx.arange(30)[None], mx.arange(30))
    layer_mask = bias + model_module.padding_mask(mask, x.dtype)
    for layer in model.encoder.layers:
        x = layer(x, layer_mask)
    plain = model.encoder.norm(x)
    scale = float(mx.abs(plain).max())
    assert float(mx.abs(sliced - plain).max()) <= 1e-5 * scale
