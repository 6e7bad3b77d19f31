"""Generate text with a T5 model, speculatively, from models converted by convert.py.

python main.py                                   # t5-11b with a t5-small draft
python main.py --prompt "summarize: ..." --num-draft 3 --delta 0.1
python main.py --regular-decode                  # the main model alone
python main.py --draft-model-name none --prompt-lookup 3 --num-draft auto --show-draft
"""

from __future__ import annotations

import argparse
import sys

# Before anything imports mlx: on Linux it loads an optimized BLAS, which MLX uses only if first.
import blas  # noqa: F401  # isort: skip
from cli import (
    NON_NEGATIVE,
    POSITIVE,
    ArgumentParser,
    checked,
    num_draft,
    read_prompt,
    resolve_model,
)

# Accepted draft tokens, with --show-draft on a terminal.
DRAFT_COLOUR, RESET = "\033[32m", "\033[0m"
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
        help="draft model: converted name or directory; none: no draft model (needs --prompt-lookup)",
    )
    add("--prompt", default=DEFAULT_PROMPT, help="the input text; - reads it from standard input")
    add(
        "--num-draft",
        type=num_draft,
        default=5,
        help="draft tokens per main-model pass, or auto: chosen before every round",
    )
    add(
        "--prompt-lookup",
        type=NON_NEGATIVE,
        default=0,
        help="draft from n-grams up to N tokens long found in the prompt or output (0: off)",
    )
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
    add("--top-k", type=NON_NEGATIVE, default=0, help="sample among the k likeliest (0: all)")
    add("--seed", type=int, default=0, help="random seed for sampling")
    add("--regular-decode", action="store_true", help="decode with the main model alone")
    add("--show-draft", action="store_true", help="colour accepted draft tokens on a terminal")
    return parser


def drafting_summary(result, drafting: str, num_draft: int | str) -> str:
    """The drafting mode, the draft length and, with prompt lookup, how often it drafted."""
    line = f"Drafting: {drafting}, "
    lengths = result.draft_lengths
    if num_draft == "auto" and lengths:
        line += f"g auto: average {sum(lengths) / len(lengths):.1f}, range {min(lengths)}-{max(lengths)}"
    else:
        line += f"g = {num_draft}"
    if drafting != "draft model":
        line += f"; prompt lookup drafted {result.n_lookup_rounds} of {result.n_steps} rounds"
    return line


def print_summary(result, drafting: str, num_draft: int | str) -> None:
    """The numbers of a run, in mlx-lm's layout: prompt and generation apart."""
    import mlx.core as mx

    print("=" * 40)
    print(f"Prompt: {result.prompt_tokens} tokens, {result.prompt_tokens_per_second:.1f} tokens/s")
    print(f"Generation: {len(result.tokens)} tokens, {result.tokens_per_second:.1f} tokens/s")
    print(f"Main-model passes: {result.n_steps}")
    if drafting != "none":
        print(
            f"Draft tokens accepted: {result.n_accepted}/{result.n_draft} "
            f"({100 * result.acceptance_rate:.1f}%)"
        )
        print(drafting_summary(result, drafting, num_draft))
    peak = mx.get_peak_memory()
    print(
        f"Peak memory: {peak / 1e9:.3f} GB" if peak >= 1e8 else f"Peak memory: {peak / 1e6:.2f} MB"
    )


def new_text(result, tokenizer, printed: str, num_printed: int, show_draft: bool) -> str:
    """The text of ``result`` after ``printed`` (its first ``num_printed``
    tokens); with ``show_draft``, the accepted draft tokens that start it,
    coloured."""
    text = result.text[len(printed) :]
    if not show_draft or not any(result.from_draft[num_printed : num_printed + 1]):
        return text
    drafted = result.from_draft[num_printed:] + [False]
    draft_end = num_printed + drafted.index(False)
    boundary = len(tokenizer.decode(result.tokens[:draft_end], skip_special_tokens=True))
    boundary -= len(printed)
    return f"{DRAFT_COLOUR}{text[:boundary]}{RESET}{text[boundary:]}"


def run(args: argparse.Namespace) -> None:
    prompt = read_prompt(args.prompt)
    # mlx, transformers and the models load only once the arguments are known good.
    from decoder import SpeculativeDecoder, check_draft_directories, load_tokenizer
    from model import load_model

    model_path = resolve_model(args.model_name)
    draft_model = None
    use_draft_model = not args.regular_decode and args.draft_model_name != "none"
    if use_draft_model:
        draft_path = resolve_model(args.draft_model_name)
        check_draft_directories(model_path, draft_path)
    print(f"Loading {model_path}", flush=True)
    model = load_model(model_path)
    if use_draft_model:
        print(f"Loading draft {draft_path}", flush=True)
        draft_model = load_model(draft_path)
    decoder = SpeculativeDecoder(
        model,
        draft_model,
        load_tokenizer(model_path),
        args.num_draft,
        args.delta,
        0 if args.regular_decode else args.prompt_lookup,
    )
    # Colour codes only for a terminal: redirected output stays plain text.
    show_draft = args.show_draft and sys.stdout.isatty()

    printed, num_printed = "", 0
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
            text = new_text(result, decoder.tokenizer, printed, num_printed, show_draft)
            print(text, end="", flush=True)
            printed, num_printed = result.text, len(result.tokens)
    print()
    print_summary(result, decoder.drafting, args.num_draft)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.draft_model_name == "none" and not args.prompt_lookup and not args.regular_decode:
        parser.error(
            "--draft-model-name none leaves nothing to draft with: add --prompt-lookup N "
            "(N >= 1), or use --regular-decode"
        )
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
