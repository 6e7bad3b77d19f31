"""Time CTranslate2's batched greedy decoding for the batch benchmark, in a process of its own.

    python benchmarks/ctranslate2_worker.py HF_MODEL CACHE_DIR COMPUTE_TYPE THREADS

CTranslate2 (``pip install ctranslate2``, an optional benchmark dependency:
see ``requirements.txt`` beside this file) decodes a converted copy of the
Hugging Face checkpoint HF_MODEL. The copy is made with CTranslate2's own
converter (``ctranslate2.converters.TransformersConverter``, what
``ct2-transformers-converter`` runs), quantized to COMPUTE_TYPE (float32 or
int8), and kept in CACHE_DIR under a name that changes with the checkpoint,
so later runs load it instead of converting again. Like
``transformers_worker.py``, this process never imports ``blas`` or ``mlx``.
THREADS is CTranslate2's ``intra_threads`` (0: its default).

It answers the batch requests of ``workers.serve_batches`` with
``Translator.translate_batch(max_batch_size=B, beam_size=N)``, greedy (N = 1)
or beam search, at most ``max_tokens`` tokens a prompt. Given more prompts than B, CTranslate2
sorts them by length and decodes them B at a time (its own batching); the
answer is in input order. The ready line says the model directory and the
seconds converting took (0 when the copy was cached).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

from workers import serve_batches


def converted_copy(hf_model: Path, cache_dir: Path, compute_type: str) -> tuple[Path, float]:
    """The CTranslate2 copy of ``hf_model`` quantized to ``compute_type``,
    converted now unless cached; and the seconds converting took."""
    from ctranslate2.converters import TransformersConverter

    # The name changes when the checkpoint's files do.
    files = sorted(path for path in hf_model.iterdir() if path.is_file())
    stamp = "\n".join(f"{p.name} {p.stat().st_size} {p.stat().st_mtime_ns}" for p in files)
    key = hashlib.sha256(f"{hf_model.resolve()}\n{stamp}".encode()).hexdigest()[:12]
    target = cache_dir / f"{hf_model.name}-{key}-{compute_type}"
    if (target / "model.bin").is_file():
        return target, 0.0
    start = time.perf_counter()
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    quantization = None if compute_type == "float32" else compute_type
    TransformersConverter(str(hf_model)).convert(str(partial), quantization=quantization)
    os.replace(partial, target)  # a directory converted whole, or none
    return target, time.perf_counter() - start


def main() -> int:
    import ctranslate2
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_model, cache_dir, compute_type, threads = sys.argv[1:5]
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    model_dir, convert_seconds = converted_copy(Path(hf_model), cache_dir, compute_type)
    tokenizer = AutoTokenizer.from_pretrained(hf_model)
    translator = ctranslate2.Translator(
        str(model_dir), device="cpu", compute_type=compute_type, intra_threads=int(threads)
    )

    def generate(
        prompts: list[str], batch_size: int, max_tokens: int, num_beams: int = 1
    ) -> list[list[int]]:
        sources = [tokenizer.convert_ids_to_tokens(tokenizer(p).input_ids) for p in prompts]
        results = translator.translate_batch(
            sources,
            max_batch_size=batch_size,
            beam_size=num_beams,
            max_decoding_length=max_tokens,
        )
        # Hypotheses come without the start token and the end token.
        return [tokenizer.convert_tokens_to_ids(result.hypotheses[0]) for result in results]

    generate(["warm up"], 1, 4)
    ready = {
        "model_dir": str(model_dir),
        "convert_seconds": convert_seconds,
        "ctranslate2": ctranslate2.__version__,
        "intra_threads": int(threads),
    }
    serve_batches(generate, tokenizer.eos_token_id, ready)
    return 0


if __name__ == "__main__":
    sys.exit(main())
