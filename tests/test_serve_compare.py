"""``bench serve-compare``'s own logic: the rounds' summaries (guidellm's and the burst's, a line per engine of
ours), the table without the loads, the engines' names and the options. (The comparison itself starts both
servers and runs for minutes: ``make serve-compare``.)"""
import argparse

import pytest

from labsupport.bench.serving import serve_compare as sc

MACHINE = {"date": "2026-12-04T20:22:00+00:00", "cpu": "AMD EPYC", "cores": 2}


def rounds(*pairs):
    return [row for i, (ours, vllm) in enumerate(pairs)
            for row in ({"round": i, "engine": "ours", "output_throughput": ours},
                        {"round": i, "engine": "vllm", "output_throughput": vllm})]


def test_each_round_is_a_ratio_and_the_median_is_theirs():
    text = sc.rounds_summary(rounds((143.5, 144.6), (149.1, 142.0), (137.2, 128.6)))
    assert "3 rounds" in text and "0.99x" in text and "1.05x" in text and "1.07x" in text
    assert text.endswith("median 1.05x")
    assert sc.rounds_summary(rounds((100.0, 100.0), (120.0, 100.0))).endswith("median 1.10x")  # even: the mean of two
    lone = [{"round": 0, "engine": "ours", "output_throughput": 150.0}, {"round": 1, "engine": "vllm", "skipped": "x"}]
    assert sc.rounds_summary(lone) == ""  # no round with both servers: nothing to compare


def test_a_rounds_only_report_prints_the_rounds_not_an_empty_table():
    report = {"machine": MACHINE, "results": {}, "guidellm_rounds": rounds((150.0, 140.0))}
    text = sc.format_table(report)
    assert "1.07x" in text and "| |" not in text and "2026-12-04" in text


def test_rounds_only_needs_rounds():
    p = argparse.ArgumentParser()
    sc.add_arguments(p)
    with pytest.raises(ValueError, match="guidellm-rounds"):
        sc.main(p.parse_args(["--only-guidellm-rounds"]))


def burst(*triples):
    """Rounds of the burst: (engine, tok/s, P99 ITL ms) per server, one tuple per round."""
    return [{"round": i, "engine": e, "output_throughput": tps, "p99_itl_ms": itl}
            for i, servers in enumerate(triples) for e, tps, itl in servers]


def test_burst_rounds_give_a_line_per_engine_of_ours_with_the_p99_itl_medians():
    rows = burst([("ours", 127.0, 700.0), ("vllm", 110.0, 2800.0), ("ours@2048", 133.0, 1500.0)],
                 [("ours", 125.0, 690.0), ("vllm", 115.0, 2400.0), ("ours@2048", 140.0, 1400.0)],
                 [("ours", 130.0, 710.0), ("vllm", 100.0, 2600.0), ("ours@2048", 120.0, 1600.0)])
    lines = sc.rounds_summary(rows, "burst").splitlines()
    assert len(lines) == 2 and lines[0].startswith("burst, 3 rounds (ours / vLLM")  # ours first, then the variant
    assert "1.15x" in lines[0] and "1.09x" in lines[0] and "1.30x" in lines[0]
    assert lines[0].endswith("median 1.15x; median P99 ITL 700 ms against 2,600 ms")
    assert "(ours@2048 / vLLM" in lines[1] and "median 1.21x" in lines[1]  # 1.21, 1.22, 1.20
    # a round where a server failed (no throughput) is left out of that engine's pairs, not counted as zero
    failed = rows + [{"round": 3, "engine": "ours", "output_throughput": None}, {"round": 3, "engine": "vllm",
                                                                                 "output_throughput": 90.0}]
    assert sc.rounds_summary(failed, "burst").splitlines()[0].startswith("burst, 3 rounds")


def test_the_table_prints_the_burst_rounds_before_guidellms():
    report = {"machine": MACHINE, "results": {}, "guidellm_rounds": rounds((150.0, 140.0)),
              "burst_rounds": burst([("ours", 132.0, 700.0), ("vllm", 110.0, 2500.0)])}
    text = sc.format_table(report)
    assert text.index("burst alone, 1 rounds") < text.index("guidellm alone, 1 rounds")
    assert "1.20x" in text and "1.07x" in text


def test_engines_name_a_budget_and_nothing_else():
    assert sc.parse_engines("ours, vllm,ours@2048") == ["ours", "vllm", "ours@2048"]
    for bad in ("ours@0", "ours@x", "ours@", "theirs", ""):
        with pytest.raises(ValueError, match="ours@N"):
            sc.parse_engines(bad)
    assert sc.server_args("ours@2048")[-2:] == ["--max-num-batched-tokens", "2048"]
    assert "--max-num-batched-tokens" not in sc.server_args("ours")  # the default budget is the server's own
    assert "--engine-in-process" in sc.server_args("ours-thread")


def test_only_rounds_accepts_burst_rounds_alone_and_refuses_negatives():
    p = argparse.ArgumentParser()
    sc.add_arguments(p)
    args = p.parse_args(["--only-rounds", "--burst-rounds", "2", "--rounds-engines", "ours,vllm"])
    assert args.only_rounds and args.burst_rounds == 2 and args.rounds_engines == "ours,vllm"
    assert p.parse_args(["--only-guidellm-rounds"]).only_rounds  # the older spelling still works
    with pytest.raises(ValueError, match="burst-rounds"):
        sc.main(p.parse_args(["--burst-rounds", "-1"]))
    with pytest.raises(ValueError, match="ours@N"):
        sc.main(p.parse_args(["--engines", "ours,nope"]))


def test_an_even_number_of_rounds_takes_the_mean_of_the_middle_two_p99_itls():
    rows = burst([("ours", 120.0, 600.0), ("vllm", 100.0, 2000.0)], [("ours", 130.0, 800.0), ("vllm", 100.0, 3000.0)])
    assert sc.rounds_summary(rows, "burst").endswith("median 1.25x; median P99 ITL 700 ms against 2,500 ms")


def test_a_round_that_fails_is_kept_as_an_error_and_the_rounds_go_on(tmp_path):
    """A server that cannot start (no model where it is told to look) fails its round, not the run."""
    ran = []
    rows = sc.alternating_rounds(["ours"], 2, str(tmp_path / "no-model"), lambda url: ran.append(url) or {},
                                 log=lambda *_: None)
    assert [r["round"] for r in rows] == [0, 1] and not ran
    assert all(r["engine"] == "ours" and r["error"] and "output_throughput" not in r for r in rows)
    assert sc.rounds_summary(rows, "burst") == ""


def test_rounds_need_vllm_and_one_of_ours_and_rounds_engines_need_rounds():
    p = argparse.ArgumentParser()
    sc.add_arguments(p)
    with pytest.raises(ValueError, match="needs vllm"):
        sc.main(p.parse_args(["--burst-rounds", "1", "--rounds-engines", "ours,ours@2048"]))
    with pytest.raises(ValueError, match="give --burst-rounds or --guidellm-rounds"):
        sc.main(p.parse_args(["--rounds-engines", "ours,vllm"]))
    assert sc.parse_engines("ours,vllm,ours") == ["ours", "vllm"]  # each once: one result per name
