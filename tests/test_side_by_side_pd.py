"""Chapter 08's vLLM side: disaggregated prefill with vLLM's ExampleConnector behind chapter 07's router,
vLLM's toy proxy pattern, the GPU recipe's flags, and vLLM's offline greedy tokens.

vLLM runs from ``.venv-vllm`` (``make vllm``); without it the live tests skip with ``vllm_status()``'s
message. Two vLLM starts in all, one after the other (2 cores): the offline ``LLM`` for the
single-instance reference, then the producer/consumer pair.
"""
import os

import httpx
import pytest
from server_tools import stand_in_worker

from labsupport.pd.router_app import create_router_app
from labsupport.serve.background import BackgroundServer
from labsupport.side_by_side import disagg
from labsupport.side_by_side.disagg import (BLOCK_SIZE, VllmPD, check_recipe, external_hit_tokens, log_external_hits,
                                            nixl_recipe, prompt_token_sources, toy_proxy_request)
from labsupport.side_by_side.offline import compare_tokens, greedy_tokens
from labsupport.servers import vllm_status

USABLE, WHY = vllm_status()


def live(test):
    """A test that starts vLLM: slow, marked ``vllm_serve`` (``make unit`` leaves these to chapter 08's nbval run,
    which checks the same in CI; ``make test-vllm`` runs them), and skipped (saying why) without vLLM."""
    return pytest.mark.vllm_serve(pytest.mark.slow(pytest.mark.skipif(not USABLE, reason=WHY)(test)))


MAX_TOKENS = 24
# 100 and 90 tokens: ExampleConnector saves whole blocks of all but the last token, so 96 and 64 tokens
# travel. (Not 32k + 1: there it saves under one key and looks up under another, and nothing travels.)
LENGTHS = (100, 90)


def loaded(length: int) -> int:
    return (length - 2) // BLOCK_SIZE * BLOCK_SIZE


# ------------------------------------------------------------------ no vLLM needed


def test_compare_tokens_finds_the_first_difference():
    rows = compare_tokens([[1, 2, 3], [1, 2, 3], [1, 2]], {"tokens": [[1, 2, 3], [1, 5, 3], [1, 2, 9]]})
    assert [r["equal"] for r in rows] == [True, False, False]
    assert [r["first_diff"] for r in rows] == [None, 1, 2]
    assert (rows[1]["ours_token"], rows[1]["theirs_token"]) == (2, 5)
    assert (rows[2]["ours_token"], rows[2]["theirs_token"]) == (None, 9)
    with pytest.raises(RuntimeError, match="not installed"):
        compare_tokens([[1]], {"skipped": "vLLM is not installed"})


def test_greedy_tokens_without_vllm_says_why(monkeypatch):
    from labsupport.side_by_side import offline
    monkeypatch.setattr(offline, "vllm_status", lambda: (False, "run `make vllm`"))
    assert offline.greedy_tokens("/nonexistent", [[1, 2, 3]], 4) == {"skipped": "run `make vllm`"}


def stand_in(seen: list):
    """Answers as ExampleConnector's vLLM does: ``kv_transfer_params: null`` on every completion."""
    async def complete(body, request):
        seen.append(body)
        return {"choices": [{"text": " decoded"}], "kv_transfer_params": None}

    return stand_in_worker(complete)


def test_router_kv_params_optional_passes_null_params_on():
    pre, dec = [], []
    body = {"model": "smol", "prompt": "Hello", "max_tokens": 5}
    with BackgroundServer(stand_in(pre)) as p, BackgroundServer(stand_in(dec)) as d:
        for kv_params, status in (("required", 502), ("optional", 200)):
            app = create_router_app(prefill=[p.url], decode=[d.url], health_interval=0.2, kv_params=kv_params)
            with BackgroundServer(app) as r:
                reply = httpx.post(r.url + "/v1/completions", json=body, timeout=30)
                assert reply.status_code == status, reply.text
    assert len(pre) == 2 and pre[-1]["kv_transfer_params"]["do_remote_decode"] is True
    assert dec == [body]  # only the optional router reached decode, with the original body
    with pytest.raises(ValueError):
        create_router_app(prefill=[p.url], decode=[d.url], kv_params="sometimes")


def test_a_failed_start_still_removes_the_storage(monkeypatch):
    def broken(workers, timeout):
        raise RuntimeError("no vLLM today")
    monkeypatch.setattr(disagg, "start_all", broken)
    pd = VllmPD("/nonexistent")
    assert pd.storage.is_dir()
    with pytest.raises(RuntimeError, match="no vLLM today"):
        with pd:
            pass
    assert not pd.storage.exists()
    pd.stop()  # twice is fine


@live
def test_nixl_recipe_passes_the_installed_vllms_parser():
    """No GPU here to run the recipe on: vLLM's own ``vllm serve`` parser reads it instead."""
    producer, consumer, router = lines = nixl_recipe("HuggingFaceTB/SmolLM2-135M-Instruct", 0.4)
    parsed = check_recipe(lines)
    assert [p["kv_role"] for p in parsed] == ["kv_producer", "kv_consumer"]
    for p in parsed:
        assert p["kv_connector"] == "NixlConnector" and p["connector_registered"] and p["unknown_env"] == []
        assert p["gpu_memory_utilization"] == 0.4
    assert [p["port"] for p in parsed] == [8100, 8200]
    assert producer.split()[0] != consumer.split()[0]  # distinct NIXL side channel ports
    assert router == "python -m labsupport router --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 " \
                     "--port 8000"


# ------------------------------------------------------------------ live vLLM


@pytest.fixture(scope="module")
def folder():
    from labsupport.models.loader import prepare_default_model
    return prepare_default_model()


@pytest.fixture(scope="module")
def prompts(folder):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    texts = ["The printing press spread across Europe within fifty years of its invention, and with it came "
             "cheaper books, new ideas and the first newspapers. " * 6,
             "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen inside the leaves "
             "of green plants. " * 6]
    out = [tok(t)["input_ids"][:n] for t, n in zip(texts, LENGTHS)]
    assert [len(p) for p in out] == list(LENGTHS)
    return out


@pytest.fixture(scope="module")
def single(folder, prompts):
    """The single-instance reference: vLLM's offline LLM, one core, as the consumer will have."""
    result = greedy_tokens(folder, prompts, MAX_TOKENS, cpus="1")
    assert "skipped" not in result, result.get("skipped")
    return result


@pytest.fixture(scope="module")
def pd(folder, single):  # after `single`: never more than two vLLMs at once
    with VllmPD(folder) as deployment:
        yield deployment


def completion(prompt) -> dict:
    return {"model": "smol", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}


@live
def test_greedy_tokens_are_sane(single):
    assert single["vllm_version"].startswith("0.") and single["startup_s"] > 0
    assert [len(t) for t in single["tokens"]] == [MAX_TOKENS] * len(LENGTHS)
    assert all(isinstance(t, int) and 0 <= t < 49152 for row in single["tokens"] for t in row)
    assert single["tokens"][0] != single["tokens"][1]


@live
def test_pd_through_our_router_equals_single_instance(pd, single, prompts):
    assert external_hit_tokens(pd.consumer) == 0
    reply = httpx.post(pd.url + "/v1/completions", json=completion(prompts[0]), timeout=300)
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-pd-route"] == f"prefill={pd.producer.url};decode={pd.consumer.url}"
    assert reply.json()["choices"][0]["token_ids"] == single["tokens"][0]
    assert external_hit_tokens(pd.consumer) == loaded(LENGTHS[0])  # 96 of 100 prompt tokens came from storage
    assert prompt_token_sources(pd.consumer)["local_compute"] == LENGTHS[0] - loaded(LENGTHS[0])
    assert prompt_token_sources(pd.producer)["local_compute"] == LENGTHS[0]
    assert log_external_hits(pd.consumer) == 1 and pd.stored_prompts() == 1


@live
def test_toy_proxy_equals_single_instance(pd, single, prompts):
    before = external_hit_tokens(pd.consumer)
    reply = toy_proxy_request(pd.producer.url, pd.consumer.url, completion(prompts[1]))
    assert reply["choices"][0]["token_ids"] == single["tokens"][1]
    assert external_hit_tokens(pd.consumer) - before == loaded(LENGTHS[1])


@live
def test_router_requiring_kv_params_answers_502(pd):
    with BackgroundServer(create_router_app(prefill=[pd.producer.url], decode=[pd.consumer.url])) as r:
        reply = httpx.post(r.url + "/v1/completions", json={**completion("Hello"), "max_tokens": 2}, timeout=120)
    assert reply.status_code == 502 and reply.json()["error"]["type"] == "bad_gateway"


@live
def test_stop_removes_storage_and_processes(pd):
    assert pd.stored_prompts() >= 2
    pd.stop()
    assert not pd.storage.exists()
    for worker in pd.workers:
        assert not worker.alive
    for server in (pd.producer, pd.consumer):
        with pytest.raises(ProcessLookupError):
            os.killpg(server.proc.pid, 0)  # nothing of its process group is left
