"""Chapter 08's ``check_disagg_request`` passes a correct hand-written proxy and fails planted wrong ones, each
with a message naming the cause, on two real engines with TCP connectors served on loopback. Most of these
bugs still answer the right text (the decode worker recomputes what it was not sent), so only the recorded
requests and the engines' counters can catch them."""
import pytest

from labsupport import LLM, checks

PATH = "/v1/completions"


def prefill_copy(body):
    request = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    if "max_completion_tokens" in body:
        request["max_completion_tokens"] = 1
    return request


def post(client, url, request):
    r = client.post(url + PATH, json=request)
    r.raise_for_status()
    return r


def disagg_request(client, prefill_url, decode_url, body):
    kv = post(client, prefill_url, prefill_copy(body)).json()["kv_transfer_params"]
    return post(client, decode_url, {**body, "kv_transfer_params": kv}).json()


# ---------------------------------------------------------------- planted wrong proxies

def prefill_not_limited(client, prefill_url, decode_url, body):
    request = {**body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    kv = post(client, prefill_url, request).json()["kv_transfer_params"]
    return post(client, decode_url, {**body, "kv_transfer_params": kv}).json()


def kv_not_forwarded(client, prefill_url, decode_url, body):
    post(client, prefill_url, prefill_copy(body))
    return post(client, decode_url, body).json()


def forwards_own_kv_params(client, prefill_url, decode_url, body):
    request = prefill_copy(body)
    post(client, prefill_url, request)
    return post(client, decode_url, {**body, "kv_transfer_params": request["kv_transfer_params"]}).json()


def mutates_body(client, prefill_url, decode_url, body):
    body.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    kv = post(client, prefill_url, body).json()["kv_transfer_params"]
    return post(client, decode_url, {**body, "kv_transfer_params": kv}).json()  # a one-token answer


def decode_from_prefill_copy(client, prefill_url, decode_url, body):
    request = prefill_copy(body)
    kv = post(client, prefill_url, request).json()["kv_transfer_params"]
    return post(client, decode_url, {**request, "kv_transfer_params": kv}).json()


def returns_prefill_answer(client, prefill_url, decode_url, body):
    answer = post(client, prefill_url, prefill_copy(body)).json()
    post(client, decode_url, {**body, "kv_transfer_params": answer["kv_transfer_params"]})
    return answer


def streams_prefill(client, prefill_url, decode_url, body):
    kv = post(client, prefill_url, {**prefill_copy(body), "stream": True}).json()["kv_transfer_params"]
    return post(client, decode_url, {**body, "kv_transfer_params": kv}).json()


def leaves_stream_unset(client, prefill_url, decode_url, body):
    request = {k: v for k, v in prefill_copy(body).items() if k != "stream"}
    kv = post(client, prefill_url, request).json()["kv_transfer_params"]
    return post(client, decode_url, {**body, "kv_transfer_params": kv}).json()


def not_written_yet(client, prefill_url, decode_url, body):  # the exercise notebook's stub
    raise NotImplementedError("Exercise: write this part, then run the check cell below")


WRONG = [(not_written_yet, "raised before sending any request: NotImplementedError: Exercise"),
         (prefill_not_limited, "prefill request asked for max_tokens=4, expected 1"),
         (kv_not_forwarded, "no kv_transfer_params: the decode worker computed (\\d+) of the prompt's \\1 tokens"),
         (forwards_own_kv_params, "the ones your prefill request sent"),
         (mutates_body, "changed the caller's body \\(.*max_tokens is 1 instead of 4.*got a 1-token answer"),
         (decode_from_prefill_copy, "decode request asked for max_tokens=1, the caller for 4"),
         (returns_prefill_answer, "returned the prefill server's answer"),
         (streams_prefill, "prefill request has stream=True"),
         (leaves_stream_unset, "does not set stream=False")]


def make():  # short leases: the KV a wrong proxy leaves held comes back within the next check's wait
    return LLM(device="cpu", num_blocks=128, kv_transfer_config={"kv_connector": "TcpConnector", "kv_lease_s": 1.0})


@pytest.fixture(scope="module")
def engines():
    prefill, decode = make(), make()
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


@pytest.mark.parametrize("wrong, message", WRONG, ids=[f.__name__ for f, _ in WRONG])
def test_planted_wrong_proxy_fails(engines, llm, wrong, message):
    with pytest.raises(checks.CheckFailed, match=message):
        checks.check_disagg_request(wrong, *engines, llm)


def test_a_correct_proxy_passes(engines, llm, capsys):
    """Run last: the engines serve again after the failed runs, and what those left held has been freed."""
    checks.check_disagg_request(disagg_request, *engines, llm)
    assert "computed 1 of the" in capsys.readouterr().out
