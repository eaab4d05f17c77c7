"""The decider server against the real thing: HTTP on a free localhost port, the real jobs.

Equality claims compare the server's probabilities with ``ask`` and ``jobs.evaluate`` computed in
this process (1e-6, CPU); batching claims use the TEST-ONLY hold inside the worker's forward, so
the queue holds exactly the questions the test sent when the worker takes them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import threading
import time

import httpx
import pytest

from hobson.decider.ask import ask
from hobson.decider.evaluate import model_probs
from hobson.decider.predict import load_decider, rendered_lengths, row_temperature
from hobson.serve.batching import plan_forwards
from tests.serve.conftest import CAP, PER_REQUEST, QUEUE, REPO, Server, question

TOL = 1e-6


@pytest.fixture(scope="module")
def loaded(calibrated):
    return load_decider(calibrated)


@pytest.fixture(scope="module")
def expected(loaded, rows) -> list[list[float]]:
    probs = ask(loaded, rows)
    again = model_probs(loaded, rows, batch_size=7)  # jobs.evaluate's path, other batches
    for p, q in zip(probs, again, strict=True):
        assert max(abs(a - b) for a, b in zip(p, q, strict=True)) < TOL
    return probs


def _close(got: list[list[float]], want: list[list[float]]) -> float:
    assert [len(g) for g in got] == [len(w) for w in want]
    return max(abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))


def _probs(resp: httpx.Response) -> list[list[float]]:
    assert resp.status_code == 200, resp.text
    return [a["probabilities"] for a in resp.json()["answers"]]


def test_plan_forwards_groups_by_length_under_the_cap():
    assert plan_forwards([5, 3, 9, 3, 4], 12) == [[1, 3, 4], [0], [2]]  # 3x4=12 fits, 5 alone, 9 alone
    assert plan_forwards([2] * 7, 6) == [[0, 1, 2], [3, 4, 5], [6]]
    with pytest.raises(ValueError, match="max_batch_tokens=4"):
        plan_forwards([5], 4)


def test_answers_equal_ask_and_evaluate_one_by_one_all_at_once_and_interleaved(server, rows, expected, loaded):
    fit = [i for i, n in enumerate(rendered_lengths(loaded, rows)) if n <= CAP]
    assert len(fit) == len(rows)  # the cap refuses none of these
    one_by_one = [_probs(server.client.post("/v1/decide", json=question(rows[i])))[0] for i in range(len(rows))]
    assert _close(one_by_one, expected) < TOL
    chunks = [list(range(k, min(k + PER_REQUEST, len(rows)))) for k in range(0, len(rows), PER_REQUEST)]
    at_once = [p for c in chunks for p in _probs(server.decide([question(rows[i]) for i in c]))]
    assert _close(at_once, expected) < TOL
    # four clients, each with its own interleaved share of the rows, sending together
    got: dict[int, list[float]] = {}
    errors: list[str] = []

    def client(k: int) -> None:
        mine = list(range(k, len(rows), 4))
        with httpx.Client(base_url=server.url, timeout=60) as c:
            for start in range(0, len(mine), 3):
                part = mine[start:start + 3]
                r = c.post("/v1/decide", json={"questions": [question(rows[i]) for i in part]})
                if r.status_code != 200:
                    errors.append(r.text)
                    return
                got.update(zip(part, (a["probabilities"] for a in r.json()["answers"]), strict=True))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert _close([got[i] for i in range(len(rows))], expected) < TOL
    # the answer's other fields: the option chosen and the row kind's calibrated temperature
    answer = server.client.post("/v1/decide", json=question(rows[2])).json()["answers"][0]
    best = max(range(len(expected[2])), key=expected[2].__getitem__)
    assert answer["choice_index"] == best and answer["choice"] == rows[2]["options"][best][0]
    assert answer["temperature"] == row_temperature(loaded.temperatures, rows[2]["kind"]) != 1.0


def test_questions_of_concurrent_requests_share_forwards_under_the_cap(server, rows, expected, loaded):
    before = server.health()["stats"]
    server.arm()
    first = threading.Thread(target=lambda: server.decide([question(rows[0])]))
    first.start()
    server.wait_held()  # the worker is inside the forward of the first request
    picks = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
    results: dict[int, list[list[float]]] = {}

    def send(k: int) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            results[k] = _probs(c.post("/v1/decide", json={"questions": [question(rows[i]) for i in picks[k]]}))

    threads = [threading.Thread(target=send, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    server.wait_queued(13)  # all twelve queued behind the held one
    server.release()
    for t in [first, *threads]:
        t.join()
    after = server.health()["stats"]
    lengths = rendered_lengths(loaded, [rows[i] for p in picks for i in p])
    plan = plan_forwards(lengths, CAP)
    assert after["forwards"] - before["forwards"] == 1 + len(plan) < 1 + 4  # fewer forwards than requests
    assert after["questions"] - before["questions"] == 13
    assert after["largest_forward_tokens"] <= CAP
    assert max(len(g) for g in plan) > 3  # one forward mixed questions of several requests
    for k, p in enumerate(picks):
        assert _close(results[k], [expected[i] for i in p]) < TOL


def test_a_full_queue_is_429_with_retry_after_and_nothing_is_lost(server, rows, expected):
    server.arm()
    held = [threading.Thread(target=lambda: server.decide([question(rows[i]) for i in range(PER_REQUEST)]))]
    held[0].start()
    server.wait_held()
    second: dict[str, httpx.Response] = {}
    held.append(threading.Thread(target=lambda: second.update(r=server.decide([question(r) for r in rows[8:16]]))))
    held[1].start()
    server.wait_queued(QUEUE)
    full = server.decide([question(rows[20])])
    assert full.status_code == 429 and full.headers["Retry-After"] == "1"
    assert "busy" in full.json()["error"] and f"limit is {QUEUE}" in full.json()["error"]
    server.release()
    for t in held:
        t.join()
    assert _close(_probs(second["r"]), expected[8:16]) < TOL
    assert _close(_probs(server.decide([question(rows[20])])), [expected[20]]) < TOL  # the retry is answered


def test_options_longer_than_the_checkpoints_max_length_are_a_400(server, rows, expected):
    long = dict(question(rows[1]), options=[[f"o{i}", "apple river stone " * 5] for i in range(10)])
    r = server.decide([question(rows[0]), long])
    assert r.status_code == 400 and r.json()["field"] == "questions[1].options"
    assert "more than max_length 128" in r.json()["error"]
    assert _close(_probs(server.decide([question(rows[1])])), [expected[1]]) < TOL


BAD = [
    (b"{not json", "body", "not valid JSON"),
    (b"[1, 2]", "body", "must be a JSON object"),
    (json.dumps({"questions": []}).encode(), "questions", "non-empty"),
    (json.dumps({"questions": [{"instructions": "Q?", "options": [["a", ""], ["b", ""]]}] * (PER_REQUEST + 1)}
                ).encode(), "questions", f"limit of {PER_REQUEST}"),
    (json.dumps({"options": [["a", ""], ["b", ""]]}).encode(), "instructions", "missing"),
    (json.dumps({"questions": [{"instructions": "Q?"}]}).encode(), "questions[0].options", "missing"),
    (json.dumps({"instructions": "Q?", "options": [["a", ""]]}).encode(), "options", "at least two"),
    (json.dumps({"instructions": "Q?", "options": [["a", ""], ["b", ""]], "kind": "vote"}).encode(), "kind",
     "not one of"),
    (json.dumps({"instructions": "Q?", "options": ["a", "b"]}).encode(), "options[0]", "[name, description]"),
    (json.dumps({"instructions": "Q?", "options": [["a", ""], ["b", ""]], "labels": 1}).encode(), "labels",
     "unknown field"),
    (json.dumps({"instructions": "  ", "options": [["a", ""], ["b", ""]]}).encode(), "instructions", "empty"),
    (json.dumps({"instructions": "Q?", "options": [["a", ""], ["b", ""]], "state": 3}).encode(), "state",
     "must be a string"),
    (json.dumps({"questions": [{"instructions": "Q?", "options": [["a", ""], ["b", ""]]}], "x": 1}).encode(), "x",
     "unknown field"),
    (b'{"instructions": "' + b"x" * 70000 + b'", "options": [["a", ""], ["b", ""]]}', "body", "limit of 65536"),
]


def test_bad_requests_get_400_naming_the_field_and_change_nothing(server, rows, expected):
    for body, field, words in BAD:
        r = server.client.post("/v1/decide", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (body[:80], r.text)
        assert r.json()["field"] == field and words in r.json()["error"], (body[:80], r.json())
    assert server.client.get("/v1/nothing").status_code == 404
    assert server.client.get("/v1/decide").status_code == 405
    assert server.health()["status"] == "ready"
    assert _close(_probs(server.decide([question(r) for r in rows[:PER_REQUEST]])), expected[:PER_REQUEST]) < TOL


def test_model_endpoint_names_the_checkpoint_digest_and_temperatures(server, calibrated):
    info = server.client.get("/v1/model").json()
    assert info["checkpoint"] == str(calibrated.resolve())
    assert info["config_sha256"] == hashlib.sha256((calibrated / "config.json").read_bytes()).hexdigest()
    assert info["temperatures"] == json.loads((calibrated / "temperatures.json").read_text())
    assert info["head"] == "pointer" and info["torso"].endswith("torso") and info["max_batch_tokens"] == CAP


def test_ask_server_prints_what_ask_prints(server, calibrated, capsys):
    from hobson.jobs import ask as ask_job

    argv = ["--state", "the red box", "--choice", "Which one?=apple,river:a river,stone", "--kind", "score",
            "--choice", "Is it?=yes,no"]
    assert ask_job.main([str(calibrated), *argv]) == 0
    local = capsys.readouterr().out
    assert ask_job.main(["--server", server.url, *argv]) == 0
    assert capsys.readouterr().out == local
    assert ask_job.main(["--server", "http://127.0.0.1:9", *argv]) == 1
    assert "cannot reach the server" in capsys.readouterr().err


def test_loading_then_ready_a_token_and_sigterm_answers_in_flight_then_exits_0(calibrated, rows, expected,
                                                                                 tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    # a cap below the checkpoint's max_length (128): some questions then cannot fit a forward
    small = 100
    s = Server(calibrated, tmp_path, "--token-file", str(token), "--max-batch-tokens", str(small),
               released=("serve-forward",), wait_ready=False)
    lengths = rendered_lengths(load_decider(calibrated), rows)
    fits = next(i for i, n in enumerate(lengths) if n <= small)
    too_long = next(i for i, n in enumerate(lengths) if n > small)
    try:
        s.wait_held("serve-load")
        h = s.client.get("/healthz")
        assert h.status_code == 503 and h.json()["status"] == "loading" and h.headers["Retry-After"] == "1"
        early = s.client.post("/v1/decide", json=question(rows[0]), headers={"Authorization": "Bearer s3cret"})
        assert early.status_code == 503 and "loading" in early.json()["error"]
        s.release("serve-load")
        s.wait_ready()
        assert s.client.get("/v1/model").status_code == 401
        assert s.client.post("/v1/decide", json=question(rows[0]),
                             headers={"Authorization": "Bearer wrong"}).status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        assert s.client.get("/v1/model", headers=auth).status_code == 200
        refused = s.decide([question(rows[fits]), question(rows[too_long])], headers=auth)
        assert refused.status_code == 400 and refused.json()["field"] == "questions[1]"
        assert f"renders to {lengths[too_long]} tokens" in refused.json()["error"]
        assert f"--max-batch-tokens={small}" in refused.json()["error"]
        s.arm()
        answer: dict[str, httpx.Response] = {}
        t = threading.Thread(target=lambda: answer.update(r=s.decide([question(rows[fits])], headers=auth)))
        t.start()
        s.wait_held()
        s.proc.send_signal(15)  # SIGTERM with a request inside the forward
        s.release()
        t.join()
        assert _close(_probs(answer["r"]), [expected[fits]]) < TOL
        assert s.proc.wait(60) == 0, s.output()
        assert not s.address_file.exists()  # the server took its address with it
    finally:
        s.stop()


def test_a_corrupt_checkpoint_is_one_clear_error_and_exit_1(calibrated, tmp_path, capsys):
    from hobson.jobs import serve

    bad = tmp_path / "ckpt"
    shutil.copytree(calibrated, bad)
    head = bad / "head.safetensors"
    data = bytearray(head.read_bytes())
    data[-1] ^= 0xFF
    head.write_bytes(bytes(data))
    # in this process: the server binds, its loader finds the bytes changed, the server stops
    assert serve.main([str(bad), "--port", "0", "--threads", "1"]) == 1
    err = capsys.readouterr().err
    assert "head.safetensors" in err and "Traceback" not in err
    assert serve.main([str(tmp_path / "none"), "--port", "0"]) == 1
    assert "no such checkpoint directory" in capsys.readouterr().err


def test_submit_serve_runs_locally_in_the_foreground_and_cancel_stops_it(calibrated, loaded, tmp_path, capsys):
    """`submit.py serve CKPT` (no Slurm): a recorded run on the local backend, on loopback;
    `status` finds it ready, `ask --server RUN` asks it, `cancel RUN` stops it."""
    from hobson.jobs import ask as ask_job
    from hobson.launch import submit
    from tests.conftest import _env

    run_dir = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, str(REPO / "launch" / "submit.py"), "serve", str(calibrated),
                                 "--backend", "local", "--port", "0", "--run-dir", str(run_dir), "--logs-dir",
                                 str(tmp_path / "logs"), "--threads", "1"],
                                cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        address = run_dir / "serve" / "address.json"
        while not address.exists():
            assert launcher.poll() is None, launcher.stdout.read()
            time.sleep(0.05)
        url = json.loads(address.read_text())["url"]
        assert url.startswith("http://127.0.0.1:") and json.loads(address.read_text())["token_file"] is None
        with httpx.Client(base_url=url, timeout=60) as c:
            while c.get("/healthz").status_code != 200:
                time.sleep(0.05)
        assert submit.main(["status", str(run_dir)]) == 0
        assert f"serve: {url} on node" in capsys.readouterr().out
        argv = ["--state", "x", "--choice", "Q?=a,b"]
        assert ask_job.main(["--server", str(run_dir), *argv]) == 0
        assert ask_job.main([str(calibrated), *argv]) == 0
        served, local = capsys.readouterr().out.split("Q?\n")[1:]
        assert served == local
        assert submit.main(["cancel", str(run_dir)]) == 0
        out, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert "serve on the local backend" in out and not address.exists()


def test_the_listening_socket_says_it_is_tcp_so_responses_are_not_held_by_nagle():
    """asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP; with proto 0 every
    keep-alive response waited for the client's delayed ACK (44 ms against 0.7 ms measured)."""
    import socket

    from hobson.jobs.serve import _listen

    sock, advertise = _listen("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP and advertise == "127.0.0.1"
    finally:
        sock.close()
