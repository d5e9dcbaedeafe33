"""Nothing an attendee types or does wedges the engine: bad sampling values are refused when the request
is made, a step that raises fails only its own requests, an interrupted ``generate()`` cleans up after
itself, and text comes out right token by token (non-ASCII included)."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from labsupport import LLM, SamplingParams
from labsupport.engine.detokenizer import IncrementalDetokenizer
from labsupport.engine.request import Request
from labsupport.result_cache import ResultCache

GREEDY4 = SamplingParams(max_tokens=4, temperature=0)


def assert_idle_and_free(llm):
    stats = llm.stats()
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert not llm.engine.detokenizers and not llm.engine.runner.sampler.generators


@pytest.mark.parametrize("field, value", [
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", -0.5), ("temperature", "hot"),
    ("temperature", True), ("top_p", float("nan")), ("top_p", 0), ("top_p", 1.5), ("seed", "x"), ("seed", 2**63),
    ("seed", -2**63 - 1), ("seed", 1.5), ("max_tokens", 0), ("max_tokens", 2.0), ("max_tokens", True),
    ("stop", [""]), ("stop", ""), ("stop", [3]), ("stop", 7), ("ignore_eos", "yes"),
])
def test_bad_sampling_values_are_refused_when_made(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_edge_values_that_are_valid_are_accepted():
    sp = SamplingParams(max_tokens=10**12, temperature=0, seed=2**63 - 1, top_p=1, stop="\u3002")
    assert sp.stop == ["\u3002"] and sp.seed == 2**63 - 1 and isinstance(sp.top_p, float)
    assert SamplingParams(seed=-2**63).seed == -2**63


def test_a_chat_message_without_content_is_a_value_error(llm):
    with pytest.raises(ValueError, match="content"):
        llm.generate([{"role": "user"}], GREEDY4, use_tqdm=False)
    with pytest.raises(ValueError, match="content"):
        llm.generate([{"role": "user", "content": None}], GREEDY4, use_tqdm=False)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}]
    plain = [{"role": "user", "content": "Say hi."}]
    assert llm.generate(parts, GREEDY4, use_tqdm=False)[0].token_ids == \
        llm.generate(plain, GREEDY4, use_tqdm=False)[0].token_ids
    assert_idle_and_free(llm)


weird = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                  st.text(max_size=3), st.lists(st.text(max_size=2), max_size=2))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(temperature=weird, top_p=weird, seed=weird, stop=weird, ignore_eos=weird)
def test_random_sampling_values_never_wedge_the_engine(llm, temperature, top_p, seed, stop, ignore_eos):
    try:
        sp = SamplingParams(max_tokens=2, temperature=temperature, top_p=top_p, seed=seed, stop=stop,
                            ignore_eos=ignore_eos)
    except ValueError:
        sp = None
    if sp is not None:  # accepted values must run
        out = llm.generate("Hello", sp, use_tqdm=False)[0]
        assert out.finish_reason in ("stop", "length")
    normal = llm.generate("The capital of France is", GREEDY4, use_tqdm=False)[0]
    assert normal.finish_reason == "length" and len(normal.token_ids) == 4
    assert_idle_and_free(llm)


def test_a_step_that_raises_fails_only_its_requests_and_the_engine_goes_on(llm, monkeypatch):
    engine = llm.engine
    reference = llm.generate("The capital of France is", GREEDY4, use_tqdm=False)[0].token_ids
    with engine.options(max_num_seqs=2):
        a = engine.add_request(llm.tokenize("one two")[0], SamplingParams(max_tokens=50, temperature=0))
        b = engine.add_request(llm.tokenize("three four")[0], SamplingParams(max_tokens=50, temperature=0))
        c = engine.add_request(llm.tokenize("The capital of France is")[0], GREEDY4)  # waits: 2 slots
        engine.step()
        execute = engine.runner.execute

        def broken_once(out):
            monkeypatch.setattr(engine.runner, "execute", execute)
            raise RuntimeError("a bug in the forward pass")

        monkeypatch.setattr(engine.runner, "execute", broken_once)
        with pytest.raises(RuntimeError, match="a bug"):
            engine.step()
        assert a.finish_reason == b.finish_reason == "error" and not c.is_finished
        while engine.has_unfinished_requests():
            engine.step()
    assert c.output_token_ids == reference
    assert_idle_and_free(llm)


def test_a_plugged_function_that_raises_leaves_the_engine_working(llm):
    def broken_schedule(s):
        raise ZeroDivisionError("attendee's bug")

    with pytest.raises(ZeroDivisionError):
        with llm.plugged(schedule_fn=broken_schedule):
            llm.generate(["one", "two"], GREEDY4, use_tqdm=False)
    assert llm.engine.scheduler.schedule_fn is None  # the engine's own policy is back
    assert_idle_and_free(llm)
    assert len(llm.generate("hello", GREEDY4, use_tqdm=False)[0].token_ids) == 4
    with pytest.raises(ValueError, match="no plug point"):
        llm.engine.plug(shedule_fn=broken_schedule)
    with pytest.raises(ValueError, match="attend_fn"):
        llm.engine.plug(attend_fn=print)  # a paged engine has no attend_fn


def test_a_plugged_policy_that_raises_cannot_hang_a_server_loop(llm):
    """Each failed step finishes at least one request, so a loop that keeps stepping ends."""
    with llm.plugged(schedule_fn=lambda s: 1 / 0):
        reqs = [llm.engine.add_request(llm.tokenize(w)[0], GREEDY4) for w in ("a", "b", "c")]
        for _ in range(3):
            with pytest.raises(ZeroDivisionError):
                llm.engine.step()
    assert all(r.finish_reason == "error" for r in reqs)
    assert_idle_and_free(llm)


@pytest.mark.parametrize("where", ["between steps", "inside the forward pass"])
def test_an_interrupted_generate_aborts_its_requests(llm, monkeypatch, where):
    engine = llm.engine
    owner, name = (engine, "step") if where == "between steps" else (engine.runner, "execute")
    original, calls = getattr(owner, name), []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the notebook's stop button
        return original(*args)

    monkeypatch.setattr(owner, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["Tell me a long story."] * 4, SamplingParams(max_tokens=500, temperature=0, ignore_eos=True),
                     use_tqdm=False)
    monkeypatch.setattr(owner, name, original)
    assert_idle_and_free(llm)
    before = engine.num_steps
    out = llm.generate("hello", GREEDY4, use_tqdm=False)[0]
    assert len(out.token_ids) == 4 and engine.num_steps - before == 4  # only its own request ran


def test_options_change_through_one_validated_method(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.set_options(max_num_seqs=0)
    with pytest.raises(ValueError, match="cannot change"):
        engine.set_options(block_size=8)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        engine.set_options(long_prefill_token_threshold=16)  # needs chunked prefill
    assert engine.config.max_num_seqs == 64
    with engine.options(max_num_seqs=3, enable_chunked_prefill=True, max_num_batched_tokens=8):
        assert engine.scheduler.config.max_num_seqs == 3
        llm.generate("one two three four five six seven eight nine ten eleven", GREEDY4, use_tqdm=False)
    assert engine.config.max_num_seqs == 64 and not engine.config.enable_chunked_prefill
    with engine.options(enable_chunked_prefill=True):
        engine.set_options(long_prefill_token_threshold=64)  # valid only with chunking: undone on exit too
    assert engine.config.long_prefill_token_threshold == 0
    engine.set_options(max_num_seqs=64)  # the configuration left behind is valid
    with pytest.raises(ValueError, match="chunk_rule must be a function"):
        engine.plug(chunk_rule=None)
    with engine.options(max_num_batched_tokens=4):  # the prompt check reads the same config as the scheduler
        with pytest.raises(ValueError, match="max_num_batched_tokens"):
            llm.generate("one two three four five six seven eight nine ten eleven", GREEDY4, use_tqdm=False)


@pytest.mark.parametrize("text", ["Paris is the capital of France.", "日本の首都は東京です。北京是中国的首都。",
                                  "emoji 🙂👍🏽 and accents: café, naïve, Ελληνικά", "\u200bzero width, tabs\tand\nnewlines"])
def test_incremental_text_equals_decoding_everything(llm, text):
    tok = llm.tokenizer
    prompt = tok("Say:").input_ids
    ids = tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.update(ids[:i + 1], flush=i == len(ids) - 1)[0] for i in range(len(ids))]
    assert "".join(pieces) == detok.text == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)  # a split character comes out whole, never as U+FFFD


def test_stop_strings_are_found_across_tokens_and_cut_the_text(llm):
    tok = llm.tokenizer
    ids = tok(" 北京是中国的首都。上海很大", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok, [1], stop=["首都。"])
    for i in range(len(ids)):
        _, stopped = detok.update(ids[:i + 1])
        if stopped:
            break
    assert stopped and detok.text == " 北京是中国的"
    req = Request([1], SamplingParams(stop=["abc"]))
    req.text = "xyzab"
    assert req.streamable_text() == "xyz"  # "ab" may begin the stop string: held back while running


def test_generated_non_ascii_text_matches_a_full_decode(llm):
    outs = llm.generate(["日本の首都は", "Écris une phrase en français avec des accents :"],
                        SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    for out in outs:
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_the_result_cache_ttl_is_honoured_by_the_frontend(monkeypatch):
    cache = ResultCache(ttl_s=10)
    clock = [100.0]
    monkeypatch.setattr("labsupport.result_cache.time.monotonic", lambda: clock[0])
    cache.put("k", "answer")
    assert cache.get("k") == "answer"
    clock[0] += 11
    assert cache.get("k") is None and "k" not in cache.entries


def test_an_expired_result_is_computed_again(llm, monkeypatch):
    cached = LLM(device="cpu", enable_result_cache=True, result_cache_ttl_s=10)
    clock = [100.0]
    monkeypatch.setattr("labsupport.result_cache.time.monotonic", lambda: clock[0])
    first = cached.generate("Hello", GREEDY4, use_tqdm=False)[0]
    assert cached.frontend.prepare("Hello", GREEDY4).cached is not None
    clock[0] += 11
    prepared = cached.frontend.prepare("Hello", GREEDY4)
    assert prepared.cached is None and prepared.cache_key is not None
    again = cached.generate("Hello", GREEDY4, use_tqdm=False)[0]
    assert not again.cached and again.token_ids == first.token_ids

