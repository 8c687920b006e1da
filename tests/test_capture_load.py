"""`python capture.py` (the real entry point, its own vLLM engine) under heavy and hostile load, then stopped.

    .venv/bin/python -m pytest tests/test_capture_load.py -q -s  # ~1.5 minutes on 2 cores (one engine start)

While attackers send 15 MiB single-word requests (three at once), 150k-message requests, 16 MiB
headers, slow headers and stalled bodies, a well-behaved session keeps taking turns: its p99 latency
stays within a stated bound of its idle p99 (the measured figures are in docs/capture.md), every
attack reply is a 4xx in the protocol's format, and a bystander's trajectory does not change. Then
5,000 sessions are created and finished over HTTP and the server's RSS stays bounded. The server
keeps serving after all of it, and SIGTERM stops it with its engine process.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from conftest import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.stack  # engines, in processes of their own
HEADER_TIMEOUT_S = 10.0  # capture.py's defaults
# The bound: a well-behaved session's p99 under attack <= SLOWDOWN x its idle p99 + SLACK_S. On 2
# cores shared with other jobs (docs/capture.md) idle p99 was 0.06-0.13 s and under attack
# 0.33-1.5 s: the attack's own CPU competes with the engine there; before the limits one 15 MiB
# request stalled every session for up to 16 s (three: 53 s).
SLOWDOWN, SLACK_S = 10.0, 2.0
RSS_GROWTH_MIB = 16  # over 5,000 created-and-finished sessions (measured +0-1 MiB; unbounded it was +4.2 KiB each)


class CapturePy:
    """`python capture.py` on a free port, started on first use and started again if a test ended it (the SIGTERM
    test does), so that the tests of this file pass in any order."""

    def __init__(self, log_dir):
        self.log_dir, self.proc, self.runs = log_dir, None, 0

    def get(self):
        """(process, its base URL, the log path) of a running server."""
        if self.proc is None or self.proc.poll() is not None:
            self.kill()
            self.runs += 1
            self.log_path = self.log_dir / f"capture{self.runs}.log"
            self.proc = subprocess.Popen([sys.executable, "capture.py"], cwd=ROOT, stdout=open(self.log_path, "w"),
                                         stderr=subprocess.STDOUT, env=child_env(PYTHONUNBUFFERED="1"),
                                         start_new_session=True)
            deadline, self.url = time.monotonic() + 300, None
            while self.url is None:
                text = open(self.log_path).read()
                if "capture server for" in text:
                    self.url = text.split("capture server for", 1)[1].split(" at ", 1)[1].split()[0]
                elif self.proc.poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    pytest.fail(f"capture.py did not start:\n{text[-3000:]}")
                else:
                    time.sleep(0.2)
        return self.proc, self.url, self.log_path

    def kill(self):
        if self.proc is not None:
            for p in [self.proc] + descendants(self.proc):
                try:
                    p.kill()
                except (psutil.NoSuchProcess, ProcessLookupError):
                    pass
            self.proc = None


@pytest.fixture(scope="module")
def capture_py(tmp_path_factory):
    """One capture.py for the file; killed with its tree at the end."""
    server = CapturePy(tmp_path_factory.mktemp("capture"))
    yield server
    server.kill()


@pytest.fixture
def standalone(capture_py):
    return capture_py.get()


def descendants(proc):
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def new_session(client, url):
    r = client.post(url + "/sessions")
    assert r.status_code == 200, r.text
    return r.json()


def turn(client, session, text, max_tokens=4):
    return client.post(session["base_url"] + "/chat/completions", headers={"authorization": f"Bearer {session['api_key']}"},
                       json={"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "seed": 1})


def segments(client, url, session):
    r = client.get(f"{url}/sessions/{session['id']}", headers={"x-api-key": session["api_key"]})
    assert r.status_code == 200, r.text
    return r.json()


def p99(values):
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def check_error(r, anthropic=False):
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    body = r.json()
    assert (body["type"] == "error" and body["error"]["message"]) if anthropic else body["error"]["message"]


def raw_request(url):
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=60)


def send_slowly(url, head, chunk, pause_s, max_chunks):
    """Send `head`, then `chunk` after each pause_s without a reply; return (the server's whole reply, or b"" if it
    never answered, chunks sent). Reading before each send: more bytes after the server closed would reset the
    connection and lose its reply."""
    with raw_request(url) as sock:
        sock.sendall(head)
        sock.settimeout(pause_s)
        try:
            for sent in range(max_chunks):
                try:
                    reply = sock.recv(65536)
                except socket.timeout:
                    sock.sendall(chunk)
                    continue
                sock.settimeout(30)
                while more := sock.recv(65536):
                    reply += more
                return reply, sent
        except ConnectionError:  # our byte crossed the server's close: closed all the same, its reply lost
            return b"reset", sent
        return b"", max_chunks


def test_latency_under_attack_stays_bounded(standalone):
    proc, url, _ = standalone
    stop, failures, attack_replies, attacking = threading.Event(), [], [], set()
    with httpx.Client(timeout=120) as client:
        good, bystander = new_session(client, url), new_session(client, url)
        assert turn(client, bystander, "I was here first.").status_code == 200
        before = segments(client, url, bystander)
        for i in range(3):  # warm-up: the engine's first steps are slower
            assert turn(client, good, f"warm up {i}").status_code == 200

        def timed_turns(n):
            times = []
            for i in range(n):
                t0 = time.perf_counter()
                r = turn(client, good, f"Question {i}: what is {i} + {i}?")
                times.append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text
            return times
        idle = timed_turns(30)

        def attacker(kind):
            try:
                with httpx.Client(timeout=120) as c:
                    mine = new_session(c, url)
                    target, auth = mine["base_url"] + "/chat/completions", {"authorization": f"Bearer {mine['api_key']}"}
                    word = b'{"messages": [{"role": "user", "content": "' + b"a" * (15 << 20) + b'"}]}'
                    empties = json.dumps({"messages": [{"role": "user", "content": ""}] * 150_000}).encode()
                    while not stop.is_set():
                        r = c.post(target, headers=auth, content=word if kind == "word" else empties)
                        check_error(r)
                        attack_replies.append(r.status_code)
                        attacking.add(threading.get_ident())
            except Exception as e:  # reported by the main thread
                failures.append(f"{kind}: {e!r}")

        slow_replies = []

        def slow_headers():  # a header byte a second, never finished
            slow_replies.append(send_slowly(url, b"POST /sessions HTTP/1.1\r\nhost: x", b"x", 0.75,
                                            int(4 * HEADER_TIMEOUT_S))[0])

        attackers = [threading.Thread(target=attacker, args=(k,)) for k in ("word", "word", "word", "empties")]
        attackers += [threading.Thread(target=slow_headers) for _ in range(15)]
        stalled = []
        for _ in range(15):  # bodies that stop after 10 of their 1000 bytes (the body timeout is 60 s: they stay)
            stalled.append(raw_request(url))
            stalled[-1].sendall(b"POST /sessions HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n{\"attempt\"")
        for t in attackers:
            t.start()
        deadline = time.monotonic() + 120
        while len(attacking) < 4 and not failures:  # every big-body attacker has had an answer: the attack is on
            assert time.monotonic() < deadline, "the attackers got no answer"
            time.sleep(0.05)
        # a 16 MiB header, 64 KiB at a time: refused long before its end
        reply, chunks = send_slowly(url, b"GET /sessions HTTP/1.1\r\nx-big: ", b"a" * (64 << 10), 0.5, 256)
        assert reply.startswith(b"HTTP/1.1 431") and b'"error"' in reply and chunks < 16, (reply[:200], chunks)
        attacked = timed_turns(30)
        print(f"\nwell-behaved session p99: idle {p99(idle):.3f} s, under attack {p99(attacked):.3f} s "
              f"(median {sorted(idle)[15]:.3f} / {sorted(attacked)[15]:.3f} s)")
        stop.set()
        for t in attackers:
            t.join(timeout=120)
        assert not failures, failures
        assert len(attack_replies) >= 4 and set(attack_replies) == {400}
        # slow headers: answered 408 in JSON and closed by the server (after HEADER_TIMEOUT_S)
        timed_out = [r for r in slow_replies if r.startswith(b"HTTP/1.1 408") and b'"error"' in r]
        assert len(slow_replies) == 15 and timed_out and all(r in timed_out or r == b"reset" for r in slow_replies)
        for sock in stalled:
            sock.close()
        assert segments(client, url, bystander) == before
        assert p99(attacked) <= SLOWDOWN * p99(idle) + SLACK_S
        assert proc.poll() is None


def test_rss_bounded_after_5000_sessions(standalone):
    proc, url, _ = standalone
    server = psutil.Process(proc.pid)

    def churn(n, clients=4):  # n sessions made and finished, `clients` at a time
        failures = []

        def run(k):
            try:
                with httpx.Client(timeout=60) as client:
                    for _ in range(k):
                        s = new_session(client, url)
                        r = client.post(f"{url}/sessions/{s['id']}/finish", headers={"x-api-key": s["api_key"]},
                                        json={"reward": 1.0})
                        assert r.status_code == 200, r.text
            except Exception as e:
                failures.append(repr(e))
        threads = [threading.Thread(target=run, args=(n // clients,)) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failures, failures
    with httpx.Client(timeout=60) as client:
        first = new_session(client, url)
        client.post(f"{url}/sessions/{first['id']}/finish", headers={"x-api-key": first["api_key"]}, json={"reward": 0})
        churn(500)  # warm: allocator pools, the server's session table on its way to its steady size
        rss = server.memory_info().rss
        churn(4500)
        growth = (server.memory_info().rss - rss) / 2**20
        print(f"server RSS {rss / 2**20:.0f} MiB after 500 sessions, +{growth:.1f} MiB after 5,000")
        assert growth < RSS_GROWTH_MIB
        # finished sessions beyond the server's limit were dropped: the first ones are gone
        gone = client.get(f"{url}/sessions/{first['id']}", headers={"x-api-key": first["api_key"]})
        assert gone.status_code == 410 and "finished and was dropped" in gone.json()["error"]["message"]


def test_keeps_serving_then_sigterm_leaves_no_process(standalone):
    proc, url, log_path = standalone
    with httpx.Client(timeout=60) as client:
        s = new_session(client, url)
        assert turn(client, s, "Still there?").status_code == 200
        assert len(segments(client, url, s)) == 1
    tree = descendants(proc)
    assert any("EngineCore" in p.name() for p in tree), [p.name() for p in tree]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, open(log_path).read()[-3000:]
    _, alive = psutil.wait_procs(tree, timeout=60)
    assert not alive, f"left behind: {[p.name() for p in alive]}"
