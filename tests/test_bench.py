"""The benchmark pieces (workload, driver, metrics) and the static-batching baseline."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from labsupport import LLM, SamplingParams
from labsupport.bench import poisson_workload, run_workload, summarize
from labsupport.bench.summary import percentile


def test_workload_is_seeded_and_follows_its_arguments(llm):
    a = poisson_workload(llm.tokenizer, 20, rate=5.0, input_lens=(16, 48), output_lens=(4, 9), shared_prefix_len=8, seed=3)
    b = poisson_workload(llm.tokenizer, 20, rate=5.0, input_lens=(16, 48), output_lens=(4, 9), shared_prefix_len=8, seed=3)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    times = [r.arrival_time for r in a]
    assert times == sorted(times) and times[0] > 0
    assert {len(r.prompt_token_ids) for r in a} <= {16, 48} and {r.max_tokens for r in a} <= {4, 9}
    assert len({tuple(r.prompt_token_ids[:8]) for r in a}) == 1
    assert all(r.arrival_time == 0 for r in poisson_workload(llm.tokenizer, 5))


def test_percentile_matches_numpy():
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_driver_runs_every_request_to_its_length_and_frees_the_pool(llm):
    work = poisson_workload(llm.tokenizer, 6, rate=20.0, input_lens=(16, 40), output_lens=(3, 8), seed=1)
    outputs, duration = run_workload(llm, work, use_tqdm=False)
    assert [len(o.token_ids) for o in outputs] == [w.max_tokens for w in work]
    summary = summarize(outputs, duration)
    assert summary["total_output_tokens"] == sum(w.max_tokens for w in work)
    assert summary["p50_ttft_ms"] <= summary["p99_ttft_ms"] and summary["output_throughput"] > 0
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_static_batching_holds_newcomers_until_the_batch_drains():
    static = LLM(device="cpu", scheduling_policy="static")
    engine = static.engine
    long = engine.add_request(list(range(100, 120)), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    engine.step()
    late = engine.add_request(list(range(200, 220)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    while not long.is_finished:
        engine.step()
        assert not late.output_token_ids  # its slot waits for the batch's longest member
    while engine.has_unfinished_requests():
        engine.step()
    continuous = LLM(device="cpu").generate([{"prompt_token_ids": list(range(200, 220))}],
                                            SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                                            use_tqdm=False)[0]
    assert late.output_token_ids == continuous.token_ids


def test_unknown_scheduling_policy_is_rejected():
    with pytest.raises(ValueError, match="policy"):
        LLM(device="cpu", scheduling_policy="lottery")


def test_bench_cli_prints_json_metrics():
    done = subprocess.run([sys.executable, "-m", "labsupport", "bench", "--num-requests", "3", "--input-len", "16",
                           "--output-len", "4", "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["requests"] == 3 and summary["total_output_tokens"] == 12


# The subcommand tests check what is computed, not how fast: one OpenMP thread keeps them quick
# when other processes share the 2 cores (two threads then spin-wait, and runs take 5-10x longer).
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_comparison_workloads_are_seeded_and_sized(llm):
    from labsupport.bench.offline.workload import comparison_workloads

    full = comparison_workloads(llm.tokenizer)
    w1 = full["W1"]
    assert [len(w1.prompts), {len(p) for p in w1.prompts}, set(w1.max_tokens)] == [32, {200}, {128}]
    assert len(full["W0"].prompts[0]) == 128 and full["W0"].max_tokens == [256]
    assert len(full["WV"].prompts) == 48 and all(20 <= len(p) <= 400 for p in full["WV"].prompts)
    assert all(8 <= m <= 256 for m in full["WV"].max_tokens)
    w3 = full["W3"]
    assert w3.prefix_caching and len({tuple(p[:600]) for p in w3.prompts}) == 1
    again = comparison_workloads(llm.tokenizer, ["W3", "W1"])  # the same ids whichever others are chosen
    assert again["W1"].prompts == full["W1"].prompts and again["W3"].max_tokens == w3.max_tokens
    with pytest.raises(ValueError, match="W9"):
        comparison_workloads(llm.tokenizer, ["W9"])


def test_offline_figures_count_decode_after_the_last_first_token():
    from labsupport.bench.offline.engine_runner import offline_figures

    fig = offline_figures(3.0, [11, 11], first_s=[1.0, 1.0], last_s=[3.0, 3.0])
    assert fig["output_tok_s"] == pytest.approx(22 / 3) and fig["tpot_ms"] == pytest.approx(200)
    assert fig["decode_tok_s"] == pytest.approx(10) and fig["median_ttft_ms"] == pytest.approx(1000)
    assert offline_figures(2.0, [4, 4])["tpot_ms"] == pytest.approx(250)  # no per-request times: wall / tokens


def test_roofline_floor_takes_the_slower_of_memory_and_compute():
    from labsupport.bench.lab.roofline import achieved, decode_floor

    roof = {"read_gbps": 10.0, "matmul": {"fp32": {"decode_gflops": {1: 5.0, 32: 50.0}}},
            "model": {"weight_bytes": 1e9, "kv_bytes_per_token": 1e3, "matmul_params": 1e8}}
    one = decode_floor(roof, 1, context_len=1000)
    assert one["bound"] == "memory" and one["floor_ms"] == pytest.approx(100.1)
    big = decode_floor(roof, 32, context_len=0)
    assert big["bound"] == "compute" and big["floor_ms"] == pytest.approx(128)
    assert achieved(roof, 0.2002, 1, 1000) == pytest.approx(0.5)


def test_vllm_runner_skips_with_a_reason_without_its_venv(llm, tmp_path):
    from labsupport.bench.offline import vllm_runner
    from labsupport.bench.offline.workload import comparison_workloads

    work = comparison_workloads(llm.tokenizer, ["W0"], quick=True)
    result = vllm_runner.run(llm.engine.model_path, work, [[1, 2, 3]], python=tmp_path / "nope" / "python")
    assert "make vllm-env" in result["skipped"]


def test_bench_compare_prints_one_run_ratios_without_a_verdict_word():
    """Each engine runs each workload once: the table gives ratios and says that no verdict is drawn."""
    from pathlib import Path

    from labsupport.bench.offline.compare import format_report

    saved = json.loads((Path(__file__).parents[1] / "benchmarks" / "compare-cpu-2026-12-05c.json").read_text())
    text = format_report(saved)
    assert f"{saved['ratios']['W0']['labsupport/vllm']:.2f}x" in text
    assert "one run each: a ratio, no verdict" in text
    assert not any(w in text for w in ("faster", "slower", "noise", "beyond"))


def test_bench_compare_quick_writes_throughputs_ratios_and_roofline(tmp_path):
    out = tmp_path / "compare.json"
    done = subprocess.run([sys.executable, "-m", "labsupport", "bench", "compare", "--quick", "--engines",
                           "labsupport,transformers", "--workloads", "W0,W1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, env=ONE_THREAD)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "ours/this" in done.stdout and report["machine"]["cores"] >= 1 and report["command"].endswith(str(out))
    for engine in ("labsupport", "transformers"):
        for name in ("W0", "W1"):
            r = report["results"][engine][name]
            assert r["output_tok_s"] > 0 and r["wall_s"] > 0 and r["tpot_ms"] > 0
            assert r["output_tokens"] == report["workloads"][name]["output_tokens"]
    assert all(report["ratios"][name]["labsupport/transformers"] > 0 for name in ("W0", "W1"))
    agree = report["agreement"]["transformers"]
    assert agree["agree"] >= agree["prompts"] - 1  # fp32 greedy: the same tokens
    roof = report["roofline"]
    figures = [roof["read_gbps"], roof["copy_gbps"], roof["matmul"]["fp32"]["prefill_gflops"],
               *roof["matmul"]["fp32"]["decode_gflops"].values(),
               *(f["floor_ms"] for f in roof["decode_floor"].values())]
    assert all(np.isfinite(x) and x > 0 for x in figures)
    assert 0 < report["roofline_fraction"]["labsupport"]["W0_tpot"] < 10


def test_bench_profile_quick_prints_ops_and_step_breakdown(tmp_path):
    trace, out = tmp_path / "trace.json", tmp_path / "steps.json"
    done = subprocess.run([sys.executable, "-m", "labsupport", "bench", "profile", "--quick", "--trace", str(trace),
                           "--json", str(out)], capture_output=True, text=True, timeout=300, env=ONE_THREAD)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Self CPU" in done.stdout and "prefill" in done.stdout
    steps = json.loads(out.read_text())
    assert steps["prefill_steps"] >= 1 and all(d["median_ms"] > 0 for d in steps["decode_steps"].values())
    assert json.loads(trace.read_text())["traceEvents"]


def test_bench_subcommand_rejects_unknown_engine():
    done = subprocess.run([sys.executable, "-m", "labsupport", "bench", "compare", "--engines", "tgi"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "tgi" in done.stderr


def test_small_samples_report_the_max_not_a_p99():
    from types import SimpleNamespace

    from labsupport.bench.summary import format_summary, summarize, tail

    def out(ttft, gaps):
        m = SimpleNamespace(ttft=ttft, tpot=sum(gaps) / len(gaps), itl=gaps, latency=ttft + sum(gaps), queueing_time=0.0)
        return SimpleNamespace(metrics=m, token_ids=[0] * (len(gaps) + 1))

    few = summarize([out(0.1 * i, [0.01] * 3) for i in range(1, 17)], 10.0)
    assert tail(few, "ttft") == ("max", pytest.approx(1600.0)) and "mean/P50/max" in format_summary(few)
    many = summarize([out(0.01 * i, [0.01] * 3) for i in range(1, 201)], 10.0)
    assert tail(many, "ttft")[0] == "P99" and tail(many, "ttft")[1] < many["max_ttft_ms"]
    assert tail(few, "itl")[0] == "max" and tail(many, "itl")[0] == "P99"   # 48 gaps vs 600
