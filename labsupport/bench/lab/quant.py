"""``python -m labsupport.bench.lab.quant``: what quantization buys and what it costs, side by side in one run.

For each method (``fp32``, ``bf16``, ``int8``, ``int4``) one engine is built and measured on:

* weights: the bytes a decode step reads (every matrix incl. ``lm_head``, not the embedding table, of
  which a step looks up one row), and the bytes the model's modules hold;
* speed: decode tokens/s of our engine, one sequence (the memory-bound case quantization is for), with the time
  between consecutive tokens kept as samples; the first method decodes once more after all the others (its
  A/A run), so ``reading`` can call a method faster or slower only beyond that band (``labsupport.measure``);
* quality on real tasks: exact-match accuracy on ``labsupport/data/quant_tasks.json`` (greedy), because
  a model can keep its perplexity and still lose the answers that matter;
* perplexity on a fixed text (the first tokens of ``northwind_handbook.txt``).

A method may carry options after dashes: ``int4-g64`` (group size 64; default 32), ``int4-sym`` (symmetric),
``int8-nohead`` (keep ``lm_head`` in float). Timings depend on the machine being idle: on 2 cores a
busy neighbour slows torch's threads many times over, so the run warns when it sees one.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time

import torch
from tqdm.auto import tqdm

from ...data import text
from ...engine.request import SamplingParams
from ...engine.runner import sequence_logits
from ...measure import Band, Verdict, noise_band, one_run_each, share_interval, share_verdict, verdict
from ...models.quantize import quantize_model
from ..summary import write_report

DEFAULT_METHODS = ("fp32", "bf16", "int8", "int4")


def load_tasks() -> dict:
    """The shipped task set: ``{"tasks": [{"category", "prompt", "answers"}], "max_tokens", ...}``."""
    return json.loads(text("quant_tasks.json"))


def first_word(completion: str) -> str:
    """The answer a completion gives: its first word or number, case-folded, punctuation stripped."""
    words = re.findall(r"[a-z0-9]+(?:-[a-z0-9]+)*", completion.casefold())
    return words[0] if words else ""


def parse_method(spec: str) -> dict:
    """``"int4-g64-sym"`` -> ``{"name": "int4", "group_size": 64, "symmetric": True, "include_lm_head": True}``."""
    name, *options = spec.split("-")
    if name not in ("fp32", "bf16", "int8", "int4"):
        raise ValueError(f"method {spec!r}: start with fp32, bf16, int8 or int4")
    method = {"name": name, "group_size": 32, "symmetric": False, "include_lm_head": True}
    for option in options:
        if re.fullmatch(r"g\d+", option) and name == "int4":
            method["group_size"] = int(option[1:])
        elif option == "sym" and name == "int4":
            method["symmetric"] = True
        elif option == "nohead" and name in ("int8", "int4"):
            method["include_lm_head"] = False
        else:
            raise ValueError(f"method {spec!r}: unknown option {option!r} (int4 takes g32/g64/g128/sym, "
                             "int8 and int4 take nohead)")
    return method


def build_llm(spec: str, model=None):
    """An engine for one method: fp32 or bf16 as loaded, int8/int4 quantized in place after loading."""
    from ... import LLM

    method = parse_method(spec)
    llm = LLM(model=model, device="cpu", dtype="bfloat16" if method["name"] == "bf16" else "float32")
    quant = None
    if method["name"] in ("int8", "int4"):
        quant = quantize_model(llm.engine.model, method["name"], method["group_size"], method["symmetric"],
                               method["include_lm_head"])
    return llm, quant


def weight_bytes(model: torch.nn.Module) -> dict:
    """``read_per_step``: tensors of every module but the embedding table (a tied ``lm_head`` counts);
    ``held``: every distinct tensor of the model's modules."""
    def total(tensors):
        seen = {}
        for t in tensors:
            seen.setdefault(t.data_ptr(), t.numel() * t.element_size())
        return sum(seen.values())

    embedding = model.model.embed_tokens
    per_step = [t for m in model.modules() if m is not embedding
                for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)] if t is not None]
    return {"read_per_step": total(per_step), "held": total([*model.parameters(), *model.buffers()])}


def decode_speed(llm, tokens: int, batch: int = 1) -> tuple[float, list[float]]:
    """Decode tokens/s (``batch`` sequences generating ``tokens`` each, timed from the first token to the last)
    and every sequence's gaps between consecutive tokens in ms, sequence by sequence: with ``ignore_eos`` two
    runs give the same count, gap i of one the same position as gap i of the other (the samples pair up)."""
    llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm up
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    outs = llm.generate(["Write a short story about a lighthouse keeper."] * batch, params, use_tqdm=False)
    start = min(o.metrics.first_token_time for o in outs)
    end = max(o.metrics.finished_time for o in outs)
    gaps = [round(1000 * g, 3) for o in outs for g in o.metrics.itl]
    return sum(len(o.token_ids) - 1 for o in outs) / max(end - start, 1e-9), gaps


def select_tasks(tasks: dict, limit: int | None = None) -> list[int]:
    """Indices of the tasks a run asks: all of them in file order, or ``limit`` taken in turn from each group
    (facts, arithmetic, code) and within a group in turn from each category, so that a short run still asks
    every kind of question."""
    items = tasks["tasks"]
    if limit is None or limit >= len(items):
        return list(range(len(items)))

    def in_turn(queues):
        order, turn = [], 0
        while any(turn < len(q) for q in queues):
            order += [q[turn] for q in queues if turn < len(q)]
            turn += 1
        return order

    by_category = {}
    for i, t in enumerate(items):
        by_category.setdefault(t["category"], []).append(i)
    groups = [in_turn([by_category[c] for c in cs if c in by_category]) for cs in tasks["groups"].values()]
    return sorted(in_turn(groups)[:limit])


def task_accuracy(llm, tasks: dict, limit: int | None = None) -> dict:
    """Exact-match accuracy, overall and per category, and the answers given (greedy, one batch)."""
    ids = select_tasks(tasks, limit)
    items = [tasks["tasks"][i] for i in ids]
    params = SamplingParams(temperature=0, max_tokens=tasks["max_tokens"])
    outs = llm.generate([t["prompt"] for t in items], params, use_tqdm=False)
    given = [first_word(o.text) for o in outs]
    right = [g in t["answers"] for g, t in zip(given, items)]
    by_category = {}
    for t, ok in zip(items, right):
        by_category.setdefault(t["category"], []).append(ok)
    return {"accuracy": sum(right) / len(right), "correct": sum(right), "total": len(right),
            "by_category": {c: sum(v) / len(v) for c, v in by_category.items()},
            "by_category_counts": {c: [sum(v), len(v)] for c, v in by_category.items()},
            "task_ids": ids, "answers": given}


def group_counts(row: dict, tasks: dict | None = None) -> dict[str, tuple[int, int]]:
    """(correct, asked) per group of categories (``quant_tasks.json``'s "groups": facts, arithmetic, code).
    A saved row without counts (runs before 2026-12-05) is recounted from its answers, which line up with
    the first tasks of the file."""
    tasks = tasks or load_tasks()
    counts = row.get("by_category_counts")
    if counts is None:
        ids = row.get("task_ids") or range(len(row["answers"]))
        counts = {}
        for i, given in zip(ids, row["answers"]):
            t = tasks["tasks"][i]
            c = counts.setdefault(t["category"], [0, 0])
            c[0] += given in t["answers"]
            c[1] += 1
    out = {}
    for group, categories in tasks["groups"].items():
        right = sum(counts[c][0] for c in categories if c in counts)
        asked = sum(counts[c][1] for c in categories if c in counts)
        if asked:
            out[group] = (right, asked)
    return out


def format_categories(report: dict) -> str:
    """Correct answers per group of questions and method, with how many were asked (n)."""
    tasks = load_tasks()
    rows = {spec: group_counts(r, tasks) for spec, r in report["methods"].items()}
    groups = [g for g in tasks["groups"] if any(g in r for r in rows.values())]
    head = f"{'method':<14}" + "".join(f"{g + ' (n=' + str(next(r[g][1] for r in rows.values() if g in r)) + ')':>20}"
                                       for g in groups)
    lines = [head, "-" * len(head)]
    for spec, r in rows.items():
        lines.append(f"{spec:<14}" + "".join(
            f"{f'{r[g][0]}/{r[g][1]} {r[g][0] / r[g][1]:4.0%}':>20}" if g in r else f"{'-':>20}" for g in groups))
    return "\n".join(lines)


def perplexity(llm, tokens: int) -> float:
    """exp(mean next-token loss) of the model on the first ``tokens`` tokens of the fixed text."""
    ids = llm.tokenizer(text(load_tasks()["perplexity_text"])).input_ids[:tokens]
    logits = sequence_logits(llm.engine.model, ids)
    loss = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:], device=logits.device))
    return math.exp(float(loss))


def run(methods=DEFAULT_METHODS, tokens: int = 64, questions: int | None = None, ppl_tokens: int | None = None,
        batch: int = 1, model=None, threads: int | None = None, progress: bool = True) -> dict:
    """Measure every method in ``methods``; return ``{"methods": {spec: row}, "settings": {...}}``.

    Each row: ``bytes_read_per_step``, ``bytes_held``, ``decode_tok_s``, ``accuracy`` (+ per category and
    the answers), ``perplexity``, ``quantization`` (the report of ``quantize_model``, or None), ``decode_gaps_ms``
    (the samples behind ``decode_tok_s``), and the ratios to the first method (fp32 when it is listed first):
    ``memory_ratio``, ``speedup``. ``decode_again``: the first method decoded once more after all the others.
    ``threads``: torch threads for the run (restored after); 1 keeps a shared 2-core machine's timings sane."""
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _measure(methods, tokens, questions, ppl_tokens, batch, model, progress)
    finally:
        torch.set_num_threads(previous_threads)


def _measure(methods, tokens, questions, ppl_tokens, batch, model, progress) -> dict:
    from .roofline import warn_if_busy

    methods = [methods] if isinstance(methods, str) else list(methods)
    for spec in methods:
        parse_method(spec)  # a typo fails now, not after minutes of measuring
    tasks = load_tasks()
    ppl_tokens = ppl_tokens or tasks["perplexity_tokens"]
    busy = warn_if_busy()
    rows, again = {}, None
    stages = ("load", "decode", "tasks", "perplexity")
    with tqdm(total=len(methods) * len(stages) + 1, desc="Quantization bench", unit="step",
              disable=not progress) as bar:
        first = None  # the first method's engine stays up to decode once more after the others: its A/A run
        for spec in methods:
            bar.set_postfix_str(f"{spec}: load")
            llm, quant = build_llm(spec, model)
            bar.update()
            row = {"quantization": quant, **{f"bytes_{k}": v for k, v in weight_bytes(llm.engine.model).items()}}
            bar.set_postfix_str(f"{spec}: decode")
            row["decode_tok_s"], row["decode_gaps_ms"] = decode_speed(llm, tokens, batch)
            bar.update()
            bar.set_postfix_str(f"{spec}: tasks")
            row.update(task_accuracy(llm, tasks, questions))
            bar.update()
            bar.set_postfix_str(f"{spec}: perplexity")
            row["perplexity"] = perplexity(llm, ppl_tokens)
            bar.update()
            if first is None:
                first = llm
            else:
                llm.shutdown()
            rows[spec] = row
        bar.set_postfix_str(f"{methods[0]}: decode again")
        tok_s, gaps = decode_speed(first, tokens, batch)
        again = {"method": methods[0], "decode_tok_s": tok_s, "decode_gaps_ms": gaps}
        first.shutdown()
        bar.update()
    base = rows[methods[0]]
    for row in rows.values():
        row["memory_ratio"] = row["bytes_read_per_step"] / base["bytes_read_per_step"]
        row["speedup"] = row["decode_tok_s"] / base["decode_tok_s"]
    from ...machine import machine
    return {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "methods": rows, "decode_again": again,
            "settings": {"tokens": tokens, "batch": batch, "questions": len(base["answers"]),
                         "ppl_tokens": ppl_tokens, "threads": torch.get_num_threads(),
                         "other_runnable_threads": busy}}


def format_table(report: dict) -> str:
    """One line per method; ratios are to the first method."""
    rows = report["methods"]
    first = next(iter(rows))
    head = (f"{'method':<14}{'read/step':>11}{'x ' + first:>10}{'tok/s':>8}{'x ' + first:>10}"
            f"{'accuracy':>14}{'perplexity':>12}  kernel")
    lines = [head, "-" * len(head)]
    for spec, r in rows.items():
        paths = ", ".join((r["quantization"] or {}).get("paths", {})) or "torch F.linear"
        lines.append(f"{spec:<14}{r['bytes_read_per_step'] / 2**20:>8.0f} MB{r['memory_ratio']:>10.2f}"
                     f"{r['decode_tok_s']:>8.1f}{r['speedup']:>10.2f}"
                     f"{r['correct']:>5}/{r['total']:<3} {r['accuracy']:>4.0%}{r['perplexity']:>12.2f}  {paths}")
    s = report["settings"]
    lines.append(f"decode: {s['batch']} sequence(s) x {s['tokens']} tokens, {s['threads']} torch threads; "
                 f"tasks: {s['questions']} questions, greedy; perplexity: first {s['ppl_tokens']} tokens "
                 "of northwind_handbook.txt")
    return "\n".join(lines)


GAP_STAT = "median"  # one sequence decodes one token a step: the median gap is its typical step


def decode_band(report: dict, seed: int = 0) -> Band | None:
    """The A/A band of decode speed: the first method's gaps between tokens against its own second run (paired by
    position); None for a report saved without per-token gaps (an older run)."""
    first = next(iter(report["methods"].values()))
    again = report.get("decode_again")
    if not again or len(first.get("decode_gaps_ms") or []) < 2 or len(again["decode_gaps_ms"]) < 2:
        return None
    return noise_band(first["decode_gaps_ms"], again["decode_gaps_ms"], GAP_STAT, seed=seed, paired=True)


def decode_verdict(report: dict, spec: str, band: Band, seed: int = 0) -> Verdict:
    """``spec``'s gaps between tokens against the first method's, read against ``band``: "faster" when the whole
    interval of the ratio of median gaps lies below it."""
    first = next(iter(report["methods"].values()))
    return verdict(first["decode_gaps_ms"], report["methods"][spec]["decode_gaps_ms"], band, higher="slower",
                   lower="faster", higher_is_better=False, stat=GAP_STAT, seed=seed, paired=True)


def reading(report: dict) -> str:
    """The table in sentences, every figure from ``report``; ratios are to the first method (Markdown bullets).
    Decode speed gets a verdict word only through ``decode_band``/``decode_verdict``; a report without per-token
    gaps gets ratios, one run each, and says so."""
    rows = report["methods"]
    first, base = next(iter(rows.items()))
    others = {k: r for k, r in rows.items() if k != first}
    mb = lambda r: f"{r['bytes_read_per_step'] / 2**20:.0f} MB"  # noqa: E731
    lines = [f"* **Bytes read per decode step**: {first} {mb(base)}; "
             + ", ".join(f"{k} {mb(r)} ({r['memory_ratio']:.2f}x)" for k, r in others.items()) + "."]
    band = decode_band(report)
    per = f"{report['settings']['batch']} sequence"
    if band is None:
        speed = ", ".join(f"{k} {one_run_each(r['decode_tok_s'], base['decode_tok_s'])}" for k, r in others.items())
        lines.append(f"* **Decode tokens/s** against {first}'s {base['decode_tok_s']:.1f} ({per}; this run kept no "
                     f"per-token times and no second {first} run, so no A/A band): {speed}.")
        lines.append("* **Bytes against speed**, one run each (no verdict): " + ", ".join(
            f"{k} read {1 / r['memory_ratio']:.1f}x fewer bytes and ran {r['speedup']:.2f}x {first}'s tokens/s"
            for k, r in others.items()) + ".")
    else:
        verdicts = {k: decode_verdict(report, k, band) for k in others}
        again = report["decode_again"]
        lines.append(f"* **Decode speed** against {first} ({per}, {base['decode_tok_s']:.1f} tokens/s; decoded again "
                     f"after the others at {again['decode_tok_s']:.1f}: the {band} of the median time between "
                     f"tokens): " + "; ".join(f"{k} {v}" for k, v in verdicts.items()) + ".")
        # slower than the bytes predict, beyond the noise: the interval of the gap ratio lies above what the
        # byte ratio alone would give (memory_ratio) times the band's top
        lagging = [k for k, v in verdicts.items() if v.interval.low > band.high * others[k]["memory_ratio"]]
        if lagging:
            lines.append("* Speed did not follow the bytes: " + ", ".join(
                f"{k} read {1 / others[k]['memory_ratio']:.1f}x fewer bytes but ran at most "
                f"{1 / verdicts[k].interval.low:.2f}x {first}'s speed (its interval's fast end)" for k in lagging)
                + " — a step's time here is not its weight bytes alone.")
    tasks = load_tasks()
    counts = {k: group_counts(r, tasks) for k, r in rows.items()}
    kinds = []
    for group, (right, asked) in counts[first].items():
        ref = share_interval(right, asked)  # exact binomial: how far chance alone could move a share of so few
        changes = ", ".join(f"{k} {counts[k][group][0]} ({counts[k][group][0] - right:+d}: "
                            f"{share_verdict(ref, share_interval(*counts[k][group]))})"
                            for k in others if group in counts[k])
        kinds.append(f"{group}: {first} {right} of {asked} (95 % interval {100 * ref.low:.0f}-{100 * ref.high:.0f} %), "
                     f"{changes}")
    if kinds:
        lines.append("* **By kind of question**: " + "; ".join(kinds)
                     + ". Higher or lower only where the two shares' exact 95 % intervals do not overlap; with a "
                     "handful of questions a kind, most changes are level.")
    lines.append(f"* **Tasks** ({base['total']} questions, greedy): {first} {base['correct']}; "
                 + ", ".join(f"{k} {r['correct']} ({r['correct'] - base['correct']:+d})" for k, r in others.items())
                 + f". **Perplexity**: {first} {base['perplexity']:.2f}; "
                 + ", ".join(f"{k} {r['perplexity']:.2f} ({100 * (r['perplexity'] / base['perplexity'] - 1):+.1f} %)"
                             for k, r in others.items()) + ".")
    return "\n".join(lines)


def label(report: dict) -> str:
    """Where and when a report was measured (older saved reports carry a label added afterwards)."""
    from ...machine import describe_machine
    m = report.get("machine")
    return f"{describe_machine(m)}, {report['date']}" if m else "an unrecorded machine and date"


def plot_quant(report: dict):
    """Four panels, one bar per method: bytes read per decode step, decode tokens/s, task accuracy,
    perplexity. Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    rows = report["methods"]
    names = list(rows)
    panels = [("weights read per decode step (MB)", [r["bytes_read_per_step"] / 2**20 for r in rows.values()]),
              ("decode tokens/s", [r["decode_tok_s"] for r in rows.values()]),
              ("accuracy by kind of question (%)", None),
              ("perplexity (lower is better)", [r["perplexity"] for r in rows.values()])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for ax, (title, values) in zip(axes, panels):
        if values is None:
            _accuracy_by_kind(ax, report)
        else:
            bars = ax.bar(names, values, color=[f"C{i}" for i in range(len(names))])
            ax.bar_label(bars, fmt="%.1f", fontsize=8)
            ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax.margins(y=0.15)
        ax.set_title(title, fontsize=10)
    fig.suptitle(f"Weight quantization: memory, speed and quality; {label(report)}")
    fig.tight_layout()
    return fig


def _accuracy_by_kind(ax, report: dict):
    """Grouped bars: one group per kind of question (n in its label), one bar per method."""
    tasks = load_tasks()
    counts = {spec: group_counts(r, tasks) for spec, r in report["methods"].items()}
    groups = [g for g in tasks["groups"] if any(g in c for c in counts.values())]
    width = 0.8 / max(len(counts), 1)
    for i, (spec, c) in enumerate(counts.items()):
        xs = [j + (i - (len(counts) - 1) / 2) * width for j in range(len(groups))]
        ax.bar(xs, [100 * c[g][0] / c[g][1] if g in c else 0 for g in groups], width, label=spec, color=f"C{i}")
    n = {g: next(c[g][1] for c in counts.values() if g in c) for g in groups}
    ax.set_xticks(range(len(groups)), [f"{g}\n(n={n[g]})" for g in groups], fontsize=8)
    ax.set_ylim(0, 110)
    ax.legend(fontsize=7, ncol=2)


def add_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help="comma-separated: fp32, bf16, int8, int4, with options int4-g64, int4-sym, int8-nohead")
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per sequence for the speed figure")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together for the speed figure")
    parser.add_argument("--questions", type=int, default=None, help="only the first N questions of the task set")
    parser.add_argument("--ppl-tokens", type=int, default=None, help="perplexity over the first N tokens (512)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--json", metavar="FILE", default=None, help="write the full report")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labsupport.bench.lab.quant",
                                     description=__doc__.split("\n")[0].split(": ", 1)[1])
    add_arguments(parser)
    return main_from_args(parser.parse_args(argv))


def main_from_args(args: argparse.Namespace) -> int:
    """Run, print the table, write ``--json``: for a parser built with ``add_arguments`` (a CLI subcommand)."""
    try:
        report = run([m for m in args.methods.split(",") if m], args.tokens, args.questions, args.ppl_tokens,
                     args.batch, args.model, args.threads)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(report))
    if args.json:
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
