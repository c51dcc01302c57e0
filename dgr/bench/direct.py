"""llama-cpp-python called directly: the baseline every dgr figure is a ratio to.

Same model file, same threads, same prompt tokens. Prefill is one `eval` of
the prompt (llama-cpp-python batches it by n_batch); decode is greedy, one
token per `eval`, with no sampling overhead beyond argmax.
"""

from __future__ import annotations

import time

import numpy as np

__all__ = ["direct_llama"]


def direct_llama(model: str, prompt_tokens: list[int], n_decode: int, threads: int, n_ctx: int = 4096) -> dict[str, float]:
    import llama_cpp

    llm = llama_cpp.Llama(model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                          verbose=False, logits_all=False)
    try:
        n_vocab = llm.n_vocab()

        def last_logits() -> np.ndarray:
            # llm.scores only holds rows when logits_all is on; read the context's last row directly
            return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))

        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt_tokens)
        prefill = time.perf_counter() - t0
        tok = int(np.argmax(last_logits()))
        t1 = time.perf_counter()
        for _ in range(n_decode):
            llm.eval([tok])
            tok = int(np.argmax(last_logits()))
        decode = time.perf_counter() - t1
    finally:
        llm.close()
    return {"prefill_tok_s": len(prompt_tokens) / prefill, "decode_tok_s": n_decode / decode,
            "ttft_s": prefill}
