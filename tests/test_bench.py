"""The benchmark pieces (workload, driver, metrics) and the static-batching baseline."""
import json
import subprocess
import sys

import numpy as np
import pytest

from labsupport import LLM, SamplingParams
from labsupport.bench import poisson_workload, run_workload, summarize
from labsupport.bench.metrics import percentile


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
