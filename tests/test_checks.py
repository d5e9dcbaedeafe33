"""Every exercise check passes the notebook's reference solution and fails planted wrong ones."""
import pytest
import torch

from labsupport import checks

from notebook_tools import chapter, exercise_solutions


@pytest.fixture(scope="module")
def reference_greedy():
    return exercise_solutions(chapter("00"))["greedy_generate"]


def test_reference_greedy_generate_passes(reference_greedy, llm):
    checks.check_greedy_generate(reference_greedy, llm)


def argmax_of_first_row(logits_of, prompt_ids, max_new_tokens, eos_id):
    ids, out = list(prompt_ids), []
    for _ in range(max_new_tokens):
        t = int(logits_of(ids)[0].argmax())
        ids.append(t); out.append(t)
        if t == eos_id:
            break
    return out


def never_stops_at_eos(logits_of, prompt_ids, max_new_tokens, eos_id):
    ids, out = list(prompt_ids), []
    for _ in range(max_new_tokens):
        t = int(logits_of(ids)[-1].argmax())
        ids.append(t); out.append(t)
    return out


def drops_the_eos_token(logits_of, prompt_ids, max_new_tokens, eos_id):
    ids, out = list(prompt_ids), []
    for _ in range(max_new_tokens):
        t = int(logits_of(ids)[-1].argmax())
        if t == eos_id:
            break
        ids.append(t); out.append(t)
    return out


def forgets_to_append(logits_of, prompt_ids, max_new_tokens, eos_id):
    out = []
    for _ in range(max_new_tokens):
        t = int(logits_of(list(prompt_ids))[-1].argmax())
        out.append(t)
        if t == eos_id:
            break
    return out


def returns_prompt_too(logits_of, prompt_ids, max_new_tokens, eos_id):
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        t = int(logits_of(ids)[-1].argmax())
        ids.append(t)
        if t == eos_id:
            break
    return ids


def one_token_short(logits_of, prompt_ids, max_new_tokens, eos_id):
    return never_stops_at_eos(logits_of, prompt_ids, max_new_tokens - 1, eos_id)


def samples_instead_of_argmax(logits_of, prompt_ids, max_new_tokens, eos_id):
    g = torch.Generator().manual_seed(0)
    ids, out = list(prompt_ids), []
    for _ in range(max_new_tokens):
        t = int(torch.multinomial(torch.softmax(logits_of(ids)[-1], -1), 1, generator=g))
        ids.append(t); out.append(t)
        if t == eos_id:
            break
    return out


def returns_tensors(logits_of, prompt_ids, max_new_tokens, eos_id):
    ids, out = list(prompt_ids), []
    for _ in range(max_new_tokens):
        t = logits_of(ids)[-1].argmax()
        ids.append(int(t)); out.append(t)
        if int(t) == eos_id:
            break
    return out


@pytest.mark.parametrize("wrong", [argmax_of_first_row, never_stops_at_eos, drops_the_eos_token, forgets_to_append,
                                   returns_prompt_too, one_token_short, samples_instead_of_argmax, returns_tensors])
def test_planted_wrong_greedy_generate_fails(wrong, llm):
    with pytest.raises(checks.CheckFailed):
        checks.check_greedy_generate(wrong, llm)
