"""Runs INSIDE the vLLM virtual environment: ``python vllm_worker.py SPEC.json RESULT.json``.

A standalone script file, importing nothing from labsupport (that venv need not have it), because
vLLM spawns its engine core as a new process that re-imports the main module: the work must sit
under ``if __name__ == "__main__":`` of a real file (a script piped on stdin fails).

It starts vLLM once (not timed; how long that takes: ``benchmarks/README.md``), warms it up, then for
each workload resets the prefix cache and times one ``generate`` over the given token ids. Per request it
writes the token count and, when vLLM fills ``RequestOutput.metrics``, the engine's first and
last token times (``time.monotonic``, the same clock in every process), relative to the start.

With ``"mode": "greedy"`` in the spec (``side_by_side/offline.py``) it instead returns the greedy
token ids of each prompt, for a token-by-token comparison with our engine.
"""
import json
import signal
import sys
import time


def greedy_tokens(spec) -> dict:
    """The greedy continuation of each prompt (token ids in, token ids out), with the settings of the
    chapter 08 servers: fp32, eager, block size 32 (the CPU attention wants a multiple of 32)."""
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, block_size=32,
              max_model_len=spec["max_model_len"], seed=0)
    startup = time.perf_counter() - started
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=spec["ignore_eos"])
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "startup_s": startup,
            "generate_s": time.perf_counter() - t0, "vllm_version": vllm.__version__,
            "torch_version": torch.__version__}


def main(spec_path, result_path):
    spec = json.load(open(spec_path))
    if spec.get("mode") == "greedy":
        json.dump(greedy_tokens(spec), open(result_path, "w"))
        return
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, enable_prefix_caching=True,
              max_model_len=spec["max_model_len"], seed=0, disable_log_stats=False)
    startup = time.perf_counter() - started

    def run(prompts, max_tokens):
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    run(spec["warmup"], [4] * len(spec["warmup"]))
    results = {}
    for name, work in spec["workloads"].items():
        llm.reset_prefix_cache()  # nothing left from the warm-up or an earlier workload
        t_mono, t0 = time.monotonic(), time.perf_counter()
        outs = run(work["prompts"], work["max_tokens"])
        wall = time.perf_counter() - t0
        first, last = [], []
        for o in outs:
            m = getattr(o, "metrics", None)
            if m is None or not getattr(m, "first_token_ts", 0) or not getattr(m, "last_token_ts", 0):
                first = last = None
                break
            first.append(m.first_token_ts - t_mono)
            last.append(m.last_token_ts - t_mono)
        results[name] = {"wall_s": wall, "counts": [len(o.outputs[0].token_ids) for o in outs],
                         "first_s": first, "last_s": last,
                         "first_tokens": [list(o.outputs[0].token_ids[:32]) for o in outs[:4]]}
    json.dump({"startup_s": startup, "vllm_version": vllm.__version__, "torch_version": torch.__version__,
               "results": results}, open(result_path, "w"))


if __name__ == "__main__":
    # SIGTERM (the lab's launcher sends it when the notebook that started us dies, ``labsupport.procs``) must
    # unwind like an exception, so that vLLM's exit handlers stop the engine core it spawned
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main(sys.argv[1], sys.argv[2])
