"""Quantized conversion (convert.py -q): a quantized model is exactly the function
of its own dequantized weights, stays close to float, keeps the greedy identity
of speculative decoding, and converts in memory bounded by its output."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from fixtures import assert_within, copy_tokenizer, tokenizer_vocab_size
from mlx import nn
from test_convert import ROOT, assert_one_line_error, bin_checkpoint, offline_env
from test_decoder import PROMPTS
from test_model import random_ids

import convert
from decoder import SpeculativeDecoder
from loading import check_draft_directories, load_config, load_model, load_tokenizer
from model import T5, ModelArgs, quantizable_layers

# (bits, group size, mode) of the parity tests.
SETTINGS = [(8, 32, "affine"), (8, 64, "affine"), (4, 32, "affine"), (4, 64, "affine")]
WIDE = ["relu_tied_64", "gated_untied_64"]
# Logits may differ from those of the dequantized twin by float32 round-off only.
PARITY_TOLERANCE = 1e-4


# --- helpers -----------------------------------------------------------------


def dequantized_twin(directory: Path) -> T5:
    """A float64 T5 (no quantized layer) whose weights are ``mx.dequantize`` of
    the quantized tensors in ``directory/weights.safetensors``, the others as they are."""
    args = load_config(directory)
    settings = args.quantization
    weights = mx.load(str(directory / "weights.safetensors"))
    float_weights = {}
    for name, weight in weights.items():
        layer, part = name.rsplit(".", 1)
        if part in ("scales", "biases"):
            continue
        if f"{layer}.scales" in weights:
            weight = mx.dequantize(
                weight,
                weights[f"{layer}.scales"],
                weights.get(f"{layer}.biases"),
                group_size=settings["group_size"],
                bits=settings["bits"],
                mode=settings["mode"],
                dtype=mx.float32,  # mxfp4 scales are uint8: the type must be given
            )
        float_weights[name] = weight.astype(mx.float64)
    model = T5(dataclasses.replace(args, quantization=None))
    model.load_weights(list(float_weights.items()))
    return model


def parity_inputs(vocab_size: int) -> tuple[mx.array, mx.array, mx.array]:
    """Two prompts, the second padded, and decoder inputs starting with the start token."""
    inputs = random_ids((2, 13), vocab_size, seed=5)
    mask = np.ones_like(inputs)
    mask[1, 9:] = 0
    decoder_inputs = random_ids((2, 9), vocab_size, seed=6)
    decoder_inputs[:, 0] = 0
    return mx.array(inputs), mx.array(decoder_inputs), mx.array(mask)


def relative_error_to_twin(directory: Path) -> float:
    """Max |logits - twin logits| / max |twin logits|, the twin computed in
    float64 (on the CPU: GPUs have no float64). The float32 twin differs from the
    quantized model by summation order; both are float32 round-off away from the
    float64 twin, so against it the error is one round-off, not two."""
    model = load_model(directory)
    inputs, decoder_inputs, mask = parity_inputs(model.args.vocab_size)
    logits = np.array(model(inputs, decoder_inputs, mask))
    with mx.stream(mx.cpu):
        expected = np.array(dequantized_twin(directory)(inputs, decoder_inputs, mask))
    assert logits.shape == expected.shape
    return float(np.abs(logits - expected).max() / np.abs(expected).max())


def expected_quantized_layers(args: ModelArgs) -> set[str]:
    """Every attention and feed-forward projection, ``shared`` and ``lm_head``
    (when untied), spelled out from the configuration."""
    ff = ["wi_0", "wi_1", "wo"] if args.feed_forward_proj.startswith("gated-") else ["wi", "wo"]
    projections = {
        "self_attn": ["qkv_proj", "out_proj"],
        "cross_attn": ["query_proj", "key_proj", "value_proj", "out_proj"],
    }
    layers = {"shared"} | ({"lm_head"} if not args.tie_word_embeddings else set())
    for stack, count, attentions in (
        ("encoder", args.num_layers, ["self_attn"]),
        ("decoder", args.num_decoder_layers, ["self_attn", "cross_attn"]),
    ):
        for i in range(count):
            prefix = f"{stack}.layers.{i}"
            layers |= {f"{prefix}.{a}.{p}" for a in attentions for p in projections[a]}
            layers |= {f"{prefix}.ff.{name}" for name in ff}
    return layers


def quantized_modules(model: T5) -> set[str]:
    return {
        path
        for path, module in model.named_modules()
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    }


def teacher_forced_agreement(
    model: T5, reference: T5, tokenizer, prompts: list[str], max_tokens: int
) -> float:
    """Fraction of positions of ``reference``'s greedy outputs where ``model``'s
    argmax, given the reference's tokens before it, is the reference's token."""
    agree = total = 0
    for prompt in prompts:
        target = SpeculativeDecoder(reference, None, tokenizer).generate(
            prompt, max_tokens=max_tokens
        )
        decoder_inputs = [reference.args.decoder_start_token_id, *target.tokens[:-1]]
        logits = model(mx.array([tokenizer(prompt).input_ids]), mx.array([decoder_inputs]))
        predicted = mx.argmax(logits[0], axis=-1).tolist()
        agree += sum(p == t for p, t in zip(predicted, target.tokens, strict=True))
        total += len(target.tokens)
    return agree / total


# --- a quantized model is the function of its dequantized weights ---------------


@pytest.mark.parametrize(
    ("name", "bits", "group_size", "mode"),
    [(name, *setting) for name in WIDE for setting in SETTINGS]
    + [("relu_tied_64", 4, 32, "mxfp4")],
)
def test_quantized_model_equals_its_dequantized_twin(name, bits, group_size, mode, quantized):
    out = quantized(name, bits, group_size, mode)
    what = f"quantized {name}-{bits}bit-{mode}-g{group_size}"
    assert_within(what, relative_error_to_twin(out), PARITY_TOLERANCE)


@pytest.mark.parametrize("name", WIDE)
def test_projections_and_embedding_are_quantized_norms_and_position_biases_not(name, quantized):
    out = quantized(name, 4, 64)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    model = load_model(out)
    expected = expected_quantized_layers(model.args)
    assert quantized_modules(model) == expected
    # 2 + 2 layers: 4 self-attentions (qkv, out), 2 cross (query, key, value,
    # out), 4 feed-forward blocks (wi or wi_0 and wi_1, wo), the embedding and,
    # untied (the gated checkpoints), lm_head.
    assert len(expected) == (30 if "gated" in name else 25)
    scaled = {
        n.removesuffix(".scales")
        for n in mx.load(str(out / "weights.safetensors"))
        if "scales" in n
    }
    assert scaled == expected
    # The tied output projection is the quantized embedding itself.
    assert hasattr(model, "lm_head") is ("gated" in name)
    for stack in (model.encoder, model.decoder):
        assert type(stack.position_bias.embeddings) is nn.Embedding
        assert stack.position_bias.embeddings.weight.dtype == mx.float32
    norms = [m for _, m in model.named_modules() if isinstance(m, nn.RMSNorm)]
    assert len(norms) == 2 * 2 + 2 * 3 + 2
    assert {norm.weight.dtype for norm in norms} == {mx.float32}
    assert model.dtype == mx.float32


def test_position_bias_tables_stay_float_whatever_their_width():
    """With 64 heads a bias table is [32, 64], a shape groups of 64 fit (T5-11B has 128)."""
    args = ModelArgs(
        128, d_model=64, d_kv=1, d_ff=128, num_layers=1, num_decoder_layers=1, num_heads=64
    )
    quantized, too_narrow = quantizable_layers(T5(args), 64)
    assert quantized == expected_quantized_layers(args)
    assert too_narrow == set()


def test_quantized_half_precision_models_keep_their_dtype(quantized):
    """Affine scales have the model's type; mxfp4 scales are uint8, and an mxfp4
    embedding dequantizes to bfloat16 whatever the model's type."""
    for mode, dtype in (("affine", "bfloat16"), ("mxfp4", "float16")):
        model = load_model(quantized("relu_tied_64", 4, 32, mode, dtype))
        inputs, decoder_inputs, mask = parity_inputs(model.args.vocab_size)
        assert model.dtype == getattr(mx, dtype)
        assert model.embed(inputs).dtype == model.dtype
        logits = model(inputs, decoder_inputs, mask)
        assert logits.dtype == model.dtype
        assert mx.isfinite(logits).all()


# --- layers too narrow for the group size ---------------------------------------


def test_layers_too_narrow_for_the_group_stay_float(hf_checkpoint, tmp_path, capsys):
    """d_ff 96: the feed-forward output projections take 96 inputs, not a
    multiple of 64; conversion says so in one line and keeps them float."""
    source = str(hf_checkpoint("narrow_ff"))
    capsys.readouterr()
    out = convert.convert(
        source, tmp_path / "g64", "float32", {"group_size": 64, "bits": 4, "mode": "affine"}
    )
    said = [line for line in capsys.readouterr().out.splitlines() if "kept in" in line]
    narrow_kinds = "decoder.layers.*.ff.wo (2), encoder.layers.*.ff.wo (2)"
    assert said == [f"kept in float32, input width not a multiple of 64: {narrow_kinds}"]
    model = load_model(out)
    narrow = {f"{stack}.layers.{i}.ff.wo" for stack in ("encoder", "decoder") for i in range(2)}
    assert quantized_modules(model) == expected_quantized_layers(model.args) - narrow
    for stack in (model.encoder, model.decoder):
        for layer in stack.layers:
            assert type(layer.ff.wo) is nn.Linear
            assert isinstance(layer.ff.wi, nn.QuantizedLinear)
    assert_within(
        "quantized narrow_ff-4bit-affine-g64", relative_error_to_twin(out), PARITY_TOLERANCE
    )

    # Groups of 32 divide 96: everything is quantized, and nothing is said.
    out = convert.convert(
        source, tmp_path / "g32", "float32", {"group_size": 32, "bits": 4, "mode": "affine"}
    )
    assert "kept in" not in capsys.readouterr().out
    model = load_model(out)
    assert quantized_modules(model) == expected_quantized_layers(model.args)


# --- speculative decoding with quantized models -----------------------------------


@pytest.fixture(scope="module")
def quantized_pair(quantized, decoding_pair):
    """The decoding pair (main model and its draft; d_model 32) in float32 and 4-bit."""
    main, draft, tokenizer = decoding_pair
    return {
        "float": (main, draft),
        "4-bit": (load_model(quantized("main", 4, 32)), load_model(quantized("draft", 4, 32))),
        "tokenizer": tokenizer,
    }


@pytest.mark.parametrize(
    ("main", "draft"), [("4-bit", "4-bit"), ("4-bit", "float"), ("float", "4-bit")]
)
def test_greedy_speculative_output_equals_quantized_main_model(main, draft, quantized_pair):
    decoder = SpeculativeDecoder(
        quantized_pair[main][0], quantized_pair[draft][1], quantized_pair["tokenizer"], num_draft=4
    )
    proposed = accepted = rejected = 0
    for prompt in PROMPTS:
        regular = decoder.generate(prompt, max_tokens=30)
        speculative = decoder.speculative_decode(prompt, max_tokens=30)
        assert speculative.tokens == regular.tokens
        proposed += speculative.n_draft
        accepted += speculative.n_accepted
        rejected += speculative.n_rejected
    print(f"\n{main} main, {draft} draft: {accepted}/{proposed} accepted, {rejected} rejected")
    assert proposed > 0 and accepted > 0 and rejected > 0


def test_quantized_main_model_differs_from_float(quantized_pair):
    """Otherwise the greedy identity above would not be tested on quantized outputs."""
    tokenizer = quantized_pair["tokenizer"]
    outputs = {
        kind: [
            SpeculativeDecoder(quantized_pair[kind][0], None, tokenizer)
            .generate(p, max_tokens=30)
            .tokens
            for p in PROMPTS
        ]
        for kind in ("float", "4-bit")
    }
    assert outputs["float"] != outputs["4-bit"]


def test_draft_check_accepts_other_precisions(quantized, converted_pair):
    main_dir, draft_dir = converted_pair
    check_draft_directories(quantized("main", 4, 32), draft_dir)
    check_draft_directories(main_dir, quantized("draft", 4, 32))


# --- close to float ---------------------------------------------------------------


@pytest.mark.parametrize("name", WIDE)
def test_quantized_logits_stay_close_to_float(name, quantized, converted):
    """Teacher-forced top-1 agreement with float32, reported. On these fixtures
    (attention as initialised, fixtures.PARITY_QK_SCALE) 8-bit measured 0.992
    (ReLU) and 0.958 (gated), 4-bit 0.817 and 0.592 (a trained model: 0.99 at
    8 bits, 0.92 at 4 in issue 8); asserted: 8-bit at least 0.9, and above
    4-bit by at least 0.1 (measured: 0.175 and 0.366)."""
    reference = load_model(converted(name))
    tokenizer = load_tokenizer(converted(name))
    rates = {
        bits: teacher_forced_agreement(
            load_model(quantized(name, bits, 64)), reference, tokenizer, PROMPTS, 30
        )
        for bits in (8, 4)
    }
    print(f"\n{name}: top-1 agreement with float32: 8-bit {rates[8]:.3f}, 4-bit {rates[4]:.3f}")
    assert rates[8] >= 0.9
    assert rates[8] >= rates[4] + 0.1


# --- the command line ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "mentioned"),
    [
        (["-q", "--q-bits", "7"], "--q-bits"),
        (["--q-bits", "4"], "-q"),
        (["-q", "--q-mode", "mxfp4", "--q-group-size", "64"], "--q-group-size"),
        (["-q", "--q-group-size", "48"], "--q-group-size"),
    ],
    ids=["7-bits", "bits-without-q", "mxfp4-group-64", "group-48"],
)
def test_bad_quantization_flags_give_one_line(
    flags, mentioned, hf_checkpoint, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_status:
        convert.main(["--model", str(hf_checkpoint("relu_tied_64")), *flags])
    assert exit_status.value.code != 0
    assert mentioned in assert_one_line_error(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("flags", "suffix", "settings"),
    [
        ([], "-4bit", {"group_size": 64, "bits": 4, "mode": "affine"}),
        (["--q-bits", "8"], "-8bit", {"group_size": 64, "bits": 8, "mode": "affine"}),
    ],
)
def test_default_output_is_named_after_the_quantization(
    flags, suffix, settings, hf_checkpoint, tmp_path, monkeypatch
):
    checkpoint = hf_checkpoint("relu_tied_64")
    monkeypatch.chdir(tmp_path)
    assert convert.main(["--model", str(checkpoint), "-q", *flags]) == 0
    out = tmp_path / "mlx_models" / f"{checkpoint.name}{suffix}"
    assert json.loads((out / "config.json").read_text())["quantization"] == settings
    model = load_model(out)
    assert model.dtype == mx.bfloat16
    assert quantized_modules(model) == expected_quantized_layers(model.args)


# --- conversion memory (issue 8) -------------------------------------------------------

# A T5 v1.1-large-like checkpoint (flan-t5-large shapes), with 6 + 6 layers
# instead of 24 + 24: about 1 GB in float32.
BIG_CONFIG = {
    "model_type": "t5",
    "vocab_size": 32128,
    "d_model": 1024,
    "d_kv": 64,
    "num_heads": 16,
    "d_ff": 2816,
    "num_layers": 6,
    "num_decoder_layers": 6,
    "feed_forward_proj": "gated-gelu",
    "tie_word_embeddings": False,
}


def t5_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and shapes of every tensor of a T5 v1.1 checkpoint."""
    d_model, inner, d_ff = config["d_model"], config["num_heads"] * config["d_kv"], config["d_ff"]
    shapes = {"shared.weight": (config["vocab_size"], d_model)}
    shapes["lm_head.weight"] = shapes["shared.weight"]
    for stack, count, attentions in (
        ("encoder", config["num_layers"], ["SelfAttention"]),
        ("decoder", config["num_decoder_layers"], ["SelfAttention", "EncDecAttention"]),
    ):
        for block in range(count):
            for position, attention in enumerate(attentions):
                prefix = f"{stack}.block.{block}.layer.{position}"
                for projection in "qkv":
                    shapes[f"{prefix}.{attention}.{projection}.weight"] = (inner, d_model)
                shapes[f"{prefix}.{attention}.o.weight"] = (d_model, inner)
                if block == 0 and position == 0:
                    bias = (32, config["num_heads"])
                    shapes[f"{prefix}.{attention}.relative_attention_bias.weight"] = bias
                shapes[f"{prefix}.layer_norm.weight"] = (d_model,)
            prefix = f"{stack}.block.{block}.layer.{len(attentions)}"
            shapes[f"{prefix}.DenseReluDense.wi_0.weight"] = (d_ff, d_model)
            shapes[f"{prefix}.DenseReluDense.wi_1.weight"] = (d_ff, d_model)
            shapes[f"{prefix}.DenseReluDense.wo.weight"] = (d_model, d_ff)
            shapes[f"{prefix}.layer_norm.weight"] = (d_model,)
        shapes[f"{stack}.final_layer_norm.weight"] = (d_model,)
    return shapes


def write_random_safetensors(file: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A float32 safetensors file of random tensors, written one tensor at a time
    (the format: header length, JSON header, the tensors' bytes)."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 4 * int(np.prod(shape))
        header[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header_bytes = json.dumps(header).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    rng = np.random.default_rng(0)
    with file.open("wb") as stream:
        stream.write(struct.pack("<Q", len(header_bytes)) + header_bytes)
        for shape in shapes.values():
            stream.write((rng.standard_normal(shape, dtype=np.float32) * 0.05).tobytes())


# Runs convert.main in a fresh interpreter and prints its peak resident memory
# (bytes) after the imports (the baseline) and after converting. The baseline
# includes the tokenizer library convert imports when it reads the tokenizer,
# a fixed cost of some 240 MB whatever the model's size (transformers imports
# torch), and torch itself when the first argument is "bin" (convert reads .bin
# weights with it), whatever transformers imports. On Linux ru_maxrss
# carries the parent's high-water mark through fork and exec (the pytest
# process is large), so there the peak is read as VmHWM, which exec resets.
MEASURE_CONVERSION = """
import json, resource, sys
sys.path.insert(0, sys.argv[1])

def peak_rss():
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if "VmHWM" in line)
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS

import convert
imported = peak_rss()
from transformers import AutoTokenizer
if sys.argv[2] == "bin":
    import torch
baseline = peak_rss()
code = convert.main(sys.argv[3:])
print(json.dumps({"code": code, "imported": imported, "baseline": baseline, "peak": peak_rss()}))
"""


@pytest.mark.parametrize("weights_format", ["safetensors", "bin"])
def test_quantized_conversion_memory_is_bounded(weights_format, tmp_path, tokenizer_dir):
    """Peak resident memory above the baseline <= output + 4 x the largest input tensor,
    from safetensors and from a pytorch_model.bin (memory-mapped)."""
    checkpoint = tmp_path / "big-t5"
    checkpoint.mkdir()
    assert BIG_CONFIG["vocab_size"] >= tokenizer_vocab_size(tokenizer_dir)
    shapes = t5_tensor_shapes(BIG_CONFIG)
    try:
        write_random_safetensors(checkpoint / "model.safetensors", shapes)
        (checkpoint / "config.json").write_text(json.dumps(BIG_CONFIG))
        copy_tokenizer(tokenizer_dir, checkpoint)
        if weights_format == "bin":
            source, checkpoint = checkpoint, bin_checkpoint(checkpoint, tmp_path / "big-t5-bin")
            shutil.rmtree(source)
        out = tmp_path / "big-t5-4bit"
        args = ["--model", str(checkpoint), "-q", "--out", str(out), "--dtype", "float32"]
        run = subprocess.run(
            [sys.executable, "-c", MEASURE_CONVERSION, str(ROOT), weights_format, *args],
            check=False,
            env=offline_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr
        memory = json.loads(run.stdout.splitlines()[-1])
        assert memory["code"] == 0
        # Nothing is left beside the weights (a .bin is copied through an unlinked file).
        assert not [file for file in checkpoint.iterdir() if file.name.startswith(".")]
    finally:
        shutil.rmtree(checkpoint)
    baseline, peak = memory["baseline"], memory["peak"]
    input_size = sum(4 * int(np.prod(shape)) for shape in shapes.values())
    largest = max(4 * int(np.prod(shape)) for shape in shapes.values())
    output = (out / "weights.safetensors").stat().st_size
    bound = output + 4 * largest
    print(
        f"\nconversion of {input_size / 1e9:.2f} GB float32 {weights_format} to 4 bits: "
        f"{(peak - baseline) / 1e6:.0f} MB above the baseline "
        f"({baseline / 1e6:.0f} MB; {memory['imported'] / 1e6:.0f} MB before importing "
        f"transformers), bound {bound / 1e6:.0f} MB = output {output / 1e6:.0f} MB "
        f"+ 4 x largest tensor {largest / 1e6:.0f} MB"
    )
    assert peak - baseline <= bound
    # The bound is tight enough to matter: holding the float checkpoint would break it.
    assert input_size > bound
