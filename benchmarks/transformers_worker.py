"""Time transformers' generation for the benchmarks, in a process of its own.

    python benchmarks/transformers_worker.py HF_MODEL HF_DRAFT THREADS NUM_DRAFT MAX_TOKENS
    python benchmarks/transformers_worker.py --batch HF_MODEL THREADS

benchmark.py loads an OpenBLAS into its process's global symbol scope for
MLX (``cpu/blas.py``). torch exports the ``sgemm_`` of the MKL it carries, and
the OpenBLAS loaded first takes precedence over it, so torch in that process
computes on the OpenBLAS from inside its own threads, several times slower
(measured: 9.5 against 34 greedy tokens/s on the benchmark pair's main
model). This worker never imports ``cpu`` or ``mlx``, so transformers runs
as a user would run it. THREADS 0 leaves torch's default. Where torch sees
a CUDA GPU, the models and inputs go there (the peer of MLX's CUDA
backend), and each timing waits for the GPU's work to finish.

The first form prints ``ready`` once the models are loaded and warmed up,
then answers every line of standard input (a prompt, JSON-encoded) with one
JSON line: the seconds of prompt processing (tokenizing and the encoder
pass), the prompt's token count, and for greedy and assisted generation the
seconds and the generated tokens (without the start token, cut at end of
sequence).

The second (``--batch``) times batched greedy (or beam search) ``generate``: it answers the
batch requests of ``workers.serve_batches``, decoding the prompts in input
order, ``batch_size`` at a time, each batch right-padded to its longest
prompt (what ``generate`` does; it has no continuous batching).
"""

from __future__ import annotations

import json
import sys
import time

from workers import cut_at_eos, send, serve_batches


def device() -> str:
    """Where torch computes: the GPU if it sees one."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def finished() -> float:
    """``time.perf_counter()`` once the GPU's queued work is done (at once on the CPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def load(hf_model: str, threads: str):
    """The tokenizer and the model, in inference mode, on ``threads`` torch
    threads, on ``device()``."""
    import torch
    from transformers import AutoTokenizer, T5ForConditionalGeneration
    from transformers.utils import logging as hf_logging

    # Assisted generation warns about its own internal generate() call.
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if int(threads):
        torch.set_num_threads(int(threads))
    tokenizer = AutoTokenizer.from_pretrained(hf_model)
    return tokenizer, T5ForConditionalGeneration.from_pretrained(hf_model).eval().to(device())


GREEDY = {"do_sample": False, "num_beams": 1}


def serve_single(hf_model: str, hf_draft: str, threads: str, num_draft: str, max_tokens: str):
    """Greedy and assisted generation, one prompt at a time."""
    import torch
    from transformers import T5ForConditionalGeneration

    tokenizer, main_model = load(hf_model, threads)
    draft = T5ForConditionalGeneration.from_pretrained(hf_draft).eval().to(device())
    draft.generation_config.num_assistant_tokens = int(num_draft)
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    options = {"max_new_tokens": int(max_tokens), **GREEDY}
    eos = main_model.config.eos_token_id
    main_model.generate(**tokenizer("warm up", return_tensors="pt").to(device()), **options)
    send({"ready": True, "torch_threads": torch.get_num_threads(), "device": device()})
    for line in sys.stdin:
        prompt = json.loads(line)
        start = time.perf_counter()
        inputs = tokenizer(prompt, return_tensors="pt").to(device())
        main_model.get_encoder()(**inputs)
        answer = {
            "prompt_time": finished() - start,
            "prompt_tokens": inputs.input_ids.shape[1],
        }
        for name, extra in (("greedy", {}), ("assisted", {"assistant_model": draft})):
            start = time.perf_counter()
            output = main_model.generate(**inputs, **options, **extra)[0, 1:].tolist()
            answer[f"{name}_time"] = finished() - start
            answer[f"{name}_tokens"] = cut_at_eos(output, eos)
        send(answer)


def serve_batch(hf_model: str, threads: str):
    """Batched greedy generation or beam search (``workers.serve_batches``)."""
    import torch
    import transformers

    tokenizer, model = load(hf_model, threads)

    def generate(
        prompts: list[str], batch_size: int, max_tokens: int, num_beams: int = 1
    ) -> list[list[int]]:
        outputs = []
        for first in range(0, len(prompts), batch_size):
            inputs = tokenizer(
                prompts[first : first + batch_size], return_tensors="pt", padding=True
            ).to(device())
            search = {**GREEDY, "num_beams": num_beams}
            generated = model.generate(**inputs, max_new_tokens=max_tokens, **search)
            outputs += generated[:, 1:].tolist()  # without the start token
        return outputs

    generate(["warm up"], 1, 4)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    ready = {"torch_threads": torch.get_num_threads(), "device": device(), **versions}
    serve_batches(generate, model.config.eos_token_id, ready)


def main() -> int:
    import torch

    with torch.no_grad():
        if sys.argv[1] == "--batch":
            serve_batch(*sys.argv[2:4])
        else:
            serve_single(*sys.argv[1:6])
    return 0


if __name__ == "__main__":
    sys.exit(main())
