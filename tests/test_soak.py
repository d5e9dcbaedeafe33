"""``bench soak``'s own logic: the fuzz's cost bound leaves invalid requests invalid, and a missed target fails
the run. (The soak itself starts three model processes and runs for minutes: ``make soak``.)"""
import math

from labsupport.bench.serving import soak
from labsupport.bench.serving.soak_probes import FUZZ_MAX_TOKENS, bound_cost


def test_bound_cost_caps_valid_sizes_and_keeps_invalid_ones():
    big = {"max_tokens": 5000, "n": 100, "prompt": ["a", "b", "c", "d"]}
    bound_cost(big)
    assert big["max_tokens"] == FUZZ_MAX_TOKENS and big["n"] <= 2 and big["prompt"] == ["a", "b"]
    bad = {"max_tokens": -3, "n": 0, "prompt": [1, 2, 3, 4]}  # refused by the server: must stay refused
    bound_cost(bad)
    assert bad == {"max_tokens": -3, "n": 0, "prompt": [1, 2, 3, 4]}
    wrong_type = {"max_tokens": "4"}
    bound_cost(wrong_type)
    assert wrong_type == {"max_tokens": "4"}
    none = {"messages": []}
    bound_cost(none)
    assert none["max_tokens"] == FUZZ_MAX_TOKENS  # no limit given: chat would run to the context's end


def test_a_missed_target_fails_the_run():
    text, ok = soak.report({"server_5xx": 0, "leaked_blocks": 0, "max_stall_s": 0.2, "time_to_error_s": 2.0})
    assert ok and text.count(" met") == 4
    text, ok = soak.report({"server_5xx": 1, "max_stall_s": 8.3, "time_to_error_s": math.inf})
    assert not ok and text.count("MISSED") == 3
