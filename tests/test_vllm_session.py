"""``side_by_side.session.VllmSession``: one long-lived Python of vLLM's venv, one JSON line per job each way.

The protocol tests run a stand-in for vLLM's Python (a small script that answers, fails, hangs or dies on
request), so they need no vLLM and take a second: a job that fails raises with the log's tail, a job
that hangs past its timeout or dies stops the process, and the next job gets a fresh one (never a late
answer meant for the job before). The live test runs the real session script in ``.venv-vllm``.
"""
import os
import sys
import textwrap

import pytest

from labsupport.side_by_side import session as session_module
from labsupport.side_by_side.session import VllmSession
from labsupport.servers import vllm_status

STAND_IN = textwrap.dedent("""\
    #!{python}
    import json, os, sys, time
    print("stand-in starting", file=sys.stderr, flush=True)
    sys.stdout.write(json.dumps({{"ok": True, "ready": True, "pid": os.getpid()}}) + "\\n"); sys.stdout.flush()
    for line in sys.stdin:
        job = json.loads(line)["vllm"][0]
        if job == "hang":
            time.sleep(60)
        if job == "die":
            print("stand-in dying", file=sys.stderr, flush=True)
            sys.exit(3)
        answer = {{"ok": job != "fail", "pid": os.getpid(), "job": job}}
        if job == "fail":
            print("the stand-in's own error text", file=sys.stderr, flush=True)
            answer["error"] = "vllm fail exited with status 1"
        sys.stdout.write(json.dumps(answer) + "\\n"); sys.stdout.flush()
    """)


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    python = tmp_path / "python"
    python.write_text(STAND_IN.format(python=sys.executable))
    python.chmod(0o755)
    monkeypatch.setattr(session_module, "vllm_status", lambda: (True, "stand-in"))
    s = VllmSession(python)
    s.log_path = str(tmp_path / "session.log")
    yield s
    s.stop()


def test_jobs_go_to_one_process_and_come_back_in_order(stand_in):
    first = stand_in.vllm(["a"])
    second = stand_in.vllm(["b"])
    assert (first["job"], second["job"]) == ("a", "b")
    assert first["pid"] == second["pid"] == stand_in.ready()["pid"]  # one process for every job


def test_a_failed_job_raises_with_the_log_and_the_session_goes_on(stand_in):
    with pytest.raises(RuntimeError, match="(?s)exited with status 1.*the stand-in's own error text"):
        stand_in.vllm(["fail"])
    assert stand_in.alive and stand_in.vllm(["after"])["job"] == "after"


def test_a_job_past_its_timeout_stops_the_process_and_the_next_job_gets_a_fresh_one(stand_in):
    pid = stand_in.ready()["pid"]
    proc = stand_in.proc
    with pytest.raises(TimeoutError, match="no answer to vllm within 1 s"):
        stand_in.vllm(["hang"], timeout_s=1)
    assert proc.poll() is not None and not stand_in.alive  # stopped, not left sleeping
    again = stand_in.vllm(["next"])
    assert again["job"] == "next" and again["pid"] != pid  # a new process: no late answer read as this one


def test_a_process_that_dies_mid_job_is_reported_and_replaced(stand_in):
    with pytest.raises(RuntimeError, match="(?s)exited \\(3\\) during vllm.*stand-in dying"):
        stand_in.vllm(["die"])
    assert not stand_in.alive
    assert stand_in.vllm(["next"])["job"] == "next"


def test_stop_is_safe_twice_and_before_start(stand_in):
    stand_in.stop()
    stand_in.ready()
    proc = stand_in.proc
    stand_in.stop()
    stand_in.stop()
    assert proc.poll() is not None and stand_in.proc is None


USABLE, WHY = vllm_status()


@pytest.mark.vllm_serve
@pytest.mark.slow
@pytest.mark.skipif(not USABLE, reason=WHY)
def test_the_real_session_refuses_a_wrong_flag_and_answers_the_next_job():
    """vLLM's own ``vllm serve`` parser in the session: a wrong flag is an error naming the line, and the
    session stays for the next job (argparse's exit does not end it)."""
    with VllmSession() as s:
        with pytest.raises(RuntimeError, match="refused 'vllm serve m --no-such-flag 1'"):
            s.parse_serve(["vllm serve m --no-such-flag 1"])
        parsed = s.parse_serve(["vllm serve m --port 8100 --gpu-memory-utilization 0.4 --kv-transfer-config "
                                "'{\"kv_connector\": \"ExampleConnector\", \"kv_role\": \"kv_consumer\"}'"])
        assert parsed == [{"unknown_env": [], "port": 8100, "gpu_memory_utilization": 0.4,
                           "kv_connector": "ExampleConnector", "kv_role": "kv_consumer", "connector_registered": True}]
        assert os.path.exists(s.log_path)
