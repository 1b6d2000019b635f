"""llama.cpp's side of ``benchmarks/quant_latency.py``: run by path with a Python
that has ``llama-cpp-python`` (built as ../shared/BENCHMARK.md says), importing
nothing but it and the standard library.

    PEER_PYTHON llama_cpp_peer.py SPEC.json RESULT.json

SPEC.json: ``{"gguf": path, "prompt": [token ids], "output_len": 128, "num_iters": 3,
"threads": 2}``. RESULT.json: ``{"token_times_s": [[seconds], ...], "startup_s"}``:
per timed run, each output token's seconds since the prompt was handed over (greedy,
no stop at EOS: the loop takes exactly ``output_len`` tokens). One warm-up run first;
the KV cache is reset before each run.
"""

import json
import sys
import time


def main(spec_path, result_path):
    from llama_cpp import Llama

    with open(spec_path) as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    llm = Llama(model_path=spec["gguf"], n_ctx=1024, n_threads=spec["threads"], n_threads_batch=spec["threads"],
                n_batch=512, verbose=False)
    startup = time.perf_counter() - t0

    def timed_run():
        llm.reset()
        times = []
        start = time.perf_counter()
        for _ in llm.generate(spec["prompt"], temp=0.0, top_k=1, reset=True):
            times.append(time.perf_counter() - start)
            if len(times) == spec["output_len"]:
                break
        return times

    timed_run()  # warm-up
    runs = [timed_run() for _ in range(spec["num_iters"])]
    with open(result_path, "w") as f:
        json.dump({"token_times_s": runs, "startup_s": startup}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
