"""Speculative decoding (chapter 09): guesses verified in one pass through the paged KV cache.

Greedy output must equal plain decoding token for token, whatever the guesser (prompt lookup, the
model itself as a perfect draft, a random draft that is almost always wrong); sampled output must be
distributed as the target's (chi-square tests at alpha = 0.001, stated below); rejected guesses'
blocks must come back, and vLLM's counters must add up."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from labsupport import LLM, SamplingParams
from labsupport.checks.acceptance import CHI2_DF5, CHI2_DF35, markov_pairs
from labsupport.engine.runner import sequence_logits
from labsupport.engine.spec_decode import check_speculative_config, ngram_propose, rejection_sample
from labsupport.models.llama import ModelConfig
from labsupport.models.loader import prepare_default_model, random_model

from conftest import PROMPTS

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
REPETITIVE = [
    "Copy this list twice: apples, pears, plums, grapes, cherries. apples, pears, plums, grapes,",
    "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n\ndef area(w, h):\n",
    "Extract the names: Alice met Bob. Bob met Carol. Carol met Alice. Names: Alice, Bob,",
]


@pytest.fixture(scope="module")
def ngram_llm():
    return LLM(device="cpu", speculative_config=NGRAM, enable_prefix_caching=True, enable_chunked_prefill=True,
               max_num_batched_tokens=64, num_blocks=256)


def random_draft(folder, vocab_size: int = 49152) -> str:
    """A tiny random Llama with the default model's tokenizer files, saved in ``folder``."""
    cfg = {"model_type": "llama", "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "max_position_embeddings": 8192, "tie_word_embeddings": True, "rms_norm_eps": 1e-5}
    (folder / "config.json").write_text(json.dumps(cfg))
    net = random_model(ModelConfig.from_hf(cfg), "cpu", torch.float32, seed=7)
    state = {k: v.contiguous() for k, v in net.state_dict().items() if k != "lm_head.weight"}
    save_file(state, folder / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(prepare_default_model() / name, folder / name)
    return str(folder)


@pytest.fixture(scope="module")
def wrong_draft(tmp_path_factory):
    """A draft of the default model's vocabulary with random weights: nearly every guess is rejected."""
    return random_draft(tmp_path_factory.mktemp("random-draft"))


def test_a_draft_of_another_vocabulary_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vocabulary .1000 tokens. differs"):
        LLM(device="cpu", num_blocks=8, speculative_config={
            "method": "draft_model", "model": random_draft(tmp_path, vocab_size=1000), "num_speculative_tokens": 2})


def greedy(max_tokens=32, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def assert_all_blocks_free(llm):
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


# ------------------------------------------------------------------ the rule alone

def test_greedy_rule_keeps_guesses_up_to_the_first_disagreement():
    argmax = [3, 1, 4, 1]
    p = torch.nn.functional.one_hot(torch.tensor(argmax), 6).float()
    assert rejection_sample(p, [3, 1, 4], None) == [3, 1, 4, 1]  # all accepted, then the bonus token
    assert rejection_sample(p, [3, 2, 4], None) == [3, 1]  # the second is wrong: the target's token instead
    assert rejection_sample(p, [5, 1, 4], None) == [3]


def test_rule_keeps_the_target_distribution_over_whole_steps():
    """A toy target and draft (Markov chains over 6 tokens) generate two tokens by speculative steps;
    the pairs must follow the target's joint distribution p0(a) T[a, b], whatever the draft."""
    counts, expected, _, _ = markov_pairs(rejection_sample, trials=12000, seed=0)  # the check's own simulation
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_DF35, chi2


def test_rule_with_deterministic_guesses_keeps_the_target_distribution():
    """Prompt lookup's guesses are certain (q one-hot): accept with p(d), else draw from p without d."""
    gen = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.4, 0.3, 0.1, 0.1, 0.05, 0.05], [1 / 6] * 6])
    counts = torch.zeros(6)
    trials = 20000
    for _ in range(trials):
        counts[rejection_sample(p, [1], None, gen)[0]] += 1
    chi2 = float(((counts - trials * p[0]) ** 2 / (trials * p[0])).sum())
    assert chi2 < CHI2_DF5, chi2


def test_ngram_lookup_and_config_validation():
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 1, 3) == [9, 1]  # the earliest match, as vLLM
    assert ngram_propose([4, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 1, 3) == [7, 1]  # the longest match first
    assert check_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                     "prompt_lookup_max": 3})["prompt_lookup_min"] == 3
    assert ngram_propose([5, 6, 7], 3, 1, 2) == []
    assert check_speculative_config({"method": "ngram", "num_speculative_tokens": 2})["prompt_lookup_min"] == 5
    for bad in ({"method": "eagle", "num_speculative_tokens": 2}, {"method": "ngram", "num_speculative_tokens": 0},
                {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
                {"method": "draft_model", "num_speculative_tokens": 2}, "ngram"):
        with pytest.raises(ValueError):
            check_speculative_config(bad)
    with pytest.raises(ValueError, match="paged"):
        LLM(device="cpu", kv_cache="contiguous", speculative_config=NGRAM)


# ------------------------------------------------------------------ in the engine

def test_ngram_greedy_equals_plain_decoding_and_frees_every_block(llm, ngram_llm):
    prompts = REPETITIVE + PROMPTS[:4]
    plain = llm.generate(prompts, greedy(40), use_tqdm=False)
    before = ngram_llm.stats()
    spec = ngram_llm.generate(prompts, greedy(40), use_tqdm=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.text for o in spec] == [o.text for o in plain]
    s = ngram_llm.stats()
    drafts = s["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    accepted = s["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert drafts > 0 and accepted > 0
    assert sum(s["spec_decode_num_accepted_tokens_per_pos"]) == s["spec_decode_num_accepted_tokens"]
    assert s["spec_decode_num_accepted_tokens"] <= s["spec_decode_num_draft_tokens"]
    assert s["num_steps"] - before["num_steps"] < sum(len(o.token_ids) for o in spec)  # tokens came faster than steps
    assert_all_blocks_free(ngram_llm)


def test_stop_rules_and_logprobs_equal_plain_decoding(llm, ngram_llm):
    prompt = REPETITIVE[0]
    for params in (greedy(40, stop=[" plums"]), greedy(40, stop_token_ids=[11]), greedy(7),
                   greedy(30, min_tokens=20), greedy(12, logprobs=2)):
        a = llm.generate(prompt, params, use_tqdm=False)[0]
        b = ngram_llm.generate(prompt, params, use_tqdm=False)[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), params
        if params.logprobs:
            assert [list(d) for d in b.logprobs] == [list(d) for d in a.logprobs]
            assert all(abs(b.logprobs[i][t] - a.logprobs[i][t]) < 1e-3 for i, t in enumerate(a.token_ids))
    assert_all_blocks_free(ngram_llm)


def test_draft_models_right_and_wrong_give_plain_greedy_output(llm, wrong_draft):
    plain = llm.generate(REPETITIVE, greedy(24), use_tqdm=False)
    for draft, expect_all_accepted in ((str(prepare_default_model()), True), (wrong_draft, False)):
        spec_llm = LLM(device="cpu", num_blocks=128, speculative_config={
            "method": "draft_model", "model": draft, "num_speculative_tokens": 3})
        out = spec_llm.generate(REPETITIVE, greedy(24), use_tqdm=False)
        assert [o.token_ids for o in out] == [o.token_ids for o in plain]
        s = spec_llm.stats()
        assert s["spec_decode_num_drafts"] > 0
        if expect_all_accepted:  # the model drafting for itself guesses exactly what it will choose
            assert s["spec_decode_num_accepted_tokens"] == s["spec_decode_num_draft_tokens"]
        else:
            assert s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"] / 2
        assert_all_blocks_free(spec_llm)
        spec_llm.shutdown()


def test_a_draft_models_pool_counts_against_the_kv_budget(wrong_draft):
    """The draft's pool has as many blocks as the target's, so one budget must hold both (as in vLLM)."""
    plain = LLM(device="cpu", num_blocks=4)
    per_block = plain.engine.backend.pool_bytes // 4  # the target's bytes per block
    plain.shutdown()
    budget = 40 * per_block
    alone = LLM(device="cpu", kv_cache_memory_bytes=budget)
    spec = LLM(device="cpu", kv_cache_memory_bytes=budget, speculative_config={
        "method": "draft_model", "model": wrong_draft, "num_speculative_tokens": 2})
    draft_pool = spec.engine.speculator.draft.backend
    assert alone.engine.backend.num_blocks == 40 and spec.engine.backend.num_blocks == 39
    assert draft_pool.num_blocks == 39 and spec.engine.backend.pool_bytes + draft_pool.pool_bytes <= budget
    out = spec.generate(REPETITIVE[:1], greedy(8), use_tqdm=False)[0]
    assert out.token_ids == alone.generate(REPETITIVE[:1], greedy(8), use_tqdm=False)[0].token_ids
    assert_all_blocks_free(spec)
    alone.shutdown()
    spec.shutdown()


def test_sampled_tokens_follow_the_target_distribution():
    """Temperature 1 on a repetitive prompt: prompt lookup guesses the next items, the rule accepts or
    resamples. Given the most common first token, the second (verified) token's counts must fit the
    target's own distribution, computed from the model's logits (chi-square, alpha = 0.001)."""
    ngram_llm = LLM(device="cpu", speculative_config=NGRAM, enable_prefix_caching=True, max_num_seqs=128)
    prompt = "a b c d a b c d a b c d a b c"
    ids = ngram_llm.tokenize(prompt)[0]
    n = 320
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=s, ignore_eos=True) for s in range(n)]
    outs = ngram_llm.generate([prompt] * n, params, use_tqdm=False)
    firsts = [o.token_ids[0] for o in outs]
    mode = max(set(firsts), key=firsts.count)
    seconds = [o.token_ids[1] for o in outs if o.token_ids[0] == mode]
    model = ngram_llm.engine.model
    p = torch.softmax(sequence_logits(model, ids + [mode])[-1], -1)
    top = p.topk(5).indices.tolist()
    cells = [[t] for t in top] + [None]  # the five likeliest tokens, and all others together
    expected = [float(p[c].sum()) if c else 1 - float(p[top].sum()) for c in cells]
    observed = [sum(s in c for s in seconds) if c else sum(s not in top for s in seconds) for c in cells]
    m = len(seconds)
    keep = [i for i, e in enumerate(expected) if e * m >= 5]  # chi-square wants >= 5 expected per cell
    rest_obs = m - sum(observed[i] for i in keep)
    rest_exp = m - sum(expected[i] * m for i in keep)
    chi2 = sum((observed[i] - expected[i] * m) ** 2 / (expected[i] * m) for i in keep)
    if rest_exp >= 1:
        chi2 += (rest_obs - rest_exp) ** 2 / rest_exp
    assert m >= 100 and ngram_llm.stats()["spec_decode_num_accepted_tokens"] > 0
    assert chi2 < CHI2_DF5, (chi2, observed, [e * m for e in expected])
    assert_all_blocks_free(ngram_llm)


def test_aborted_and_preempted_requests_give_every_block_back():
    tight = LLM(device="cpu", num_blocks=12, block_size=8, max_num_seqs=4, speculative_config=NGRAM)
    outs = tight.generate(REPETITIVE + REPETITIVE[:1], greedy(40), use_tqdm=False)
    assert all(o.finish_reason in ("length", "stop") for o in outs)
    assert_all_blocks_free(tight)
    req = tight.engine.add_request(tight.tokenize(REPETITIVE[0])[0], greedy(40))
    for _ in range(4):
        tight.engine.step()
    tight.engine.abort(req)
    assert_all_blocks_free(tight)
    with pytest.raises(ValueError, match="n > 1"):
        tight.engine.add_request([1, 2, 3], SamplingParams(n=2))


def test_server_streams_the_same_text_and_exports_vllms_counters(llm, ngram_llm):
    """Over a loopback port with the official client: streamed text equals plain decoding, and /metrics
    carries the spec-decode counters, equal to the engine's own."""
    import openai
    from server_tools import server_metrics, wait_metrics_free

    from labsupport.serve.api import create_app
    from labsupport.serve.background import BackgroundServer

    ref = llm.generate(REPETITIVE[1], greedy(32), use_tqdm=False)[0]
    with BackgroundServer(create_app(ngram_llm, "smol")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
        stream = client.completions.create(model="smol", prompt=REPETITIVE[1], max_tokens=32, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in stream) == ref.text
        m = wait_metrics_free(srv, ngram_llm)
        s = ngram_llm.stats()
        for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
            assert m[f"labsupport:{name}_total"] > 0
        per_pos = {k: v for k, v in server_metrics(srv).items() if "accepted_tokens_per_pos" in k and "position=" in k and "model_name=" in k}
        assert sum(per_pos.values()) == m["labsupport:spec_decode_num_accepted_tokens_total"]
        assert s["spec_decode_num_accepted_tokens"] >= m["labsupport:spec_decode_num_accepted_tokens_total"]


def test_bench_spec_reports_both_sweeps_and_plots():
    from labsupport.bench.lab.spec_bench import format_report, reading, run
    from labsupport.viz.spec_charts import plot_spec

    report = run(ks=(2,), temperatures=(0.0,), batch_sizes=(2,), max_tokens=8, device="cpu", use_tqdm=False)
    rows = report["rows"]
    assert {(r["sweep"], r["k"]) for r in rows} == {("k", 0), ("k", 2), ("batch", 0), ("batch", 2)}
    assert all(r["same_tokens"] for r in rows)  # greedy: guessing never changes the tokens
    spec_rows = [r for r in rows if r["k"]]
    assert all(1 <= r["acceptance_length"] <= 3 and r["draft_tokens"] >= r["accepted"] for r in spec_rows)
    assert "accept len" in format_report(report) and "0 again" in format_report(report)
    groups = {(r["sweep"], r["workload"], r["batch"]) for r in rows}  # two traffics one at a time, one batch
    assert len(groups) == 3 and sum(r["repeat"] for r in rows) == 3  # plain decoding once more in each group
    assert len(plot_spec(report).axes) == 3
    for r in rows:  # every token after a request's first leaves a gap: the samples a verdict reads
        assert len(r["gaps_ms"]) == sum(len(t) - 1 for t in r["token_ids"]) and min(r["gaps_ms"]) >= 0
    assert "A/A band" in reading(report)


def _row(sweep, k, tok_s, repeat=False, gaps=None, **extra):
    """A row; ``gaps``: its per-token gaps (ms), a seeded spread around 1000 / tok_s (None: a report saved without)."""
    row = {"sweep": sweep, "workload": "repetitive", "k": k, "temperature": 0.0, "batch": 1 if sweep == "k" else 4,
           "repeat": repeat, "tok_s": tok_s, "speedup": tok_s / 10, "seconds": 10 / tok_s, "steps": 10,
           "same_tokens": True, **extra}
    if gaps is not None:
        row["gaps_ms"] = list(1000 / tok_s * (1 + np.random.default_rng(gaps).uniform(-0.05, 0.05, 60)))
    return row


SPEC = dict(drafts=5, draft_tokens=20, accepted=15, acceptance_length=4.0, acceptance_rate=0.75)


def test_reading_calls_a_speed_up_only_outside_the_band_of_plain_decodings_repeat():
    from labsupport.bench.lab.spec_bench import band, reading, speed

    quiet = {"max_tokens": 8, "rows": [_row("k", 0, 10, gaps=1), _row("k", 4, 13, gaps=2, **SPEC),
                                       _row("k", 0, 10.2, repeat=True, gaps=3)]}
    assert band(quiet, quiet["rows"][1]).high < 1.1
    assert speed(quiet, quiet["rows"][1]).word == "faster"
    text = reading(quiet)
    assert "mean time between tokens against plain decoding's: 1.3" in text and "x faster (95 % interval" in text
    assert "A/A band" in text and "guesses in 5 of 10 engine steps" in text and "75 % of the guessed tokens" in text
    # plain decoding read 1.4x faster on its repeat: a 1.3x speed-up is inside what chance showed
    loud = {**quiet, "rows": quiet["rows"][:2] + [_row("k", 0, 14, repeat=True, gaps=3)]}
    assert band(loud, loud["rows"][1]).low < 1 / 1.3
    assert speed(loud, loud["rows"][1]).word == "level" and ": level (" in reading(loud)
    assert "faster" not in reading(loud).split("A/A band", 1)[0]
    slow = {**quiet, "rows": [*quiet["rows"][:1], _row("k", 4, 7, gaps=2, **SPEC), quiet["rows"][2]]}
    assert speed(slow, slow["rows"][1]).word == "slower"


def test_reading_a_report_without_per_token_gaps_gives_ratios_and_no_verdict():
    from labsupport.bench.lab.spec_bench import reading, speed

    old = {"max_tokens": 8, "rows": [_row("k", 0, 10), _row("k", 4, 13, **SPEC), _row("k", 0, 14, repeat=True)]}
    assert speed(old, old["rows"][1]) is None
    text = reading(old)
    assert "tokens/s against plain decoding's: 1.30x (one run each: no verdict)" in text
    assert "kept no per-token times" in text and "faster" not in text and "slower" not in text
    saved = json.loads((Path(__file__).parents[1] / "benchmarks" / "spec-cpu-2026-12-01.json").read_text())
    text = reading(saved)  # the saved sweep, from before rows kept their gaps
    assert "1.40x (one run each: no verdict)" in text and "faster" not in text and "slower" not in text


def test_spec_chart_legend_tells_the_temperatures_apart():
    """Colour says the traffic, line style the temperature: the legend names both temperatures, each with its
    own dash drawn without a marker (a marker hides a dash in a legend's short sample)."""
    from labsupport.viz.spec_charts import plot_spec

    rows = [{"sweep": "k", "workload": w, "k": k, "temperature": t, "batch": 1, "repeat": False,
             "speedup": 1.0 + k / 10, "acceptance_length": 1 + k / 2}
            for w in ("repetitive", "open-ended") for t in (0.0, 1.0) for k in (0, 4)]
    rows += [{"sweep": "batch", "workload": "repetitive", "k": 4, "temperature": 0.0, "batch": 4, "repeat": False,
              "speedup": 1.1, "acceptance_length": 3.0}]
    fig = plot_spec({"method": "ngram", "max_tokens": 8, "rows": rows})
    legend = fig.axes[0].get_legend()
    styles = {t.get_text(): h for t, h in zip(legend.get_texts(), legend.legend_handles)}
    assert {"T=0 (greedy)", "T=1", "repetitive", "open-ended"} <= set(styles)
    greedy, sampled = styles["T=0 (greedy)"], styles["T=1"]
    assert greedy.get_linestyle() != sampled.get_linestyle() and greedy.get_marker() in ("None", "", None)
    dashes = {line.get_linestyle() for line in fig.axes[0].get_lines()}
    assert dashes == {greedy.get_linestyle(), sampled.get_linestyle()}  # the plotted lines use exactly those
