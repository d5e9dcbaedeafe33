"""``bench serve-compare``'s own logic: the guidellm rounds' summary and the table without the loads. (The
comparison itself starts both servers and runs for minutes: ``make serve-compare``.)"""
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
