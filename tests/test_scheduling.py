"""Continuous batching, preemption and chunked prefill as the engine's own step records show them."""
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from labsupport import LLM, SamplingParams
from labsupport.bench import BenchRequest, long_prompt_workload, run_workload
from labsupport.engine.scheduler import chunk_rule
from labsupport.viz.timeline import BatchTimeline

from browser_tools import select

STORY = {"a": 3, "b": 6, "c": 12, "d": 7, "e": 4}


def story(llm):
    ids = llm.tokenizer("Tell me about the sea.").input_ids
    return [BenchRequest(0, ids, n, user) for user, n in STORY.items()]


def run_story(policy):
    llm = LLM(device="cpu", max_num_seqs=3, num_blocks=64, scheduling_policy=policy)
    timeline = BatchTimeline(policy)
    outputs, _ = run_workload(llm, story(llm), on_step=timeline.on_step, clock="steps", use_tqdm=False)
    return llm, timeline, outputs


@pytest.fixture(scope="module")
def stories():
    return {policy: run_story(policy) for policy in ("static", "continuous")}


def first_step(timeline, user):
    return min(t for t, _, rid, _ in timeline.cells if rid == user)


def test_continuous_batching_refills_a_slot_at_the_next_step(stories):
    _, static, static_out = stories["static"]
    _, continuous, continuous_out = stories["continuous"]
    # static: d and e wait for the whole first batch (c is its longest member)
    assert static.num_steps == STORY["c"] + max(STORY["d"], STORY["e"])
    assert first_step(static, "d") == first_step(static, "e") == STORY["c"]
    # continuous: d takes a's slot the step after a finished, e takes b's
    assert first_step(continuous, "d") == STORY["a"] and first_step(continuous, "e") == STORY["b"]
    slots = {rid: slot for _, slot, rid, _ in continuous.cells}
    assert slots["d"] == slots["a"] and slots["e"] == slots["b"]
    assert continuous.num_steps == max(STORY["c"], STORY["a"] + STORY["d"], STORY["b"] + STORY["e"])
    assert continuous.summary()["slot_use"] > static.summary()["slot_use"]
    # the batch composition differs at almost every step; the tokens do not
    assert [o.token_ids for o in static_out] == [o.token_ids for o in continuous_out]
    assert [len(o.token_ids) for o in continuous_out] == list(STORY.values())


def test_step_records_say_what_ran(stories):
    llm, timeline, _ = stories["continuous"]
    kinds = {}
    for t, _, rid, kind in timeline.cells:
        kinds.setdefault(rid, []).append(kind)
    for user, n in STORY.items():  # one prefill step, then a decode per further token
        assert kinds[user] == ["prefill"] + ["decode"] * (n - 1)
    assert timeline.queue[0] == 2 and timeline.queue[-1] == 0
    assert all(d > 0 for d in timeline.durations)
    assert llm.engine.last_step.finished and llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_preemption_by_recompute_is_recorded_and_changes_no_token():
    prompts = [list(range(100 + 10 * i, 130 + 10 * i)) for i in range(3)]
    work = [BenchRequest(0, p, 30, f"p{i}") for i, p in enumerate(prompts)]
    small = LLM(device="cpu", num_blocks=8, block_size=16)  # 3 x 60 tokens need 12 blocks at the end
    timeline = BatchTimeline()
    outputs, _ = run_workload(small, work, on_step=timeline.on_step, clock="steps", use_tqdm=False)
    big, _ = run_workload(LLM(device="cpu"), work, clock="steps", use_tqdm=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in big]
    stats = small.stats()
    assert stats["num_preemptions"] == len(timeline.preemptions) > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    for step, _, victim in timeline.preemptions:  # the newest goes, and comes back with a recompute
        later = [kind for t, _, rid, kind in timeline.cells if rid == victim and t > step]
        assert later and later[0] == "prefill"
    assert "p0" not in {rid for _, _, rid in timeline.preemptions}  # the oldest is never the victim here


def test_chunked_prefill_feeds_the_budget_left_after_decodes():
    llm = LLM(device="cpu", enable_chunked_prefill=True, max_num_batched_tokens=40)
    work = long_prompt_workload(llm.tokenizer, num_decoding=3, decode_input_len=8, decode_output_len=12,
                                num_long=1, long_input_len=150, long_output_len=3, long_start=2)
    timeline = BatchTimeline()
    outputs, _ = run_workload(llm, work, on_step=timeline.on_step, clock="steps", use_tqdm=False)
    fed = timeline.fed["long-0"]
    assert fed[:4] == [40 - 3] * 4 and sum(fed) == 150 + 2  # chunks beside 3 decodes, then its 2 decodes
    assert not any(kind == "stalled" for *_, kind in timeline.cells)  # decoders got a token every step
    whole, _ = run_workload(LLM(device="cpu"), work, clock="steps", use_tqdm=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in whole]


def test_long_prefill_token_threshold_caps_each_chunk():
    llm = LLM(device="cpu", enable_chunked_prefill=True, max_num_batched_tokens=64, long_prefill_token_threshold=16)
    ids = [list(range(200, 250)), list(range(300, 340))]
    timeline = BatchTimeline()
    outputs, _ = run_workload(llm, [BenchRequest(0, p, 4, f"r{i}") for i, p in enumerate(ids)],
                              on_step=timeline.on_step, clock="steps", use_tqdm=False)
    assert timeline.fed["r0"][:4] == [16, 16, 16, 2] and timeline.fed["r1"][:3] == [16, 16, 8]  # side by side
    whole = LLM(device="cpu").generate([{"prompt_token_ids": p} for p in ids],
                                       SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in whole]
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        LLM(device="cpu", long_prefill_token_threshold=16)


def test_chunk_rule_cases():
    assert chunk_rule(150, 100, False) == 0 and chunk_rule(150, 100, True) == 100
    assert chunk_rule(150, 100, True, 64) == 64 and chunk_rule(30, 100, True, 64) == 30
    assert chunk_rule(5, 0, True) == 0 and chunk_rule(1, 1, False) == 1


def test_chunk_cost_context_shrinks_the_chunks_late_in_a_long_prompt():
    """With ``chunk_cost_context`` K a prompt token attending to c earlier tokens takes 1 + c/K of the budget:
    the chunks of one long prompt shrink as its context grows, each step's cost stays within the budget, and
    the tokens are those of the prompt fed whole."""
    k, budget = 64, 48
    llm = LLM(device="cpu", enable_chunked_prefill=True, max_num_batched_tokens=budget, chunk_cost_context=k)
    ids = [(7 * i) % 5000 + 100 for i in range(300)]
    timeline = BatchTimeline()
    outputs, _ = run_workload(llm, [BenchRequest(0, ids, 3, "long")], on_step=timeline.on_step, clock="steps",
                              use_tqdm=False)
    chunks = timeline.fed["long"][:-2]  # then its two decodes
    assert sum(chunks) == len(ids) and chunks[0] > chunks[-2] and chunks == sorted(chunks, reverse=True)
    done = 0
    for n in chunks[:-1]:  # the last one is what was left
        cost = n * (1 + (done + n / 2) / k)
        assert cost <= budget < (n + 1) * (1 + (done + (n + 1) / 2) / k)  # the most the budget affords
        done += n
    whole = LLM(device="cpu").generate([{"prompt_token_ids": ids}],
                                       SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert outputs[0].token_ids == whole[0].token_ids
    with pytest.raises(ValueError, match="chunk_cost_context"):
        LLM(device="cpu", enable_chunked_prefill=True, chunk_cost_context=-1)


def test_chunk_cost_context_counts_chunks_not_decodes():
    """A decode row takes 1 of the budget whatever its context; the prompt beside it gets what is left, priced."""
    llm = LLM(device="cpu", enable_chunked_prefill=True, max_num_batched_tokens=40, chunk_cost_context=1000)
    s = llm.engine.scheduler
    work = long_prompt_workload(llm.tokenizer, num_decoding=3, decode_input_len=8, decode_output_len=12,
                                num_long=1, long_input_len=150, long_output_len=3, long_start=2)
    timeline = BatchTimeline()
    run_workload(llm, work, on_step=timeline.on_step, clock="steps", use_tqdm=False)
    fed = timeline.fed["long-0"]
    assert fed[0] == 37 - 1  # 37 left after 3 decodes; 37 tokens would cost 37 (1 + 18.5/1000) > 37
    assert s.affordable(SimpleNamespace(num_computed_tokens=0), 37) == 36 and s.affordable(None, 1) == 1


def test_chunk_cost_context_auto_is_the_models_flop_ratio():
    """"auto": the context at which a token's attention FLOPs equal its products' (SmolLM2-135M: 3,072);
    without chunked prefill it is off."""
    assert LLM(device="cpu", enable_chunked_prefill=True, chunk_cost_context="auto").engine.config.chunk_cost_context == 3072
    assert LLM(device="cpu", chunk_cost_context="auto").engine.config.chunk_cost_context == 0


def test_an_oversized_recompute_still_runs_alone():
    """A preempted sequence longer than the (unchunked) budget is not starved: it runs alone."""
    llm = LLM(device="cpu", max_num_batched_tokens=32, num_blocks=6, block_size=16)
    work = [BenchRequest(0, list(range(100, 130)), 30, "x"), BenchRequest(0, list(range(200, 220)), 40, "y")]
    timeline = BatchTimeline()
    outputs, _ = run_workload(llm, work, on_step=timeline.on_step, clock="steps", use_tqdm=False)
    assert [rid for _, _, rid in timeline.preemptions] == ["y"]
    assert max(timeline.fed["y"]) > 32  # its recompute: prompt + tokens so far, over the budget, alone
    assert [len(o.token_ids) for o in outputs] == [30, 40]


def step_record(i, scheduled, running, waiting, preempted, finished):
    """A SchedulerOutput as the engine leaves it after a step, built by hand."""
    from labsupport.engine.request import Request
    from labsupport.engine.scheduler import SchedulerOutput

    def req(rid):
        return Request([1], SamplingParams(), request_id=rid)

    return SchedulerOutput(requests=[req(r) for r in scheduled], num_new_tokens=[n for n, _ in scheduled.values()],
                           is_prefill=[p for _, p in scheduled.values()], preempted=[req(r) for r in preempted],
                           running=running, waiting=waiting, finished=[req(r) for r in finished],
                           index=i, start=0.0, end=0.1)


def test_timeline_html_shows_slots_prefill_and_preemptions():
    timeline = BatchTimeline("fixture", num_slots=2)
    steps = [({"a": (5, True), "b": (7, True)}, ["a", "b"], ["c"], [], []),
             ({"a": (1, False)}, ["a", "b"], ["c"], [], []),
             ({"a": (1, False), "c": (9, True)}, ["a", "c"], ["b"], ["b"], ["a"]),
             ({"c": (1, False)}, ["c"], ["b"], [], [])]
    for i, (scheduled, running, waiting, preempted, finished) in enumerate(steps):
        timeline.record(step_record(i, scheduled, running, waiting, preempted, finished))
    assert timeline.cells[3] == (1, 1, "b", "stalled")
    assert timeline.preemptions == [(2, 1, "b")] and (2, 1, "c", "prefill") in timeline.cells
    page = timeline.render_html()
    assert len(select(page, ".batch-timeline .tl-grid .tl-prefill")) == 3
    assert len(select(page, ".batch-timeline .tl-grid .tl-stalled")) == 1
    assert len(select(page, ".batch-timeline .tl-grid .tl-preempt")) == 1
    assert "4 steps · 3 requests · mean batch 1.5 · slot use 75 % · 1 preemptions" in page
    assert timeline.plot() is not None
    wide = BatchTimeline(num_slots=64)  # a big max_num_seqs draws only the slots in use
    wide.record(step_record(0, {"a": (3, True)}, ["a"], [], [], []))
    assert wide.slots_drawn() == 1 and BatchTimeline(num_slots=3).slots_drawn() == 3


def test_bench_cli_long_prompt_workload_reports_both_groups():
    done = subprocess.run([sys.executable, "-m", "labsupport", "bench", "--workload", "long-prompts",
                           "--num-requests", "2", "--input-len", "8", "--output-len", "6", "--num-long", "1",
                           "--long-input-len", "60", "--long-start", "1", "--enable-chunked-prefill",
                           "--max-num-batched-tokens", "24", "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["short"]["requests"] == 2 and summary["long"]["requests"] == 1
    assert summary["short"]["total_output_tokens"] == 12
