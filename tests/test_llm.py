"""The public API: vLLM-shaped ``LLM.generate``, its prompt forms, sampling, stops and errors."""
import subprocess
import sys

import pytest

from labsupport import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0)


def test_prompt_forms_give_the_same_tokens(llm):
    ids = llm.tokenizer("The capital of France is").input_ids
    outs = llm.generate(["The capital of France is", {"prompt": "The capital of France is"},
                         {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    assert outs[0].prompt_token_ids == ids


def test_chat_messages_get_the_chat_template(llm):
    messages = [{"role": "user", "content": "Hello"}]
    out = llm.generate(messages, GREEDY, use_tqdm=False)[0]
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.prompt_token_ids == llm.tokenizer(text, add_special_tokens=False).input_ids
    assert llm.chat(messages, GREEDY, use_tqdm=False)[0].token_ids == out.token_ids


def test_outputs_keep_prompt_order_and_per_prompt_params(llm):
    prompts = ["Water boils at", "The quick brown fox", "1, 2, 3,"]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 7, 5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [3, 7, 5]
    assert [o.prompt for o in outs] == prompts
    assert all(o.finish_reason == "length" for o in outs)
    assert outs[0].outputs[0].text == outs[0].text  # vLLM's out.outputs[0].text works


def test_generate_from_a_second_thread_is_a_clear_error_and_the_first_call_is_untouched(llm):
    """Two threads in ``generate`` at once used to share the engine's steps: one raised ``KeyError``, the
    other got ``finish_reason="error"``. Now the second is refused at once, naming the async engine."""
    import threading
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    alone = llm.generate(["The quick brown fox"] * 4, params, use_tqdm=False)
    first, second, started = {}, {}, threading.Event()

    def run(into):
        try:
            started.set()
            into["outs"] = llm.generate(["The quick brown fox"] * 4, params, use_tqdm=False)
        except Exception as exc:  # noqa: BLE001 (the test reads it)
            into["error"] = exc

    t = threading.Thread(target=run, args=(first,))
    t.start()
    started.wait()
    while not llm.stats()["num_requests_running"] and t.is_alive():  # the first call is stepping
        pass
    run(second)
    t.join(120)
    assert "error" not in first and [o.token_ids for o in first["outs"]] == [o.token_ids for o in alone]
    assert all(o.finish_reason == "length" for o in first["outs"])
    assert isinstance(second.get("error"), RuntimeError) and "AsyncEngine" in str(second["error"])
    assert llm.generate("Water boils at", GREEDY, use_tqdm=False)[0].finish_reason  # the LLM serves on


def test_fixed_seed_sampling_is_reproducible_whatever_the_batch(llm):
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate("Tell me a story", sp, use_tqdm=False)[0].token_ids
    batched = llm.generate(["Water boils at", "Tell me a story"],
                           [SamplingParams(max_tokens=5, temperature=1.0), sp], use_tqdm=False)[1].token_ids
    assert alone == batched
    other = llm.generate("Tell me a story", SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=99,
                                                            ignore_eos=True), use_tqdm=False)[0].token_ids
    assert other != alone


def test_stop_string_ends_and_trims_the_text(llm):
    free = llm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0]
    assert " 7" in free.text
    out = llm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=12, temperature=0, stop=[" 7"]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and " 7" not in out.text and out.text == free.text[:free.text.find(" 7")]


def test_timings_are_recorded(llm):
    out = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert 0 < out.ttft <= out.metrics.latency and out.tpot > 0 and len(out.metrics.itl) == 3
    assert 0 <= out.metrics.queueing_time <= out.ttft


@pytest.mark.parametrize("call, message", [
    (lambda llm: llm.generate("", GREEDY), "empty"),
    (lambda llm: llm.generate({"prompt_token_ids": []}, GREEDY), "empty"),
    (lambda llm: llm.generate("hi", SamplingParams(max_tokens=0)), "max_tokens"),
    (lambda llm: llm.generate("hi", SamplingParams(max_tokens=-3)), "max_tokens"),
    (lambda llm: llm.generate("word " * 9000, GREEDY), "maximum context length is 8192 tokens"),  # the server's words
    (lambda llm: llm.generate(["a", "b"], [GREEDY]), "SamplingParams"),
    (lambda llm: llm.generate({"text": "hi"}, GREEDY), "prompt"),
    (lambda llm: llm.generate({"prompt_token_ids": [10 ** 9]}, GREEDY), "token ids"),
])
def test_bad_input_raises_value_error_and_queues_nothing(llm, call, message):
    with pytest.raises(ValueError, match=message):
        call(llm)
    assert llm.stats()["num_requests_waiting"] == 0 and llm.stats()["num_requests_running"] == 0


def test_a_prompt_is_checked_once_on_its_way_in(llm, monkeypatch):
    """``generate`` checks each prompt when it prepares it (before anything is queued); the engine trusts
    that check instead of running it again when the request is added."""
    checked = []
    limits = type(llm.engine.limits)
    original = limits.check_prompt
    monkeypatch.setattr(limits, "check_prompt",
                        lambda self, ids, *more: (checked.append(list(ids)), original(self, ids, *more))[1])
    llm.generate(["one", "two"], GREEDY, use_tqdm=False)
    assert len(checked) == 2


def test_a_bad_prompt_in_a_list_loses_nothing(llm):
    with pytest.raises(ValueError):
        llm.generate(["fine", ""], GREEDY, use_tqdm=False)
    assert llm.stats()["num_requests_waiting"] == 0  # "fine" was not left queued either
    assert llm.generate("fine", GREEDY, use_tqdm=False)[0].token_ids


@pytest.mark.parametrize("model", ["no-such-model", "/nonexistent/folder", "org/name/extra"])
def test_unknown_model_raises_value_error(model):
    with pytest.raises(ValueError, match="unknown model"):
        LLM(model=model)


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        LLM(model=str(tmp_path))


def test_engine_options_are_validated():
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(max_num_seqs=0)


def test_cli_generate_prints_the_completion(llm):
    ref = llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0].text
    done = subprocess.run([sys.executable, "-m", "labsupport", "generate", "The capital of France is",
                           "--max-tokens", "8"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ref + "\n"


def test_cli_reports_bad_input_without_a_traceback():
    done = subprocess.run([sys.executable, "-m", "labsupport", "generate", "", "--max-tokens", "4"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "empty" in done.stderr and "Traceback" not in done.stderr
