"""vLLM's side of ``vframe bench throughput|latency --backend vllm``: run by path with
a Python that has vLLM installed, never imported by vframe, and importing nothing
but vLLM and the standard library.

    PEER_PYTHON vllm_peer.py SPEC.json RESULT.json

SPEC.json (written by ``vframe.bench.peers``)::

    {"workload": "throughput" | "latency", "model_dir": HF directory, "dtype": "bfloat16",
     "prompts": [[token ids], ...], "warmup_prompt": [token ids], "output_len": 128,
     "num_iters": 3, "max_model_len": 2048}

RESULT.json: ``vllm_version``, ``startup_s`` and, for ``throughput``, ``walls_s`` (each of
``num_iters`` timed ``LLM.generate`` calls over every prompt), ``wall_s`` (the best of them),
``prompt_tokens`` and ``output_tokens``; for
``latency``, ``token_times_s``: per timed run, the seconds from ``add_request`` to the
return of the engine step that delivered each output token (the engine's own step loop,
as vframe's side is timed). Greedy, ``ignore_eos``, prefix cache emptied after the
warm-up and before each timed run. vLLM's logs go to stdout/stderr; the result only to
RESULT.json.
"""

import json
import os
import sys
import time

if __name__ in ("__main__", "__mp_main__"):
    # Run by path, this file's directory heads sys.path, and vframe/bench's modules would
    # shadow top-level names vLLM imports (its spawned engine process re-runs this too).
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]


def _build(spec):
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], seed=0)
    return llm, time.perf_counter() - t0


def _params(max_tokens, delta=False):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, output_kind=kind)


def run_throughput(llm, spec):
    params = _params(spec["output_len"])
    llm.generate([{"prompt_token_ids": spec["warmup_prompt"]}], params, use_tqdm=False)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    walls = []
    for _ in range(spec.get("num_iters", 1)):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - t0)
    return {
        "wall_s": min(walls),
        "walls_s": walls,
        "num_requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in spec["prompts"]),
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
    }


def timed_request(engine, request_id, prompt, params):
    """Seconds from ``add_request`` to the return of the step that delivered each output
    token, for a streaming (``output_kind`` delta) request. vframe's ``LLMEngine`` has the
    same ``add_request`` / ``step`` / ``has_unfinished_requests``, and is timed by this too."""
    times = []
    t0 = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter() - t0
            times.extend([now] * sum(len(c.token_ids) for c in out.outputs))
    return times


def run_latency(llm, spec):
    engine = llm.llm_engine
    params = _params(spec["output_len"], delta=True)
    prompt = spec["prompts"][0]
    timed_request(engine, "warmup", spec["warmup_prompt"], params)
    runs = []
    for i in range(spec["num_iters"]):
        llm.reset_prefix_cache()
        runs.append(timed_request(engine, f"timed-{i}", prompt, params))
    return {"prompt_tokens": len(prompt), "token_times_s": runs}


def main(spec_path, result_path):
    import vllm

    with open(spec_path) as f:
        spec = json.load(f)
    llm, startup = _build(spec)
    run = {"throughput": run_throughput, "latency": run_latency}[spec["workload"]]
    result = {"vllm_version": vllm.__version__, "startup_s": startup} | run(llm, spec)
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM's engine core is a spawned process that re-imports this file
    main(sys.argv[1], sys.argv[2])
