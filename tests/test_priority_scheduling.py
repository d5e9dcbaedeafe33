"""``scheduling_policy="priority"``, vLLM's: the queue by (priority, arrival), the least urgent preempted first,
first come first served untouched, and a priority refused where the policy would ignore it.

The bookkeeping is checked without a model first (the fake runner of ``test_engine_core.py`` over random
workloads with random priorities), then on the real engine, whose step records say who ran when.
"""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine_core import check_invariants, make_engine, reference_output

from labsupport import LLM, SamplingParams
from labsupport.engine.request import Request
from labsupport.engine.request_queue import PriorityQueue, priority_order, waiting_queue
from labsupport.experiments.online_offline import mixed_jobs, online_offline, report

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def fake(rid, priority, arrival):
    return SimpleNamespace(request_id=rid, priority=priority, metrics=SimpleNamespace(arrival_time=arrival))


def ids(queue):
    return [r.request_id for r in queue]


# ---------------------------------------------------------------------------------------------- the queue alone

def test_the_queue_serves_the_smallest_priority_first_and_equals_in_arrival_order():
    q = PriorityQueue()
    for rid, priority, arrival in [("batch-a", 1, 0.0), ("batch-b", 1, 1.0), ("chat-a", 0, 2.0), ("vip", -5, 3.0),
                                   ("chat-b", 0, 4.0)]:
        q.append(fake(rid, priority, arrival))
    assert ids(q) == ["vip", "chat-a", "chat-b", "batch-a", "batch-b"] and q[0].request_id == "vip" and len(q) == 5
    q.remove(q[0])
    assert ids(q) == ["chat-a", "chat-b", "batch-a", "batch-b"]
    same_time = [fake(f"t{i}", 0, 7.0) for i in range(3)]  # equal keys: the order they came in, as a deque would
    for r in same_time:
        q.append(r)
    assert ids(q)[2:5] == ["t0", "t1", "t2"]


def test_a_preempted_request_goes_back_to_its_place_not_to_the_front():
    """vLLM's ``PriorityRequestQueue.prepend_request``: no front in a priority queue. The deque's ``appendleft``
    (FCFS: it arrived before everyone waiting) keeps its meaning there."""
    early_batch, chat = fake("early-batch", 1, 0.0), fake("chat", 0, 5.0)
    q = PriorityQueue([chat])
    q.appendleft(early_batch)
    assert ids(q) == ["chat", "early-batch"]
    fcfs = waiting_queue("continuous", [chat])
    fcfs.appendleft(early_batch)
    assert isinstance(fcfs, deque) and ids(fcfs) == ["early-batch", "chat"]


def test_the_queue_follows_a_policy_changed_on_a_live_engine():
    s, _, _ = make_engine({"num_blocks": 16, "block_size": 4, "max_num_seqs": 1})
    reqs = [Request([1, 2, 3], GREEDY, f"r{i}", priority=p) for i, p in enumerate([2, 0, 1])]
    for r in reqs:
        s.add_request(r)
    assert isinstance(s.waiting, deque) and ids(s.waiting) == ["r0", "r1", "r2"]
    s.config.scheduling_policy = "priority"
    out = s.schedule()
    assert [r.request_id for r in out.requests] == ["r1"] and out.waiting == ["r2", "r0"]
    s.config.scheduling_policy = "continuous"
    s.schedule()
    assert isinstance(s.waiting, deque) and ids(s.waiting) == ["r2", "r0"]  # kept as it stood
    with pytest.raises(ValueError, match="scheduling_policy"):
        waiting_queue("fcfs")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(options=st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 2, 4]),
    "num_blocks": st.integers(8, 30),
    "max_num_seqs": st.integers(1, 5),
    "max_num_batched_tokens": st.integers(8, 48),
    "enable_chunked_prefill": st.booleans(),
    "enable_prefix_caching": st.booleans(),
    "scheduling_policy": st.just("priority"),
}), specs=st.lists(st.tuples(st.integers(0, 10), st.integers(-2, 2), st.integers(1, 16), st.integers(1, 12)),
                   min_size=1, max_size=10))
def test_random_workloads_with_priorities_keep_every_invariant_and_the_reference_tokens(options, specs):
    """Arrival step, priority, prompt and output lengths at random, memory short: after every step the queue is in
    (priority, arrival) order, every request preempted is at least as unimportant as every one still running,
    and in the end nobody starved, no block leaked, and the tokens are those of the request run alone."""
    s, kv, runner = make_engine(options)
    cfg, pending, requests = s.config, sorted(enumerate(specs), key=lambda x: x[1][0]), []
    for step in range(3000):
        while pending and pending[0][1][0] <= step:
            i, (_, priority, own, max_tokens) = pending.pop(0)
            prompt = [1 + (i * 7 + j) % 60 for j in range(own)]
            if (len(prompt) + 1 > cfg.num_blocks * cfg.block_size
                    or (not cfg.enable_chunked_prefill and len(prompt) > cfg.max_num_batched_tokens)):
                continue  # the engine's prompt check would refuse it
            req = Request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                          f"r{i}", priority=priority)
            requests.append(req)
            s.add_request(req)
        if not s.has_unfinished() and not pending:
            break
        out = s.schedule()
        keys = [priority_order(r) for r in s.waiting]
        assert keys == sorted(keys), "the queue is out of (priority, arrival) order"
        for victim in out.preempted:
            if victim not in s.running:  # not re-admitted within the step
                assert all(priority_order(r) <= priority_order(victim) for r in s.running), victim
        s.lifecycle.update_from_output(out, runner.execute(out))
        check_invariants(s, kv, runner, requests)
    else:
        raise AssertionError("not finished after 3000 steps")
    assert kv.allocator.num_free == kv.num_blocks and not kv.tables, "blocks leaked"
    for req in requests:
        assert req.is_finished and req.output_token_ids == reference_output(req.prompt_token_ids, req.params,
                                                                             s.lifecycle.longest)


# ---------------------------------------------------------------------------------------------- the real engine

def first_scheduled(engine, requests) -> list[str]:
    """Step the engine to the end; the request ids in the order they first ran."""
    order = []
    while engine.has_unfinished_requests():
        engine.step()
        order += [r.request_id for r in engine.last_step.requests if r.request_id not in order]
    assert all(r.is_finished for r in requests)
    return order


def test_an_urgent_request_overtakes_the_queue_and_equals_keep_arrival_order():
    llm = LLM(device="cpu", max_num_seqs=1, scheduling_policy="priority")
    e = llm.engine
    added = [e.add_request(list(range(100 + 10 * i, 108 + 10 * i)), GREEDY, rid, priority=p)
             for i, (rid, p) in enumerate([("batch-0", 1), ("batch-1", 1), ("batch-2", 1), ("chat-1", 0),
                                           ("chat-2", 0), ("vip", -1)])]
    assert first_scheduled(e, added) == ["vip", "chat-1", "chat-2", "batch-0", "batch-1", "batch-2"]
    # vLLM's LLM.generate(..., priority=[...]): one per prompt, outputs in prompt order whatever ran first
    prompts = [{"prompt_token_ids": list(range(200, 210))}, {"prompt_token_ids": list(range(300, 306))}]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, priority=[1, 0])
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]
    assert outs[1].metrics.first_token_time < outs[0].metrics.first_token_time
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(prompts, GREEDY, use_tqdm=False, priority=[1])
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, priority=2)] == [o.token_ids for o in outs]


def preemption_run(policy: str):
    """A long low-priority job that arrived first, then two urgent ones, in a pool too small for all three."""
    llm = LLM(device="cpu", num_blocks=10, block_size=16, scheduling_policy=policy)
    e, urgent = llm.engine, 0 if policy != "priority" else -1
    long_job = e.add_request(list(range(100, 130)), SamplingParams(max_tokens=90, temperature=0, ignore_eos=True),
                             "batch", priority=0)
    e.step()
    chats = [e.add_request(list(range(200 + 40 * i, 230 + 40 * i)), SamplingParams(max_tokens=40, temperature=0,
                                                                                  ignore_eos=True),
                           f"chat-{i}", priority=urgent) for i in range(2)]
    victims = []
    while e.has_unfinished_requests():
        e.step()
        victims += [r.request_id for r in e.last_step.preempted]
    return victims, {r.request_id: r.output_token_ids for r in [long_job, *chats]}


def test_memory_short_the_least_urgent_running_request_is_preempted_not_the_newest():
    fcfs_victims, fcfs_tokens = preemption_run("continuous")
    victims, tokens = preemption_run("priority")
    assert fcfs_victims and "batch" not in fcfs_victims  # first come first served: the newest goes, never the oldest
    assert victims and set(victims) == {"batch"}  # by priority: the batch job goes, although it came first
    assert tokens == fcfs_tokens  # recomputed, not changed


def test_a_priority_is_refused_where_the_policy_would_ignore_it():
    for policy in ("continuous", "static"):
        e = LLM(device="cpu", scheduling_policy=policy).engine
        with pytest.raises(ValueError, match=r"^Got priority 3 but Priority scheduling is not enabled\. .*"
                                             r"--scheduling-policy priority"):
            e.add_request([1, 2, 3], GREEDY, priority=3)
        assert not e.has_unfinished_requests()  # nothing queued
        e.add_request([1, 2, 3], GREEDY, priority=0)  # 0 is every request's priority there
    e = LLM(device="cpu", scheduling_policy="priority").engine
    for bad in (True, 1.5, "1", 1 << 63):
        with pytest.raises(ValueError, match="priority must be an integer"):
            e.add_request([1, 2, 3], GREEDY, priority=bad)
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        LLM(device="cpu", scheduling_policy="lifo")


def test_vllms_fcfs_is_first_come_first_served_and_refuses_a_priority_the_same_way():
    """``scheduling_policy="fcfs"`` (vLLM's name) is ``"continuous"``: in the config, after a change on a live
    engine, and in what it refuses; ``serve --scheduling-policy fcfs`` parses to it."""
    e = LLM(device="cpu", scheduling_policy="fcfs").engine
    assert e.config.scheduling_policy == "continuous" and isinstance(e.scheduler.queues.waiting, deque)
    with pytest.raises(ValueError, match="Priority scheduling is not enabled"):
        e.add_request([1, 2, 3], GREEDY, priority=3)
    e.set_options(scheduling_policy="priority")
    old = e.set_options(scheduling_policy="fcfs")
    assert old == {"scheduling_policy": "priority"} and e.config.scheduling_policy == "continuous"
    from labsupport.__main__ import build_parser
    from labsupport.engine.config import EngineConfig
    from labsupport.serve.server import engine_options
    chosen = engine_options(build_parser().parse_args(["serve", "--scheduling-policy", "fcfs"]))["scheduling_policy"]
    assert EngineConfig(scheduling_policy=chosen).scheduling_policy == "continuous"


def test_priority_lowers_interactive_ttft_in_steps_and_changes_no_token():
    """Chapter 05's experiment, small: walk-ins arriving while a batch of jobs fills the slots. Counted in engine
    steps (deterministic), priority serves every walk-in sooner than first come first served does."""
    llm = LLM(device="cpu")
    jobs = mixed_jobs(num_interactive=4, interactive_prompt=8, interactive_tokens=4, mean_gap_steps=4, first_arrival=2,
                      num_batch=8, batch_prompt=32, batch_tokens=(4, 10), seed=0)
    results = online_offline(llm.engine, jobs, max_num_seqs=2)
    alone, fcfs, prio = results.values()
    assert alone["ttft_steps"] == [1] * 4  # an idle engine: the first token in the prompt's own step
    assert max(prio["ttft_steps"]) < min(fcfs["ttft_steps"])
    assert prio["batch_tokens"] == fcfs["batch_tokens"] == sum(j.max_tokens for j in jobs if not j.interactive)
    assert prio["tokens"] == fcfs["tokens"]
    assert llm.engine.config.scheduling_policy == "continuous" and llm.engine.config.max_num_seqs == 64  # restored
    lines = report(results).splitlines()
    assert len(lines) == 3 and "batch:" not in lines[0] and all("batch:" in line for line in lines[1:])
