"""``python -m labsupport bench spec``: when does speculative decoding pay, and when does it stop paying?

One run, side by side, on our engine: the same prompts decoded plainly and with k guesses per step
(prompt lookup by default; ``--draft MODEL`` for a draft model), for two kinds of traffic:

* **repetitive**: the answer copies its input (a function edited, facts extracted, a text summarised
  in its own words) -- prompt lookup finds the next tokens in the prompt;
* **open-ended**: a story, advice -- nothing to copy, guesses mostly fail.

For each (traffic, k, temperature) it reports the mean acceptance length (tokens per verified step,
``1 + accepted / drafts``, vLLM's definition), the acceptance rate per guess position, output tokens
per second and the speed-up over plain decoding at the same temperature; a second sweep varies the
batch size, where spare compute per step runs out and guesses stop being free. Greedy runs must
give exactly the plain tokens: the report says whether they did.

Plain decoding runs twice in every group, before and after the guessing runs (``repeat`` rows): the same
work measured twice. Every row keeps the time between consecutive tokens of each request (``gaps_ms``), so
``reading`` follows ``labsupport.measure``: the two plain runs give the group's A/A band (``band``), and a
speed-up is called faster or slower only where the bootstrap interval of its mean time between tokens lies
outside that band. A report saved without ``gaps_ms`` (an older run) gets ratios, one run each, no verdict.
"""
from __future__ import annotations

import argparse
import math
import time

from tqdm.auto import tqdm

from ...measure import CONFIDENCE, Band, Verdict, noise_band, one_run_each, verdict
from ...data import text
from ..summary import write_report

CODE = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        total += item["price"] * item["quantity"]
    total = total * (1 + tax_rate)
    return round(total, 2)'''

REPETITIVE = [
    [{"role": "user", "content": f"Rename the variable `total` to `amount` in this function. Reply with the "
                                 f"whole function and nothing else.\n\n```python\n{CODE}\n```"}],
    [{"role": "user", "content": "Copy every sentence that mentions remote work from this text, word for word.\n\n"
                                 + text('northwind_handbook.txt')[1200:2200]}],
    [{"role": "user", "content": "Summarise this policy text, quoting its key sentences.\n\n"
                                 + text('northwind_handbook.txt')[2200:3000]}],
]
OPEN_ENDED = [
    [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a strange map."}],
    [{"role": "user", "content": "Give me five tips for staying focused while studying."}],
    [{"role": "user", "content": "Describe your ideal weekend in a mountain village."}],
]
WORKLOADS = {"repetitive": REPETITIVE, "open-ended": OPEN_ENDED}


def spec_engines(ks, method: str = "ngram", draft: str | None = None, **options) -> dict:
    """One LLM per k (0: plain decoding); they share the model's weights."""
    from ... import LLM
    engines = {}
    for k in ks:
        spec = None
        if k:
            spec = ({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
                    if method == "ngram" else {"method": "draft_model", "model": draft, "num_speculative_tokens": k})
        engines[k] = LLM(speculative_config=spec, **options)
    return engines


def measure(llm, prompts, temperature: float, max_tokens: int, seed: int = 0, one_at_a_time: bool = False) -> dict:
    """Decode ``prompts`` together (or each alone: one user's latency); tokens/s and the spec-decode
    counters of this run alone."""
    from ... import SamplingParams
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i)
              for i in range(len(prompts))]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm the kernels
    before = llm.stats()
    start = time.perf_counter()
    if one_at_a_time:
        outs = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    # every request's gaps between consecutive tokens, in request order: the samples a verdict needs (the
    # tokens one verify step accepts arrive together, gap 0, so the *mean* gap is what guessing changes)
    gaps = [round(1000 * g, 3) for o in outs for g in o.metrics.itl]
    row = {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
           "steps": after["num_steps"] - before["num_steps"], "token_ids": [o.token_ids for o in outs],
           "gaps_ms": gaps}
    if "spec_decode_num_drafts" in after:
        drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
        guessed = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        per_pos = [a - b for a, b in zip(after["spec_decode_num_accepted_tokens_per_pos"],
                                         before["spec_decode_num_accepted_tokens_per_pos"])]
        row |= {"drafts": drafts, "draft_tokens": guessed, "accepted": accepted,
                "acceptance_length": 1 + accepted / drafts if drafts else 1.0,
                "acceptance_rate": accepted / guessed if guessed else 0.0,
                "per_position": [a / drafts if drafts else 0.0 for a in per_pos]}
    return row


GROUP = ("sweep", "workload", "temperature", "batch")  # rows that decode the same prompts the same way


def run(ks=(0, 2, 4, 8), temperatures=(0.0, 1.0), batch_sizes=(4, 16), max_tokens: int = 64,
        method: str = "ngram", draft: str | None = None, device: str = "auto", use_tqdm: bool = True,
        repeat_plain: bool = True) -> dict:
    """The two sweeps. ``ks`` must include 0 (the plain baseline every speed-up is measured against);
    ``repeat_plain``: decode plainly once more after each group's guessing runs (the run's noise)."""
    ks = sorted(set(ks) | {0})
    engines = spec_engines(ks, method, draft, device=device, max_num_seqs=max(64, max(batch_sizes)))
    again = [0] if repeat_plain else []
    jobs = [("k", w, k, t, 1) for w in WORKLOADS for t in temperatures for k in ks + again]  # one user at a time
    k_batch = 4 if 4 in ks else max(ks)
    jobs += [("batch", "repetitive", k, 0.0, b) for b in batch_sizes for k in [0, k_batch] + again if b > 1]
    rows = []
    for sweep, workload, k, temp, batch in tqdm(jobs, desc="spec decode", disable=not use_tqdm):
        prompts = [WORKLOADS[workload][i % len(WORKLOADS[workload])] for i in range(batch)]
        if sweep == "k":
            prompts = WORKLOADS[workload]
        row = measure(engines[k], prompts, temp, max_tokens, one_at_a_time=sweep == "k")
        repeat = k == 0 and any(r["k"] == 0 and all(r[key] == v for key, v in
                                                    zip(GROUP, (sweep, workload, temp, batch))) for r in rows)
        rows.append({"sweep": sweep, "workload": workload, "k": k, "temperature": temp, "batch": batch,
                     "repeat": repeat, **row})
    for row in rows:  # speed-up and identity against plain decoding of the same prompts and temperature
        base = next(r for r in rows if r["k"] == 0 and not r["repeat"] and all(r[key] == row[key] for key in GROUP))
        row["speedup"] = row["tok_s"] / base["tok_s"]
        row["same_tokens"] = row["token_ids"] == base["token_ids"] if row["temperature"] == 0 else None
    for llm in engines.values():
        llm.shutdown()
    from ...machine import machine
    return {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "method": method, "draft": draft,
            "max_tokens": max_tokens, "rows": rows}


GAP_STAT = "mean"  # mean time between tokens is 1 / decode tokens/s; a median would read the accepted tokens' 0s


def _plain(report: dict, row: dict, repeat: bool) -> dict | None:
    """Plain decoding of the same prompts the same way as ``row`` (its group): the first run or the repeat."""
    return next((b for b in report["rows"] if b["k"] == 0 and bool(b.get("repeat")) == repeat
                 and all(b[key] == row[key] for key in GROUP)), None)


def _gaps(row: dict | None) -> list[float] | None:
    gaps = (row or {}).get("gaps_ms")
    return gaps if gaps is not None and len(gaps) >= 2 else None


def band(report: dict, row: dict, seed: int = 0) -> Band | None:
    """The A/A band of ``row``'s group: plain decoding against its own repeat (mean time between tokens); None
    when the group has no repeat or the report kept no per-token gaps."""
    first, again = _gaps(_plain(report, row, False)), _gaps(_plain(report, row, True))
    if first is None or again is None:
        return None
    return noise_band(first, again, GAP_STAT, seed=seed)


def speed(report: dict, row: dict, seed: int = 0) -> Verdict | None:
    """``row``'s mean time between tokens against plain decoding's, read against the group's A/A band ("faster":
    the whole interval below it); None without the samples, where only the one-run ratio can be given."""
    b, base = band(report, row, seed), _gaps(_plain(report, row, False))
    if b is None or _gaps(row) is None:
        return None
    return verdict(base, row["gaps_ms"], b, higher="slower", lower="faster", level="level",
                           higher_is_better=False, stat=GAP_STAT, seed=seed)


def format_report(report: dict) -> str:
    lines = [f"{'sweep':6} {'traffic':11} {'k':>7} {'temp':>4} {'batch':>5} {'tok/s':>7} {'speedup':>7} "
             f"{'accept len':>10} {'accept %':>8}  per position  greedy same"]
    for r in report["rows"]:
        pos = " ".join(f"{p:.2f}" for p in r.get("per_position", []))
        same = "" if r["same_tokens"] is None else "yes" if r["same_tokens"] else "NO"
        k = "0 again" if r.get("repeat") else r["k"]
        lines.append(f"{r['sweep']:6} {r['workload']:11} {k:>7} {r['temperature']:>4.1f} {r['batch']:>5} "
                     f"{r['tok_s']:>7.1f} {r['speedup']:>6.2f}x {r.get('acceptance_length', 1.0):>10.2f} "
                     f"{100 * r.get('acceptance_rate', 0.0):>7.0f}%  {pos:12}  {same}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--k", default="0,2,4,8", help="guesses per step to try (0: plain decoding)")
    p.add_argument("--temperatures", default="0,1", help="comma-separated")
    p.add_argument("--batch-sizes", default="4,16", help="the batch sweep (repetitive traffic, greedy, k=4; the k "
                                                       "sweep is batch 1)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--draft", default=None, help="a draft model (same vocabulary): method draft_model instead "
                                                 "of prompt lookup")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", metavar="FILE", default=None)


def main(args) -> int:
    def numbers(text, kind=int):
        return [kind(x) for x in text.split(",") if x.strip()]
    report = run(numbers(args.k), numbers(args.temperatures, float), numbers(args.batch_sizes), args.max_tokens,
                 "draft_model" if args.draft else "ngram", args.draft, args.device)
    print(format_report(report))
    if args.json:
        write_report(args.json, {**report, "rows": [{k: v for k, v in r.items() if k != "token_ids"}
                                                    for r in report["rows"]]})
    return 0 if all(r["same_tokens"] is not False for r in report["rows"]) else 1


def reading(report: dict) -> str:
    """The sweep in sentences, every figure from ``report`` (Markdown bullets). A speed-up gets a verdict word only
    from ``speed`` (interval against the group's A/A band); a report without per-token gaps gets ratios only."""
    rows = [r for r in report["rows"] if r["k"] > 0]
    one = [r for r in rows if r["sweep"] == "k"]

    def step_cost(r) -> str:  # mean engine step time against plain decoding's, same prompts and temperature
        base = _plain(report, r, False)
        x = math.nan if not (r["steps"] and base["steps"]) else \
            (r["seconds"] / r["steps"]) / (base["seconds"] / base["steps"])
        v = speed(report, r)
        said = (f"mean time between tokens against plain decoding's: {v}" if v is not None else
                f"tokens/s against plain decoding's: {one_run_each(r['tok_s'], base['tok_s'])}")
        return f"an engine step took {x:.2f}x a plain one; {said}"

    lines = []
    for r in one:
        temp = "greedy" if r["temperature"] == 0 else f"temperature {r['temperature']:g}"
        guessed = f"guesses in {r['drafts']} of {r['steps']} engine steps" if r["steps"] else "no steps"
        lines.append(f"* **{r['workload'].capitalize()}, {temp}, 1 user, k = {r['k']}**: prompt lookup proposed "
                     f"{guessed}; {100 * r['acceptance_rate']:.0f} % of the guessed tokens were accepted, "
                     f"{r['acceptance_length']:.2f} tokens per verified step; {step_cost(r)}.")
    pairs = []
    for w in WORKLOADS:
        greedy = next((r for r in one if r["workload"] == w and r["temperature"] == 0), None)
        hot = next((r for r in one if r["workload"] == w and r["temperature"] > 0), None)
        if greedy and hot:
            pairs.append(f"{100 * hot['acceptance_rate']:.0f} % against {100 * greedy['acceptance_rate']:.0f} % greedy "
                         f"on {w} traffic")
    if pairs:
        lines.append("* **Sampling**: the share of guessed tokens accepted at temperature 1 was " + "; ".join(pairs)
                     + ".")
    for r in (r for r in rows if r["sweep"] == "batch"):
        lines.append(f"* **{r['batch']} users at once**, {r['workload']}, greedy, k = {r['k']}: "
                     f"{r['acceptance_length']:.2f} tokens per verified step; {step_cost(r)}.")
    greedy = [r for r in report["rows"] if r["temperature"] == 0 and r["k"] > 0]
    same = sum(bool(r["same_tokens"]) for r in greedy)
    repeats = [r for r in report["rows"] if r.get("repeat")]
    measured = [r for r in repeats if band(report, r) is not None]
    if measured:
        bands = "; ".join(f"{r['workload']}, {_group_name(r)}: {b}" for r in measured for b in [band(report, r)])
        rule = (f"plain decoding measured twice in each of {len(measured)} groups gives that group's A/A band of the "
                f"mean time between tokens ({bands}); a speed-up is called faster or slower only where its whole "
                f"{100 * CONFIDENCE:.0f} % interval lies outside that band, else level")
    else:
        again = "; ".join(f"{r['workload']}, {_group_name(r)} {one_run_each(r['tok_s'], p['tok_s'])}"
                          for r in repeats for p in [_plain(report, r, False)] if p)
        rule = ("this report kept no per-token times, so every figure is one run against one: ratios, no verdict"
                + (f" (plain decoding against its own repeat: {again})" if again else ""))
    lines.append(f"* Greedy output equal to plain decoding in {same} of {len(greedy)} greedy rows. "
                 f"{report['max_tokens']} tokens per request; {rule}.")
    return "\n".join(lines)


def _group_name(r: dict) -> str:
    temp = "greedy" if r["temperature"] == 0 else f"temperature {r['temperature']:g}"
    return f"{temp}, {r['batch']} user{'s' if r['batch'] > 1 else ''}"
