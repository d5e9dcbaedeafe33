"""Checks for the attendee's exercises. Each check runs the attendee's code against the real
engine and raises ``CheckFailed`` with a message saying what differs and where to look.

The tests prove every check passes the reference solution (taken from the chapter notebook
itself) and fails planted wrong implementations, so a check can never be a rubber stamp.
"""
from __future__ import annotations

from .engine.request import SamplingParams
from .engine.runner import sequence_logits


class CheckFailed(AssertionError):
    """An exercise result is wrong. The message says what to fix."""


def passed(message: str):
    print(f"\u2713 {message}")


def first_difference(got: list, want: list) -> str:
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"position {i}: got {a!r}, expected {b!r}"
    return f"lengths differ: got {len(got)} items, expected {len(want)}"


CHECK_PROMPTS = ["The capital of France is", "def add(a, b):", "My favourite colour is"]


def check_greedy_generate(greedy_generate, llm, max_new_tokens: int = 12):
    """Chapter 00: ``greedy_generate(logits_of, prompt_ids, max_new_tokens, eos_id) -> new ids``.

    Compared token for token with the engine's greedy decoding (which equals transformers'),
    including stopping right after EOS.
    """
    model, tok = llm.engine.model, llm.tokenizer
    eos_id = tok.eos_token_id
    cases = [(tok(p).input_ids, max_new_tokens) for p in CHECK_PROMPTS]
    # a chat prompt whose short answer ends with EOS inside the budget: stopping is checked too
    chat = llm.tokenize([{"role": "user", "content": "Say hi."}])[0]
    cases.append((chat, 40))
    for ids, budget in cases:
        want = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=budget, temperature=0),
                            use_tqdm=False)[0].token_ids
        calls = []

        def logits_of(seq):
            calls.append(list(seq))
            return sequence_logits(model, list(seq))

        got = greedy_generate(logits_of, list(ids), budget, eos_id)
        if not isinstance(got, list) or not all(isinstance(t, int) for t in got):
            raise CheckFailed(f"greedy_generate must return a list of int token ids, got {type(got).__name__} "
                              f"{str(got)[:80]} (hint: int(tensor.argmax()))")
        if got[:len(ids)] == ids and len(got) > len(want):
            raise CheckFailed("return only the new tokens, not the prompt followed by them")
        if got != want:
            prompt = tok.decode(ids)[-60:]
            raise CheckFailed(f"for prompt ...{prompt!r} your tokens differ from the reference at "
                              f"{first_difference(got, want)}.\n  yours:    {tok.decode(got)!r}\n"
                              f"  expected: {tok.decode(want)!r}\n(hint: take the argmax at the *last* "
                              "position, append it to the sequence, stop after EOS or max_new_tokens)")
        if calls and calls[0] != ids:
            raise CheckFailed("the first call to logits_of must see the whole prompt")
    passed(f"greedy_generate equals the engine's greedy tokens on {len(cases)} prompts, EOS included")
