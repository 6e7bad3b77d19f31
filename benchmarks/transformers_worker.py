"""Time transformers' greedy and assisted generation for benchmark.py, in a process of its own.

    python benchmarks/transformers_worker.py HF_MODEL HF_DRAFT THREADS NUM_DRAFT MAX_TOKENS

benchmark.py loads an OpenBLAS into its process's global symbol scope for
MLX (``blas.py``). torch exports the ``sgemm_`` of the MKL it carries, and
the OpenBLAS loaded first takes precedence over it, so torch in that process
computes on the OpenBLAS from inside its own threads, several times slower
(measured: 9.5 against 34 greedy tokens/s on the benchmark pair's main
model). This worker never imports ``blas`` or ``mlx``, so transformers runs
as a user would run it.

It prints ``ready`` once the models are loaded and warmed up, then answers
every line of standard input (a prompt, JSON-encoded) with one JSON line:
the seconds of prompt processing (tokenizing and the encoder pass), the
prompt's token count, and for greedy and assisted generation the seconds and
the generated tokens (without the start token, cut at end of sequence).
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    import torch
    from transformers import AutoTokenizer, T5ForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_model, hf_draft, threads, num_draft, max_tokens = sys.argv[1:6]
    # Assisted generation warns about its own internal generate() call.
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if int(threads):
        torch.set_num_threads(int(threads))
    tokenizer = AutoTokenizer.from_pretrained(hf_model)
    main_model = T5ForConditionalGeneration.from_pretrained(hf_model).eval()
    draft = T5ForConditionalGeneration.from_pretrained(hf_draft).eval()
    draft.generation_config.num_assistant_tokens = int(num_draft)
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    options = {"max_new_tokens": int(max_tokens), "do_sample": False, "num_beams": 1}
    eos = main_model.config.eos_token_id
    with torch.no_grad():
        main_model.generate(**tokenizer("warm up", return_tensors="pt"), **options)
        print(json.dumps({"ready": True, "torch_threads": torch.get_num_threads()}), flush=True)
        for line in sys.stdin:
            prompt = json.loads(line)
            start = time.perf_counter()
            inputs = tokenizer(prompt, return_tensors="pt")
            main_model.get_encoder()(**inputs)
            answer = {
                "prompt_time": time.perf_counter() - start,
                "prompt_tokens": inputs.input_ids.shape[1],
            }
            for name, extra in (("greedy", {}), ("assisted", {"assistant_model": draft})):
                start = time.perf_counter()
                output = main_model.generate(**inputs, **options, **extra)[0, 1:].tolist()
                answer[f"{name}_time"] = time.perf_counter() - start
                answer[f"{name}_tokens"] = output[: output.index(eos)] if eos in output else output
            print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
