"""Checks for chapter 07: the KV hand-off, ``pack_blocks`` and ``unpack_blocks``, and its decode side,
``land_transfers``.

The unit checks run the attendee's functions on small random pools, shaped like one layer of
``PagedAttention`` (``[num_kv_heads, slots, head_dim]``, slot = block * block_size + offset), in the
cases that hide mistakes: block size 1 (no offsets to get wrong) and 16, GQA head counts, float32
and bfloat16, ids out of order and not contiguous, a single block, the pool's last block. A wrong
value is traced back to where it came from, so the message says what happened ("holds block 1's
K", "K and V are swapped"), not only that something differs.

``check_kv_handoff`` then plugs both into two real engines with TCP connectors and moves a prompt's
KV between them, as the router does: the decode engine must compute one prompt token, answer what
a colocated engine answers, and leave no block behind on either side.
"""
from __future__ import annotations

import contextlib
import logging
import time
import uuid

import torch

from ..engine.request import SamplingParams
from ..pd.kv_transfer import pack_blocks as reference_pack
from ..pd.kv_transfer import unpack_blocks as reference_unpack
from .base import CheckFailed, passed

# (num_kv_heads, blocks in the pool, block_size, head_dim, dtype, sending ids, receiving ids)
CASES = [(2, 8, 4, 8, torch.float32, [5, 1, 6], [0, 7, 2]),
         (3, 10, 1, 4, torch.float32, [7, 2, 9, 0], [4, 8, 1, 3]),      # block_size 1, 3 KV heads
         (2, 6, 16, 8, torch.bfloat16, [5], [5]),                       # one block: the pool's last
         (4, 12, 8, 16, torch.bfloat16, [11, 3, 7, 2], [6, 11, 0, 9]),  # the last block among others
         (1, 5, 16, 4, torch.float32, [4, 0], [2, 4])]
PROMPT = ("The prefill worker reads the whole prompt once; the decode worker then continues from the blocks "
          "it was sent, one layer at a time, in the order the request uses them, and it never computes them "
          "again, which is the whole point of splitting the two.")  # 53 tokens, a prime: the last block is partial
NEW_TOKENS = 8


def _pools(hkv, num_blocks, bs, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(hkv, num_blocks * bs, d, generator=g).to(dtype) for _ in "kv"]


def _call(what, fn, *args, note=""):
    try:
        return fn(*args)
    except Exception as exc:
        raise CheckFailed(f"{what}: raised {type(exc).__name__}: {exc}{note}") from exc


def _origin(vec, pools, head):
    """Where in ``pools`` ({name: [H, slots, D]}) ``vec`` lives: (name, head, slot), own head first, or None."""
    for name, pool in pools.items():
        for h in [head, *(h for h in range(pool.shape[0]) if h != head)]:
            hit = (pool[h] == vec).all(-1).nonzero()
            if len(hit):
                return name, h, int(hit[0])
    return None


def check_pack_blocks(pack_fn):
    """``pack_fn(k_pool, v_pool, block_ids, block_size)`` -> ``[2, Hkv, len(block_ids) * block_size, D]``."""
    for hkv, nb, bs, d, dtype, ids, _ in CASES:
        k, v = _pools(hkv, nb, bs, d, dtype, seed=nb)
        k0, v0, n = k.clone(), v.clone(), len(ids)
        what = f"pack_blocks(block_ids={ids}, block_size={bs}) on {hkv} KV heads in {str(dtype)[6:]}"
        got = _call(what, pack_fn, k, v, list(ids), bs)
        if not (torch.equal(k, k0) and torch.equal(v, v0)):
            raise CheckFailed(f"{what} changed the pool: packing must only read it (the blocks are still in use)")
        if not isinstance(got, torch.Tensor):
            raise CheckFailed(f"{what} returned a {type(got).__name__}: return one tensor (it goes on the wire)")
        want = reference_pack(k, v, ids, bs)
        if got.shape != want.shape:
            shape = tuple(got.shape)
            hint = {(hkv, n * bs, d): " (V is missing: stack K and V)", (2, n * bs, hkv, d): " (heads and slots "
                    "are swapped)", (2, hkv, nb * bs, d): " (the whole pool: select only block_ids)"}.get(shape, "")
            raise CheckFailed(f"{what}: the output shape is {shape}, expected {tuple(want.shape)} = [2 (K then V), "
                              f"num_kv_heads, len(block_ids) * block_size, head_dim]{hint}")
        if got.dtype != dtype:
            raise CheckFailed(f"{what}: the output is {got.dtype}, the pool {dtype}: send the pool's own values "
                              "(the receiver reads the bytes as the pool's dtype)")
        bad = (got != want).any(-1).permute(0, 2, 1).nonzero()  # [K/V, slot in packed, head]: first wrong vector
        if not len(bad):
            continue
        p, t, h = bad[0].tolist()
        part, (i, o), b = "KV"[p], divmod(t, bs), ids[t // bs]
        at = f"{what}: packed[{p}] ({part}) at position {i} (block {b}), offset {o}, head {h}"
        found = _origin(got[p, h, t], {"K": k, "V": v}, h)
        if found is None:
            raise CheckFailed(f"{at} holds values found nowhere in the pool: copy them, do not compute them")
        (name, fh, s), (sb, so) = found, divmod(found[2], bs)
        if name != part:
            raise CheckFailed(f"{what}: K and V are swapped: packed[0] must be K, packed[1] V"
                              if p == 0 and torch.equal(got[1], want[0]) else
                              f"{at} holds {name}: V is missing (packed is [K, V])" if p == 1 else
                              f"{at} holds V: packed[0] must be K")
        if fh != h:
            raise CheckFailed(f"{at} holds head {fh}'s {name}: keep every head in its place (dim 0 of the pool)")
        if sb != b:
            hint = ("you sorted the ids: keep the order given, the receiver writes the i-th block into its i-th id"
                    if sorted(ids)[i] == sb else
                    f"off by one block: block {b} is slots {b * bs}..{(b + 1) * bs - 1}" if abs(sb - b) == 1 else
                    f"position i must be block_ids[i] = {b}")
            raise CheckFailed(f"{at} holds block {sb}'s {name}: {hint}")
        raise CheckFailed(f"{at} holds the {name} of offset {so} (slot {s}): token {o} of block {b} is slot "
                          f"block * block_size + offset = {b * bs + o}")
    passed(f"pack_blocks packs K then V of the given blocks in their order, in {len(CASES)} cases "
           "(block sizes 1 to 16, GQA heads, bfloat16, the pool's last block)")


def _went_wrong(pools, old, packed, ids, bs, i, p):
    """What became of the i-th packed block's K (p=0) or V (p=1), which is not where it belongs."""
    part, blk, chunk = "KV"[p], ids[i], packed[p, :, i * bs:(i + 1) * bs]
    for x, b in ((x, b) for x in "KV" for b in range(pools[x].shape[1] // bs)):
        if torch.equal(pools[x][:, b * bs:(b + 1) * bs], chunk):  # the whole block went somewhere else
            if x != part:
                return (f"its {part} landed in the {x} of block {b}'s slots (K and V are swapped: packed[0] is K, "
                        "packed[1] V)")
            hint = "you sorted the ids: " if sorted(ids)[i] == b else "block_ids were ignored: " if b == i else ""
            return f"its {part} landed in block {b}'s slots ({hint}the i-th packed block goes into block_ids[i])"
    mine = pools[part][:, blk * bs:(blk + 1) * bs]
    o = int((mine != chunk).any(-1).any(0).nonzero()[0])  # the first wrong token, and head
    h = int((mine[:, o] != chunk[:, o]).any(-1).nonzero()[0])
    now, src = mine[h, o], _origin(mine[h, o], {"K": packed[0], "V": packed[1]}, h)
    state = ("was not written" if torch.equal(now, old[part][h, blk * bs + o]) else "is zero" if not now.any() else
             "holds values that are not in the packed tensor" if src is None else
             f"holds packed {src[0]}'s token {src[2] % bs} of packed block {src[2] // bs}"
             + (f" from head {src[1]}" if src[1] != h else ""))
    rule = ("packed[0] is K, packed[1] V" if src and src[0] != part else
            "keep every head in its place (dim 1 of packed, dim 0 of the pool)" if src and src[1] != h else
            f"token o of packed block i goes into slot block_ids[i] * block_size + o = {blk * bs + o}")
    return f"its {part} at offset {o}, head {h} {state}: {rule}"


def check_unpack_blocks(unpack_fn):
    """``unpack_fn(k_pool, v_pool, block_ids, block_size, packed)`` writes packed block i into block_ids[i]."""
    for hkv, nb, bs, d, dtype, src, ids in CASES:
        n, sk, sv = len(ids), *_pools(hkv, nb, bs, d, dtype, seed=nb)
        packed = reference_pack(sk, sv, src, bs)
        k, v = _pools(hkv, nb, bs, d, dtype, seed=nb + 100)  # not zeros: an untouched slot keeps its value
        k0, v0 = k.clone(), v.clone()
        what = f"unpack_blocks(block_ids={ids}, block_size={bs}) on {hkv} KV heads in {str(dtype)[6:]}"
        _call(what, unpack_fn, k, v, list(ids), bs, packed.clone(), note=f" (the packed tensor was right: "
              f"{tuple(packed.shape)} = [2, num_kv_heads, {n} * block_size, head_dim])")
        want = {"K": k0.clone(), "V": v0.clone()}
        reference_unpack(want["K"], want["V"], ids, bs, packed)
        pools, old = {"K": k, "V": v}, {"K": k0, "V": v0}
        if all(torch.equal(pools[x], old[x]) for x in "KV"):
            raise CheckFailed(f"{what} left the pool as it was: write into k_pool and v_pool in place "
                              "(index_copy_, or assignment through a view), not into a copy")
        for i, blk in enumerate(ids):
            for p, part in enumerate("KV"):
                if not torch.equal(pools[part][:, blk * bs:(blk + 1) * bs], packed[p, :, i * bs:(i + 1) * bs]):
                    raise CheckFailed(f"{what}: packed block {i} (for block {blk}): "
                                      + _went_wrong(pools, old, packed, ids, bs, i, p))
        for part in "KV":
            changed = (pools[part] != want[part]).any(-1).any(0).nonzero()
            if len(changed):
                s = int(changed[0])
                zeroed = not pools[part][:, s].any()
                raise CheckFailed(f"{what}: slots outside the given blocks changed ({part} of block {s // bs}, slot {s}"
                                  f"{' was zeroed' if zeroed else ''}): write only into block_ids, the rest of the "
                                  "pool belongs to other requests")
        _check_refuses(unpack_fn, what, hkv, nb, bs, d, dtype, ids, packed)
    passed(f"unpack_blocks writes each packed block into its id and nothing else, and refuses a misshapen "
           f"tensor, in {len(CASES)} cases (block sizes 1 to 16, GQA heads, bfloat16, the pool's last block)")


def _check_refuses(unpack_fn, what, hkv, nb, bs, d, dtype, ids, packed):
    """A tensor of the wrong shape must be refused with ValueError before anything is written: ``view`` would
    accept a transposed one of the same size, and the next request would read garbage."""
    short = packed[:, :, :-bs] if len(ids) > 1 else torch.cat([packed, packed], 2)
    for bad, why in ((packed.transpose(1, 2).contiguous(), "heads and slots transposed"),
                     (short, f"{short.shape[2] // bs} blocks' worth")):
        k, v = _pools(hkv, nb, bs, d, dtype, seed=7)
        k0, v0 = k.clone(), v.clone()
        try:
            unpack_fn(k, v, list(ids), bs, bad)
        except ValueError:
            if not (torch.equal(k, k0) and torch.equal(v, v0)):
                raise CheckFailed(f"{what} raised ValueError on a tensor of shape {tuple(bad.shape)} ({why}) but "
                                  "had already written into the pool: check the shape first") from None
            continue
        except Exception as exc:
            raise CheckFailed(f"{what} raised {type(exc).__name__} ({exc}) on a tensor of shape {tuple(bad.shape)} "
                              f"({why}): check the shape first and raise ValueError naming the expected "
                              f"{(2, hkv, len(ids) * bs, d)}") from exc
        raise CheckFailed(f"{what} accepted a packed tensor of shape {tuple(bad.shape)} ({why}) for {len(ids)} "
                          f"blocks, expected {(2, hkv, len(ids) * bs, d)}: raise ValueError, a wrong tensor must "
                          "never be written into the pool")


# ---------------------------------------------------------------- end to end, on real engines

def _settle(llm, timeout):
    """Step an engine until no KV is on its way in or out: held blocks are freed on the step after their pull."""
    deadline = time.monotonic() + timeout
    while llm.engine.has_pending_transfers() and time.monotonic() < deadline:
        llm.engine.step()
        time.sleep(0.01)


def _idle(llm):
    s, sched = llm.stats(), llm.engine.scheduler
    return s["kv_blocks_free"] == s["kv_blocks_total"] and not sched.queues.held and not sched.queues.loading


def require_idle_pair(prefill_llm, decode_llm, before: str):
    """Two distinct engines with KV connectors and nothing in flight: what every end-to-end PD check runs on.
    An earlier failed run's held blocks are waited out (their lease) before the engines count as busy."""
    if prefill_llm is decode_llm:
        raise ValueError("prefill_llm and decode_llm must be two engines: the KV has to travel")
    for name, llm in (("prefill_llm", prefill_llm), ("decode_llm", decode_llm)):
        if getattr(llm.engine, "connector", None) is None:
            raise ValueError(f"{name} has no KV connector: create it with "
                             "LLM(..., kv_transfer_config={'kv_connector': 'TcpConnector'})")
        _settle(llm, llm.engine.connector.lease_s + 2)
        if not _idle(llm):
            raise CheckFailed(f"{name} is busy before {before} (blocks in use, or KV held or loading): "
                              "give the check idle engines")


def _hand_off(prefill_llm, decode_llm, pack_fn, unpack_fn):
    """The router's two legs with these functions plugged in; a fresh cache_salt so no prefix cache can help."""
    errors, prompt = {}, {"prompt": PROMPT, "cache_salt": f"check_kv_handoff-{uuid.uuid4().hex}"}

    def recorded(fn, name):  # the engines catch what the attendee's function raises: keep it for the message
        def call(*args):
            try:
                return fn(*args)
            except Exception as exc:
                errors.setdefault(name, exc)
                raise
        return call

    def run(llm, max_tokens, kv_params):
        params = SamplingParams(max_tokens=max_tokens, kv_transfer_params=kv_params, temperature=0, ignore_eos=True)
        return llm.generate(prompt, params, use_tqdm=False, use_result_cache=False)[0]

    with prefill_llm.plugged(pack_blocks=recorded(pack_fn, "pack_blocks")), \
            decode_llm.plugged(unpack_blocks=recorded(unpack_fn, "unpack_blocks")):
        pre = run(prefill_llm, 1, {"do_remote_decode": True})  # its blocks are held for the pull
        before = decode_llm.stats()
        out = run(decode_llm, NEW_TOKENS, pre.kv_transfer_params)  # parks the request, pulls, then decodes
        after = decode_llm.stats()
    return pre, out, {k: after[k] - before[k] for k in ("prompt_tokens_computed", "kv_loads_failed")}, errors


def check_kv_handoff(pack_fn, unpack_fn, prefill_llm, decode_llm, colocated_llm):
    """Prefill on ``prefill_llm``, pull the KV into ``decode_llm`` through the attendee's functions, decode there:
    the tokens must equal ``colocated_llm``'s, with one prompt token computed and every block freed after."""
    require_idle_pair(prefill_llm, decode_llm, "the hand-off")
    want = colocated_llm.generate(PROMPT, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
                                  use_tqdm=False, use_result_cache=False)[0]
    pre, out, delta, errors = _hand_off(prefill_llm, decode_llm, pack_fn, unpack_fn)
    n = len(want.prompt_token_ids)
    fallback = "failed the request" if out.finish_reason == "error" else "computed the whole prompt itself"
    for name, exc in errors.items():  # the first one is enough
        side = "prefill" if name == "pack_blocks" else "decode"
        raise CheckFailed(f"your {name} raised {type(exc).__name__} on the {side} worker during the hand-off: "
                          f"{exc}. The KV never arrived: the decode worker {fallback}")
    if pre.token_ids != want.token_ids[:1]:
        raise CheckFailed("the prefill engine's token differs from the colocated engine's: give both the same model")
    if delta["kv_loads_failed"] or out.finish_reason == "error":
        raise CheckFailed(f"the KV load failed (the connector's log says why): the decode worker {fallback}")
    if out.token_ids != want.token_ids:
        i = next((i for i, (a, b) in enumerate(zip(out.token_ids, want.token_ids)) if a != b), len(out.token_ids))
        # which side? each of the attendee's functions again, with the reference one on the other side
        pack_ok, unpack_ok = (_hand_off(prefill_llm, decode_llm, *fns)[1].token_ids == want.token_ids
                              for fns in ((pack_fn, reference_unpack), (reference_pack, unpack_fn)))
        _settle(prefill_llm, 5)
        blame = ("with the reference unpack_blocks your pack_blocks works, so look at unpack_blocks" if pack_ok else
                 "with the reference pack_blocks your unpack_blocks works, so look at pack_blocks" if unpack_ok else
                 "each of your functions fails even with the reference one on the other side")
        raise CheckFailed(f"the decode worker's answer differs from the colocated one at token {i}: its KV did not "
                          f"arrive intact ({blame}; check_pack_blocks and check_unpack_blocks say more)")
    if delta["prompt_tokens_computed"] != 1:
        raise CheckFailed(f"the decode worker computed {delta['prompt_tokens_computed']} prompt tokens, expected 1 "
                          f"(the last, for its logits): the other {n - 1} tokens' KV must come from the prefill worker")
    for name, llm in (("prefill_llm", prefill_llm), ("decode_llm", decode_llm)):
        _settle(llm, 5)
        if not _idle(llm):
            s = llm.stats()
            raise CheckFailed(f"after the hand-off {name} has {s['kv_blocks_free']} of {s['kv_blocks_total']} blocks "
                              f"free, {s.get('kv_requests_held')} requests' KV held: every block must be freed")
    blocks = -(-n // decode_llm.engine.kv.block_size)
    passed(f"a {n}-token prompt's KV ({blocks} blocks, every layer) went through your pack_blocks and unpack_blocks "
           f"over TCP: the decode worker computed 1 prompt token, its {NEW_TOKENS} tokens equal the colocated "
           "engine's, and both engines freed every block")


# ---------------------------------------------------------------- the decode side of the hand-off

def _step_until(llm, req, seconds: float) -> bool:
    """Step ``llm`` until ``req`` finished and no KV is on its way in or out, for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        llm.engine.step()
        if req.is_finished and not llm.engine.has_pending_transfers():
            return True
        time.sleep(0.005)
    return False


def _unheard():
    """A listening socket that never answers: a pull from it hangs until the pull times out."""
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(4)
    return s


def check_land_transfers(land_fn, prefill_llm, decode_llm, colocated_llm):
    """The attendee's ``land_transfers`` on both engines of a real pair, in the four cases of the hand-off:
    (1) a pull that lands: the answer equals ``colocated_llm``'s, the decode worker computes one prompt token,
    the prefill worker's held blocks are freed once pulled; (2) a load that fails under
    ``kv_load_failure_policy="recompute"``: the decode worker computes the whole prompt and answers the same;
    (3) the same under ``"fail"``: the request ends with an error; (4) a request aborted while its load runs:
    its blocks are freed once the load ends (here it fails), and it never comes back; (5) the same with a load
    that lands. Every case leaves both engines idle.
    Whatever the attendee's function left behind is settled with the engine's own before the next case."""
    from ..engine.lifecycle import land_transfers as reference
    require_idle_pair(prefill_llm, decode_llm, "the check")
    plain = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    want = colocated_llm.generate(PROMPT, plain, use_tqdm=False, use_result_cache=False)[0]
    n, errors, seen = len(want.prompt_token_ids), [], {"sending": set(), "recving": set(), "failed": {}}
    mine = []  # the decode worker's requests of this check: any left unfinished is aborted at the end

    def recorded(lc, done_sending, done_recving, failed):
        seen["sending"] |= set(done_sending)
        seen["recving"] |= set(done_recving)
        seen["failed"] |= dict(failed)
        try:
            return land_fn(lc, done_sending, done_recving, failed)
        except Exception as exc:
            errors.append(exc)
            raise

    def settle():  # the engine's own rule on what the attendee's was handed, the check's requests ended, drained
        for llm in (prefill_llm, decode_llm):
            reference(llm.engine.scheduler.lifecycle, set(seen["sending"]), set(seen["recving"]), dict(seen["failed"]))
        for req in mine:
            if not req.is_finished:
                decode_llm.engine.abort(req)
        for llm in (prefill_llm, decode_llm):
            _settle(llm, 3)  # after the with block: the engine's own rule is back

    def decode(kv_params, seconds=10.0):
        salt = f"check_land_transfers-{uuid.uuid4().hex}"
        params = SamplingParams(max_tokens=NEW_TOKENS, kv_transfer_params=kv_params, temperature=0, ignore_eos=True)
        before = decode_llm.stats()["prompt_tokens_computed"]
        req = decode_llm.engine.add_request(list(want.prompt_token_ids), params, cache_salt=salt)
        mine.append(req)
        try:
            done = _step_until(decode_llm, req, seconds)
        except Exception:
            if not errors:
                raise  # not the attendee's function: the check's own failure, shown as it is
            done = True  # the step failed in the attendee's function: the engine failed the request
        return req, done, decode_llm.stats()["prompt_tokens_computed"] - before

    def handed_off():  # the prefill worker's side: the prompt computed, its blocks held for a pull
        return prefill_llm.generate({"prompt": PROMPT, "cache_salt": f"check-{uuid.uuid4().hex}"},
                                    SamplingParams(max_tokens=1, temperature=0, ignore_eos=True,
                                                   kv_transfer_params={"do_remote_decode": True}),
                                    use_tqdm=False, use_result_cache=False)[0]

    def abort_while_loading(kv_params, case, rule):  # parked, aborted once its pull started, the load left to end
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, kv_transfer_params=kv_params)
        req = decode_llm.engine.add_request(list(want.prompt_token_ids), params,
                                            cache_salt=f"check_land_transfers-{uuid.uuid4().hex}")
        mine.append(req)
        decode_llm.engine.step()  # parked: its blocks reserved, the pull started
        decode_llm.engine.abort(req)
        drain(decode_llm, case)
        if req.output_token_ids:
            raise CheckFailed(f"{case}: the aborted request ran again and produced {len(req.output_token_ids)} "
                              f"tokens: {rule}")

    def raised(case):
        if errors:
            exc = errors[0]
            raise CheckFailed(f"{case}: your land_transfers raised {type(exc).__name__}: {exc}. The engine failed "
                              "the step's requests")

    def drain(llm, case):  # step until no KV moves; a step that raised in the attendee's function is reported
        try:
            _settle(llm, 3)
        except Exception:
            if not errors:
                raise
        raised(case)

    def idle_after(case, which=("prefill_llm", "decode_llm")):
        for name, llm in (("prefill_llm", prefill_llm), ("decode_llm", decode_llm)):
            if name not in which:
                continue
            drain(llm, case)
            if not _idle(llm):
                s = llm.stats()
                q = llm.engine.scheduler.queues
                where = ("finished requests' blocks still held for a pull that already happened (done_sending)"
                         if q.held else "requests still parked as loading" if q.loading else
                         "blocks of no live request still in use")
                raise CheckFailed(f"{case}: afterwards {name} has {s['kv_blocks_free']} of {s['kv_blocks_total']} "
                                  f"blocks free: {where}. Every block must go back to the pool once nobody needs it")

    connector = decode_llm.engine.connector
    policy, timeout = connector.failure_policy, connector.pull_timeout_s
    quiet = logging.getLogger(connector.__module__)  # cases 2-4 fail loads on purpose: no warning for each
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with prefill_llm.plugged(land_transfers=recorded), decode_llm.plugged(land_transfers=recorded):
            # (1) a pull that lands
            case = "a pull that landed"
            pre = handed_off()
            raised(case)
            req, done, computed = decode(pre.kv_transfer_params, 30.0)
            raised(case)
            if not done:
                raise CheckFailed(f"{case}: the request never finished: once its KV has landed it must go back to "
                                  "the waiting queue (its head: it was admitted already) to be scheduled again")
            if req.finish_reason == "error":
                raise CheckFailed(f"{case}: the request ended with an error, though its load landed")
            if computed == n:
                raise CheckFailed(f"{case}: the decode worker computed all {n} prompt tokens: the pulled KV went "
                                  "unused. A landed request has every prompt token computed but the last")
            if computed != 1:
                raise CheckFailed(f"{case}: the decode worker computed {computed} prompt tokens, expected 1: only "
                                  "the last is computed again (its logits give the first new token)")
            if req.output_token_ids != want.token_ids:
                i = next((i for i, (a, b) in enumerate(zip(req.output_token_ids, want.token_ids)) if a != b),
                         len(req.output_token_ids))
                raise CheckFailed(f"{case}: the answer differs from the colocated one at token {i}: the request "
                                  "must keep the blocks the KV landed in")
            if req.remote_kv.num_external_tokens != n - 1:
                raise CheckFailed(f"{case}: the request counts {req.remote_kv.num_external_tokens} prompt tokens as "
                                  f"pulled; {n - 1} came over the wire (the metrics report this count)")
            idle_after(case)
            # (2) a load that fails, policy "recompute": a transfer the prefill worker never held
            ids = list(range(-(-n // decode_llm.engine.kv.block_size)))
            missing = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "none",
                       "remote_block_ids": ids, "remote_host": "127.0.0.1",
                       "remote_port": prefill_llm.engine.connector.server.port,
                       "remote_request_id": f"never-held-{uuid.uuid4().hex}", "tp_size": 1}
            connector.failure_policy = "recompute"
            case = "a failed load under kv_load_failure_policy='recompute'"
            req, done, computed = decode(missing)
            raised(case)
            if not done:
                raise CheckFailed(f"{case}: the request never finished: a failed load must not leave it parked")
            if req.finish_reason == "error":
                raise CheckFailed(f"{case}: the request failed; this policy computes the prompt here instead")
            if req.output_token_ids != want.token_ids or computed != n:
                raise CheckFailed(f"{case}: the decode worker computed {computed} of the {n} prompt tokens and "
                                  f"answered {'the same' if req.output_token_ids == want.token_ids else 'otherwise'}: "
                                  "a failed load left nothing usable in its blocks, so every prompt token must be "
                                  "computed here")
            idle_after(case, ("decode_llm",))
            # (3) the same, policy "fail"
            connector.failure_policy = "fail"
            case = "a failed load under kv_load_failure_policy='fail'"
            req, done, computed = decode({**missing, "remote_request_id": f"never-held-{uuid.uuid4().hex}"})
            raised(case)
            if not done or req.finish_reason != "error":
                raise CheckFailed(f"{case}: the request {'never finished' if not done else 'finished with '}"
                                  f"{'' if not done else repr(req.finish_reason)}: this policy ends it with an error")
            if computed:
                raise CheckFailed(f"{case}: the decode worker computed {computed} prompt tokens for a request this "
                                  "policy fails")
            idle_after(case, ("decode_llm",))
            # (4) aborted while its load runs: the load hangs until the pull times out
            connector.failure_policy, connector.pull_timeout_s = "recompute", 0.5
            case = "a request aborted while its KV was loading"
            with contextlib.closing(_unheard()) as sock:
                abort_while_loading({**missing, "remote_port": sock.getsockname()[1]}, case,
                                    "once its load ends, an aborted request only frees its blocks")
            idle_after(case, ("decode_llm",))
            # (5) aborted after its pull started, the pull then landing: the engine learns of the landing at
            # the next step's poll, so the abort always comes first, however quick the pull
            connector.pull_timeout_s = timeout
            case = "a request aborted while its KV was loading, the load then landing"
            pre = handed_off()
            raised(case)
            abort_while_loading(pre.kv_transfer_params, case, "a load that lands for an aborted request only frees "
                                                              "its blocks")
            idle_after(case)
    finally:
        connector.failure_policy, connector.pull_timeout_s = policy, timeout
        settle()
        quiet.setLevel(level)
    passed(f"your land_transfers on both workers: a landed {n}-token prompt's KV was used (1 prompt token computed, "
           f"{NEW_TOKENS} tokens equal the colocated engine's), the pulled blocks were freed; a failed load computed "
           "the prompt (policy 'recompute') or failed the request ('fail'); an aborted request's load, failed or "
           "landed, freed its blocks; both engines idle after each case")
