"""convert.py: Hugging Face T5 checkpoints in, self-contained MLX model directories out."""

from __future__ import annotations

import http.server
import json
import os
import random
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

import convert
from layout import LEGACY_WEIGHTS_FILE, WEIGHTS_FILE, is_converted, written_by_convert
from loading import (
    STACKED_PROJECTIONS,
    load_config,
    load_model,
    load_tokenizer,
    stacked_projections,
)
from model import ModelArgs, parameter_bytes

ROOT = Path(__file__).resolve().parents[1]
CONVERT_PY = ROOT / "convert.py"
MAIN_PY = ROOT / "main.py"
TEXT = "translate English to German: the house is small."
HF_WEIGHTS = "model.safetensors"


# --- helpers -----------------------------------------------------------------


def offline_env() -> dict[str, str]:
    """The environment of a CLI run that must not contact the Hugging Face Hub."""
    return {**os.environ, "HF_HUB_OFFLINE": "1"}


def run_convert(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python convert.py ARGS`` in ``cwd``."""
    return subprocess.run(
        [sys.executable, str(CONVERT_PY), *args],
        check=False,
        cwd=cwd,
        env=offline_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_one_line_error(stderr: str) -> str:
    """``stderr`` is exactly one non-empty line, an ``error:`` message without a traceback."""
    assert "Traceback" not in stderr, f"convert.py crashed:\n{stderr}"
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one error line, got:\n{stderr}"
    assert lines[0].startswith("error:"), stderr
    return lines[0]


def copy_checkpoint(source: Path, destination: Path, *, without: tuple[str, ...] = ()) -> Path:
    """Copy a Hugging Face checkpoint directory, leaving out the files named in ``without``."""
    destination.mkdir(parents=True)
    for file in source.iterdir():
        if file.is_file() and file.name not in without:
            shutil.copyfile(file, destination / file.name)
    return destination


def read_weights(out: Path) -> dict[str, np.ndarray]:
    """The converted weights as float32 numpy arrays."""
    return {
        name: np.array(w.astype(mx.float32))
        for name, w in mx.load(str(out / "weights.safetensors")).items()
    }


def assert_same_weights(out: Path, reference: Path) -> None:
    weights, expected = read_weights(out), read_weights(reference)
    assert sorted(weights) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(weights[name], value, err_msg=name)


def leftovers(parent: Path, out: Path) -> list[str]:
    """Entries of ``parent`` other than ``out``, e.g. a staging directory left behind."""
    return sorted(entry.name for entry in parent.iterdir() if entry != out)


def base_config(**overrides) -> dict:
    """A minimal Hugging Face T5 config.json, as a dict."""
    config = {
        "model_type": "t5",
        "vocab_size": 200,
        "d_model": 32,
        "d_kv": 8,
        "d_ff": 64,
        "num_layers": 2,
        "num_heads": 4,
    }
    config.update(overrides)
    return config


# --- the output directory --------------------------------------------------------


@pytest.mark.parametrize("name", ["relu_tied", "gated_untied"])
def test_output_is_self_contained(name, converted, hf_checkpoint):
    """weights.safetensors, config.json and the tokenizer: enough to load model and tokenizer."""
    out = converted(name)
    files = {file.name for file in out.iterdir()}
    assert {"weights.safetensors", "config.json", "tokenizer_config.json"} <= files
    assert files & {"tokenizer.json", "spiece.model"}, files
    assert leftovers(out.parent, out) == []
    assert written_by_convert(out), f"files convert.py does not know it writes: {files}"

    model = load_model(out)
    tokenizer = load_tokenizer(out)
    source_tokenizer = AutoTokenizer.from_pretrained(hf_checkpoint(name), local_files_only=True)
    assert tokenizer(TEXT).input_ids == source_tokenizer(TEXT).input_ids
    assert len(tokenizer) == model.args.vocab_size
    logits = model(mx.array([tokenizer(TEXT).input_ids]), mx.array([[0, 5, 7]]))
    assert logits.shape == (1, 3, model.args.vocab_size)


@pytest.mark.parametrize(
    ("name", "tied", "scaled"),
    [("relu_tied", True, True), ("gated_untied", False, False)],
)
def test_config_tie_and_scale(name, tied, scaled, converted):
    """Original T5 shares its output projection and scales; T5 v1.1 does neither."""
    out = converted(name)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    assert config["scale_decoder_outputs"] is scaled
    assert config["model_type"] == "t5"
    assert ("lm_head.weight" in mx.load(str(out / "weights.safetensors"))) is not tied
    args = load_model(out).args
    assert (args.tie_word_embeddings, args.scale_decoder_outputs) == (tied, scaled)


def test_default_output_names():
    assert convert.default_output("t5-small") == Path("mlx_models/t5-small")
    assert convert.default_output("google/flan-t5-large") == Path("mlx_models/google-flan-t5-large")


def test_default_output_of_a_local_directory(tmp_path, monkeypatch):
    checkpoint = tmp_path / "some" / "my-t5"
    checkpoint.mkdir(parents=True)
    assert convert.default_output(str(checkpoint)) == Path("mlx_models/my-t5")
    monkeypatch.chdir(checkpoint)  # --model . is named after the directory, not mlx_models itself
    assert convert.default_output(".") == Path("mlx_models/my-t5")


def test_small_conversions_report_their_size(tmp_path, hf_checkpoint, capsys):
    """Not "0.00 GB": a size below 0.1 GB is given in MB."""
    capsys.readouterr()
    out = convert.convert(str(hf_checkpoint("relu_tied")), tmp_path / "out", "float32")
    said = re.search(r"writing \d+ tensors \(([\d.]+) MB, float32\)", capsys.readouterr().out)
    assert said, "no size in MB"
    stored = sum(array.nbytes for array in mx.load(str(out / "weights.safetensors")).values())
    assert float(said[1]) == pytest.approx(stored / 1e6, abs=0.005)


# --- model_config ----------------------------------------------------------------


def test_model_config_old_style_v1_1_is_not_scaled():
    """Hub T5 v1.1 configs carry only ``tie_word_embeddings: false``."""
    config = convert.model_config(base_config(tie_word_embeddings=False), has_lm_head=True)
    assert config["scale_decoder_outputs"] is False
    assert config["tie_word_embeddings"] is False


def test_model_config_transformers_5_style_is_not_scaled():
    """transformers 5 writes ``scale_decoder_outputs`` and forces ``tie_word_embeddings: true``."""
    hf_config = base_config(scale_decoder_outputs=False, tie_word_embeddings=True)
    config = convert.model_config(hf_config, has_lm_head=True)
    assert config["scale_decoder_outputs"] is False
    assert config["tie_word_embeddings"] is False


def test_model_config_original_t5_is_scaled():
    config = convert.model_config(base_config(), has_lm_head=False)
    assert config["scale_decoder_outputs"] is True
    assert config["tie_word_embeddings"] is True


@pytest.mark.parametrize("has_lm_head", [True, False])
@pytest.mark.parametrize("config_says_tied", [True, False, None])
def test_model_config_tying_follows_the_weights(has_lm_head, config_says_tied):
    """Whatever config.json says, the output projection is untied iff lm_head.weight exists."""
    overrides = {} if config_says_tied is None else {"tie_word_embeddings": config_says_tied}
    config = convert.model_config(base_config(**overrides), has_lm_head=has_lm_head)
    assert config["tie_word_embeddings"] is (not has_lm_head)


def test_model_config_eos_list_is_normalized():
    config = convert.model_config(base_config(eos_token_id=[1, 7]), has_lm_head=False)
    assert config["eos_token_id"] == 1


def test_model_config_decoder_layers_default_to_encoder_layers():
    config = convert.model_config(base_config(num_decoder_layers=None), has_lm_head=False)
    assert config["num_decoder_layers"] == 2
    config = convert.model_config(base_config(num_decoder_layers=3), has_lm_head=False)
    assert config["num_decoder_layers"] == 3


def test_model_config_defaults_and_fields():
    """Every written field is a ModelArgs field; absent optional fields get T5 defaults."""
    config = convert.model_config(
        base_config(model_type="mt5", decoder_start_token_id=None), has_lm_head=False
    )
    assert config["model_type"] == "t5"
    assert config["decoder_start_token_id"] == 0
    assert config["eos_token_id"] == 1
    assert config["pad_token_id"] == 0
    assert config["feed_forward_proj"] == "relu"
    assert config["relative_attention_num_buckets"] == 32
    assert config["relative_attention_max_distance"] == 128
    args = ModelArgs.from_dict(config)
    assert {key for key in config if key != "model_type"} <= set(vars(args))


@pytest.mark.parametrize("model_type", ["gpt2", "bart", None])
def test_model_config_rejects_other_models(model_type):
    with pytest.raises(ValueError, match="model_type"):
        convert.model_config(base_config(model_type=model_type), has_lm_head=False)


# --- weight formats --------------------------------------------------------------


def test_sharded_safetensors_match_single_file(tmp_path, hf_checkpoint, converted):
    """A model.safetensors.index.json with two shards converts to the same weights."""
    source = hf_checkpoint("gated_untied")
    sharded = copy_checkpoint(source, tmp_path / "sharded", without=(HF_WEIGHTS,))
    tensors = load_file(source / HF_WEIGHTS)
    names = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    weight_map = {}
    for shard, shard_names in halves.items():
        save_file({n: tensors[n] for n in shard_names}, sharded / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard_names, shard))
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))

    out = convert.convert(str(sharded), tmp_path / "out", "float32")
    assert_same_weights(out, converted("gated_untied"))
    config, reference = (
        json.loads((directory / "config.json").read_text())
        for directory in (out, converted("gated_untied"))
    )
    assert config["converted_from"] == str(sharded.resolve())
    del config["converted_from"], reference["converted_from"]
    assert config == reference


def test_missing_shard_is_reported(tmp_path, hf_checkpoint):
    source = hf_checkpoint("relu_tied")
    checkpoint = copy_checkpoint(source, tmp_path / "ckpt", without=(HF_WEIGHTS,))
    index = {"weight_map": {"shared.weight": "model-00001-of-00001.safetensors"}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="missing weight file"):
        convert.convert(str(checkpoint), tmp_path / "out", "float32")
    assert not (tmp_path / "out").exists()


def bin_checkpoint(source: Path, destination: Path) -> Path:
    """A copy of ``source`` whose weights are only in pytorch_model.bin."""
    checkpoint = copy_checkpoint(source, destination, without=(HF_WEIGHTS,))
    torch.save(load_file(source / HF_WEIGHTS), checkpoint / "pytorch_model.bin")
    return checkpoint


def test_pytorch_bin_matches_safetensors(tmp_path, hf_checkpoint, converted):
    checkpoint = bin_checkpoint(hf_checkpoint("gated_untied"), tmp_path / "bin")
    out = convert.convert(str(checkpoint), tmp_path / "out", "float32")
    reference = converted("gated_untied")
    assert_same_weights(out, reference)

    rng = np.random.default_rng(0)
    inputs = mx.array(rng.integers(3, 200, size=(2, 11)))
    decoder_inputs = rng.integers(3, 200, size=(2, 7))
    decoder_inputs[:, 0] = 0
    decoder_inputs = mx.array(decoder_inputs)
    logits = np.array(load_model(out)(inputs, decoder_inputs))
    expected = np.array(load_model(reference)(inputs, decoder_inputs))
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-6)


def test_pytorch_bin_is_read_with_weights_only(tmp_path, hf_checkpoint, monkeypatch):
    checkpoint = bin_checkpoint(hf_checkpoint("relu_tied"), tmp_path / "bin")
    calls = []
    real_load = torch.load

    def recording_load(*args, **kwargs):
        calls.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    convert.convert(str(checkpoint), tmp_path / "out", "float32")
    assert calls, "torch.load was not called"
    assert all(kwargs.get("weights_only") is True for kwargs in calls), calls


@pytest.mark.parametrize(
    ("legacy", "dtype"),
    [(True, torch.float32), (False, torch.bfloat16), (False, torch.float16)],
    ids=["legacy-float32", "zip-bfloat16", "zip-float16"],
)
def test_pytorch_bin_formats_and_types(legacy, dtype, tmp_path, hf_checkpoint, capsys):
    """A legacy (non-zip) .bin converts as a zip one does, after one line saying it is
    loaded whole and how much memory that takes; half-precision and non-contiguous tensors
    keep their values; nothing is left beside the checkpoint (its tensors pass through an
    unlinked file)."""
    source = hf_checkpoint("relu_tied")
    checkpoint = copy_checkpoint(source, tmp_path / "bin", without=(HF_WEIGHTS,))
    tensors = {name: tensor.to(dtype) for name, tensor in load_file(source / HF_WEIGHTS).items()}
    # Stored column by column: a tensor need not be contiguous in its storage.
    tensors["shared.weight"] = tensors["shared.weight"].t().contiguous().t()
    assert not tensors["shared.weight"].is_contiguous()
    bin_file = checkpoint / "pytorch_model.bin"
    torch.save(tensors, bin_file, _use_new_zipfile_serialization=not legacy)
    files = sorted(checkpoint.iterdir())
    capsys.readouterr()
    out = convert.convert(str(checkpoint), tmp_path / "out", "float32")
    notes = [line for line in capsys.readouterr().out.splitlines() if "loaded whole" in line]
    size = f"{bin_file.stat().st_size / 1e9:.2f} GB"
    expected = "pytorch_model.bin is in PyTorch's legacy format, which cannot be memory-mapped: "
    assert notes == ([f"{expected}it is loaded whole, about {size} of memory"] if legacy else [])
    weights = read_weights(out)
    expected = {
        convert.mlx_name(hf_name): mx.array(tensor.float().numpy())
        for hf_name, tensor in tensors.items()
        if convert.mlx_name(hf_name) is not None
    }
    expected = stacked_projections(expected)
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        np.testing.assert_array_equal(weights[name], np.array(tensor), err_msg=name)
    assert sorted(checkpoint.iterdir()) == files


def test_pytorch_bin_beside_which_nothing_can_be_written(
    tmp_path, hf_checkpoint, converted, monkeypatch
):
    """A .bin in a read-only directory passes through the system's temporary directory."""
    checkpoint = bin_checkpoint(hf_checkpoint("relu_tied"), tmp_path / "bin")
    make_temporary_file = tempfile.mkstemp
    refused = []

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and Path(dir) == checkpoint:
            refused.append(dir)
            raise PermissionError(f"read-only: {dir}")
        return make_temporary_file(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    out = convert.convert(str(checkpoint), tmp_path / "out", "float32")
    assert refused
    assert_same_weights(out, converted("relu_tied"))


class CreatesFileWhenUnpickled:
    """Unpickling this calls ``open(path, "w")``: code run by merely reading a checkpoint."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def write_code_running_bin(file: Path, marker: Path) -> None:
    torch.save({"shared.weight": CreatesFileWhenUnpickled(marker)}, file)


def write_tensor_list(file: Path, marker: Path) -> None:
    torch.save([torch.ones(2)], file)


def write_garbage(file: Path, marker: Path) -> None:
    file.write_bytes(random.Random(0).randbytes(4096))


def write_truncated_safetensors(file: Path, marker: Path) -> None:
    file.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{")


@pytest.mark.parametrize(
    ("file_name", "write"),
    [
        ("pytorch_model.bin", write_code_running_bin),
        ("pytorch_model.bin", write_garbage),
        ("pytorch_model.bin", write_tensor_list),
        ("model.safetensors", write_garbage),
        ("model.safetensors", write_truncated_safetensors),
    ],
    ids=[
        "bin-running-code",
        "bin-garbage",
        "bin-not-a-state-dict",
        "safetensors-garbage",
        "safetensors-truncated",
    ],
)
def test_unreadable_weights_give_one_line_error(file_name, write, tmp_path, hf_checkpoint, capsys):
    """Bad weight files end the CLI with ``error: ...``; a pickle never runs code."""
    checkpoint = copy_checkpoint(
        hf_checkpoint("relu_tied"), tmp_path / "ckpt", without=(HF_WEIGHTS,)
    )
    marker = tmp_path / "unpickling-ran-code"
    write(checkpoint / file_name, marker)
    out = tmp_path / "out"
    capsys.readouterr()
    try:
        code = convert.main(["--model", str(checkpoint), "--out", str(out)])
    except Exception as error:  # noqa: BLE001 - an escaping exception is the failure tested
        pytest.fail(
            f"convert.main let {type(error).__name__} escape for an unreadable {file_name} "
            f"(the CLI prints a traceback): {str(error).splitlines()[0]}"
        )
    assert not marker.exists(), "reading the checkpoint ran code from the pickle"
    assert code != 0
    message = assert_one_line_error(capsys.readouterr().err)
    assert file_name in message
    assert not out.exists()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_dtype_of_converted_weights(dtype, converted):
    out = converted("relu_tied", dtype)
    weights = mx.load(str(out / "weights.safetensors"))
    assert weights
    assert {w.dtype for w in weights.values()} == {getattr(mx, dtype)}
    assert load_model(out).dtype == getattr(mx, dtype)


def test_bfloat16_weights_are_rounded_float32_weights(converted):
    low = read_weights(converted("relu_tied", "bfloat16"))
    full = read_weights(converted("relu_tied", "float32"))
    for name, value in full.items():
        np.testing.assert_allclose(low[name], value, rtol=2**-8, atol=0, err_msg=name)


# --- atomic output ---------------------------------------------------------------


def failing_save(error: BaseException):
    """An ``mx.save_safetensors`` that writes part of the file, then fails with ``error``."""

    def save_safetensors(file, *args, **kwargs):
        Path(file).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{ partial")
        raise error

    return save_safetensors


def snapshot(directory: Path) -> dict[str, bytes]:
    return {file.name: file.read_bytes() for file in sorted(directory.iterdir())}


def interrupt_writing(monkeypatch) -> str:
    """Ctrl-C while the weights are written; returns the function interrupted."""
    monkeypatch.setattr(convert.mx, "save_safetensors", failing_save(KeyboardInterrupt()))
    return "save_safetensors"


def interrupt_converting(monkeypatch) -> str:
    """Ctrl-C at the third tensor cast (or quantized), before anything is written."""
    real_eval, calls = mx.eval, []

    def eval_(*args):
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_eval(*args)

    monkeypatch.setattr(convert.mx, "eval", eval_)
    return "convert_tensors"


@pytest.mark.parametrize("interrupt", [interrupt_writing, interrupt_converting])
@pytest.mark.parametrize(
    "quantization", [None, {"group_size": 32, "bits": 4, "mode": "affine"}], ids=["float", "4-bit"]
)
def test_interrupted_conversion_leaves_nothing(
    interrupt, quantization, tmp_path, hf_checkpoint, monkeypatch
):
    parent = tmp_path / "mlx_models"
    out = parent / "tiny"
    interrupted = interrupt(monkeypatch)
    with pytest.raises(KeyboardInterrupt) as error:
        convert.convert(str(hf_checkpoint("relu_tied")), out, "float32", quantization)
    assert interrupted in [entry.name for entry in error.traceback]
    assert not out.exists()
    assert not parent.exists() or leftovers(parent, out) == []


def test_failed_conversion_keeps_the_previous_one(tmp_path, hf_checkpoint, monkeypatch, capsys):
    """A failure while writing (disk full) keeps the earlier good conversion intact."""
    out = tmp_path / "tiny"
    convert.convert(str(hf_checkpoint("relu_tied")), out, "float32")
    before = snapshot(out)
    monkeypatch.setattr(
        convert.mx, "save_safetensors", failing_save(OSError(28, "No space left on device"))
    )
    capsys.readouterr()
    code = convert.main(
        ["--model", str(hf_checkpoint("gated_untied")), "--out", str(out), "--force"]
    )
    assert code != 0
    assert "No space left on device" in assert_one_line_error(capsys.readouterr().err)
    assert snapshot(out) == before
    assert leftovers(tmp_path, out) == []
    load_model(out)


def tree(directory: Path) -> dict[str, bytes | None]:
    """Every path under ``directory``, with the bytes of the files."""
    return {
        str(path.relative_to(directory)): path.read_bytes() if path.is_file() else None
        for path in sorted(directory.rglob("*"))
    }


def convert_cli(capsys, *args: str) -> tuple[int, str]:
    """``convert.main(ARGS)``: its exit status and its standard error."""
    capsys.readouterr()
    code = convert.main(list(args))
    return code, capsys.readouterr().err


def foreign_directory(directory: Path) -> None:
    """A user's directory: notes and data, nothing convert.py wrote."""
    (directory / "sub").mkdir(parents=True)
    (directory / "notes.txt").write_text("my notes")
    (directory / "sub" / "data.csv").write_text("a,b\n1,2\n")


def conversion_with_a_foreign_file(directory: Path) -> None:
    """A conversion into which the user put a file of their own."""
    (directory / "notes.txt").write_text("my notes")


def conversion_with_a_foreign_directory(directory: Path) -> None:
    (directory / "extra").mkdir()
    (directory / "extra" / "data.csv").write_text("a,b\n")


def a_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("not a directory")


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
@pytest.mark.parametrize(
    "make",
    [
        foreign_directory,
        conversion_with_a_foreign_file,
        conversion_with_a_foreign_directory,
        a_file,
    ],
    ids=["foreign-directory", "conversion-plus-file", "conversion-plus-directory", "file"],
)
def test_output_not_written_by_convert_is_refused_untouched(
    make, force, tmp_path, hf_checkpoint, converted, capsys
):
    """An --out holding anything convert.py did not write survives byte for
    byte, with or without --force; nothing is converted or left beside it."""
    out = tmp_path / "precious"
    if make in (conversion_with_a_foreign_file, conversion_with_a_foreign_directory):
        shutil.copytree(converted("relu_tied"), out)
    make(out)
    before = tree(out) if out.is_dir() else out.read_bytes()
    args = ["--model", str(hf_checkpoint("gated_untied")), "--out", str(out)]
    code, err = convert_cli(capsys, *args, *(["--force"] if force else []))
    assert code != 0
    assert "not a model directory convert.py wrote" in assert_one_line_error(err)
    assert (tree(out) if out.is_dir() else out.read_bytes()) == before
    assert leftovers(tmp_path, out) == []
    assert "reading" not in capsys.readouterr().out  # refused before converting


@pytest.mark.parametrize(
    "where", ["itself", "inside", "parent"], ids=["in-place", "inside", "containing"]
)
def test_output_overlapping_the_checkpoint_is_refused(where, tmp_path, hf_checkpoint, capsys):
    """--out equal to, inside or containing --model: refused, the checkpoint intact."""
    checkpoint = copy_checkpoint(hf_checkpoint("relu_tied"), tmp_path / "ckpt" / "main")
    out = {"itself": checkpoint, "inside": checkpoint / "mlx", "parent": checkpoint.parent}[where]
    before = tree(tmp_path)
    code, err = convert_cli(capsys, "--model", str(checkpoint), "--out", str(out))
    assert code != 0
    assert "overlap" in assert_one_line_error(err)
    assert tree(tmp_path) == before


def test_earlier_conversion_is_replaced_only_with_force(tmp_path, hf_checkpoint, capsys):
    out = tmp_path / "tiny"
    first = str(hf_checkpoint("relu_tied"))
    convert.convert(first, out, "float32")
    before = tree(out)
    args = ["--model", str(hf_checkpoint("gated_untied")), "--out", str(out), "--dtype", "bfloat16"]
    code, err = convert_cli(capsys, *args)
    assert code != 0
    message = assert_one_line_error(err)
    assert "--force" in message and str(Path(first).resolve()) in message
    assert tree(out) == before

    assert convert_cli(capsys, *args, "--force")[0] == 0
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert {w.dtype for w in mx.load(str(out / "weights.safetensors")).values()} == {mx.bfloat16}
    assert leftovers(tmp_path, out) == []


def test_conversion_from_before_the_marker_is_ours(tmp_path, hf_checkpoint):
    """An output of an earlier convert.py, whose config.json has no
    converted_from, is still recognised as convert.py's: --force replaces it."""
    out = tmp_path / "tiny"
    convert.convert(str(hf_checkpoint("relu_tied")), out, "float32")
    config = json.loads((out / "config.json").read_text())
    del config["converted_from"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="--force"):
        convert.convert(str(hf_checkpoint("gated_untied")), out, "float32")
    convert.convert(str(hf_checkpoint("gated_untied")), out, "float32", force=True)
    assert "converted_from" in json.loads((out / "config.json").read_text())


def test_an_empty_output_directory_is_used(tmp_path, hf_checkpoint):
    out = tmp_path / "empty"
    out.mkdir()
    convert.convert(str(hf_checkpoint("relu_tied")), out, "float32")
    load_model(out)
    assert leftovers(tmp_path, out) == []


def test_failed_replacement_keeps_the_earlier_conversion(tmp_path, hf_checkpoint, monkeypatch):
    """--force moves the earlier output aside and deletes it only once the
    new one is in place: if that last rename fails, the earlier one is back."""
    out = tmp_path / "tiny"
    convert.convert(str(hf_checkpoint("relu_tied")), out, "float32")
    before = tree(out)
    real_replace = os.replace

    def failing_replace(source, destination):
        staged = Path(source).name.startswith(".tiny.") and ".old." not in Path(source).name
        if staged and Path(destination) == out:
            raise OSError(28, "No space left on device")
        real_replace(source, destination)

    monkeypatch.setattr(convert.os, "replace", failing_replace)
    with pytest.raises(OSError, match="No space left"):
        convert.convert(str(hf_checkpoint("gated_untied")), out, "float32", force=True)
    assert tree(out) == before
    assert leftovers(tmp_path, out) == []


def test_checkpoints_named_alike_do_not_replace_each_other(
    tmp_path, hf_checkpoint, monkeypatch, capsys
):
    """a/checkpoint-500 and b/checkpoint-500 share the default output name:
    the second conversion is refused, naming what the first one wrote."""
    first = copy_checkpoint(hf_checkpoint("relu_tied"), tmp_path / "a" / "checkpoint-500")
    second = copy_checkpoint(hf_checkpoint("gated_untied"), tmp_path / "b" / "checkpoint-500")
    monkeypatch.chdir(tmp_path)
    assert convert_cli(capsys, "--model", str(first), "--dtype", "float32")[0] == 0
    out = tmp_path / "mlx_models" / "checkpoint-500"
    before = tree(out)
    code, err = convert_cli(capsys, "--model", str(second), "--dtype", "float32")
    assert code != 0
    assert str(first) in assert_one_line_error(err)
    assert tree(out) == before


def test_output_directory_has_ordinary_permissions(tmp_path, hf_checkpoint):
    """The output is staged with tempfile.mkdtemp (mode 0700); once in place it should
    have the mode of any directory created under the current umask."""
    out = convert.convert(str(hf_checkpoint("relu_tied")), tmp_path / "tiny", "float32")
    reference = tmp_path / "reference"
    reference.mkdir()
    assert oct(out.stat().st_mode & 0o777) == oct(reference.stat().st_mode & 0o777), (
        "convert.py leaves the output directory with tempfile.mkdtemp's private mode 0700"
    )


# --- the command line --------------------------------------------------------------


def test_cli_converts_and_prints_a_working_command(tmp_path, hf_checkpoint):
    """Default output mlx_models/<directory name>; the printed main.py command runs."""
    checkpoint = copy_checkpoint(hf_checkpoint("relu_tied"), tmp_path / "tiny-t5")
    result = run_convert("--model", str(checkpoint), "--dtype", "float32", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = Path("mlx_models") / "tiny-t5"
    assert (tmp_path / out / "weights.safetensors").is_file()
    assert f"Saved to {out}" in result.stdout
    # From another directory, the commands name this Python and main.py where they are.
    main_py = f"{sys.executable} {MAIN_PY}"
    commands = [
        line.split(": ", 1)[1].strip() for line in result.stdout.splitlines() if main_py in line
    ]
    assert f"{main_py} --model-name {out}" in commands, result.stdout
    assert f"{main_py} --draft-model-name {out}" in commands, result.stdout

    command = next(line for line in commands if "--model-name" in line)
    run = subprocess.run(
        [*shlex.split(command), "--regular-decode", "-m", "3", "--prompt", TEXT],
        check=False,
        cwd=tmp_path,
        env=offline_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "Generation: " in run.stderr


def make_no_config(checkpoint: Path) -> None:
    (checkpoint / "config.json").unlink()


def make_no_tokenizer(checkpoint: Path) -> None:
    for name in (
        "spiece.model",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ):
        (checkpoint / name).unlink(missing_ok=True)


def make_gpt2_config(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    config["model_type"] = "gpt2"
    (checkpoint / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("damage", "expected"),
    [(make_no_config, "config.json"), (make_no_tokenizer, "tokenizer"), (make_gpt2_config, "gpt2")],
    ids=["no-config", "no-tokenizer", "gpt2-config"],
)
def test_cli_rejects_bad_checkpoint_directories(damage, expected, tmp_path, hf_checkpoint):
    checkpoint = copy_checkpoint(hf_checkpoint("relu_tied"), tmp_path / "ckpt")
    damage(checkpoint)
    result = run_convert("--model", str(checkpoint), cwd=tmp_path)
    assert result.returncode != 0
    assert expected in assert_one_line_error(result.stderr)
    assert not (tmp_path / "mlx_models").exists()


@pytest.mark.parametrize("out", [None, "itself"], ids=["default-out", "out-itself"])
def test_converted_directory_is_not_converted_again(out, tmp_path, converted, monkeypatch, capsys):
    """Given a directory convert.py wrote, convert.py says how to use it."""
    model = converted("relu_tied")
    before = tree(model)
    monkeypatch.chdir(tmp_path)
    code, err = convert_cli(capsys, "--model", str(model), *(["--out", str(model)] if out else []))
    assert code != 0
    message = assert_one_line_error(err)
    assert "already converted" in message
    assert f"{sys.executable} {MAIN_PY} --model-name {model}" in message
    assert tree(model) == before
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["no-such-t5-model", "no-such-org/no-such-t5"])
def test_cli_rejects_unknown_model_names(name, tmp_path):
    result = run_convert("--model", name, cwd=tmp_path)
    assert result.returncode != 0
    assert name in assert_one_line_error(result.stderr)
    assert not (tmp_path / "mlx_models").exists()


# --- the Hugging Face Hub --------------------------------------------------------

HUB_MODEL = "tiny-org/tiny-t5"


class HubAnswer(http.server.BaseHTTPRequestHandler):
    """Answers every request with the class's status and ``X-Error-Code``, as
    the Hugging Face Hub answers for a model it will not serve."""

    status, error_code = 404, None

    def do_GET(self):
        self.send_response(self.status)
        if self.error_code:
            self.send_header("X-Error-Code", self.error_code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "refused by the test hub"}')

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The hub client with an empty cache, ``tmp_path / "cache"``; call
    ``hub(status, error_code)`` to point it at a local server answering so,
    ``hub("unreachable")`` at a port nothing listens on (no network),
    ``hub("offline")`` for HF_HUB_OFFLINE=1."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    servers = []

    def answer(status, error_code=None):
        if status == "offline":
            monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
            return
        if status == "unreachable":
            with socket.socket() as unused:
                unused.bind(("127.0.0.1", 0))
                port = unused.getsockname()[1]
        else:
            handler = type("Answer", (HubAnswer,), {"status": status, "error_code": error_code})
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            servers.append(server)
            port = server.server_address[1]
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")

    yield answer
    for server in servers:
        server.shutdown()
        server.server_close()


def put_in_hub_cache(cache: Path, repo_id: str, checkpoint: Path) -> None:
    """``checkpoint`` in a Hugging Face cache, as a download of ``repo_id`` leaves it."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(checkpoint, repo / "snapshots" / commit)


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
@pytest.mark.parametrize("hub_state", ["offline", "unreachable"])
def test_model_in_the_hub_cache_converts_without_the_hub(
    hub_state, weights, hub, tmp_path, hf_checkpoint, converted, monkeypatch, capsys
):
    """HF_HUB_OFFLINE=1, or no network: what the cache holds converts."""
    source = hf_checkpoint("gated_untied")
    if weights == "bin":
        source = bin_checkpoint(source, tmp_path / "bin")
    put_in_hub_cache(tmp_path / "cache", HUB_MODEL, source)
    hub(hub_state)
    monkeypatch.chdir(tmp_path)
    code, err = convert_cli(capsys, "--model", HUB_MODEL, "--dtype", "float32")
    assert code == 0, err
    out = tmp_path / "mlx_models" / "tiny-org-tiny-t5"
    assert_same_weights(out, converted("gated_untied"))
    assert json.loads((out / "config.json").read_text())["converted_from"] == HUB_MODEL


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ((404, "RepoNotFound"), "the hub has no such repository"),
        # The hub's answer to an anonymous request for a missing or private model.
        ((401, "RepoNotFound"), "the hub has no such repository"),
        ((403, "GatedRepo"), "gated on the Hugging Face Hub"),
        ((401, None), "refused"),
        ((500, None), "try again later"),
        (("unreachable",), "cannot be reached"),
        (("offline",), "HF_HUB_OFFLINE=1 forbids downloading it"),
    ],
    ids=[
        "not-found",
        "not-found-401",
        "gated",
        "unauthorised",
        "server-error",
        "no-network",
        "offline",
    ],
)
def test_hub_failures_are_told_apart_at_once(answer, expected, hub, tmp_path, monkeypatch, capsys):
    """What the hub answered, or that it could not be asked, in one line,
    without retrying (the file listing's retries slept 23 s before giving up)."""
    hub(*answer)
    monkeypatch.chdir(tmp_path)
    tic = time.monotonic()
    code, err = convert_cli(capsys, "--model", HUB_MODEL)
    assert time.monotonic() - tic < 20  # well under a second, but the machine may be busy
    assert code != 0
    message = assert_one_line_error(err)
    assert expected in message and HUB_MODEL in message
    if answer == ("unreachable",):
        assert "HF_HUB_OFFLINE=1" in message and "local checkpoint directory" in message
    assert not (tmp_path / "mlx_models").exists()


def test_cli_rejects_an_unknown_dtype(tmp_path, hf_checkpoint):
    result = run_convert(
        "--model", str(hf_checkpoint("relu_tied")), "--dtype", "float64", cwd=tmp_path
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "invalid choice: 'float64'" in result.stderr
    assert not (tmp_path / "mlx_models").exists()


def test_checkpoint_missing_a_tensor_is_refused(tmp_path, hf_checkpoint):
    """A tensor missing from the checkpoint is found at conversion, not at run time."""
    source = copy_checkpoint(hf_checkpoint("relu_tied"), tmp_path / "hf")
    tensors = load_file(source / "model.safetensors")
    del tensors["decoder.block.1.layer.2.DenseReluDense.wo.weight"]
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    run = run_convert("--model", str(source), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert run.returncode != 0
    assert "does not match its config.json" in assert_one_line_error(run.stderr)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["relu_tied", "gated_untied"])
@pytest.mark.parametrize(
    ("dtype", "quantization"),
    [("float32", None), ("bfloat16", None), ("bfloat16", (8, 32)), ("float32", (4, 32))],
    ids=["float32", "bfloat16", "8-bit", "4-bit"],
)
def test_parameter_bytes_match_the_converted_files(
    name, dtype, quantization, tmp_path, hf_checkpoint
):
    """The memory table (docs/converting.md) and main.py's memory check compute sizes
    with parameter_bytes: they are those of the files convert.py writes."""
    settings = quantization and convert.quantization_settings(*quantization, "affine")
    out = convert.convert(str(hf_checkpoint(name)), tmp_path / "out", dtype, settings)
    stored = sum(array.nbytes for array in mx.load(str(out / "weights.safetensors")).values())
    assert stored == parameter_bytes(load_config(out), getattr(mx, dtype), settings)
    file_size = (out / "weights.safetensors").stat().st_size
    assert stored < file_size < stored + 200 * 1024  # safetensors adds its header


def earlier_conversion(directory: Path, out: Path) -> Path:
    """A copy of the converted ``directory`` as earlier versions wrote it:
    the same weights in weights.npz, each self-attention's query, key and
    value projections apart."""
    shutil.copytree(directory, out)
    weights = {}
    for name, array in mx.load(str(out / WEIGHTS_FILE)).items():
        if ".qkv_proj." in name:
            for projection, part in zip(STACKED_PROJECTIONS, mx.split(array, 3)):
                weights[name.replace("qkv_proj", projection)] = part
        else:
            weights[name] = array
    mx.savez(str(out / LEGACY_WEIGHTS_FILE), **weights)
    (out / WEIGHTS_FILE).unlink()
    return out


def test_a_script_that_loads_a_model_and_ends_exits_cleanly(converted):
    """From weights.npz, MLX's I/O thread could drop its last Python reader
    after the interpreter had begun to exit, and the process aborted
    (SIGABRT): in 9 runs of 16 on the benchmark pair's main model, 2 of 16
    on this one (too rarely to test that here without many more runs).
    safetensors has no Python reader."""
    path = converted("relu_tied")
    script = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import loading; loading.load_model({str(path)!r})"
    runs = [
        subprocess.run(
            [sys.executable, "-c", script], capture_output=True, timeout=120, check=False
        )
        for _ in range(8)
    ]
    assert [run.returncode for run in runs] == [0] * 8, runs[-1].stderr[-300:]


@pytest.mark.parametrize("bits", [None, 4], ids=["float", "4-bit"])
def test_an_earlier_conversion_loads_with_a_note(bits, converted, quantized, tmp_path, capsys):
    """A directory converted by an earlier version (weights.npz, the
    self-attention projections apart) still loads, to the same weights,
    with a one-line note to convert it again; quantized too (weights,
    scales and biases stacked alike)."""
    path = converted("relu_tied") if bits is None else quantized("relu_tied", bits)
    earlier = earlier_conversion(path, tmp_path / "earlier")
    assert is_converted(earlier) and written_by_convert(earlier)
    capsys.readouterr()
    current, legacy = (
        tree_flatten(load_model(path).parameters()),
        tree_flatten(load_model(earlier).parameters()),
    )
    note = capsys.readouterr().err
    assert note.count("\n") == 1 and "convert the model again" in note and str(earlier) in note
    assert [name for name, _ in current] == [name for name, _ in legacy]
    assert all(mx.array_equal(a, b) for (_, a), (_, b) in zip(current, legacy))


def test_quantization_choices_are_listed_in_order_and_in_help():
    with pytest.raises(ValueError, match=r"takes --q-bits 2, 3, 4, 5, 6 or 8$"):
        convert.quantization_settings(7, None, "affine")
    with pytest.raises(ValueError, match=r"takes --q-group-size 32, 64 or 128$"):
        convert.quantization_settings(None, 48, "affine")
    result = subprocess.run(
        [sys.executable, str(ROOT / "convert.py"), "--help"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    help_text = " ".join(result.stdout.split())
    assert "2, 3, 4, 5, 6 or 8" in help_text and "32, 64 or 128" in help_text


@pytest.mark.parametrize("path", ["/abs/missing/path", "./missing", "~/missing-t5"])
def test_a_missing_local_path_is_refused_before_the_hub(path, capsys):
    with pytest.raises(ValueError, match=f"--model {re.escape(path)}: does not exist"):
        convert.fetch_checkpoint(path)
    assert "Fetching" not in capsys.readouterr().out
