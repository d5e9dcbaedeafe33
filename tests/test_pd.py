"""Prefill/decode disaggregation at the engine level (chapter 07): two engines with TCP connectors on
loopback, KV moved by real pulls. Tokens equal the colocated engine's, the decode engine computes
one prompt token instead of the prompt, held blocks are freed after the pull or when the lease
expires, a failed pull follows ``kv_load_failure_policy``, and nothing leaks either way."""
import time

import pytest
import torch

from waiting import wait_until

from labsupport import LLM, SamplingParams
from labsupport.pd.kv_transfer import pack_blocks, pull_blocks, unpack_blocks

PROMPT = "Explain, step by step, why the sky is blue and sunsets are red. " * 4
GREEDY = dict(temperature=0, ignore_eos=True)


def make(num_blocks=128, **kw):
    return LLM(device="cpu", num_blocks=num_blocks, kv_transfer_config={"kv_connector": "TcpConnector", **kw})


@pytest.fixture(scope="module")
def prefill():
    llm = make(kv_lease_s=2.0)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def decode():
    llm = make()
    yield llm
    llm.shutdown()


def hand_off(prefill, prompt=PROMPT):
    """The router's first leg: the prompt on the prefill engine with max_tokens=1, KV kept for a pull."""
    out = prefill.generate(prompt, SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}, **GREEDY),
                           use_tqdm=False)[0]
    assert out.kv_transfer_params["do_remote_prefill"] is True
    return out


def settle(llm, timeout=10.0):
    """Step an idle engine until no KV is on its way in or out (the server's loop does this by itself)."""
    def stepped_and_settled():
        llm.engine.step()
        return not llm.engine.has_pending_transfers()
    if llm.engine.has_pending_transfers():
        wait_until(stepped_and_settled, timeout=timeout, interval=0.01, message="no KV on its way in or out")


def all_free(llm):
    s, queues = llm.stats(), llm.engine.scheduler.queues
    return s["kv_blocks_free"] == s["kv_blocks_total"] and not queues.held and not queues.loading


def test_pack_unpack_moves_blocks_between_different_ids():
    torch.manual_seed(0)
    src_k, src_v = torch.randn(2, 64, 8), torch.randn(2, 64, 8)
    dst_k, dst_v = torch.zeros(2, 64, 8), torch.zeros(2, 64, 8)
    packed = pack_blocks(src_k, src_v, [5, 1, 6], 8)
    assert packed.shape == (2, 2, 24, 8)
    unpack_blocks(dst_k, dst_v, [0, 7, 2], 8, packed)
    for s, d in zip([5, 1, 6], [0, 7, 2]):
        assert torch.equal(dst_k[:, d * 8:(d + 1) * 8], src_k[:, s * 8:(s + 1) * 8])
        assert torch.equal(dst_v[:, d * 8:(d + 1) * 8], src_v[:, s * 8:(s + 1) * 8])
    untouched = [b for b in range(8) if b not in (0, 7, 2)]
    assert all(dst_k[:, b * 8:(b + 1) * 8].abs().sum() == 0 for b in untouched)


def test_decode_continues_without_recomputing_and_equals_colocated(llm, prefill, decode):
    params = SamplingParams(max_tokens=20, **GREEDY)
    ref = llm.generate(PROMPT, params, use_tqdm=False)[0]
    pre = hand_off(prefill)
    assert pre.token_ids == ref.token_ids[:1]  # the prefill worker's one token is the colocated first token
    assert prefill.stats()["kv_requests_held"] == 1  # its blocks wait for the pull
    computed = decode.stats()["prompt_tokens_computed"]
    out = decode.generate(PROMPT, SamplingParams(max_tokens=20, kv_transfer_params=pre.kv_transfer_params, **GREEDY),
                          use_tqdm=False)[0]
    assert out.token_ids == ref.token_ids
    assert decode.stats()["prompt_tokens_computed"] - computed == 1  # the last prompt token only, for its logits
    assert out.num_cached_tokens == len(out.prompt_token_ids) - 1
    nbytes = decode.stats()["kv_transfer_bytes_received"]
    cfg = decode.engine.model.config
    blocks = -(-len(out.prompt_token_ids) // 16)
    assert nbytes >= blocks * 16 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # every block, every layer
    settle(prefill)
    assert all_free(prefill) and all_free(decode)


def test_a_lease_frees_blocks_nobody_pulls(prefill):
    expired = prefill.stats()["kv_leases_expired"]
    hand_off(prefill)
    assert not all_free(prefill)
    time.sleep(2.2)  # the module's prefill engine has a 2 s lease
    settle(prefill)
    assert all_free(prefill) and prefill.stats()["kv_leases_expired"] == expired + 1


def test_a_pull_after_the_lease_is_refused(prefill, decode):
    pre = hand_off(prefill)
    time.sleep(2.2)  # the lease running out is the behaviour under test: the 2 s lease, and a little more
    settle(prefill)
    p = pre.kv_transfer_params
    be = decode.engine.backend
    with pytest.raises(ConnectionError, match="expired or unknown"):
        pull_blocks(p["remote_host"], p["remote_port"], p["remote_request_id"], p["remote_block_ids"],
                    be.k_pool, be.v_pool, [0] * len(p["remote_block_ids"]), 16)


def dead_params(prefill):
    """kv_transfer_params pointing at a prefill worker that is gone (a port nobody listens on)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"do_remote_prefill": True, "remote_engine_id": "gone", "remote_block_ids": list(range(8)),
            "remote_host": "127.0.0.1", "remote_port": port, "remote_request_id": "gone-1"}


def test_failed_load_recomputes_by_default(llm, decode):
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0]
    computed = decode.stats()["prompt_tokens_computed"]
    out = decode.generate(PROMPT, SamplingParams(max_tokens=8, kv_transfer_params=dead_params(None), **GREEDY),
                          use_tqdm=False)[0]
    assert out.token_ids == ref.token_ids
    assert decode.stats()["prompt_tokens_computed"] - computed == len(ref.prompt_token_ids)  # all of it, here
    assert decode.stats()["kv_loads_failed"] >= 1 and all_free(decode)


def test_failed_load_with_policy_fail_errors_and_frees():
    strict = make(kv_load_failure_policy="fail")
    try:
        out = strict.generate(PROMPT, SamplingParams(max_tokens=8, kv_transfer_params=dead_params(None), **GREEDY),
                              use_tqdm=False)[0]
        assert out.finish_reason == "error" and out.token_ids == []
        assert all_free(strict)
    finally:
        strict.shutdown()


def test_aborting_a_request_while_its_kv_loads_frees_its_blocks_after_the_load(prefill, decode):
    pre = hand_off(prefill)
    req = decode.engine.add_request(decode.tokenize(PROMPT)[0],
                                    SamplingParams(max_tokens=8, kv_transfer_params=pre.kv_transfer_params, **GREEDY))
    decode.engine.step()  # parks it and starts the pull
    assert req.request_id in decode.engine.scheduler.queues.loading
    decode.engine.abort(req)
    settle(decode)
    settle(prefill)
    assert all_free(decode) and all_free(prefill)


def test_bad_kv_transfer_config_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_load_failure_policy"):
        make(kv_load_failure_policy="retry")
    with pytest.raises(ValueError, match="kv_role"):
        make(kv_role="both")
    with pytest.raises(ValueError, match="unknown kv_transfer_config keys"):
        make(kv_prot=1)


def test_a_full_decode_pool_makes_the_handoff_wait_not_recompute(llm, prefill):
    """Two hand-offs whose KV cannot both fit: the second waits for room instead of prefilling on the decode side."""
    small = make(num_blocks=6)  # one request of ~60 prompt + 20 output tokens needs 5 blocks
    try:
        params = SamplingParams(max_tokens=20, **GREEDY)
        prompts = [PROMPT, PROMPT.replace("blue", "grey")]
        refs = llm.generate(prompts, params, use_tqdm=False)
        pres = [hand_off(prefill, p) for p in prompts]
        outs = small.generate(prompts, [SamplingParams(max_tokens=20, kv_transfer_params=p.kv_transfer_params, **GREEDY)
                                        for p in pres], use_tqdm=False)
        assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
        assert small.stats()["prompt_tokens_computed"] == 2 and small.stats()["kv_loads_failed"] == 0
        settle(prefill)
        assert all_free(small) and all_free(prefill)
    finally:
        small.shutdown()


@pytest.mark.parametrize("bad, needle", [
    ({"do_remote_prefill": True, "remote_block_ids": "0,1", "remote_port": 1, "remote_host": "h",
      "remote_request_id": "r"}, "remote_block_ids"),
    ({"do_remote_prefill": True, "remote_block_ids": [0], "remote_port": 99999, "remote_host": "h",
      "remote_request_id": "r"}, "remote_port"),
    ({"do_remote_prefill": True, "remote_block_ids": [0], "remote_port": 80, "remote_request_id": "r"}, "remote_host"),
])
def test_malformed_kv_transfer_params_are_refused_before_anything_runs(decode, llm, bad, needle):
    with pytest.raises(ValueError, match=needle):
        decode.generate(PROMPT, SamplingParams(max_tokens=4, kv_transfer_params=bad), use_tqdm=False)
    with pytest.raises(ValueError, match="KV connector"):
        llm.generate(PROMPT, SamplingParams(max_tokens=4, kv_transfer_params={"do_remote_decode": True}), use_tqdm=False)
    assert all_free(decode)


def test_the_server_answers_400_for_malformed_kv_transfer_params(decode, llm):
    import httpx

    from labsupport.serve.api import create_app
    from labsupport.serve.background import BackgroundServer
    body = {"prompt": "Hi", "max_tokens": 2, "kv_transfer_params": {"do_remote_prefill": True, "remote_port": "x"}}
    with BackgroundServer(create_app(decode, "smol")) as pd_server, BackgroundServer(create_app(llm, "smol")) as plain:
        for srv, needle in ((pd_server, "remote_block_ids"), (plain, "KV connector")):
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert all_free(decode)
