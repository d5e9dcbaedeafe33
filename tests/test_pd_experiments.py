"""Chapter 07's measurement helpers on made-up runs and timelines (no model, no processes): one budget
split two ways, SLO cells and the crossover verdict, and 1P+1D's TTFT taken apart from the workers'
``/pd/timeline`` records."""
import pytest

from labsupport.bench.serving.serve_bench import BenchResult, RequestResult
from labsupport.experiments import disaggregation as pdx


def flag(args, name):
    return int(args[args.index(name) + 1])


@pytest.mark.parametrize("blocks,seqs", [(211, 16), (100, 7), (2, 2)])
def test_split_budget_gives_the_pd_workers_together_exactly_the_colocated_budget(blocks, seqs):
    colo, pre, dec = pdx.split_budget(blocks, seqs)
    for name, total in (("--num-blocks", blocks), ("--max-num-seqs", seqs)):
        assert flag(colo, name) == total
        assert flag(pre, name) + flag(dec, name) == total
        assert flag(dec, name) >= flag(pre, name) >= 1  # the odd one to the decode worker


def test_split_budget_refuses_a_budget_too_small_to_split():
    with pytest.raises(ValueError):
        pdx.split_budget(1, 8)


def request(prompt_len, start, ttft, tpot_ms=20, out=5, ok=True):
    latency = ttft + (out - 1) * tpot_ms / 1000
    return RequestResult(prompt_len, out, success=ok, start_time=start, ttft=ttft, latency=latency, output_tokens=out)


def result(requests, duration=10.0):
    return BenchResult({}, {"duration": duration}, requests)


def test_slo_cell_judges_only_short_prompts_and_counts_goodput_per_second():
    run = result([request(64, 0, 0.1), request(64, 1, 0.5), request(64, 2, 0.1, tpot_ms=90),
                  request(64, 3, 0.1, ok=False), request(512, 4, 3.0)], duration=4.0)
    cell = pdx.slo_cell(run, {"ttft": 200, "tpot": 50}, max_prompt_len=256)
    assert (cell["good"], cell["judged"]) == (1, 4)
    assert cell["attainment"] == pytest.approx(0.25) and cell["goodput"] == pytest.approx(0.25)


def test_slo_grid_judges_a_measured_cell_without_running_it_and_runs_the_others(monkeypatch):
    ran = []
    fresh = result([request(64, 0, 3.0)], duration=2.0)                 # misses the TTFT SLO
    monkeypatch.setattr(pdx, "run", lambda d, requests, rate, seed=0: ran.append((d.name, rate)) or fresh)
    deps = [pdx.Deployment(name, [], None) for name in ("colocated", "1P+1D")]
    earlier = {"colocated": result([request(64, 0, 0.1)], duration=1.0),
               "1P+1D": result([request(64, 0, 0.1), request(64, 1, 0.1)], duration=1.0)}
    grid = pdx.slo_grid(deps, {(512, 1.5): ["section 5's requests"], (512, 3.0): ["new ones"]},
                        {"ttft": 200, "tpot": 50}, measured={(512, 1.5): earlier})
    assert ran == [("colocated", 3.0), ("1P+1D", 3.0)]                  # only the cell not measured before
    assert grid[(512, 1.5)]["1P+1D"]["good"] == 2 and grid[(512, 1.5)]["colocated"]["good"] == 1
    assert grid[(512, 3.0)]["colocated"]["good"] == 0


def test_busy_during_counts_only_the_overlap_of_steps():
    steps = [{"start": 0.0, "end": 1.0}, {"start": 2.0, "end": 3.0}, {"start": 5.0, "end": 6.0}]
    assert pdx.busy_during(steps, 0.5, 2.5) == pytest.approx(1.0)
    assert pdx.busy_during(steps, 3.5, 4.5) == 0.0


def timelines():
    """Two requests through 1P+1D, wall clock from 100 s: the short one's prompt waits behind the long one."""
    pre = {"role": "kv_producer", "engine_id": "e1", "transfers": [],
           "steps": [{"start": 100.1, "end": 100.9, "prefill": {"7": 500}, "decode": []},
                     {"start": 100.9, "end": 101.0, "prefill": {"8": 60}, "decode": []}]}
    dec = {"role": "kv_consumer", "engine_id": "e2",
           "steps": [{"start": 100.95, "end": 101.0, "prefill": {}, "decode": ["x"]},
                     {"start": 101.1, "end": 101.12, "prefill": {"a": 1}, "decode": []}],
           "transfers": [{"transfer_id": "e1-7", "role": "recv", "start": 100.93, "end": 101.03, "num_bytes": 10,
                          "num_blocks": 1, "ok": True},
                         {"transfer_id": "e1-8", "role": "recv", "start": 101.05, "end": 101.07, "num_bytes": 2,
                          "num_blocks": 1, "ok": True}]}
    return {"prefill": pre, "decode": dec}


def test_ttft_parts_add_up_to_the_clients_ttft_and_match_requests_by_arrival_and_length():
    # client perf_counter 0 = wall clock 100; the long request was sent first, the short one 0.05 s later
    run = result([request(60, 0.05, 1.10), request(500, 0.0, 1.15)])
    rows = pdx.ttft_parts(run, timelines(), clock_offset=100.0)
    long_, short = rows
    assert long_["prompt_tokens"] == 500 and short["prompt_tokens"] == 60
    assert long_["queue"] == pytest.approx(100) and long_["prefill"] == pytest.approx(800)
    assert long_["hand_off"] == pytest.approx(30) and long_["transfer"] == pytest.approx(100)
    assert short["queue"] == pytest.approx(850)  # behind the long prompt on the prefill worker's one core
    for r in rows:
        parts = r["queue"] + r["prefill"] + r["hand_off"] + r["transfer"] + r["first_token"]
        assert parts == pytest.approx(r["ttft"])
    assert long_["decode_busy"] == pytest.approx(0.5)  # 100.95-101.0 of the pull 100.93-101.03
    assert long_["prefill_busy"] == pytest.approx(0.7)  # prefill steps until 101.0
    assert long_["pull_ok"] and short["pull_ok"]


def test_ttft_parts_keeps_a_request_whose_pull_failed_and_says_so():
    tl = timelines()
    tl["decode"]["transfers"][1]["ok"] = False  # the short one's lease ran out: the decode worker recomputed
    rows = pdx.ttft_parts(result([request(60, 0.05, 1.10), request(500, 0.0, 1.15)]), tl, clock_offset=100.0)
    assert [r["pull_ok"] for r in rows] == [True, False]


def test_ttft_parts_refuses_timelines_that_do_not_hold_the_run():
    with pytest.raises(ValueError, match="pulls"):
        pdx.ttft_parts(result([request(60, 0.0, 1.0)] * 3), timelines(), clock_offset=100.0)


@pytest.mark.parametrize("blocks,seqs,parts", [(225, 16, 3), (10, 3, 3), (7, 7, 1)])
def test_share_budget_cuts_the_whole_budget_and_gives_larger_shares_last(blocks, seqs, parts):
    shares = pdx.share_budget(blocks, seqs, parts)
    for name, total in (("--num-blocks", blocks), ("--max-num-seqs", seqs)):
        got = [flag(s, name) for s in shares]
        assert sum(got) == total and got == sorted(got) and got[-1] - got[0] <= 1


def test_xpyd_puts_each_worker_on_its_cpus_behind_one_router_on_one_budget():
    d = pdx.xpyd(["0", "1"], ["1"], num_blocks=225, max_num_seqs=16)
    workers, router = d.processes[:-1], d.processes[-1]
    assert d.name == "2P1D" and d.entry is router
    assert [(w.role, w.cpus) for w in workers] == [("prefill", "0"), ("prefill", "1"), ("decode", "1")]
    assert router.prefill == workers[:2] and router.decode == workers[2:]
    # the last --num-blocks / --max-num-seqs on a command line wins: they must add up to the budget
    def last(w, name):
        return int(w.args[len(w.args) - 1 - w.args[::-1].index(name) + 1])
    assert sum(last(w, "--num-blocks") for w in workers) == 225
    assert sum(last(w, "--max-num-seqs") for w in workers) == 16
    assert set(d.engines) == {"prefill 1", "prefill 2", "decode 1"}


def test_two_layouts_share_two_workers_and_each_layout_adds_up_to_the_budget():
    two_p, two_d = pdx.two_layouts("0", "1", num_blocks=225, max_num_seqs=16)
    assert (two_p.name, two_d.name) == ("2P1D", "1P2D")
    def last(w, name):
        return int(w.args[len(w.args) - 1 - w.args[::-1].index(name) + 1])
    for d in (two_p, two_d):
        workers = d.processes[:-1]
        assert sum(last(w, "--num-blocks") for w in workers) == 225
        assert sum(last(w, "--max-num-seqs") for w in workers) == 16
        assert d.processes[-1].prefill == [w for w in workers if w.role == "prefill"]
    assert [(w.role, w.cpus) for w in two_p.processes[:-1]] == [("prefill", "0"), ("prefill", "1"), ("decode", "1")]
    assert [(w.role, w.cpus) for w in two_d.processes[:-1]] == [("prefill", "0"), ("decode", "1"), ("decode", "0")]
    shared = [w for w in two_p.processes if any(w is v for v in two_d.processes)]
    assert [w.name for w in shared] == ["prefill 1", "decode 1"]
    everyone = pdx._each_once(p for d in (two_p, two_d) for p in d.processes)
    assert len(everyone) == 6            # four workers and two routers, each started and stopped once


def test_split_calls_a_tail_of_fewer_than_a_hundred_samples_the_max():
    def short(start, tpot_ms, gaps):
        r = request(64, start, 0.1, tpot_ms=tpot_ms)
        r.itl = [tpot_ms / 1000] * gaps
        return r
    def run(requests):
        return BenchResult({}, {"duration": 10.0, "output_throughput": 1.0, "failed": 0}, requests)
    few = pdx.split(run([short(0, 20, 4), short(1, 90, 4), request(512, 2, 3.0)]), long_from=256)
    assert few["short_tpot_tail"] == "max" and few["short_tail_tpot_ms"] == pytest.approx(90)
    assert few["short_itl_tail"] == "max" and few["short_tail_itl_ms"] == pytest.approx(90)
    many = pdx.split(run([short(k, 20 + k, 1) for k in range(120)]), long_from=256)
    assert many["short_tpot_tail"] == "P99" and many["short_tail_tpot_ms"] < 20 + 119


class FakeProcess:
    """Stands in for a worker or router process in ``pdx.start``: records when it was started, waited for
    and stopped in one shared log (no process runs)."""

    def __init__(self, name, log, fails=False):
        self.name, self.log, self.fails, self.proc = name, log, fails, None

    @property
    def alive(self):
        return self.proc is not None

    def start(self, wait=True, timeout=0):
        if self.proc is None:
            self.log.append(("start", self.name))
            self.proc = self
        return self

    def wait_healthy(self, timeout=0):
        self.log.append(("wait", self.name))
        if self.fails:
            raise RuntimeError(f"{self.name} exited")

    def send_signal(self, sig):
        self.log.append(("stop", self.name))
        self.proc = None

    def wait(self, timeout=None):
        return 0


class FakeRouter(FakeProcess, pdx.Router):
    pass


def deployment(log, fails=False):
    workers = [FakeProcess("prefill", log), FakeProcess("decode", log, fails)]
    router = FakeRouter.__new__(FakeRouter)
    FakeProcess.__init__(router, "router", log)
    return pdx.Deployment("1P+1D", [*workers, router], router)


def test_start_launches_the_routers_with_their_workers_not_after_them():
    log = []
    pdx.start([deployment(log)])
    starts = [i for i, (what, _) in enumerate(log) if what == "start"]
    first_wait = min(i for i, (what, _) in enumerate(log) if what == "wait")
    assert {log[i][1] for i in starts} == {"prefill", "decode", "router"} and max(starts) < first_wait
    assert [n for what, n in log if what == "wait"][-1] == "router"  # healthy last: it answers once its workers do


def test_a_worker_that_fails_to_start_takes_its_router_down_too():
    log = []
    with pytest.raises(RuntimeError, match="decode exited"):
        pdx.start([deployment(log, fails=True)])
    assert {n for what, n in log if what == "stop"} == {"prefill", "decode", "router"}


def test_prefill_stalls_counts_the_steps_where_decoders_rode_with_a_long_prompt():
    step = lambda t, prefill, decode: {"start": t, "end": t + 0.1, "prefill": prefill, "decode": decode}  # noqa: E731
    whole = {"w": {"steps": [step(0, {"s1": 60}, []), step(1, {}, ["s1"]), step(2, {"L": 512}, ["s1", "s2"]),
                             step(3, {"s2": 60}, ["s1"])]}}
    chunked = {"w": {"steps": [step(0, {"L": 256}, ["s1"]), step(1, {"L": 256}, ["s1", "s2"]), step(2, {}, ["s1"])]}}
    a, b = pdx.prefill_stalls(whole, long_from=256), pdx.prefill_stalls(chunked, long_from=256)
    assert (a["stalled_steps"], a["decode_rows"], a["max_prompt_tokens"]) == (1, 2, 512)
    assert (b["stalled_steps"], b["decode_rows"], b["max_prompt_tokens"]) == (2, 3, 256)
    assert a["longest_ms"] == pytest.approx(100.0)
    assert pdx.prefill_stalls({"dead": {"error": "refused"}}, 256)["stalled_steps"] == 0
