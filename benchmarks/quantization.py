"""Quantized pairs against the float32 pair: size, agreement, acceptance and speed.

    python benchmarks/quantization.py --hf-model benchmark_models/hf-main \\
        --hf-draft benchmark_models/hf-draft --prompts benchmark_models/prompts.txt \\
        --out benchmark_models/quantized --output benchmarks/results/quantization

Both checkpoints are converted with ``convert.py`` at each precision
(float32 parts and scales; ``--precisions`` picks among float32, 8bit,
4bit and mxfp4) into ``--out`` (reused when already there). Then, per
precision:

- the bytes of weights, and those a main-model decoder step reads, over float32's;
- top-1 agreement with the float32 main model, teacher-forced on the float32
  main model's greedy outputs;
- for every prompt, interleaved across precisions: prompt processing
  tokens/s (both encoders), regular and speculative
  decoding (``--num-draft`` tokens drafted by the draft of the same
  precision), their generation tokens/s, the acceptance rate of tested draft
  tokens, and whether the speculative tokens equal the regular ones (the
  quantized main model's greedy output).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# The example's modules live one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# An optimized BLAS on Linux: must come before anything imports mlx.
import cpu  # noqa: F401  # isort: skip
import mlx.core as mx
from limits import decoder_step_bytes
from mlx.utils import tree_flatten

import convert
from cli import POSITIVE, ArgumentParser
from decoder import SpeculativeDecoder
from layout import is_converted
from loading import load_model, load_tokenizer

PRECISIONS = {
    "float32": None,
    "8bit": (8, None, "affine"),
    "4bit": (4, None, "affine"),
    "mxfp4": (None, None, "mxfp4"),
}


def converted(hf_dir: Path, out: Path, precision: str) -> Path:
    """``hf_dir`` converted at ``precision`` into ``out``, unless already there."""
    if not is_converted(out):
        settings = PRECISIONS[precision]
        quantization = settings and convert.quantization_settings(*settings)
        convert.convert(str(hf_dir), out, "float32", quantization)
    return out


def weight_bytes(model) -> int:
    return sum(parameter.nbytes for _, parameter in tree_flatten(model.parameters()))


def top1_agreement(model, reference, prompt_ids: list[mx.array], outputs: list[list[int]]) -> float:
    """Share of positions where ``model``'s argmax equals ``reference``'s,
    both fed the same prompts and decoder inputs."""
    agreed = total = 0
    for ids, tokens in zip(prompt_ids, outputs):
        decoder_inputs = mx.array([[reference.args.decoder_start_token_id, *tokens]])
        ours = mx.argmax(model(ids, decoder_inputs), axis=-1)
        theirs = mx.argmax(reference(ids, decoder_inputs), axis=-1)
        agreed += (ours == theirs).sum().item()
        total += decoder_inputs.shape[1]
    return agreed / total


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description="Quantized pairs against the float32 pair.")
    parser.add_argument("--hf-model", type=Path, required=True, help="main model, Hugging Face")
    parser.add_argument("--hf-draft", type=Path, required=True, help="draft model, Hugging Face")
    parser.add_argument("--prompts", type=Path, required=True, help="one prompt per line")
    parser.add_argument("--out", type=Path, required=True, help="where the conversions go")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated")
    parser.add_argument("--num-draft", type=POSITIVE, default=3, help="draft tokens per round")
    parser.add_argument("--max-tokens", type=POSITIVE, default=64, help="per prompt")
    parser.add_argument("--output", type=Path, help="write the results to OUTPUT.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    precisions = args.precisions.split(",")
    if precisions[0] != "float32" or not set(precisions) <= set(PRECISIONS):
        parser.error(f"--precisions: float32 first, then any of {', '.join(PRECISIONS)}")
    prompts = [line for line in args.prompts.read_text().splitlines() if line.strip()]
    decoders = {}
    for precision in precisions:
        main_dir = converted(args.hf_model, args.out / f"main-{precision}", precision)
        draft_dir = converted(args.hf_draft, args.out / f"draft-{precision}", precision)
        decoders[precision] = SpeculativeDecoder(
            load_model(main_dir), load_model(draft_dir), load_tokenizer(main_dir), args.num_draft
        )

    reference = decoders["float32"]
    prompt_ids = [mx.array([reference.tokenizer(prompt).input_ids]) for prompt in prompts]
    outputs = [reference.generate(p, max_tokens=args.max_tokens).tokens for p in prompts]
    counts = ("prompt", "prompt_tokens", "regular", "speculative", "tokens")
    counts += ("accepted", "tested", "identical")
    totals = {precision: dict.fromkeys(counts, 0) for precision in precisions}
    for number, prompt in enumerate(prompts, 1):
        print(f"prompt {number}/{len(prompts)}", flush=True)
        for precision, decoder in decoders.items():
            regular = decoder.generate(prompt, max_tokens=args.max_tokens)
            speculative = decoder.speculative_decode(prompt, max_tokens=args.max_tokens)
            total = totals[precision]
            total["prompt"] += regular.prompt_time
            total["prompt_tokens"] += regular.prompt_tokens
            total["regular"] += regular.generation_time
            total["speculative"] += speculative.generation_time
            total["tokens"] += len(regular.tokens)
            total["accepted"] += speculative.n_accepted
            total["tested"] += speculative.n_accepted + speculative.n_rejected
            total["identical"] += speculative.tokens == regular.tokens

    float_bytes = weight_bytes(reference.model) + weight_bytes(reference.draft_model)
    float_step = decoder_step_bytes(reference.model)
    rows = []
    for precision, decoder in decoders.items():
        total = totals[precision]
        rows.append(
            {
                "precision": precision,
                "bytes": (weight_bytes(decoder.model) + weight_bytes(decoder.draft_model))
                / float_bytes,
                "step_bytes": decoder_step_bytes(decoder.model) / float_step,
                "top1_agreement": top1_agreement(
                    decoder.model, reference.model, prompt_ids, outputs
                ),
                "prompt_tokens_per_s": total["prompt_tokens"] / total["prompt"],
                "regular_tokens_per_s": total["tokens"] / total["regular"],
                "speculative_tokens_per_s": total["tokens"] / total["speculative"],
                "speedup": total["regular"] / total["speculative"],
                "alpha": total["accepted"] / total["tested"],
                "identical": f"{total['identical']}/{len(prompts)}",
            }
        )
    columns = ["precision", "bytes", "step bytes", "top-1 agreement", "prompt tok/s"]
    columns += ["regular tok/s"]
    columns += ["speculative tok/s", "speedup", "alpha", "speculative = own greedy"]
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    for row in rows:
        print(
            f"| {row['precision']} | {row['bytes']:.3f}x | {row['step_bytes']:.3f}x "
            f"| {row['top1_agreement']:.3f} | {row['prompt_tokens_per_s']:.0f} "
            f"| {row['regular_tokens_per_s']:.1f} "
            f"| {row['speculative_tokens_per_s']:.1f} | {row['speedup']:.2f}x "
            f"| {row['alpha']:.3f} | {row['identical']} |"
        )
    if args.output:
        args.output.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
