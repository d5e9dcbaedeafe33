"""Chapter 09's roofline lab: the accelerator is busy but utilisation is low. What do I tune?

Every engine step is a point on a roofline. Its *arithmetic intensity* (FLOPs per byte moved)
says which roof it lives under: below the *ridge* (peak FLOP/s / bandwidth) a step waits on
memory, above it on the multipliers. A decode step reads every weight once and does about
``2 * params`` FLOPs per sequence, so its intensity grows with the batch B; a prefill of P tokens
reuses each weight P times and sits far to the right. So: "low MFU" in decode is no bug, it is the
roofline: a memory-bound step should be judged by MBU (bytes/s over bandwidth), and the knob that
moves it right is the batch size, until each sequence's own KV reads (which grow with B too) cap
the intensity. That cap is why a long-context decode never turns compute-bound on a GPU.

The costs are counted here (``step_costs``), the times are the engine's own record of real steps
(``engine.last_step``), and this machine's roofs are measured by ``roofline.measure``.
``python -m labsupport.bench.lab.roofline_lab [--batches 1,4,16,64] [--json out.json]`` prints a table.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics

from tqdm.auto import tqdm

from ...engine.request import SamplingParams
from ...models.llama import ModelConfig
from . import roofline
from ..summary import write_report

H200 = {"name": "H200 (published)", "peak_flops": 989e12, "peak_bw": 4.8e12, "dtype_bytes": 2}  # dense BF16, HBM3e
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
CONTEXTS = (1, 1024, 8192)  # cached tokens per sequence for the compute-bound batch table


def step_costs(model_config: ModelConfig, num_tokens, context_lens, dtype_bytes: int = 4) -> dict:
    """FLOPs and bytes of one forward step, as our engine runs it.

    ``num_tokens[i]`` new tokens of sequence i are fed; afterwards it has ``context_lens[i]`` tokens
    of KV (cached + new). Counted: the matmuls (2 FLOPs per multiply-add; the LM head only for the
    last token of each sequence, as the runner does), causal attention (QK^T and PV over the keys
    each query really sees), the weights read once, KV written for new tokens and read for the
    whole context, and activations roughly (each matmul's input and output). Norms, RoPE and SiLU
    are a few FLOPs per element: left out, they would not move any point visibly.
    """
    c = model_config
    d, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = [(d, q), (d, kv), (d, kv), (q, d), (d, c.intermediate_size), (d, c.intermediate_size),
              (c.intermediate_size, d)]  # (in, out) of q, k, v, o, gate, up, down: one layer
    layer_params = sum(k * n for k, n in shapes)
    tokens, seqs = sum(num_tokens), len(num_tokens)
    pairs = sum(n * ctx - n * (n - 1) // 2 for n, ctx in zip(num_tokens, context_lens))  # (query, key) pairs
    matmul_flops = 2 * tokens * layer_params * c.num_layers + 2 * seqs * d * c.vocab_size
    attention_flops = 4 * c.num_layers * c.num_heads * c.head_dim * pairs
    norms = (2 * c.num_layers + 1) * d
    kv_per_token = 2 * c.num_layers * kv * dtype_bytes
    weight_bytes = dtype_bytes * (layer_params * c.num_layers + d * c.vocab_size + norms)
    kv_bytes = kv_per_token * (sum(context_lens) + tokens)
    activation_bytes = dtype_bytes * (tokens * (c.num_layers * sum(k + n for k, n in shapes) + d)
                                      + seqs * (d + c.vocab_size))
    return {"flops": matmul_flops + attention_flops, "bytes": weight_bytes + kv_bytes + activation_bytes,
            "matmul_flops": matmul_flops, "attention_flops": attention_flops, "weight_bytes": weight_bytes,
            "kv_bytes": kv_bytes, "activation_bytes": activation_bytes}


def _prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]  # the content is irrelevant: only shapes are timed


def _point(kind: str, batch: int, steps: list, cfg: ModelConfig, dtype_bytes: int) -> dict:
    """Reduce timed steps ``(seconds, num_tokens, context_lens)`` to one point.

    The time is the median step (a typical one; a shared machine makes the slow tail meaningless);
    the costs are those of the middle step (contexts grow one token a step: the others differ by
    well under 1 %)."""
    seconds = [s for s, _, _ in steps]
    _, num_tokens, context_lens = steps[len(steps) // 2]
    label = f"prefill P={num_tokens[0]}" if kind == "prefill" else f"decode B={batch}"
    return {"kind": kind, "label": label, "batch": batch, "seconds": statistics.median(seconds),
            "best_seconds": min(seconds), "steps": len(steps), "num_tokens": num_tokens,
            "context_lens": context_lens, "tokens_per_s": sum(num_tokens) / statistics.median(seconds),
            "dtype_bytes": dtype_bytes, **step_costs(cfg, num_tokens, context_lens, dtype_bytes)}


def measure_engine_points(llm, batch_sizes=DEFAULT_BATCHES, prompt_len: int = 256, decode_prompt_len: int = 16,
                          decode_steps: int = 4, prefill_repeats: int = 2, seed: int = 0,
                          use_tqdm: bool = True) -> list[dict]:
    """Time real steps of ``llm``'s engine: a prefill of ``prompt_len`` tokens alone, then pure-decode
    steps at each batch size. Returns one dict per point (costs, median step time, the step's shape).

    Decode batches grow in place: requests are added to reach the next B (their prefill mixes
    with the others' decode: those steps are not timed), so only ``max(batch_sizes)`` short prompts
    are ever prefilled. The engine must be idle; every request made here is aborted on the way out.
    """
    engine = llm.engine
    if engine.has_unfinished_requests():
        raise ValueError("the engine is busy: finish or abort its requests before measuring")
    batch_sizes = sorted(set(batch_sizes))
    if batch_sizes[-1] > engine.config.max_num_seqs:
        raise ValueError(f"batch {batch_sizes[-1]} exceeds max_num_seqs={engine.config.max_num_seqs}")
    cfg, rng = engine.model.config, random.Random(seed)
    dtype_bytes = next(engine.model.parameters()).element_size()
    budget = len(batch_sizes) * (decode_steps + 8) + 16  # generated tokens the longest request may need
    greedy = SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True)
    points, mine = [], []

    def add(num_tokens, params):
        mine.append(engine.add_request(_prompt(rng, cfg.vocab_size, num_tokens), params))
        return mine[-1]

    def timed_step():
        engine.step()
        s = engine.last_step  # the engine's own record: start, end, who ran, how many tokens
        return s, (s.end - s.start, list(s.num_new_tokens), [r.num_computed_tokens for r in s.requests])

    bar = tqdm(total=1 + len(batch_sizes), desc="roofline lab", unit="point", disable=not use_tqdm)
    try:
        prefill = []
        for i in range(prefill_repeats + 1):  # the first one warms up (allocator, oneDNN kernels): not kept
            add(prompt_len, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            s, record = timed_step()
            if s.is_prefill != [True] or s.num_new_tokens != [prompt_len]:
                raise RuntimeError("the prefill did not run alone in one step (chunked prefill with a smaller budget?)")
            prefill += [record] if i else []
        points.append(_point("prefill", 1, prefill, cfg, dtype_bytes))
        bar.update()
        running = []
        for batch in batch_sizes:
            running += [add(decode_prompt_len, greedy) for _ in range(batch - len(running))]
            timed = []
            for _ in range(decode_steps + 8):  # a few steps to prefill the newcomers, then pure decode
                s, record = timed_step()
                if not any(s.is_prefill) and len(s.requests) == batch:
                    timed.append(record)
                if len(timed) == decode_steps:
                    break
            if len(timed) < decode_steps or any(r.is_finished for r in running):
                raise RuntimeError(f"could not time {decode_steps} steps of {batch} decoding sequences")
            points.append(_point("decode", batch, timed, cfg, dtype_bytes))
            bar.update()
    finally:
        bar.close()
        engine.abort_requests(mine)  # finished ones are only forgotten
    return points


def compute_bound_batch(cfg: ModelConfig, peak_flops: float, peak_bw: float, dtype_bytes: int,
                        context_len: int) -> dict:
    """The smallest decode batch whose step reaches the ridge, each sequence holding ``context_len`` tokens.

    A decode step's FLOPs and bytes are both linear in B: ``f1 + (B-1) df`` over ``b1 + (B-1) db``.
    The weights are in ``b1`` only, so intensity rises with B towards ``df / db`` (one sequence's
    FLOPs over its KV and activation bytes). If that limit is below the ridge, no batch is
    compute-bound (``batch`` None): only a shorter context or a smaller KV (GQA, fp8) helps."""
    ridge = peak_flops / peak_bw
    one = step_costs(cfg, [1], [context_len], dtype_bytes)
    two = step_costs(cfg, [1, 1], [context_len] * 2, dtype_bytes)
    df, db = two["flops"] - one["flops"], two["bytes"] - one["bytes"]
    gain = df - ridge * db  # FLOPs beyond the ridge each extra sequence brings
    short = ridge * one["bytes"] - one["flops"]  # FLOPs B=1 lacks to reach the ridge
    batch = 1 if short <= 0 else 1 + math.ceil(short / gain) if gain > 0 else None
    return {"batch": batch, "ridge": ridge, "limit_intensity": df / db}


def roofline_report(points: list[dict], peak_flops: float, peak_bw: float, model_config: ModelConfig | None = None,
                    what_if: dict | None = H200, other_models: dict | None = None, contexts=CONTEXTS,
                    model_name: str = "this model") -> dict:
    """Intensity, achieved FLOP/s and bytes/s, MFU, MBU and the bound of each point; the ridge; the
    smallest compute-bound decode batch. With ``model_config``: the same steps on ``what_if`` (in
    its dtype, at its published roofs: a floor, not a prediction) and a table of compute-bound batches
    for this model and ``other_models`` (name -> config) on both machines."""
    ridge = peak_flops / peak_bw
    rows = []
    for p in points:
        intensity = p["flops"] / p["bytes"]
        floor = max(p["flops"] / peak_flops, p["bytes"] / peak_bw)
        row = {**p, "intensity": intensity, "achieved_flops": p["flops"] / p["seconds"],
               "achieved_bw": p["bytes"] / p["seconds"], "bound": "compute" if intensity >= ridge else "memory",
               "floor_seconds": floor, "attainable_flops": min(peak_flops, peak_bw * intensity)}
        row["mfu"], row["mbu"] = row["achieved_flops"] / peak_flops, row["achieved_bw"] / peak_bw
        if model_config is not None and what_if is not None:
            c = step_costs(model_config, p["num_tokens"], p["context_lens"], what_if["dtype_bytes"])
            t = max(c["flops"] / what_if["peak_flops"], c["bytes"] / what_if["peak_bw"])
            compute_bound = c["flops"] / what_if["peak_flops"] >= c["bytes"] / what_if["peak_bw"]
            row["what_if"] = {"intensity": c["flops"] / c["bytes"], "floor_seconds": t,
                              "attainable_flops": c["flops"] / t, "tokens_per_s": sum(p["num_tokens"]) / t,
                              "bound": "compute" if compute_bound else "memory"}
        rows.append(row)
    decode = sorted((r for r in rows if r["kind"] == "decode"), key=lambda r: r["batch"])
    measured_cb = next((r["batch"] for r in decode if r["bound"] == "compute"), None)
    report = {"peak_flops": peak_flops, "peak_bw": peak_bw, "ridge": ridge, "points": rows,
              "decode": decode, "compute_bound_batch_measured": measured_cb, "what_if": what_if}
    if model_config is not None:
        machines = [("this machine (measured)", peak_flops, peak_bw, points[0]["dtype_bytes"] if points else 4)]
        if what_if is not None:
            machines.append((what_if["name"], what_if["peak_flops"], what_if["peak_bw"], what_if["dtype_bytes"]))
        models = {model_name: model_config, **(other_models or {})}
        report["compute_bound_table"] = [
            {"model": name, "machine": m, "dtype_bytes": db, "ridge": pf / bw,
             "by_context": {ctx: compute_bound_batch(cfg, pf, bw, db, ctx) for ctx in contexts}}
            for name, cfg in models.items() for m, pf, bw, db in machines]
    return report


def _batch_cell(v: dict) -> str:
    return f"{v['batch'] or 'never'} ({v['limit_intensity']:.0f})"


def format_report(report: dict) -> str:
    w = report.get("what_if")
    lines = [f"roofs: {report['peak_flops'] / 1e9:.1f} GFLOP/s, {report['peak_bw'] / 1e9:.1f} GB/s -> ridge "
             f"{report['ridge']:.1f} FLOP/byte" + (f"; {w['name']}: ridge {w['peak_flops'] / w['peak_bw']:.0f}" if w else ""),
             f"{'step':<15}{'ctx':>5}{'GFLOP':>8}{'MB':>7}{'FLOP/B':>8}{'ms':>8}{'GFLOP/s':>9}{'GB/s':>7}"
             f"{'MFU':>6}{'MBU':>6}{'tok/s':>8}  bound" + (f" | {'what-if ms':>10}{'tok/s':>10}  bound" if w else "")]
    for r in report["points"]:
        line = (f"{r['label']:<15}{max(r['context_lens']):>5}{r['flops'] / 1e9:>8.2f}{r['bytes'] / 1e6:>7.0f}"
                f"{r['intensity']:>8.1f}{r['seconds'] * 1e3:>8.1f}{r['achieved_flops'] / 1e9:>9.1f}"
                f"{r['achieved_bw'] / 1e9:>7.1f}{r['mfu']:>6.0%}{r['mbu']:>6.0%}{r['tokens_per_s']:>8.0f}  {r['bound']:<7}")
        if "what_if" in r:
            x = r["what_if"]
            line += f" | {x['floor_seconds'] * 1e3:>10.3f}{x['tokens_per_s']:>10.0f}  {x['bound']}"
        lines.append(line)
    cb = report["compute_bound_batch_measured"]
    lines.append(f"decode turns compute-bound on this machine at B = {cb if cb else 'none of those measured'}")
    if "compute_bound_table" in report:
        ctxs = list(report["compute_bound_table"][0]["by_context"])
        lines += ["", "smallest compute-bound decode batch, by cached tokens per sequence ('never': KV reads cap "
                  "the intensity below the ridge; FLOP/B limit in brackets)",
                  f"{'model':<14}{'machine':<26}{'bytes':>6}{'ridge':>7}" + "".join(f"{'ctx ' + str(c):>20}" for c in ctxs)]
        for t in report["compute_bound_table"]:
            cells = "".join(f"{_batch_cell(v):>20}" for v in t["by_context"].values())
            lines.append(f"{t['model']:<14}{t['machine']:<26}{t['dtype_bytes']:>6}{t['ridge']:>7.1f}{cells}")
    return "\n".join(lines)


def _list(values) -> str:
    values = list(values)
    return ", ".join(values[:-1]) + (" and " if len(values) > 1 else "") + values[-1] if values else ""


def reading(report: dict, model_config: ModelConfig | None = None, verify=(), verify_context: int = 200) -> str:
    """The report in sentences, every figure from it (Markdown bullets). ``verify``: (users, k) pairs whose
    speculative verify step (``k + 1`` tokens per user, ``verify_context`` cached tokens each) is placed against
    the ridge too, by its counted costs."""
    ridge, w = report["ridge"], report.get("what_if")
    lines = [f"* **Roofs measured here**: {report['peak_flops'] / 1e9:.1f} GFLOP/s and {report['peak_bw'] / 1e9:.1f} "
             f"GB/s, so the ridge is {ridge:.1f} FLOP/byte"
             + (f" ({w['name']}: {w['peak_flops'] / w['peak_bw']:.0f})." if w else ".")]
    side = lambda r: "above" if r["bound"] == "compute" else "below"  # noqa: E731
    for r in (r for r in report["points"] if r["kind"] == "prefill"):
        lines.append(f"* **{r['label']}**: {r['intensity']:.1f} FLOP/byte, {side(r)} the ridge: {r['bound']}-bound; "
                     f"MFU {r['mfu']:.0%}.")
    decode = report["decode"]
    if decode:
        bounds = {r["bound"] for r in decode}
        where = f"all {side(decode[0])} the ridge: {decode[0]['bound']}-bound" if len(bounds) == 1 else "; ".join(
            f"B = {_list(str(r['batch']) for r in decode if r['bound'] == b)} {b}-bound" for b in ("memory", "compute"))
        lines.append(f"* **Decode** at B = {_list(str(r['batch']) for r in decode)}: "
                     f"{_list(format(r['intensity'], '.1f') for r in decode)} FLOP/byte, {where}. MBU "
                     f"{_list(format(r['mbu'], '.0%') for r in decode)}: each step took "
                     f"{_list(format(r['seconds'] / (r['bytes'] / report['peak_bw']), '.1f') + 'x' for r in decode)} "
                     "the time its bytes need at the measured bandwidth.")
    for t in report.get("compute_bound_table", []):
        cells = t["by_context"]
        some = [f"B = {v['batch']} with {ctx} cached token{'s' if int(ctx) > 1 else ''} per sequence"
                for ctx, v in cells.items() if v["batch"]]
        never = [(ctx, v) for ctx, v in cells.items() if not v["batch"]]
        text = f"* **{t['model']} on {t['machine']}** (ridge {t['ridge']:.1f}), by the counted costs: decode turns " \
               f"compute-bound at {_list(some) or 'no batch'}"
        if never:
            text += (f"; never with {_list(str(c) for c, _ in never)} cached tokens: each sequence's KV reads cap the "
                     f"intensity at {_list(format(v['limit_intensity'], '.0f') for _, v in never)} FLOP/byte")
        lines.append(text + ".")
    if model_config is not None and decode:
        dtype_bytes = decode[0]["dtype_bytes"]
        for users, k in verify:
            c = step_costs(model_config, [k + 1] * users, [verify_context + k + 1] * users, dtype_bytes)
            x = c["flops"] / c["bytes"]
            lines.append(f"* **A verify step of {users} user{'s' if users > 1 else ''} x {k + 1} tokens** (k = {k}, "
                         f"{verify_context} cached tokens each): {x:.1f} FLOP/byte, {'above' if x >= ridge else 'below'} "
                         "this machine's ridge, by the counted costs.")
    return "\n".join(lines)


def main(argv=None) -> int:
    import torch

    from ... import LLM
    from ...models.loader import RANDOM_MODELS

    p = argparse.ArgumentParser(prog="python -m labsupport.bench.lab.roofline_lab", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF folder or random:NAME (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)), help="decode batch sizes")
    p.add_argument("--prompt-len", type=int, default=256, help="tokens of the prefill point")
    p.add_argument("--decode-prompt-len", type=int, default=16, help="prompt tokens of each decoding sequence")
    p.add_argument("--steps", type=int, default=4, help="timed decode steps per batch size")
    p.add_argument("--peak-gflops", type=float, default=None, help="skip measuring: this machine's peak")
    p.add_argument("--peak-gbps", type=float, default=None, help="skip measuring: this machine's bandwidth")
    p.add_argument("--json", metavar="FILE", default=None)
    args = p.parse_args(argv)
    roofline.warn_if_busy()
    llm = LLM(model=args.model, device="cpu")
    roof = None
    if args.peak_gflops is None or args.peak_gbps is None:
        if not (llm.engine.model_path / "config.json").exists():
            raise SystemExit("a random model has no folder to measure with: give --peak-gflops and --peak-gbps")
        print("measuring this machine's roofs ...", flush=True)
        roof = roofline.measure(llm.engine.model_path, quick=True, dtypes=("fp32",))
    peak_flops = args.peak_gflops * 1e9 if args.peak_gflops else roof["matmul"]["fp32"]["prefill_gflops"] * 1e9
    peak_bw = args.peak_gbps * 1e9 if args.peak_gbps else roof["read_gbps"] * 1e9
    points = measure_engine_points(llm, [int(b) for b in args.batches.split(",")], args.prompt_len,
                                   args.decode_prompt_len, args.steps)
    report = roofline_report(points, peak_flops, peak_bw, llm.engine.model.config,
                             other_models={"Llama-3.1-8B": RANDOM_MODELS["llama-3.1-8b"]},
                             model_name=llm.model_name.removesuffix("-Instruct"))
    source = ("given" if roof is None else f"measured: fp32 matmul {'x'.join(map(str, roof['prefill_shape_mkn']))}, "
              f"sum over {roof['bandwidth_tensor_mb']} MB, best of rounds")
    print(f"{llm.model_name}, {torch.get_num_threads()} CPU threads; roofs {source}")
    print(format_report(report))
    if args.json:
        write_report(args.json, {**report, "roofline": roof})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
