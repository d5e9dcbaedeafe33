"""Chapter 08's SLO-aware routing: ``check_choose_worker`` passes the notebook's reference and fails each planted
mistake, and ``routing.SLOAware`` plugs such a function into chapter 07's router (tokens booked and released, a
shed request answered 429 at once)."""
import httpx
import pytest

from labsupport import checks
from labsupport.pd.router_app import create_router_app
from labsupport.pd.routing import SLOAware, Shed, WorkerLoad, prompt_tokens
from labsupport.serve.background import BackgroundServer

from notebook_tools import chapter, exercise_solutions
from server_tools import stand_in_worker


@pytest.fixture(scope="module")
def reference():
    return exercise_solutions(chapter("08"))["choose_worker"]


def ttft(load, n):
    return (load.queued_tokens + n) * load.s_per_token


def best(loads, key):
    return min(loads, key=key)


# ---------------------------------------------------------------- planted mistakes

def ignores_prompt_length(n, loads, slo):
    w = best(loads, lambda w: w.queued_tokens * w.s_per_token)
    return w.url if w.queued_tokens * w.s_per_token <= slo else None


def ignores_queued_work(n, loads, slo):
    w = best(loads, lambda w: n * w.s_per_token)
    return w.url if n * w.s_per_token <= slo else None


def always_first(n, loads, slo):
    return loads[0].url


def never_sheds(n, loads, slo):
    return best(loads, lambda w: ttft(w, n)).url


def counts_requests(n, loads, slo):
    w = best(loads, lambda w: w.in_flight)
    return w.url if ttft(w, n) <= slo else None


def sheds_too_eagerly(n, loads, slo):
    w = best(loads, lambda w: ttft(w, n))
    return w.url if ttft(w, n) < slo else None   # exactly on target is within


def first_that_fits(n, loads, slo):
    return next((w.url for w in loads if ttft(w, n) <= slo), None)   # meets the target, but not the soonest


def sorts_in_place(n, loads, slo):
    loads.sort(key=lambda w: ttft(w, n))
    return loads[0].url if ttft(loads[0], n) <= slo else None


def test_reference_choose_worker_passes(reference, capsys):
    checks.check_choose_worker(reference)
    assert "✓ choose_worker" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (ignores_prompt_length, "prompt"), (ignores_queued_work, "queued"), (always_first, "another worker"),
    (never_sheds, "shed it"), (counts_requests, "queued tokens, not requests"), (sheds_too_eagerly, "within"),
    (first_that_fits, "another worker gives it"), (sorts_in_place, "changed the list")])
def test_each_planted_routing_mistake_fails_with_its_cause(wrong, says):
    with pytest.raises(checks.CheckFailed, match=says):
        checks.check_choose_worker(wrong)


# ---------------------------------------------------------------- the policy in the router

def test_slo_aware_policy_books_prompt_tokens_until_the_request_ends_and_sheds_with_none(reference):
    policy = SLOAware(reference, slo_ttft_s=1.0, s_per_token={"a": 0.002, "b": 0.004})
    body = {"prompt": list(range(300))}
    assert prompt_tokens(body) == 300 and prompt_tokens({"prompt": "x" * 40}) == 10
    assert policy.choose(["a", "b"], body) == "a"          # 0.6 s on a, 1.2 s on b
    assert policy.loads(["a"]) == [WorkerLoad("a", 300, 1, 0.002)]
    with pytest.raises(Shed):                                # a: (300 + 300) x 2 ms = 1.2 s, b: 1.2 s
        policy.choose(["a", "b"], body)
    assert policy.shed == 1 and policy.in_flight["a"] == 1   # a shed request is never counted in flight
    policy.done("a")
    assert policy.loads(["a", "b"]) == [WorkerLoad("a", 0, 0, 0.002), WorkerLoad("b", 0, 0, 0.004)]
    assert policy.choose(["a", "b"], body) == "a"


async def counts_the_prompt(body, request):
    return {"choices": [{"text": f"{len(body['prompt'])} tokens", "index": 0}]}


def test_router_serves_what_the_policy_picks_and_answers_429_when_it_sheds(reference):
    with BackgroundServer(stand_in_worker(counts_the_prompt)) as w:
        policy = SLOAware(reference, slo_ttft_s=1.0, s_per_token={w.url: 0.002})
        with BackgroundServer(create_router_app(instances=[w.url], policy=policy, health_interval=0.2)) as r:
            ok = httpx.post(r.url + "/v1/completions", json={"model": "smol", "prompt": list(range(400))}, timeout=10)
            assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "400 tokens"
            assert ok.headers["x-pd-route"] == f"instance={w.url}"
            too_long = httpx.post(r.url + "/v1/completions", json={"model": "smol", "prompt": list(range(600))},
                                  timeout=10)
            assert too_long.status_code == 429 and "TTFT target" in too_long.json()["error"]["message"]
            assert policy.shed == 1 and policy.loads([w.url])[0].queued_tokens == 0   # the served one was released


# ---------------------------------------------------------------- the measurement, on stand-ins that prefill by the clock

def prefilling_worker(s_per_token):
    """A server that prefills one prompt at a time, ``s_per_token`` seconds a token (a sleep, so the timing holds on
    a loaded machine), then streams its answer: the cost model of the exercise, made real."""
    import asyncio
    import json

    from fastapi.responses import StreamingResponse

    lock = asyncio.Lock()

    async def completions(body, request):
        n, out = len(body["prompt"]), body["max_tokens"]

        async def events():
            async with lock:
                await asyncio.sleep(n * s_per_token)
            for _ in range(out):
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x', 'finish_reason': None}]})}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': {'prompt_tokens': n, 'completion_tokens': out}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return stand_in_worker(completions)


class Vocabulary:
    vocab_size, all_special_ids, added_tokens_decoder = 1000, [], {}


def test_bursty_load_breaks_a_baseline_and_the_slo_aware_policy_keeps_more_within_target(reference, capsys):
    from labsupport.checks.slo_routing import RoutingLoad, verdict

    with BackgroundServer(prefilling_worker(0.002)) as fast, BackgroundServer(prefilling_worker(0.004)) as slow:
        result = checks.compare_routing(reference, [fast.url, slow.url], ["fast", "slow"], "smol", Vocabulary(),
                                        RoutingLoad(num_requests=30, output_len=2, load=2.0, slo_factor=2.0))
    rows = {r["policy"]: r for r in result["rows"]}
    assert result["calibration"]["lone_ttft_s"][slow.url] > result["calibration"]["lone_ttft_s"][fast.url]
    assert min(r["attainment"] for r in rows.values()) < 0.9, rows
    mine = rows["your SLO-aware"]
    assert mine["shed"] > 0 and all(r["shed"] == 0 for name, r in rows.items() if r is not mine)
    assert mine["attainment"] >= max(rows["round robin"]["attainment"], rows["least loaded"]["attainment"]), rows
    printed = capsys.readouterr().out
    assert "round robin" in printed and "least loaded" in printed and "your SLO-aware" in printed
    assert "Below 90 % attainment:" in verdict(result)


def test_a_policy_that_raises_in_the_router_fails_the_check():
    from labsupport.checks.slo_routing import RoutingLoad

    def raises(prompt_tokens, loads, slo_ttft_s):
        raise KeyError("s_per_token")

    with BackgroundServer(prefilling_worker(0.001)) as a, BackgroundServer(prefilling_worker(0.001)) as b:
        with pytest.raises(checks.CheckFailed, match="your policy broke 6 requests"):
            checks.compare_routing(raises, [a.url, b.url], ["a", "b"], "smol", Vocabulary(),
                                   RoutingLoad(num_requests=6, output_len=1))


def test_the_verdict_calls_a_difference_only_when_the_intervals_part():
    from labsupport.checks.slo_routing import verdict

    def row(policy, within, n=16, shed=0):
        return {"policy": policy, "within": within, "requests": n, "attainment": within / n, "goodput_req_s": 1.0,
                "shed": shed}
    few = {"rows": [row("round robin", 6), row("least loaded", 5), row("your SLO-aware", 3, shed=8)]}
    assert "level with round robin" in verdict(few) and "fewer" not in verdict(few)  # 3/16 against 6/16: chance
    many = {"rows": [row("round robin", 220, 1000), row("least loaded", 190, 1000), row("your SLO-aware", 400, 1000)]}
    assert verdict(many).count("more requests within the target than") == 2


def test_simulated_routing_runs_the_attendees_policy_unchanged_and_shedding_pays_under_overload(reference):
    """The router's own policies and the attendee's function on simulated engines: at 1.5x what the engines
    sustained, refusing what cannot make the target keeps more of 600 requests within it than round robin."""
    from labsupport.checks.slo_routing import AGAIN, RoutingLoad, format_routing, simulated_routing
    from labsupport.measure import share_interval, share_verdict
    calls = []

    def counted(prompt_tokens, loads, slo_ttft_s):
        calls.append(prompt_tokens)
        return reference(prompt_tokens, loads, slo_ttft_s)
    load = RoutingLoad(num_requests=600, long_len=2048, short_len=256, output_len=32, calibration_burst=64, load=1.5)
    r = simulated_routing(counted, "h100-llama-3.1-8b", load, max_num_seqs=256, max_num_batched_tokens=8192)
    rows = {row["policy"]: row for row in r["rows"]}
    assert len(calls) == 600 and r["simulated"]
    assert all(row["within"] + row["late"] + row["shed"] == 600 for row in rows.values())
    assert rows["round robin"]["shed"] == 0 and rows["your SLO-aware"]["shed"] > 0
    mine, rr, rr2 = (share_interval(rows[n]["within"], 600) for n in ("your SLO-aware", "round robin", AGAIN))
    assert mine.low > rr.high, format_routing(r, load)
    assert rows[AGAIN]["shed"] == 0 and len(calls) == 600  # the A/A row is round robin: the policy is not asked
    assert share_verdict(rr, mine, "ahead", "behind", aa=(rr, rr2)) == "ahead", format_routing(r, load)
    assert simulated_routing(reference, "h100-llama-3.1-8b", load, max_num_seqs=256,
                             max_num_batched_tokens=8192)["rows"] == r["rows"]  # the same inputs, the same run
