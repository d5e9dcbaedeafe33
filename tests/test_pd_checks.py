"""Chapter 07's checks pass the reference pack_blocks/unpack_blocks and fail planted wrong ones, each with a
message that names the mistake; end to end, on two real engines with TCP connectors, a wrong pack and a
wrong unpack are caught by the tokens and blamed on the right side, a raising one by what it raised."""
import pytest
import torch

from labsupport import LLM, checks
import labsupport.checks.pd  # noqa: F401  (checks.pd.require_idle_pair)
from labsupport.pd.kv_transfer import pack_blocks, unpack_blocks
from labsupport.engine.lifecycle import land_transfers


def _view(pool, bs):
    return pool.view(pool.shape[0], -1, bs, pool.shape[2])


def _idx(ids, pool):
    return torch.tensor(ids, dtype=torch.long, device=pool.device)


# ---------------------------------------------------------------- planted wrong pack_blocks

def pack_swaps_k_and_v(k, v, ids, bs):
    return pack_blocks(v, k, ids, bs)


def pack_sorts_ids(k, v, ids, bs):
    return pack_blocks(k, v, sorted(ids), bs)


def pack_only_k(k, v, ids, bs):
    return pack_blocks(k, v, ids, bs)[0]


def pack_off_by_one_block(k, v, ids, bs):
    return pack_blocks(k, v, [b + 1 for b in ids], bs)


def pack_without_offsets(k, v, ids, bs):
    slots = _idx([b * bs for b in ids for _ in range(bs)], k)  # block * block_size, the offset forgotten
    return torch.stack([k.index_select(1, slots), v.index_select(1, slots)])


def pack_in_float32(k, v, ids, bs):
    return pack_blocks(k, v, ids, bs).float()


def pack_the_whole_pool(k, v, ids, bs):
    return torch.stack([k, v])


WRONG_PACKS = [(pack_swaps_k_and_v, "K and V are swapped"), (pack_sorts_ids, "sorted the ids"),
               (pack_only_k, "V is missing"), (pack_off_by_one_block, "off by one block|IndexError|out of range"),
               (pack_without_offsets, "offset"), (pack_in_float32, "float32"),
               (pack_the_whole_pool, "output shape")]


# ---------------------------------------------------------------- planted wrong unpack_blocks

def _write(k, v, ids, bs, k_data, v_data):
    n, hkv, d = len(ids), k.shape[0], k.shape[2]
    _view(k, bs).index_copy_(1, _idx(ids, k), k_data.reshape(hkv, n, bs, d))
    _view(v, bs).index_copy_(1, _idx(ids, v), v_data.reshape(hkv, n, bs, d))


def _checked(k, ids, bs, packed):
    if tuple(packed.shape) != (2, k.shape[0], len(ids) * bs, k.shape[2]):
        raise ValueError(f"bad shape {tuple(packed.shape)}")


def unpack_ignores_ids(k, v, ids, bs, packed):  # the i-th packed block into block i, as if ids were positions
    _checked(k, ids, bs, packed)
    _write(k, v, list(range(len(ids))), bs, packed[0], packed[1])


def unpack_sorts_ids(k, v, ids, bs, packed):
    _checked(k, ids, bs, packed)
    _write(k, v, sorted(ids), bs, packed[0], packed[1])


def unpack_k_into_v(k, v, ids, bs, packed):
    _checked(k, ids, bs, packed)
    _write(k, v, ids, bs, packed[0], packed[0])


def unpack_swaps_k_and_v(k, v, ids, bs, packed):
    _checked(k, ids, bs, packed)
    _write(k, v, ids, bs, packed[1], packed[0])


def unpack_whole_pool(k, v, ids, bs, packed):  # builds the pool anew: zeros wherever the packed blocks are not
    _checked(k, ids, bs, packed)
    new_k, new_v = torch.zeros_like(k), torch.zeros_like(v)
    _write(new_k, new_v, ids, bs, packed[0], packed[1])
    k.copy_(new_k)
    v.copy_(new_v)


def unpack_without_shape_check(k, v, ids, bs, packed):
    packed = packed.reshape(2, k.shape[0], len(ids) * bs, k.shape[2])  # a transposed tensor of the same size fits
    _write(k, v, ids, bs, packed[0], packed[1])


def unpack_into_a_copy(k, v, ids, bs, packed):
    _checked(k, ids, bs, packed)
    _write(k.clone(), v.clone(), ids, bs, packed[0], packed[1])


def unpack_wrong_expected_shape(k, v, ids, bs, packed):  # forgets block_size: refuses every real tensor
    if tuple(packed.shape) != (2, k.shape[0], len(ids), k.shape[2]):
        raise ValueError(f"packed has shape {tuple(packed.shape)}, expected {(2, k.shape[0], len(ids), k.shape[2])}")
    _write(k, v, ids, bs, packed[0], packed[1])


WRONG_UNPACKS = [(unpack_ignores_ids, "block_ids were ignored"), (unpack_sorts_ids, "sorted the ids"),
                 (unpack_k_into_v, "its V .* holds packed K"), (unpack_swaps_k_and_v, "K and V are swapped"),
                 (unpack_whole_pool, "outside the given blocks changed"),
                 (unpack_without_shape_check, "accepted a packed tensor"), (unpack_into_a_copy, "in place"),
                 (unpack_wrong_expected_shape, "raised ValueError")]


# ---------------------------------------------------------------- unit checks

def test_reference_pack_and_unpack_pass(capsys):
    checks.check_pack_blocks(pack_blocks)
    checks.check_unpack_blocks(unpack_blocks)
    assert capsys.readouterr().out.count("\u2713") == 2


@pytest.mark.parametrize("wrong, message", WRONG_PACKS, ids=[f.__name__ for f, _ in WRONG_PACKS])
def test_planted_wrong_pack_fails(wrong, message):
    with pytest.raises(checks.CheckFailed, match=message):
        checks.check_pack_blocks(wrong)


@pytest.mark.parametrize("wrong, message", WRONG_UNPACKS, ids=[f.__name__ for f, _ in WRONG_UNPACKS])
def test_planted_wrong_unpack_fails(wrong, message):
    with pytest.raises(checks.CheckFailed, match=message):
        checks.check_unpack_blocks(wrong)


# ---------------------------------------------------------------- end to end

def make(**kw):
    return LLM(device="cpu", num_blocks=128, kv_transfer_config={"kv_connector": "TcpConnector", **kw})


@pytest.fixture(scope="module")
def engines():
    prefill, decode = make(kv_lease_s=1.0), make()  # a short lease: a failed pull's blocks come back soon
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


@pytest.mark.parametrize("pack, unpack, message", [
    (pack_swaps_k_and_v, unpack_blocks, "differs from the colocated one at token \\d+.*look at pack_blocks"),
    (pack_blocks, unpack_k_into_v, "differs from the colocated one at token \\d+.*look at unpack_blocks"),
    (pack_blocks, unpack_wrong_expected_shape, "your unpack_blocks raised ValueError on the decode worker"),
], ids=["pack_swaps_k_and_v", "unpack_k_into_v", "unpack_wrong_expected_shape"])
def test_planted_wrong_hand_off_fails(engines, llm, pack, unpack, message):
    with pytest.raises(checks.CheckFailed, match=message):
        checks.check_kv_handoff(pack, unpack, *engines, llm)
    prefill, decode = engines  # the engines' own functions are back
    assert prefill.engine.connector.server.pack_blocks is pack_blocks
    assert decode.engine.connector.unpack_blocks is unpack_blocks


def test_reference_hand_off_passes(engines, llm, capsys):
    """Run last: it also shows the engines are usable after the failed hand-offs (the engines' own functions
    are back, the refused pull's held blocks came back when their lease ended)."""
    checks.check_kv_handoff(pack_blocks, unpack_blocks, *engines, llm)
    assert "1 prompt token" in capsys.readouterr().out


# ---------------------------------------------------------------- the decode side: land_transfers

def landing(lost_lease=False, double_free=False, recompute_from=1, keep_computed=False, missed_failure=False,
            ignored_failure=False, no_fail_policy=False, requeue_aborted=False, requeue_aborted_landed=False):
    """The engine's rule with one planted mistake switched on (each keyword is one)."""
    from labsupport.engine.request import RequestStatus

    def land(lc, done_sending, done_recving, failed):
        for rid in () if lost_lease else done_sending:
            req = lc.queues.held.pop(rid, None)
            if req is not None:
                if double_free:
                    for b in req.block_table:
                        lc.kv.allocator.free(b)
                lc.kv.release(req)
        landed = set(done_recving) | (set(failed) if missed_failure else set())
        failures = {} if missed_failure or ignored_failure else dict(failed)
        for rid in [*landed, *failures]:
            req = lc.queues.loading.pop(rid, None)
            if req is None:
                continue
            req.remote_kv.load_done = True
            if req.is_finished and not requeue_aborted and (rid in failures or not requeue_aborted_landed):
                lc.kv.release(req)
                continue
            if rid in failures and lc.connector.failure_policy == "fail" and not no_fail_policy:
                req.status = RequestStatus.WAITING
                lc.queues.waiting.appendleft(req)
                lc.finish(req, "error")
                continue
            if rid not in failures and not keep_computed:
                req.remote_kv.num_external_tokens = len(req.prompt_token_ids) - 1 - req.num_computed_tokens
                req.num_computed_tokens = len(req.prompt_token_ids) - recompute_from
            req.status = RequestStatus.WAITING
            lc.queues.waiting.appendleft(req)
    return land


PLANTED_LANDINGS = [
    ({"lost_lease": True}, "a pull that landed: afterwards prefill_llm .* blocks still held for a pull"),
    ({"double_free": True}, "a pull that landed: your land_transfers raised ValueError: double free"),
    ({"recompute_from": 2}, "computed 2 prompt tokens, expected 1"),
    ({"keep_computed": True}, "computed all 53 prompt tokens: the pulled KV went unused"),
    ({"missed_failure": True}, "'recompute'.*computed 1 of the 53 prompt tokens"),
    ({"ignored_failure": True}, "'recompute': the request never finished: a failed load must not leave it parked"),
    ({"no_fail_policy": True}, "'fail': the request finished with 'length': this policy ends it with an error"),
    ({"requeue_aborted": True}, "aborted while its KV was loading: the aborted request ran again and produced"),
    ({"requeue_aborted_landed": True}, "aborted while its KV was loading, the load then landing: "),
]


@pytest.mark.parametrize("bug, message", PLANTED_LANDINGS, ids=[next(iter(b)) for b, _ in PLANTED_LANDINGS])
def test_planted_wrong_land_transfers_fails(engines, llm, bug, message):
    with pytest.raises(checks.CheckFailed, match=message):
        checks.check_land_transfers(landing(**bug), *engines, llm)
    for engine in engines:  # the engine's own rule is back, and the check left both engines idle
        assert engine.engine.scheduler.lifecycle.land_transfers is land_transfers
        checks.pd.require_idle_pair(*engines, "the next test")


def test_reference_land_transfers_passes(engines, llm, capsys):
    checks.check_land_transfers(land_transfers, *engines, llm)
    checks.check_land_transfers(landing(), *engines, llm)  # the planted variant with no mistake passes too
    assert "1 prompt token computed" in capsys.readouterr().out
