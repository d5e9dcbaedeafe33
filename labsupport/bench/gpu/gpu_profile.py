"""``make gpu-preflight``'s step-cost profile: what an engine step costs on this device, for the simulated clock.

The simulated clock (``labsupport/sim``) replaces the model's forward by ``c · features`` (``sim/cost_model.py``:
a step, prompt tokens, attention pairs, decode rows, context tokens read). Its GPU profiles were arithmetic until
a GPU timed real steps; this file times them. For each model shape (the default model's and Llama-3.1-8B's, bf16,
random weights: no checkpoint travels to a bare GPU machine) it builds the real engine (``LLM(model="random:...")``,
so the device's kernels, the Triton decode kernel and the CUDA-graph decode are the engine's own), then hands its
runner synthetic batches of known shape: prompts of 16-4,096 tokens, chunks after a computed start, decode batches
of 1-64 rows at contexts 128-4,096, rows of mixed contexts, and decodes beside a prompt chunk. Each batch runs twice
untimed (Triton compiles a new shape there; the graphs were recorded when the engine was built), then ``ITERS``
times, each between two device synchronisations; its median is the record. The batch's requests are stand-ins
whose state never advances, so the same batch can run again (its K/V rewritten to the same slots).

A runner step leaves out the scheduler's Python, which a real engine step and the CPU profile (``sim/calibrate.py``,
``engine.last_step``) include: a short real workload measures it (engine step minus runner) and its median is
added to the ``step`` coefficient, as the notes say. The fit is ``cost_model.fit`` (non-negative least squares on
relative error); its median and P90 error over these records go into the profile.
"""
from __future__ import annotations

import dataclasses
import datetime
import random
import statistics
import time
from types import SimpleNamespace

import torch

from .gpu_decode import BLOCK_SIZE, free_memory, random_llm, sync

ITERS = 5
QUICK_ITERS = 3
# Shapes: decode (rows, context); prompts (start, tokens) alone; decode rows beside one chunk
DECODE = [(b, c) for b in (1, 2, 4, 8, 16, 32, 64) for c in (128, 1024, 4096)]
PROMPTS = [(0, n) for n in (16, 64, 256, 1024, 2048, 4096)] + [(1024, 256), (2048, 512), (4096, 1024), (6144, 2048)]
MIXED = [(8, 1024, 0, 256), (32, 1024, 0, 1024), (16, 2048, 2048, 512), (64, 512, 0, 2048)]
QUICK_DECODE = [(b, c) for b in (1, 2, 4, 8) for c in (16, 64, 128)]
QUICK_PROMPTS = [(0, n) for n in (8, 16, 32, 64, 128)] + [(64, 32), (128, 64)]
QUICK_MIXED = [(4, 64, 0, 32), (2, 128, 64, 16)]
MAX_TOKENS = 131072  # KV tokens one batch may hold: 17 GB for the 8B shape in bf16, beside its 16 GB of weights


def step_shapes(quick: bool, seed: int = 0) -> list[tuple[str, list[int], list[int]]]:
    """(label, starts, fed) of every batch to time: each row starts after ``starts[i]`` computed tokens and
    feeds ``fed[i]`` (``cost_model.features_of``'s arguments)."""
    decode, prompts, mixed = (QUICK_DECODE, QUICK_PROMPTS, QUICK_MIXED) if quick else (DECODE, PROMPTS, MIXED)
    rng = random.Random(seed)
    shapes = [(f"decode B={b} ctx={c}", [c - 1] * b, [1] * b) for b, c in decode if b * c <= MAX_TOKENS]
    top = max(c for _, c in decode)
    for b in sorted({b for b, _ in decode if b > 2}):  # contexts spread: rows and context no longer move together
        starts = [rng.randrange(8, min(top, MAX_TOKENS // b)) for _ in range(b)]
        shapes.append((f"decode B={b} mixed contexts", starts, [1] * b))
    shapes += [(f"prompt {n} after {s}", [s], [n]) for s, n in prompts]
    shapes += [(f"prompts 4x{n // 4}", [0] * 4, [n // 4] * 4) for s, n in prompts[2:4] if s == 0]
    shapes += [(f"decode B={b} ctx={c} + chunk {n} after {s}", [c - 1] * b + [s], [1] * b + [n])
               for b, c, s, n in mixed]
    return shapes


def stand_ins(starts: list[int], fed: list[int], vocab: int, first_block: int, seed: int = 0):
    """Requests in the state a scheduler hands the runner, each with its own blocks from ``first_block`` on."""
    rng, block, out = random.Random(seed), first_block, []
    for i, (s, n) in enumerate(zip(starts, fed)):
        blocks = -(-(s + n) // BLOCK_SIZE)
        tokens = [rng.randrange(vocab) for _ in range(s + n)]
        out.append(SimpleNamespace(request_id=f"p{i}", num_computed_tokens=s, num_tokens=s + n, all_token_ids=tokens,
                                   prompt_token_ids=tokens, block_table=list(range(block, block + blocks)),
                                   params=SimpleNamespace(greedy=True)))
        block += blocks
    return out


def blocks_for(shapes) -> int:
    return max(sum(-(-(s + n) // BLOCK_SIZE) for s, n in zip(starts, fed)) for _, starts, fed in shapes) + 1


def time_step(runner, batch, device, iters: int) -> list[float]:
    """Seconds of ``runner.execute(batch)``, each between two synchronisations, after two untimed runs."""
    for _ in range(2):
        runner.execute(batch)
    times = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        runner.execute(batch)
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def scheduler_overhead(llm, quick: bool) -> float:
    """Median seconds an engine step spends outside the runner (scheduling, bookkeeping, detokenizing) in a short
    real workload of mixed prompts; the runner's own time is taken out of each step."""
    from ...engine.request import SamplingParams

    engine, runner = llm.engine, llm.engine.runner
    execute, inside = runner.execute, []

    def timed(batch):
        start = time.perf_counter()
        out = execute(batch)
        inside.append(time.perf_counter() - start)
        return out

    rng, vocab = random.Random(1), engine.model.config.vocab_size
    n, n_in, n_out = (4, 24, 8) if quick else (32, 200, 32)
    params = SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True)
    for _ in range(n):
        engine.add_request([rng.randrange(vocab) for _ in range(rng.randrange(n_in // 2, n_in))], params)
    gaps = []
    runner.execute = timed
    try:
        while engine.has_unfinished_requests():
            inside.clear()
            engine.step()
            out = engine.last_step
            if out is not None and inside:
                gaps.append(max(0.0, out.end - out.start - sum(inside)))
    finally:
        del runner.execute  # the instance's own method again
    return statistics.median(gaps) if gaps else 0.0


def measure_model(spec: str, device, dtype, quick: bool, stop_at: float) -> dict:
    """Step records of one model shape (``random:<spec>``); stops adding shapes at ``stop_at`` (perf_counter)."""
    from ...sim.cost_model import features_of
    from ...kernels.cuda_graphs import DecodeGraphs
    from ...engine.scheduler import SchedulerOutput

    shapes = step_shapes(quick)
    max_batch = max(len(fed) for _, _, fed in shapes)
    llm = random_llm(spec, device, dtype, blocks_for(shapes), max_num_seqs=max_batch,
                     max_model_len=max(s + n for _, starts, fed in shapes for s, n in zip(starts, fed)) + BLOCK_SIZE,
                     max_num_batched_tokens=max(sum(fed) for _, _, fed in shapes))
    runner, vocab = llm.engine.runner, llm.engine.model.config.vocab_size
    graphs = runner.executor if isinstance(runner.executor, DecodeGraphs) else None
    records, skipped = [], []
    for label, starts, fed in shapes:
        if time.perf_counter() > stop_at:
            skipped.append(label)
            continue
        batch = SchedulerOutput(requests=stand_ins(starts, fed, vocab, 0), num_new_tokens=list(fed))
        times = time_step(runner, batch, device, QUICK_ITERS if quick else ITERS)
        records.append({**features_of(starts, fed), "duration_s": statistics.median(times), "label": label,
                        "path": "graph" if graphs is not None and graphs.can_run(batch) else "eager",
                        "spread": (max(times) - min(times)) / statistics.median(times)})
    overhead = scheduler_overhead(llm, quick)
    out = {"records": records, "skipped_shapes": skipped, "scheduler_overhead_s": overhead,
           "executor": type(runner.executor).__name__, "decode_path": llm.engine.backend.decode_attention.__name__,
           "kv_pool_bytes": llm.engine.backend.pool_bytes, "config": dataclasses.asdict(llm.engine.model.config)}
    llm.shutdown()
    del llm, runner, graphs
    free_memory(device)
    return out


def fit_profile(name: str, measured: dict, machine: dict, dtype_name: str, device_name: str) -> dict:
    """The profile of ``sim/profiles.py``'s shape from ``measure_model``'s records, fitted by ``cost_model.fit``."""
    from ...sim.cost_model import fit

    model, report = fit(measured["records"])
    coefficients = model.to_dict()
    coefficients["step"] += measured["scheduler_overhead_s"]
    graph = [r for r in measured["records"] if r["path"] == "graph"]
    eager = [r for r in measured["records"] if r["path"] == "eager"]
    notes = {
        "records": f"{len(measured['records'])} synthetic steps through the engine's runner ({measured['executor']}, "
                   f"decode attention {measured['decode_path']}): {len(graph)} decode-only steps replayed from CUDA "
                   f"graphs, {len(eager)} eager; each the median of {QUICK_ITERS if machine.get('quick') else ITERS} "
                   "synchronised runs after two untimed ones",
        "step": f"fitted, plus {measured['scheduler_overhead_s'] * 1e3:.3f} ms of scheduler Python per step (median of "
                "a short real workload: engine step minus runner), which a runner step leaves out",
        "weights": "random weights of the model's shape (speed is the shape's, tokens mean nothing)",
        "not_modelled": "one linear model for graph-replayed and eager steps: a step with a prompt chunk runs eagerly "
                        "and pays the launch cost a graph replay saves; see the fit error and the records",
    }
    if measured["skipped_shapes"]:
        notes["skipped"] = f"not timed (deadline): {', '.join(measured['skipped_shapes'])}"
    return {"name": name, "source": "measured", "device": device_name, "machine": machine,
            "date": datetime.date.today().isoformat(), "model": measured["config"], "dtype": dtype_name,
            "kv_cache_bytes": kv_budget(measured["config"], dtype_name, machine), "coefficients": coefficients,
            "fit": report, "notes": notes}


def kv_budget(config: dict, dtype_name: str, machine: dict) -> int | None:
    """The KV budget of one engine owning this GPU at vLLM's 0.9 (``sim.profiles.gpu_kv_budget``); None on a CPU."""
    memory = machine.get("gpu_memory_bytes")
    if not memory:
        return None
    from ...models.model_config import ModelConfig
    from ...sim.profiles import gpu_kv_budget
    try:
        return gpu_kv_budget(ModelConfig(**config), dtype_name, memory)
    except ValueError:  # the shape does not fit this card at 0.9: the simulator needs num_blocks
        return None
