"""Chapter 08's parity track and side-by-side benchmark against a real ``vllm serve``.

One vLLM server and one of ours, started once for the module with matched knobs (a 32-token block,
the same tight pool, max_num_seqs, chunked prefill with a threshold): the parity run must find each
mechanism on both sides (prefix hits, salts that isolate, the batch cap, preemptions, chunks no
larger than the threshold), and the side-by-side run must complete every request through both load
generators. Without ``.venv-vllm`` the vLLM tests skip with ``vllm_status()``'s message.
"""
import math

import pytest

from labsupport.side_by_side.bench import COLUMNS, GENERATORS, BenchLoad, plot_side_by_side, side_by_side, table
from labsupport.experiments.parity import KNOBS, ROWS, ParitySizes, format_table, run_parity, start_servers
from labsupport.servers import vllm_status

USABLE, WHY = vllm_status()


def needs_vllm(test):
    return pytest.mark.vllm_serve(pytest.mark.slow(pytest.mark.skipif(not USABLE, reason=WHY)(test)))


SIZES = ParitySizes()
LOAD = BenchLoad(num_prompts=8, input_len=64, output_len=16, max_concurrency=4)  # fits the tight parity pool


@pytest.fixture(scope="module")
def servers():
    from labsupport.pd.cluster import stop_all
    started = start_servers(SIZES)
    try:
        yield started
    finally:
        stop_all(list(started))


@pytest.fixture(scope="module")
def parity(servers):
    return {r["key"]: r for r in run_parity(servers, SIZES)}


@pytest.fixture(scope="module")
def bench_rows(servers, parity):  # after the parity run: one experiment at a time on the cores
    return side_by_side(LOAD, servers=servers)


def test_knobs_and_table_format():
    assert all(k["ours"] and k["vllm"] and k["chapter"] for k in KNOBS)
    assert {k["ours"] for k in KNOBS} >= {"--block-size", "--num-blocks", "--max-num-seqs",
                                         "--max-num-batched-tokens", "--enable-chunked-prefill",
                                         "--long-prefill-token-threshold"}
    text = format_table([{"a": 1.23456, "b": "x", "key": "k"}, {"a": 12345.6, "b": "yy", "key": "k"}])
    assert text.splitlines()[0].split("|")[1].strip() == "a" and "1.23" in text and "12346" in text
    assert "key" not in text


def test_the_side_by_side_table_calls_a_tail_of_few_requests_the_max():
    from labsupport.side_by_side.bench import row
    few = [row("ours", GENERATORS[0], {"completed": 8, "p99_ttft_ms": 1014.0, "max_ttft_ms": 1020.0}),
           row("vLLM", GENERATORS[1], {"completed": 8, "p99_ttft_ms": 630.0, "p100_ttft_ms": 633.0})]
    header, _, ours, vllm = table(few).splitlines()
    assert "max_ttft_ms" in header and "p99_ttft_ms" not in header
    assert "1020" in ours and "633" in vllm and "1014" not in ours
    many = [row("ours", GENERATORS[0], {"completed": 100, "p99_ttft_ms": 5.0, "max_ttft_ms": 6.0})]
    assert "p99_ttft_ms" in table(many).splitlines()[0]


@needs_vllm
def test_parity_has_every_row_with_both_sides(parity):
    assert list(parity) == [key for key, *_ in ROWS]
    for key, r in parity.items():
        assert r["ours"] not in ("-", None) and r["vLLM"] not in ("-", None), r
    print("\n" + format_table(list(parity.values())))


@needs_vllm
def test_capacity_blocks_match(parity):
    assert parity["kv.blocks"]["ours"] == parity["kv.blocks"]["vLLM"] == SIZES.num_blocks - 1
    assert parity["kv.block_size"]["ours"] == parity["kv.block_size"]["vLLM"] == SIZES.block_size


@needs_vllm
def test_prefix_cache_hits_on_both(parity):
    r = parity["prefix.hit_rate"]
    assert r["ours"] > 0 and r["vLLM"] > 0
    assert math.isclose(r["ours"], r["vLLM"], abs_tol=0.05), "same blocks, same prompts: the same hit rate"


@needs_vllm
def test_cache_salt_isolates_on_both(parity):
    assert parity["salt.other_salt"]["ours"] == parity["salt.other_salt"]["vLLM"] == 0
    assert parity["salt.same_salt"]["ours"] > 0 and parity["salt.same_salt"]["vLLM"] > 0


@needs_vllm
def test_batch_is_capped_by_max_num_seqs(parity):
    r = parity["burst.peak_running"]
    assert r["ours"] == r["vLLM"] == SIZES.max_num_seqs


@needs_vllm
def test_tight_pool_preempts_on_both(parity):
    r = parity["tight.preemptions"]
    assert r["ours"] > 0 and r["vLLM"] > 0


@needs_vllm
def test_chunks_respect_threshold_and_budget(parity):
    for side in ("ours", "vLLM"):
        assert 0 < parity["chunked.max_chunk"][side] <= SIZES.long_prefill_token_threshold
        assert parity["chunked.max_step"][side] <= SIZES.max_num_batched_tokens
        assert parity["chunked.chunk_steps"][side] >= math.ceil(SIZES.long_input_len
                                                                / SIZES.long_prefill_token_threshold)
    lone = parity["chunked.lone_steps"]  # vLLM lifts the threshold for a request alone; ours keeps it
    assert lone["ours"] == math.ceil(SIZES.long_input_len / SIZES.long_prefill_token_threshold)
    assert lone["vLLM"] == math.ceil(SIZES.long_input_len / SIZES.max_num_batched_tokens)


@needs_vllm
def test_side_by_side_completes_every_request(bench_rows):
    assert [(r["server"], r["load generator"]) for r in bench_rows] == [
        (s, g) for s in ("ours", "vLLM") for g in GENERATORS]
    for r in bench_rows:
        assert r["completed"] == LOAD.num_prompts and r["failed"] == 0, r
        assert r["output_throughput"] > 0 and r["median_ttft_ms"] > 0
    print("\n" + table(bench_rows))
    fig = plot_side_by_side(bench_rows)
    assert len(fig.axes) == 4
    assert set(COLUMNS) <= set(bench_rows[0])
