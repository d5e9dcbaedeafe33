"""The ``cpu`` profile: the default model's real steps on this machine, timed and fitted (``cost_model.fit``).

A short calibration runs ``LLM(device="cpu")`` (float32) over prompts of varied lengths (prefill alone),
batches of 1 to 32 sequences at short and long contexts (decode rows and the context they read), prompts joining
a batch that is decoding (the mixed steps arrivals make), and one long prompt fed in chunks (attention pairs after
a computed start). Each step's features are read as it is handed to the runner, before it runs; its duration is
the engine's own record (``engine.last_step``: start to end, scheduling and bookkeeping included, as a simulated
step's ``step`` coefficient holds them). The profile is cached per machine (``machine.machine()``'s CPU, vector
units, cores, threads and torch) under the model cache, and reused; ``recalibrate=True`` makes it afresh. The
calibration's workloads are not the validation's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time

from .cost_model import StepCostModel, step_features

PREFILL_LENS = (24, 64, 96, 160, 256, 512, 1024)  # one request each, a few tokens out: prefill alone, then B=1 decodes
JOINING = ((1, 128), (4, 64), (8, 192), (2, 320))  # (sequences decoding, prompt length): a prompt joins a batch
QUICK_PREFILL_LENS = (24, 96, 256)  # the quick calibration's (tests, chapter 07's one-core fit)
DECODE_SHAPES = ((4, 48), (16, 48), (32, 24), (8, 160), (12, 100), (2, 700))  # (sequences, prompt length)
DECODE_STEPS = 8
CHUNKED = (1400, 256)  # one prompt of this many tokens fed in chunks of this budget, beside two decoders
MACHINE_KEYS = ("cpu", "cpu_family", "isa", "cores", "torch_threads", "torch")


@contextlib.contextmanager
def recording_steps(engine):
    """Collect each step's features (read as the runner receives the batch) and its duration (the engine's
    ``last_step`` record) while the block runs; yields the list of records."""
    records, runner = [], engine.runner
    execute, pending = runner.execute, {}

    def timed(batch):
        pending["features"] = step_features(batch)
        return execute(batch)

    step = engine.step

    def recorded_step():
        got = step()
        out = engine.last_step
        if "features" in pending and out is not None:
            records.append({**pending.pop("features"), "duration_s": out.end - out.start})
        return got

    runner.execute, engine.step = timed, recorded_step
    try:
        yield records
    finally:
        del runner.execute, engine.step  # the instance's own methods again


def calibration_runs(llm, quick: bool = False, seed: int = 11) -> list[dict]:
    """Run the calibration workloads on ``llm`` (``quick``: about a third of them, shorter; for tests and chapter
    07's one-core fit); returns their step records. ``seed`` draws the prompts (another seed: other text, so a
    prefix cache finds none of the last calibration's)."""
    from ..bench.offline.workload import _token_pool
    from ..engine.request import SamplingParams
    import random
    pool = _token_pool(llm.tokenizer, random.Random(7))
    rng = random.Random(seed)

    def prompts(n, length):
        starts = [rng.randrange(0, len(pool) - length) for _ in range(n)]
        return [{"prompt_token_ids": pool[s:s + length]} for s in starts]

    def params(k):
        return SamplingParams(max_tokens=k, temperature=0, ignore_eos=True)

    llm.generate(prompts(2, 32), params(4), use_tqdm=False)  # warm-up: first-touch pages, kernels loaded
    with recording_steps(llm.engine) as records:
        for length in QUICK_PREFILL_LENS if quick else PREFILL_LENS:
            llm.generate(prompts(1, length), params(4), use_tqdm=False)
        for n, length in DECODE_SHAPES[::3] if quick else DECODE_SHAPES:
            llm.generate(prompts(n, length), params(DECODE_STEPS), use_tqdm=False)
        for n, length in JOINING[:1] if quick else JOINING:  # under arrivals most prompts share a step with decodes
            for p in prompts(n, 40):
                llm.engine.add_request(p["prompt_token_ids"], params(DECODE_STEPS))
            for _ in range(2):
                llm.engine.step()
            llm.engine.add_request(prompts(1, length)[0]["prompt_token_ids"], params(2))
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
        length, budget = (CHUNKED[0] // 3, CHUNKED[1] // 2) if quick else CHUNKED
        with llm.engine.options(enable_chunked_prefill=True, max_num_batched_tokens=budget):
            llm.generate(prompts(2, 32) + prompts(1, length), [params(24), params(24), params(2)], use_tqdm=False)
    return records


def machine_key(m: dict) -> str:
    return hashlib.sha256(json.dumps({k: m.get(k) for k in MACHINE_KEYS}, sort_keys=True).encode()).hexdigest()[:12]


def cache_path(m: dict):
    from ..models.loader import cache_dir
    return cache_dir() / "sim" / f"cpu-{machine_key(m)}.json"


def calibrate(llm=None, quick: bool = False) -> dict:
    """Time the calibration steps on this machine and fit them: the ``cpu`` profile (not saved)."""
    if llm is None:
        from ..llm import LLM
        llm = LLM(device="cpu", dtype="float32")
    began = time.perf_counter()
    records = calibration_runs(llm, quick)
    profile = profile_from_records(llm, records, "cpu-quick" if quick else "cpu")
    profile["fit"]["calibration_s"] = time.perf_counter() - began
    return profile


def profile_from_records(llm, records: list[dict], name: str) -> dict:
    """A profile of ``llm``'s model on this machine, fitted to step records (``recording_steps``): the calibration's,
    or the steps a chapter already ran. Its KV budget is the engine's own pool."""
    from ..machine import machine
    from .cost_model import fit
    model, report = fit(records)
    cfg, kv = llm.engine.model.config, llm.engine.kv
    m = machine()
    return {"name": name, "source": "fitted", "device": "cpu", "machine": m, "date": m["date"][:10],
            "model": dataclasses.asdict(cfg), "model_name": llm.model_name, "dtype": "float32",
            "kv_cache_bytes": kv.num_blocks * kv.block_size * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4,
            "eos_token_ids": sorted(llm.engine.scheduler.lifecycle.eos_token_ids),
            "coefficients": model.to_dict(), "fit": dict(report), "records": records,
            "notes": {"how": "labsupport.sim.calibrate: the default model's real steps on this machine, least "
                             "squares on relative error, coefficients >= 0",
                      "not_modelled": "other processes on the cores (a busy machine's steps are slower and vary)"}}


def cached_cpu_profile() -> dict | None:
    """This machine's cached profile, or None if it was never calibrated here."""
    from ..machine import machine
    path = cache_path(machine())
    return json.loads(path.read_text()) if path.exists() else None


def cpu_profile(recalibrate: bool = False, llm=None) -> dict:
    """This machine's profile: the cached one, or a calibration now (saved for next time)."""
    from ..machine import machine
    cached = None if recalibrate else cached_cpu_profile()
    if cached is not None:
        return cached
    path = cache_path(machine())
    print("calibrating the cpu profile on this machine (once; --recalibrate redoes it) ...", flush=True)
    profile = calibrate(llm)
    StepCostModel.from_dict(profile["coefficients"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=2) + "\n")  # profiles.save_profile's format (it imports this module)
    return profile
