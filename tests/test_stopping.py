"""The stop rules (``engine/stopping.py``), without a model: one ``min_tokens`` rule for tokens, text and the
sampler, stop strings found where they straddle two deltas, and a stream holding back what may still be cut."""
import ast
from types import SimpleNamespace

import torch

from labsupport.engine.request import Request, SamplingParams
from labsupport.engine.sampler import Sampler
from labsupport.engine.stopping import find_stop_string, may_stop, streamable, token_stop_reason
from test_structure import MODULES, ROOT

EOS = {2}


def _req(output, **params):
    return SimpleNamespace(params=SamplingParams(**params), output_token_ids=list(output),
                           num_tokens=3 + len(output))


def test_a_token_stops_a_request_only_after_min_tokens():
    assert token_stop_reason(_req([5, 2], min_tokens=2), 2, EOS, 100) is None  # the 2nd token: min_tokens before
    assert token_stop_reason(_req([5, 5, 2], min_tokens=2), 2, EOS, 100) == "stop"
    assert token_stop_reason(_req([7], min_tokens=0, stop_token_ids=[7]), 7, EOS, 100) == "stop"
    assert token_stop_reason(_req([2], ignore_eos=True, max_tokens=4), 2, EOS, 100) is None


def test_length_ends_a_request_at_max_tokens_or_the_longest_allowed():
    assert token_stop_reason(_req([5, 5], max_tokens=2), 5, EOS, 100) == "length"
    assert token_stop_reason(_req([5, 5], max_tokens=9), 5, EOS, 5) == "length"  # 3 prompt + 2 output tokens
    assert token_stop_reason(_req([5, 5], max_tokens=9), 5, EOS, 6) is None


def test_the_sampler_holds_back_exactly_the_tokens_that_could_not_stop():
    """The token the sampler draws is output token n + 1; it may be EOS iff ``may_stop(n + 1, min_tokens)``."""
    logits = torch.zeros(1, 10)
    logits[0, 2] = 5.0  # EOS is the argmax
    for done in range(4):
        req = Request([1], SamplingParams(temperature=0, min_tokens=2), eos_token_ids=EOS)
        req.output_token_ids = [5] * done
        drawn = Sampler().sample(logits, [req]).token_ids[0]
        assert (drawn == 2) == may_stop(done + 1, 2)


def test_a_stop_string_is_found_where_it_straddles_two_deltas():
    assert find_stop_string("Hello wor", 6, ["world"]) is None
    assert find_stop_string("Hello world", 9, ["world"]) == 6  # "wor" came before, "ld" now
    assert find_stop_string("a STOP b END", 0, ["END", "STOP"]) == 2  # the first one in the text
    assert find_stop_string("STOP and more", 10, ["STOP"]) is None  # ended before this delta could reach it
    assert find_stop_string("anything", 0, []) is None


def test_a_stream_holds_back_what_a_stop_string_may_still_cut():
    assert streamable("Hello wo", ["world"], finished=False) == "Hell"
    assert streamable("Hello wo", ["world"], finished=True) == "Hello wo"
    assert streamable("Hello", [], finished=False) == "Hello"


def test_min_tokens_is_compared_in_one_file():
    """The rule ``n > min_tokens`` lives in ``stopping.may_stop``; a second comparison elsewhere would be a
    second rule that could disagree (``SamplingParams`` checks the value's range, which is not a stop rule)."""
    places = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in MODULES.values()
              for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.Compare) and any(isinstance(a, ast.Attribute) and a.attr == "min_tokens"
                                                       for a in ast.walk(node))]
    assert all(p.startswith("engine/request.py") for p in places), places
