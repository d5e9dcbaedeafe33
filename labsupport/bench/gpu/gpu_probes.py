"""``make gpu-preflight``'s probes: what the chapters assert, measured at GPU scale before a course run relies on it.

Each probe returns the figures a chapter's assert reads and, beside each, the assert itself (``claim``): its
threshold and whether it holds here. Random weights of the chapter's model shape (the default model's; the
Llama-3.1-8B shape too where issue 52 asks whether a larger model shows the lesson), the chapter's own
parameters at its ``GPU_SCALE`` of 4. They answer issue 52's predictions with numbers:

* ``recompute_and_cache`` (chapters 00 and 01): per-token latency growth without a cache (00: last quarter >
  1.2x the first), the KV cache's speed-up (01: > 1.5x, growth > 1.3x without it), one decode step at 4,096 tokens
  of context against 128 (01: > 1.1x), a batch of 32 decodes against one (01: < 0.6 x 32).
* ``chunked_prefill`` (chapter 05, default model): the whole prompt's step against a typical one (> 5x), chunking's
  worst decoder gap (< half) and the smallest chunk's P99 ITL (< a third of unchunked).
* ``raised_max_num_seqs`` (chapter 04's dial): an engine built with ``max_num_seqs=3``, raised to 16: do its
  decode steps of 16 still replay graphs, and when were they recorded; throughput against an eager engine.
* ``engines_fit``: how many default engines (``gpu_memory_utilization=0.2``) the card holds, and an 8B-shaped one.
* ``capture_beside_copy``: a thread writing KV into the pool the way chapter 07's receiver does (``unpack_blocks``
  from pageable host memory) while the engine records new graph buckets; then the engine's tokens against eager.

On a CPU (``--device cpu --quick``) every probe runs on tiny shapes; where the engine has no graphs there, a
scratch-block backend and ``DecodeGraphs(capture=False)`` are put in, so everything but the recording runs.
"""
from __future__ import annotations

import random
import statistics
import threading
import time

import torch

from .gpu_decode import BLOCK_SIZE, free_memory, random_llm

GPU_SCALE = 4


def claim(value: float, op: str, threshold: float) -> dict:
    """A chapter's assert on ``value``, as data: what it asks and whether it holds here."""
    holds = value > threshold if op == ">" else value < threshold
    return {"value": value, "assert": f"{op} {threshold:g}", "holds": bool(holds)}


def models(quick: bool) -> list[str]:
    return ["quick-smollm2-135m", "quick-llama-3.1-8b"] if quick else ["smollm2-135m", "llama-3.1-8b"]


def _prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _llm(spec: str, device, dtype, **options):
    from ... import LLM
    return LLM(model=f"random:{spec}", device=str(device), dtype=str(dtype).removeprefix("torch."), **options)


# ------------------------------------------------------------------ chapters 00 and 01

def _decode_step_at_context(engine, ids: list[int], steps: int = 5) -> float:
    """Chapter 01's ``decode_step_at_context``: median engine step of one sequence after its prompt is in."""
    from ...engine.request import SamplingParams
    req = engine.add_request(ids, SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
    while not req.output_token_ids:
        engine.step()
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _decode_batch_step(engine, vocab: int, batch: int, steps: int = 6) -> float:
    """Chapter 01's ``decode_step_time``: median step of ``batch`` sequences decoding together."""
    from ...engine.request import SamplingParams
    for i in range(batch):
        engine.add_request(_prompt(vocab, 32, seed=i), SamplingParams(max_tokens=steps + 2, temperature=0,
                                                                      ignore_eos=True))
    engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def probe_recompute_and_cache(device, dtype, quick: bool) -> dict:
    from ...engine.request import SamplingParams

    new_tokens = 32 if quick else 128 * GPU_SCALE
    ttft_lens = [16, 32, 64] if quick else [n * GPU_SCALE for n in (16, 128, 384)]
    contexts = (16, 128) if quick else (128, 4096)
    batch = 4 if quick else 8 * GPU_SCALE
    out = {"new_tokens": new_tokens}
    for spec in models(quick):
        no_cache, cached = _llm(spec, device, dtype, kv_cache="none"), _llm(spec, device, dtype, kv_cache="contiguous")
        vocab = cached.engine.model.config.vocab_size
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        prompt = {"prompt_token_ids": _prompt(vocab, 40)}
        for llm in (no_cache, cached):  # warm-up: kernels compiled, allocator settled
            llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
        runs = {name: llm.generate([prompt], params, use_tqdm=False)[0]
                for name, llm in (("no_cache", no_cache), ("cache", cached))}
        itl = {name: r.metrics.itl for name, r in runs.items()}
        q = len(itl["cache"]) // 4
        early, late = statistics.median(itl["no_cache"][:q]), statistics.median(itl["no_cache"][-q:])
        growth = {name: (sum(t[-q:]) / q) / (sum(t[:q]) / q) for name, t in itl.items()}
        rows = []
        for n in ttft_lens:
            r = no_cache.generate([{"prompt_token_ids": _prompt(vocab, n, seed=n)}],
                                  SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)[0]
            rows.append((n, r.ttft, r.tpot))
        step = {n: _decode_step_at_context(cached.engine, _prompt(vocab, n, seed=n)) for n in contexts}
        one, many = _decode_batch_step(cached.engine, vocab, 1), _decode_batch_step(cached.engine, vocab, batch)
        out[spec] = {
            "00_latency_growth": claim(late / early, ">", 1.2),
            "00_ttft_growth": claim(rows[-1][1] / rows[0][1], ">", 1.0),
            "00_tpot_growth": claim(rows[-1][2] / rows[0][2], ">", 1.0),
            "01_kv_cache_speedup": claim(runs["no_cache"].metrics.latency / runs["cache"].metrics.latency, ">", 1.5),
            "01_growth_without_cache": claim(growth["no_cache"], ">", 1.3),
            "01_growth_with_cache": claim(growth["cache"], "<", growth["no_cache"]),
            "01_long_context_step": claim(step[contexts[-1]] / step[contexts[0]], ">", 1.1),
            f"01_batch_{batch}_step_over_one": claim(many / one, "<", 0.6 * batch),
            "same_tokens": runs["cache"].token_ids == runs["no_cache"].token_ids,
            "step_ms": {"no_cache_first_quarter": 1e3 * early, "no_cache_last_quarter": 1e3 * late,
                        **{f"cache_context_{n}": 1e3 * t for n, t in step.items()},
                        "cache_batch_1": 1e3 * one, f"cache_batch_{batch}": 1e3 * many},
        }
        for llm in (no_cache, cached):
            llm.shutdown()
        del no_cache, cached
        free_memory(device)
    return out


# ------------------------------------------------------------------ chapter 05

def probe_chunked_prefill(device, dtype, quick: bool) -> dict:
    """Chapter 05's asserts on its own default model's shape (``gpu_check`` part 5 runs the 8B shape)."""
    from .gpu_chunked_prefill import check_chunked_prefill

    r = check_chunked_prefill(device, quick, dtype, spec=f"random:{models(quick)[0]}")
    runs = r["runs"]
    whole = runs["whole"]
    chunks = sorted(int(k.split()[1]) for k in runs if k.startswith("chunk"))
    chapter_chunk = f"chunk {chunks[len(chunks) // 2]}"  # the chapter's CHUNK_TOKENS: 256 x GPU_SCALE
    smallest = runs[f"chunk {chunks[0]}"]
    return {"model": r["model"], "runs": runs, "blocks_free": r["blocks_free"],
            "05_whole_prompt_step_over_typical": claim(whole["step_max_ms"] / whole["step_p50_ms"], ">", 5),
            "05_worst_gap_over_p50_itl": claim(whole["itl_max_ms"] / whole["itl_p50_ms"], ">", 5),
            f"05_{chapter_chunk.replace(' ', '_')}_worst_gap_over_whole": claim(
                runs[chapter_chunk]["itl_max_ms"] / whole["itl_max_ms"], "<", 0.5),
            "05_smallest_chunk_p99_itl_over_whole": claim(smallest["itl_p99_ms"] / whole["itl_p99_ms"], "<", 1 / 3)}


# ------------------------------------------------------------------ graphs on a live engine

def graph_executor(llm):
    """The engine's ``DecodeGraphs``; on a device without them (the CPU rehearsal) one is put in, unrecorded
    (``capture=False``), over a scratch-block pool, so the same code runs everywhere but the recording."""
    from ...engine.paged_attention import PagedAttention
    from ...engine.runner import ModelRunner
    from ...kernels.cuda_graphs import DecodeGraphs

    engine = llm.engine
    if isinstance(engine.runner.executor, DecodeGraphs):
        return engine.runner.executor
    cfg, dtype = engine.model.config, next(engine.model.parameters()).dtype
    backend = PagedAttention(cfg.num_layers, engine.kv.num_blocks, engine.kv.block_size, cfg.num_kv_heads,
                             cfg.head_dim, dtype, engine.device, scratch_block=True)
    graphs = DecodeGraphs(engine.model, backend, engine.config.max_num_seqs, engine.max_model_len, capture=False,
                          config=engine.config)
    engine.backend, engine.runner = backend, ModelRunner(engine.model, backend, engine.device, executor=graphs)
    return graphs


def _decode_workload(llm, n: int, n_in: int, n_out: int) -> tuple[list, float]:
    from ...engine.request import SamplingParams
    vocab = llm.engine.model.config.vocab_size
    prompts = [{"prompt_token_ids": _prompt(vocab, n_in, seed=i)} for i in range(n)]
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True), use_tqdm=False)
    return [o.token_ids for o in outs], time.perf_counter() - start


def probe_raised_max_num_seqs(device, dtype, quick: bool) -> dict:
    """Chapter 04 builds with ``max_num_seqs=3`` and raises it: are steps of the larger batch still replayed?"""
    spec = models(quick)[0]
    n, n_in, n_out = (8, 16, 8) if quick else (16, 64, 64)
    llm = _llm(spec, device, dtype, max_num_seqs=3, num_blocks=n * -(-(n_in + n_out) // BLOCK_SIZE) + 8,
               block_size=BLOCK_SIZE)
    graphs = graph_executor(llm)
    built_with = graphs.max_batch
    llm.engine.set_options(max_num_seqs=n)
    at_change = graphs.max_batch  # n here if the engine tells its executor (RuntimeOptions.watch), else 3
    replays, run = [], graphs.run
    graphs.run = lambda batch: replays.append(len(batch.requests)) or run(batch)
    _decode_workload(llm, n, n_in, 4)  # warm-up
    replays.clear()
    tokens, seconds = _decode_workload(llm, n, n_in, n_out)
    eager = _llm(spec, device, dtype, max_num_seqs=n, num_blocks=llm.engine.kv.num_blocks, block_size=BLOCK_SIZE,
                 enforce_eager=True)
    _decode_workload(eager, n, n_in, 4)
    eager_tokens, eager_seconds = _decode_workload(eager, n, n_in, n_out)
    out = {"built_with": built_with, "raised_to": n, "graphs_sized_at_change": at_change,
           "graphs_sized_after_run": graphs.max_batch, "recorded": list(graphs.captured),
           "replayed_steps": len(replays), "largest_replayed_batch": max(replays, default=0),
           "graph_seconds": seconds, "eager_seconds": eager_seconds, "speedup_over_eager": eager_seconds / seconds,
           "same_tokens_share": _same_share(tokens, eager_tokens),
           "recorded_when": "at set_options" if at_change >= n else "at the first larger step (engine not wired)"}
    out["ok"] = out["largest_replayed_batch"] == n
    for x in (llm, eager):
        x.shutdown()
    free_memory(device)
    return out


def _same_share(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for s, t in zip(a, b) for x, y in zip(s, t)) / max(1, sum(map(len, a)))


def probe_capture_beside_copy(device, dtype, quick: bool) -> dict:
    """A KV-receive thread's writes (``unpack_blocks`` from pageable host memory, as ``pd/connector.py`` runs it)
    while the engine records every bucket up to a raised ``max_num_seqs``; then its tokens against eager."""
    from ...pd.kv_transfer import pack_blocks, unpack_blocks

    spec = models(quick)[0]
    n, n_in, n_out = (8, 16, 8) if quick else (16, 64, 32)
    num_blocks = n * -(-(n_in + n_out) // BLOCK_SIZE) + 16
    llm = _llm(spec, device, dtype, max_num_seqs=2, num_blocks=num_blocks, block_size=BLOCK_SIZE)
    graphs = graph_executor(llm)
    backend = llm.engine.backend
    src, dst = [1, 2, 3, 4], [num_blocks - 4, num_blocks - 3, num_blocks - 2, num_blocks - 1]  # blocks no one uses
    packed = [pack_blocks(k, v, src, BLOCK_SIZE).cpu() for k, v in zip(backend.k_pool, backend.v_pool)]
    stop, errors, copies = threading.Event(), [], [0]

    def receive():
        while not stop.is_set():
            try:
                for layer, layer_packed in enumerate(packed):
                    unpack_blocks(backend.k_pool[layer], backend.v_pool[layer], dst, BLOCK_SIZE, layer_packed)
                copies[0] += 1
            except Exception as exc:  # recorded: this is what the probe is looking for
                errors.append(f"{type(exc).__name__}: {exc}")
                return

    thread = threading.Thread(target=receive, name="kv-recv-probe", daemon=True)
    thread.start()
    started, capture_error = time.perf_counter(), None
    while copies[0] == 0 and not errors and time.perf_counter() - started < 5:
        time.sleep(0.001)  # the copies are running before the recording starts
    copies_before = copies[0]
    try:  # the engine's own path: set_options tells the graphs (when wired), follow() catches up if not
        llm.engine.set_options(max_num_seqs=n)
        graphs.follow()
    except Exception as exc:
        capture_error = f"{type(exc).__name__}: {exc}"
    copies_during = copies[0] - copies_before
    stop.set()
    thread.join(timeout=30)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    tokens, _ = _decode_workload(llm, n, n_in, n_out)
    eager = _llm(spec, device, dtype, max_num_seqs=n, num_blocks=num_blocks, block_size=BLOCK_SIZE, enforce_eager=True)
    eager_tokens, _ = _decode_workload(eager, n, n_in, n_out)
    out = {"recorded": list(graphs.captured), "copies_during_recording": copies_during, "thread_errors": errors,
           "capture_error": capture_error, "same_tokens_share": _same_share(tokens, eager_tokens),
           "recording": graphs.capture}
    out["ok"] = not errors and capture_error is None and out["same_tokens_share"] >= (1.0 if quick else 0.9)
    for x in (llm, eager):
        x.shutdown()
    free_memory(device)
    return out


# ------------------------------------------------------------------ memory

def probe_engines_fit(device, dtype, quick: bool) -> dict:
    """Default engines (their own ``gpu_memory_utilization``) built until one is refused; then an 8B-shaped one."""
    from ...models.loader import device_memory

    spec, big = models(quick)
    limit = 2 if quick or device.type != "cuda" else 8
    # a CPU engine's default pool is a fixed 1 GiB, nothing to learn from: the rehearsal keeps it small
    options = {} if device.type == "cuda" else {"kv_cache_memory_bytes": 16 << 20}
    engines, refused, per_engine = [], None, []
    while len(engines) < limit:
        free_before = device_memory(device)[0]
        try:
            engines.append(_llm(spec, device, dtype, **options))
        except ValueError as exc:  # the engine's own refusal, naming the option to change
            refused = str(exc)
            break
        per_engine.append(free_before - device_memory(device)[0])
    out = {"default_engines": len(engines), "limit_tried": limit, "refused": refused,
           "bytes_per_engine": per_engine, "device_total_bytes": device_memory(device)[1]}
    for llm in engines:
        llm.shutdown()
    del engines
    free_memory(device)
    try:
        llm = _llm(big, device, dtype, **options)
        out["8b_default"] = {"fits": True, "kv_blocks": llm.engine.kv.num_blocks}
        llm.shutdown()
        del llm
    except ValueError as exc:
        out["8b_default"] = {"fits": False, "refused": str(exc)}
    free_memory(device)
    return out


PROBES = (("capture_beside_copy", probe_capture_beside_copy), ("raised_max_num_seqs", probe_raised_max_num_seqs),
          ("recompute_and_cache", probe_recompute_and_cache), ("chunked_prefill", probe_chunked_prefill),
          ("engines_fit", probe_engines_fit))
