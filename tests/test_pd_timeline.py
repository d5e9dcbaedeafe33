"""Chapter 07's PD timeline (labsupport/viz/pd_timeline.py) over real loopback workers: a prefill and a
decode server in this process hand off KV over HTTP as the router does; the timelines they answer,
the figure drawn from them, the live widget's polls, and the widget rendered in a browser."""
import threading
import time

import httpx
import matplotlib
import nbformat
import pytest
from nbclient import NotebookClient

from browser_tools import render_in_browser, require_browser, select
from waiting import wait_until
from labsupport import LLM
from labsupport.serve.api import create_app
from labsupport.serve.background import BackgroundServer, free_port
from labsupport.serve.metrics import parse_metrics
from labsupport.viz.pd_timeline import (PDTimelineWidget, fetch_timelines, plot_pd_timeline, render_svg,
                                        transfer_table)

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PROMPTS = ["Explain, step by step, why the sky is blue and sunsets are red. " * 3,
           "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 2,
           "List the planets of the solar system with one fact about each of them. " * 2]


def worker(role):
    return LLM(device="cpu", num_blocks=128, kv_transfer_config={"kv_connector": "TcpConnector", "kv_role": role})


@pytest.fixture(scope="module")
def pd():
    """Two workers, three hand-offs over HTTP: ``{"workers": {name: url}, "handoffs": [kv params...],
    "prompt_tokens_fed": prompt tokens the prefill worker computed}``."""
    prefill, decode = worker("kv_producer"), worker("kv_consumer")
    with BackgroundServer(create_app(prefill, "smol")) as p, BackgroundServer(create_app(decode, "smol")) as d:
        handoffs, fed = [], 0
        with httpx.Client(timeout=120) as client:
            for prompt in PROMPTS:
                first = client.post(p.url + "/v1/completions", json={
                    "prompt": prompt, "max_tokens": 1, "temperature": 0,
                    "kv_transfer_params": {"do_remote_decode": True}}).json()
                params = first["kv_transfer_params"]
                fed += first["usage"]["prompt_tokens"] - first["usage"]["prompt_tokens_details"]["cached_tokens"]
                rest = client.post(d.url + "/v1/completions", json={
                    "prompt": prompt, "max_tokens": 16, "temperature": 0, "kv_transfer_params": params})
                assert rest.status_code == 200, rest.text
                handoffs.append(params)
        yield {"workers": {"decode-0": d.url, "prefill-0": p.url},  # decode first on purpose: lanes reorder
               "handoffs": handoffs, "prompt_tokens_fed": fed}
    prefill.shutdown()
    decode.shutdown()


def settled(workers, n, timeout=10.0):
    """The timelines once both ends of ``n`` transfers are recorded (the sender's record follows the ack)."""
    def recorded():
        got = fetch_timelines(workers)
        return got if all(len(got[w].get("transfers", [])) >= n for w in workers) else None
    try:
        return wait_until(recorded, timeout=timeout, interval=0.05)
    except AssertionError:
        return fetch_timelines(workers)  # the caller's assertions say which end is missing


def gids(ax, prefix):
    return [a for a in ax.patches + ax.texts + ax.collections if (a.get_gid() or "").startswith(prefix)]


def test_fetch_links_send_and_recv_and_bytes_match_metrics(pd):
    got = settled(pd["workers"], 3)
    pre, dec = got["prefill-0"], got["decode-0"]
    assert pre["role"] == "kv_producer" and dec["role"] == "kv_consumer" and pre["engine_id"] != dec["engine_id"]
    # the prompts ran on the prefill worker only; the decode worker got their KV and ran decodes only (its
    # one uncomputed prompt token per request is a one-token step, which the engine counts as a decode)
    assert sum(sum(s["prefill"].values()) for s in pre["steps"]) == pd["prompt_tokens_fed"] > 0
    assert not any(s["decode"] for s in pre["steps"])
    assert not any(s["prefill"] for s in dec["steps"]) and len({r for s in dec["steps"] for r in s["decode"]}) == 3
    sends = {t["transfer_id"]: t for t in pre["transfers"]}
    recvs = {t["transfer_id"]: t for t in dec["transfers"]}
    assert set(sends) == set(recvs) == {h["remote_request_id"] for h in pd["handoffs"]}
    assert all(t["role"] == "send" for t in sends.values()) and all(t["role"] == "recv" for t in recvs.values())
    for tid, s in sends.items():
        assert s["ok"] and recvs[tid]["ok"] and s["num_bytes"] == recvs[tid]["num_bytes"] > 0
        assert s["num_blocks"] == recvs[tid]["num_blocks"] == len(next(
            h["remote_block_ids"] for h in pd["handoffs"] if h["remote_request_id"] == tid))
    metrics = parse_metrics(httpx.get(pd["workers"]["decode-0"] + "/metrics").text)
    assert metrics["labsupport:kv_transfer_bytes_received_total"] == sum(t["num_bytes"] for t in recvs.values())
    # the pull starts only after a prefill step has run on the prefill worker: the hand-off is in order
    assert min(t["start"] for t in sends.values()) >= min(s["end"] for s in pre["steps"])
    rows = transfer_table(got)
    assert [r["transfer_id"] for r in rows] == sorted(recvs, key=lambda t: recvs[t]["start"])
    for r in rows:
        assert r["from"] == "prefill-0" and r["to"] == "decode-0" and r["ok"] and r["error"] is None
        assert r["bytes"] == recvs[r["transfer_id"]]["num_bytes"] and r["ms"] > 0
        assert r["GB/s"] == pytest.approx(r["bytes"] / r["ms"] / 1e6)
        assert 0 < r["overlap_ms"] <= min(r["send_ms"], r["recv_ms"]) + 1e-6 and 0 < r["overlap"] <= 1 + 1e-9


def test_plot_draws_a_lane_per_worker_and_a_link_per_transfer(pd):
    got = settled(pd["workers"], 3)
    ax = plot_pd_timeline(got)
    assert [t.get_text().split("\n")[0] for t in ax.get_yticklabels()] == ["prefill-0", "decode-0"]  # prefill on top
    assert len(gids(ax, "pd-lane")) == 2
    steps = {c.get_gid(): len(c.get_paths()) for c in gids(ax, "pd-steps:")}
    assert steps == {"pd-steps:prefill-0": len(got["prefill-0"]["steps"]),
                     "pd-steps:decode-0": len(got["decode-0"]["steps"])}
    links, labels = gids(ax, "pd-transfer"), gids(ax, "pd-transfer-label")
    bands = [p for p in links if p.get_gid() == "pd-transfer"]
    assert len(bands) == 3 and len(labels) == 3 and not gids(ax, "pd-transfer-half")
    assert all("MB" in a.get_text() or "KB" in a.get_text() for a in labels)
    assert all("GB/s" in a.get_text() for a in labels)
    # each band runs from the prefill lane's lower edge (send interval) to the decode lane's upper edge (recv)
    t0 = min(t for tl in got.values() for ev in tl["steps"] + tl["transfers"] for t in (ev["start"], ev["end"]))
    sends = sorted(got["prefill-0"]["transfers"], key=lambda t: t["start"])
    recvs = {t["transfer_id"]: t for t in got["decode-0"]["transfers"]}
    for band, s in zip(sorted(bands, key=lambda b: b.get_xy()[0][0]), sends):
        (x0, y0), (x1, y1), (x2, y2), (x3, y3) = band.get_xy()[:4]
        r = recvs[s["transfer_id"]]
        assert (y0, y1, y2, y3) == pytest.approx((0.32, 0.32, 0.68, 0.68))
        assert (x0, x1, x2, x3) == pytest.approx([1e3 * (t - t0) for t in (s["start"], s["end"], r["end"], r["start"])])
    assert {t.get_text() for t in ax.get_legend().get_texts()} >= {"prefill step", "decode step", "KV transfer"}
    plt.close(ax.figure)


def test_an_unreachable_worker_is_an_error_lane_and_the_rest_still_draws(pd):
    workers = {**pd["workers"], "prefill-1": f"http://127.0.0.1:{free_port()}"}
    started = time.time()
    got = fetch_timelines(workers, timeout=1.0)
    assert time.time() - started < 5
    assert set(got["prefill-1"]) == {"error"} and "Connect" in got["prefill-1"]["error"]
    assert got["prefill-0"]["steps"] and got["decode-0"]["transfers"]
    later = fetch_timelines(pd["workers"], since=time.time() + 60)  # ``since``: only what ended after it
    assert all(tl["steps"] == tl["transfers"] == [] for tl in later.values())
    ax = plot_pd_timeline(got)
    assert len(gids(ax, "pd-lane")) == 3 and len(gids(ax, "pd-error")) == 1
    assert len(gids(ax, "pd-steps:")) == 2 and len([p for p in ax.patches if p.get_gid() == "pd-transfer"]) == 3
    plt.close(ax.figure)
    # a transfer whose other end is missing (the prefill worker gone) stays on its own lane
    ax = plot_pd_timeline({"decode-0": got["decode-0"], "prefill-1": got["prefill-1"]})
    assert len(gids(ax, "pd-transfer-half")) == 3 and not [p for p in ax.patches if p.get_gid() == "pd-transfer"]
    assert transfer_table({"decode-0": got["decode-0"]})[0]["from"] is None
    plt.close(ax.figure)


def test_a_colocated_worker_is_one_lane_beside_the_pd_pair(pd, llm):
    with BackgroundServer(create_app(llm, "smol")) as server:
        httpx.post(server.url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0},
                   timeout=120).raise_for_status()
        colocated = fetch_timelines({"colocated": server.url})
    assert colocated["colocated"]["role"] is None and colocated["colocated"]["transfers"] == []
    assert any(s["prefill"] for s in colocated["colocated"]["steps"]) and transfer_table(colocated) == []
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 3))
    plot_pd_timeline(colocated, ax=left, title="colocated")
    plot_pd_timeline(settled(pd["workers"], 3), ax=right, title="disaggregated")
    assert len(gids(left, "pd-lane")) == 1 and not gids(left, "pd-transfer")
    assert left.get_title(loc="left") == "colocated"
    assert len(gids(right, "pd-lane")) == 2 and len(gids(right, "pd-transfer-label")) == 3
    plt.close(fig)


def test_widget_polls_the_real_workers_and_stops(pd):
    expected = {h["remote_request_id"] for h in pd["handoffs"]}
    settled(pd["workers"], 3)
    w = PDTimelineWidget(pd["workers"], interval_s=0.1, window_s=600)
    view = w.widget
    assert "application/vnd.jupyter.widget-view+json" in w._repr_mimebundle_()
    with w:
        assert w.running
        from waiting import wait_until
        wait_until(lambda: w.polls >= 2, 5, message="the widget polled twice")
        snap = w.snapshot()
    assert not w.running and not any(t.name == "pd-timeline-poller" for t in threading.enumerate())
    assert {t["transfer_id"] for t in snap["prefill-0"]["transfers"]} == expected
    assert {t["transfer_id"] for t in snap["decode-0"]["transfers"]} == expected
    assert w.polls >= 3 and w.failures == 0 and w.last_error is None
    html = view.value
    assert "stopped" in html and "3 transfers" in html
    assert len(select(html, ".pd-timeline svg .pd-transfer")) == 3
    assert len(select(html, ".pd-timeline svg .pd-step")) == sum(len(tl["steps"]) for tl in w.snapshot().values())
    ax = w.plot()
    assert len([p for p in ax.patches if p.get_gid() == "pd-transfer"]) == 3
    plt.close(ax.figure)


def test_poller_gives_up_when_no_worker_answers():
    w = PDTimelineWidget({"gone": f"http://127.0.0.1:{free_port()}"}, interval_s=0.01, max_failures=3).start()
    w._thread.join(10)
    assert not w.running and w.last_error.startswith("gave up after 3 polls")
    w.stop()  # still safe: one more failed poll, drawn as an error lane
    assert "gone" in render_svg(w.snapshot(), 0, 1) and "error" in w.snapshot()["gone"]


CANNED = {
    "p": {"role": "kv_producer", "engine_id": "a", "transfers": [
        {"transfer_id": "t1", "role": "send", "start": 100.30, "end": 100.32, "num_bytes": 3_686_400, "num_blocks": 5,
         "ok": True, "error": None}],
        "steps": [{"start": 100.0, "end": 100.25, "prefill": {"r1": 69}, "decode": []}]},
    "d": {"role": "kv_consumer", "engine_id": "b", "transfers": [
        {"transfer_id": "t1", "role": "recv", "start": 100.29, "end": 100.33, "num_bytes": 3_686_400, "num_blocks": 5,
         "ok": True, "error": None},
        {"transfer_id": "t2", "role": "recv", "start": 100.5, "end": 100.6, "num_bytes": 0, "num_blocks": 5,
         "ok": False, "error": "ConnectionError: refused"}],
        "steps": [{"start": 100.34 + 0.05 * i, "end": 100.38 + 0.05 * i, "prefill": {"x": 1} if i == 0 else {},
                   "decode": ["x"]} for i in range(8)]},
}


def test_canned_timeline_svg_and_figure():
    svg = render_svg(CANNED, 99.5, 101.0)
    assert len(select(svg, "svg .pd-step")) == 9 and len(select(svg, ".pd-mixed")) == 1
    assert len(select(svg, ".pd-transfer")) == 1 and len(select(svg, ".pd-transfer-half")) == 1
    assert "3.7 MB · 0.09 GB/s" in svg and "failed: ConnectionError: refused" in svg
    ax = plot_pd_timeline(CANNED)
    assert "failed transfer" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert ([a.get_text() for a in gids(ax, "pd-transfer-label")]
            == ["3.7 MB · 0.09 GB/s", "failed: ConnectionError: refused"])  # one line: it fits between the lanes
    assert ax.get_xlim()[0] == pytest.approx(-5)  # t0: the earliest event
    plt.close(ax.figure)
    w = PDTimelineWidget({}, window_s=1.5)
    w.update(CANNED)
    html = w.render_html()
    assert "2 transfers (1 failed)" in html and "last: 3.7 MB in 40.0 ms (0.09 GB/s)" in html
    assert len(select(html, ".pd-step")) == 9 and w.snapshot() == CANNED


def test_widget_renders_in_browser(tmp_path):
    require_browser()
    cell = (f"from labsupport.viz.pd_timeline import PDTimelineWidget\nw = PDTimelineWidget({{}}, window_s=1.5)\n"
            f"w.update({CANNED!r})\nw")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    NotebookClient(nb, timeout=120, kernel_name="python3", store_widget_state=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert "application/vnd.jupyter.widget-state+json" in nb.metadata.get("widgets", {})
    nbformat.write(nb, tmp_path / "pd.ipynb")
    console = []
    dom = render_in_browser(tmp_path / "pd.ipynb", tmp_path / "html", console)
    assert select(dom, ".widget-subarea") and "Error displaying widget" not in dom, console
    assert len(select(dom, ".widget-subarea .pd-timeline svg .pd-transfer")) == 1, console
    assert len(select(dom, ".widget-subarea .pd-timeline svg .pd-step")) == 9


def crowded_run(ends_at=4.7):
    """Five hand-offs, three of them within 250 ms, the last at the very end of the run: the labels must
    dodge each other and the right edge."""
    sends, recvs, psteps, dsteps = [], [], [], []
    for i, (t, mb) in enumerate([(0.04, 0.7), (1.6, 2.9), (3.75, 23.6), (3.98, 2.9), (4.0, 2.9), (ends_at, 2.9)]):
        psteps.append({"start": t - 0.05, "end": t - 0.005, "prefill": {f"r{i}": 300}, "decode": []})
        for role, steps in (("send", sends), ("recv", recvs)):
            steps.append({"transfer_id": f"t{i}", "role": role, "start": t, "end": t + 0.03, "num_bytes": int(mb * 1e6),
                          "num_blocks": 4, "ok": True, "error": None})
        dsteps += [{"start": t + 0.04 + 0.03 * k, "end": t + 0.06 + 0.03 * k, "prefill": {}, "decode": ["x"]}
                   for k in range(3)]
    return {"prefill-0": {"role": "kv_producer", "steps": psteps, "transfers": sends},
            "decode-0": {"role": "kv_consumer", "steps": dsteps, "transfers": recvs}}


def test_panels_share_one_time_scale_and_labels_neither_overlap_nor_clip():
    from labsupport.viz.pd_timeline_draw import plot_pd_timelines, renderer_of

    colocated = {"colocated": {"role": None, "transfers": [], "steps": [
        {"start": 50.0 + 0.4 * k, "end": 50.3 + 0.4 * k, "prefill": {"a": 50}, "decode": []} for k in range(6)]}}
    fig = plot_pd_timelines([(crowded_run(), "1P+1D"), (colocated, "colocated, a shorter run")])
    pd_ax, colo_ax = fig.axes
    # the longer run (1P+1D: its first prefill starts at -0.01 s, its last decode step ends at 4.82 s) sets both
    assert pd_ax.get_xlim() == colo_ax.get_xlim() == pytest.approx((-5, 1e3 * (4.82 + 0.01) + 5))
    renderer = renderer_of(fig)
    fig.canvas.draw()  # legends find their place when drawn
    labels = [t for t in gids(pd_ax, "pd-transfer-label") if t.get_visible()]
    assert len(labels) >= 5  # crowded, yet nearly all placed
    boxes = [t.get_window_extent(renderer) for t in labels]
    frame = pd_ax.get_window_extent(renderer)
    assert all(frame.x0 <= b.x0 and b.x1 <= frame.x1 for b in boxes)  # none runs past the axes' right edge
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    page = fig.bbox
    for ax in fig.axes:  # no text of the figure, titles and legends included, outside it
        for t in ax.texts + [ax.title, ax._left_title] + ax.get_legend().get_texts():
            if t.get_visible() and t.get_text():
                b = t.get_window_extent(renderer)
                assert page.x0 <= b.x0 and b.x1 <= page.x1 and page.y0 <= b.y0 and b.y1 <= page.y1, t.get_text()
