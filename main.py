"""Generate text with a T5 model, speculatively, from models converted by convert.py.

python main.py                                   # t5-11b with a t5-small draft
python main.py --prompt "summarize: ..." --num-draft 3 --delta 0.1
python main.py --regular-decode                  # the main model alone
"""

from __future__ import annotations

import argparse
import sys

# Before anything imports mlx: on Linux it loads an optimized BLAS, which MLX uses only if first.
import blas  # noqa: F401  # isort: skip
from cli import POSITIVE, ArgumentParser, checked, read_prompt, resolve_model

DEFAULT_PROMPT = (
    "translate English to German: The old bridge across the river was closed "
    "for repairs, so we took the ferry to the market."
)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description="Speculative decoding with T5 models in MLX.")
    add = parser.add_argument
    add("--model-name", default="t5-11b", help="main model: converted name or directory")
    add(
        "--draft-model-name",
        default="t5-small",
        help="draft model: converted name or directory",
    )
    add("--prompt", default=DEFAULT_PROMPT, help="the input text; - reads it from standard input")
    add("--num-draft", type=POSITIVE, default=5, help="draft tokens per main-model pass")
    add(
        "--delta",
        type=checked(float, lambda d: 0 <= d <= 1, "in [0, 1]"),
        default=0.0,
        help="acceptance relaxation in [0, 1]: 0 is exact, 1 accepts every draft token",
    )
    add("--max-tokens", "-m", type=POSITIVE, default=100, help="most tokens to generate")
    add(
        "--temp",
        type=checked(float, lambda t: t >= 0, ">= 0"),
        default=0.0,
        help="sampling temperature (0: greedy)",
    )
    add(
        "--top-p",
        type=checked(float, lambda p: 0 < p <= 1, "in (0, 1]"),
        default=1.0,
        help="nucleus mass",
    )
    add(
        "--top-k",
        type=checked(int, lambda k: k >= 0, ">= 0"),
        default=0,
        help="sample among the k likeliest (0: all)",
    )
    add("--seed", type=int, default=0, help="random seed for sampling")
    add("--regular-decode", action="store_true", help="decode with the main model alone")
    return parser


def print_summary(result, speculative: bool) -> None:
    """The numbers of a run, in mlx-lm's layout: prompt and generation apart."""
    import mlx.core as mx

    print("=" * 40)
    print(f"Prompt: {result.prompt_tokens} tokens, {result.prompt_tokens_per_second:.1f} tokens/s")
    print(f"Generation: {len(result.tokens)} tokens, {result.tokens_per_second:.1f} tokens/s")
    print(f"Main-model passes: {result.n_steps}")
    if speculative:
        print(
            f"Draft tokens accepted: {result.n_accepted}/{result.n_draft} "
            f"({100 * result.acceptance_rate:.1f}%)"
        )
    peak = mx.get_peak_memory()
    print(
        f"Peak memory: {peak / 1e9:.3f} GB" if peak >= 1e8 else f"Peak memory: {peak / 1e6:.2f} MB"
    )


def run(args: argparse.Namespace) -> None:
    prompt = read_prompt(args.prompt)
    # mlx, transformers and the models load only once the arguments are known good.
    from decoder import SpeculativeDecoder, check_draft_directories, load_tokenizer
    from model import load_model

    model_path = resolve_model(args.model_name)
    draft_model = None
    if not args.regular_decode:
        draft_path = resolve_model(args.draft_model_name)
        check_draft_directories(model_path, draft_path)
    print(f"Loading {model_path}", flush=True)
    model = load_model(model_path)
    if not args.regular_decode:
        print(f"Loading draft {draft_path}", flush=True)
        draft_model = load_model(draft_path)
    decoder = SpeculativeDecoder(
        model, draft_model, load_tokenizer(model_path), args.num_draft, args.delta
    )

    printed = ""
    result = None
    for result in decoder.stream(
        prompt,
        speculative=not args.regular_decode,
        max_tokens=args.max_tokens,
        temp=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    ):
        if result.text.startswith(printed):
            print(result.text[len(printed) :], end="", flush=True)
            printed = result.text
    print()
    print_summary(result, speculative=not args.regular_decode)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
