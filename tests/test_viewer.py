"""
The trajectory viewer (viewer.py, viewer.html) over HTTP and in a real headless Chromium driven over the DevTools
protocol: over a run directory holding bad input (a corrupt and a truncated JSONL line, a missing log, an unreadable
attempt file, a 50,000-token attempt) beside an attempt with a tool call, an image and routed experts; live during a
tiny run (view_port, the rotating sample with the trainer's logprobs, Weights & Biases offline); and over that run's
directory with `python capture.py --view`. The browser tests need Chromium (Debian: apt-get install
chromium) and fail without it, unless NO_BROWSER=1 (`make test NO_BROWSER=1`) skips them.

    .venv/bin/python -m pytest tests/test_viewer.py -q
"""
import base64
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import train
import viewer
from conftest import ROOT, child_env

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
NO_BROWSER = os.environ.get("NO_BROWSER") == "1"  # the Makefile's switch: no Chromium here
needs_chromium = pytest.mark.skipif(NO_BROWSER, reason="NO_BROWSER=1 skips the browser tests")
SHOTS = os.environ.get("VIEWER_SCREENSHOTS")  # a directory: keep the screenshots there too


class Browser:
    """Headless Chromium, a fresh profile, driven over the DevTools protocol's websocket (the websockets package
    comes with vLLM). JavaScript exceptions on the page are collected in `errors`."""

    def __init__(self, profile):
        assert CHROMIUM, ("no Chromium on this machine: apt-get install chromium (.ci/run does), "
                          "or skip the browser tests with NO_BROWSER=1")
        self.proc = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                                      "--no-first-run", "--disable-background-networking", "--disable-component-update",
                                      "--disable-sync", f"--user-data-dir={profile}", "--remote-debugging-port=0",
                                      "--window-size=1400,1000", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file, deadline = os.path.join(profile, "DevToolsActivePort"), time.time() + 60
        while not (os.path.exists(port_file) and open(port_file).read().strip()):
            assert self.proc.poll() is None and time.time() < deadline, "Chromium did not start"
            time.sleep(0.1)
        port = int(open(port_file).read().split()[0])
        page = next(t for t in json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list"))
                    if t["type"] == "page")
        from websockets.sync.client import connect
        self.ws, self.n, self.errors = connect(page["webSocketDebuggerUrl"], max_size=None), 0, []
        self.call("Runtime.enable")

    def call(self, method, **params):
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=120))
            if msg.get("method") == "Runtime.exceptionThrown":
                self.errors.append(msg["params"]["exceptionDetails"])
            if msg.get("id") == self.n:
                assert "error" not in msg, msg["error"]
                return msg["result"]

    def js(self, expression):
        out = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in out, out["exceptionDetails"]
        return out["result"].get("value")

    def wait(self, expression, timeout=120):
        deadline = time.time() + timeout
        while time.time() < deadline:
            value = self.js(expression)
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"the page never had {expression}")

    def open(self, url):
        self.call("Page.navigate", url=url)
        self.wait("document.readyState === 'complete' && !!document.getElementById('attempts')")

    def screenshot(self, path):
        with open(path, "wb") as f:
            f.write(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        if SHOTS:
            shutil.copy(path, SHOTS)
        return os.path.getsize(path)

    def close(self):
        self.ws.close()
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture
def browser(tmp_path):
    b = Browser(str(tmp_path / "chromium-profile"))
    yield b
    b.close()


def get(url, expect=200):
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            assert r.status == expect
            return json.loads(r.read()) if "/api/" in url else r.read()
    except urllib.error.HTTPError as e:
        assert e.code == expect, (url, e.code, e.read())
        return json.loads(e.read())


def png(width, height, rgb):
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (width, height), rgb).save(buf, format="PNG")
    return buf.getvalue()


def write_attempt(out_dir, name, summary, segments):
    folder = os.path.join(out_dir, "view", "attempts")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "w") as f:
        f.write(json.dumps(summary) + "\n" + json.dumps(segments) + "\n")


@pytest.fixture(scope="module")
def bad_run(tmp_path_factory, tiny_vl_model_path):
    """A run directory as the run writes it, with bad input: metrics.jsonl with a corrupt and a truncated line, no
    eval_results.jsonl, an unreadable attempt file; a sampled attempt with a tool call and its result, an image and
    routed experts (recorded by viewer.segment_record with the tiny VL model's tokenizer), one of 50,000 tokens, and
    trajectories.jsonl (capture.trajectory_record) with a corrupt line."""
    from transformers import AutoTokenizer
    import capture
    out = str(tmp_path_factory.mktemp("bad_run"))
    tok = AutoTokenizer.from_pretrained(tiny_vl_model_path)
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        for step in range(1, 6):
            f.write(json.dumps(dict(step=step, reward_mean=0.1 * step, loss=1.0 / step, mismatch_kl=1e-4)) + "\n")
        f.write("{not json\n" + '{"step": 6, "reward_me')  # a corrupt line, then one cut off mid-write
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is 2+3?"}]},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                    "name": "calculator", "arguments": {"expression": "2+3"}}}]},
                {"role": "tool", "content": "5"}, {"role": "assistant", "content": "It is 5."}]
    text = tok.apply_chat_template(messages, tokenize=False)
    cut = text.index("<tool_call>")
    ids_before = tok(text[:cut], add_special_tokens=False)["input_ids"]
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    ids_before = [t for i in ids_before for t in ([pad] * 4 if i == pad else [i])]  # 4 tokens for the image
    ids_after = tok(text[cut:], add_special_tokens=False)["input_ids"]
    ids = ids_before + ids_after
    mask = [0] * len(ids_before) + [1] * len(ids_after)  # (the tool result is context in a real one; no matter here)
    rng = np.random.default_rng(0)
    behavior = np.where(mask, -rng.random(len(ids)), 0.0)
    arrays = dict(attempt_id="toolimage", segment_index=0, token_ids=np.array(ids), action_mask=np.array(mask),
                  behavior_logprobs=behavior, token_versions=np.where(mask, 3, -1),
                  routed_experts=rng.integers(0, 8, (len(ids), 2, 2)), images=[png(16, 12, (200, 30, 30))])
    trainer = [None] + [round(float(b) + 0.3, 5) if m else None for b, m in zip(behavior[1:], mask[1:])]
    seg = viewer.segment_record(arrays, tok, trainer)
    write_attempt(out, "00000005-toolimage.json", viewer.attempt_summary(
        [seg], step=5, policy_version=4, reward=1.0, advantage=0.5, group_id=7), [seg])
    n = 50_000
    random_ids = rng.integers(0, 1000, n)
    random_ids[np.isin(random_ids, tok.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"]))] = 0  # no images
    big = dict(attempt_id="huge", segment_index=0, token_ids=random_ids, action_mask=np.arange(n) % 2,
               behavior_logprobs=-rng.random(n), token_versions=np.full(n, 4), images=[])
    seg = viewer.segment_record(big, tok)
    write_attempt(out, "00000005-huge.json", viewer.attempt_summary([seg], step=5, policy_version=4, reward=0.0,
                                                                    group_id=7), [seg])
    with open(os.path.join(out, "view", "attempts", "00000004-broken.json"), "w") as f:
        f.write('{"attempt_id": "broken", "ste')
    traj = dict(attempt_id="fromtraj", segment_index=0, token_ids=ids_after, action_mask=[1] * len(ids_after),
                behavior_logprobs=[-0.5] * len(ids_after), token_versions=[2] * len(ids_after), routed_experts=None,
                reward=0.0, finished=True, images=[], group_id=3, failed=True, error="attempt timed out after 60.0s")
    with open(os.path.join(out, "trajectories.jsonl"), "w") as f:
        f.write(json.dumps(capture.trajectory_record(traj, tok)) + "\n{\"attempt_id\": 1, broken\n")
    return out


@pytest.fixture(scope="module")
def bad_run_viewer(bad_run):
    server, url = viewer.serve_in_thread(bad_run)
    yield url
    server.should_exit = True


def test_api_over_bad_input_answers_and_needs_the_key(bad_run_viewer):
    base, key = bad_run_viewer.split("/?key=")
    assert get(base + "/api/attempts", 401)["error"].startswith("This viewer needs the key")
    assert get(base + "/api/attempts?key=" + key[:-1] + "x", 401)
    metrics = get(base + "/api/log/metrics?key=" + key)
    assert [r["step"] for r in metrics["rows"]] == [1, 2, 3, 4, 5] and metrics["bad_lines"] == 1
    later = get(base + f"/api/log/metrics?key={key}&from={metrics['next']}")  # the cut-off line is not read yet
    assert later["rows"] == [] and later["next"] == metrics["next"]
    assert get(base + "/api/log/evals?key=" + key) == dict(rows=[], bad_lines=0, next=0, missing=True)
    listed = get(base + "/api/attempts?key=" + key)
    assert [a["attempt_id"] for a in listed["attempts"]] == ["huge", "toolimage", "fromtraj"]  # newest step first
    assert listed["bad_lines"] == 2  # the unreadable attempt file and the corrupt trajectories line
    assert listed["attempts"][2]["timed_out"] and listed["attempts"][2]["failed"]
    assert get(base + "/api/attempt?id=nope&key=" + key, 404)["error"].startswith("no such attempt")
    assert get(base + "/api/attempt?file=00000004-broken.json&key=" + key, 422)
    huge = get(base + "/api/attempt?file=00000005-huge.json&key=" + key)
    assert len(huge["segments"][0]["tokens"]) == 50_000
    assert get(base + "/api/attempt?id=fromtraj&key=" + key)["segments"][0]["tokens"][0] == "<tool_call>"


@needs_chromium
def test_page_shows_tokens_tool_calls_images_and_survives_bad_input(bad_run_viewer, browser, tmp_path):
    base, key = bad_run_viewer.split("/?key=")
    browser.open(bad_run_viewer)
    assert browser.wait("document.querySelectorAll('#attempts tbody tr').length") == 3
    assert "unreadable line(s) skipped" in browser.js("document.getElementById('errors').textContent")
    assert browser.js("[...document.querySelectorAll('#curves .panel')].map(p => p.dataset.key)") == [
        "reward_mean", "mismatch_kl", "loss"]
    # filter and sort
    browser.js("const f = document.getElementById('filter'); f.value = 'timed_out=true reward<1'; f.dispatchEvent(new Event('input'))")
    assert browser.js("[...document.querySelectorAll('#attempts tbody tr')].map(r => r.dataset.attempt)") == ["fromtraj"]
    browser.js("const g = document.getElementById('filter'); g.value = ''; g.dispatchEvent(new Event('input'))")
    browser.js("[...document.querySelectorAll('#attempts th')].find(h => h.textContent.startsWith('tokens')).click()")
    assert browser.js("document.querySelector('#attempts tbody tr').dataset.attempt") == "huge"

    browser.js("document.querySelector('#attempts tbody tr[data-attempt=toolimage]').click()")
    browser.wait("document.querySelectorAll('#detail .tok.gen').length > 0")
    assert browser.js("document.querySelectorAll('#detail .tok.ctx').length") > 10
    # the image, decoded at its own size (a wrong or missing image has other dimensions or none)
    assert browser.wait("(i => i && i.complete && [i.naturalWidth, i.naturalHeight])"
                        "(document.querySelector('#detail img.inline'))") == [16, 12]
    assert '"calculator"' in browser.js("document.querySelector('#detail .block.tool-call').textContent")
    assert "5" in browser.js("document.querySelector('#detail .block.tool-result').textContent")
    # the gap (trainer - behavior = +0.3 here) colours every generated token; hover shows the numbers and experts
    assert browser.js("[...document.querySelectorAll('#detail .tok.gen')].slice(1).every(t => t.style.background)")
    tip = browser.js("(() => { const t = document.querySelectorAll('#detail .tok.gen')[3]; t.dispatchEvent("
                     "new MouseEvent('mousemove', {bubbles: true, clientX: 10, clientY: 10}));"
                     "return document.getElementById('tip').textContent; })()")
    assert "gap 0.3" in tip and "policy version 3" in tip and "moe layer 1:" in tip
    assert browser.js("document.querySelector('#detail button').textContent").startswith("its GRPO group side by side")
    browser.screenshot(tmp_path / "viewer-attempt.png")
    browser.js("document.querySelector('#detail button').click()")
    browser.wait("document.querySelectorAll('#detail .group-member .tokens').length === 2")  # both, side by side

    t0 = time.time()
    browser.js("location.hash = 'attempt=huge&file=00000005-huge.json'")
    browser.wait("document.querySelectorAll('#detail .tokens .tok').length === 50000")
    print(f"50,000-token attempt rendered in {time.time() - t0:.1f} s")
    browser.js("location.hash = 'attempt=broken&file=00000004-broken.json'")
    assert "cannot show attempt broken" in browser.wait(
        "(d => d.includes('cannot show') && d)(document.getElementById('detail').textContent)")
    assert get(base + "/api/attempts?key=" + key)["attempts"]  # the server carries on
    assert browser.errors == []
    assert browser.screenshot(tmp_path / "viewer-bad-input.png") > 10_000


@pytest.fixture(scope="module")
def tree_run(tmp_path_factory, tiny_model_path):
    """A run directory with an attempt of three segments (a lead and two sub-agents under it),
    held-out results whose prompts hold an image, and metrics over 12 steps."""
    from transformers import AutoTokenizer
    out = str(tmp_path_factory.mktemp("tree_run"))
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(dict(step=s, reward_mean=0.05 * s, loss=2.0 / s)) + "\n"
                     for s in range(1, 13))
    image = "data:image/png;base64," + base64.b64encode(png(16, 12, (30, 200, 30))).decode()
    prompt = [{"role": "system", "content": "Name colours."},
              {"role": "user", "content": [{"type": "text", "text": "Which colour is this?"},
                                           {"type": "image_url", "image_url": {"url": image}}]}]
    with open(os.path.join(out, "eval_results.jsonl"), "w") as f:
        f.write(json.dumps(dict(policy_version=2, prompt=prompt, label="green", success=1.0,
                                reward=1.0, generated_tokens=3, text=["green"])) + "\n")
    segments = []
    tree = [(None, 100.0, "Plan the trip."), (0, 101.5, "Flights."), (0, 101.75, "Hotels.")]
    for i, (parent, started, text) in enumerate(tree):
        ids = tok(text + " Done.", add_special_tokens=False)["input_ids"]
        mask = [0] * (len(ids) - 2) + [1, 1]
        arrays = dict(attempt_id="tree", segment_index=i, token_ids=np.array(ids),
                      action_mask=np.array(mask), behavior_logprobs=np.where(mask, -0.5, 0.0),
                      token_versions=np.where(mask, 2, -1),
                      images=[], parent=parent, started=started, opened="a new conversation")
        segments.append(viewer.segment_record(arrays, tok))
    summary = viewer.attempt_summary(segments, step=3, policy_version=2, reward=1.0, group_id=1)
    write_attempt(out, "00000003-tree.json", summary, segments)
    server, url = viewer.serve_in_thread(out)
    yield url
    server.should_exit = True


@needs_chromium
def test_a_colocated_runs_page_shows_where_each_steps_seconds_go(tmp_path, browser):
    # placement="colocated" logs sleep_s: the page then adds a curve per phase of the step; a run
    # without it (the control: the same rows less sleep_s and wake_s) keeps the usual curves
    phases = dict(step_time_s=4.0, batch_wait_s=2.0, train_step_s=1.2, sync_s=0.5, sleep_s=0.1,
                  wake_s=0.2, idle_s=0.2)
    shown = {}
    for name, extra in (("colocated", {}), ("separate", dict(sleep_s=None, wake_s=None))):
        out = tmp_path / name
        os.makedirs(out)
        with open(out / "metrics.jsonl", "w") as f:
            for step in (1, 2):
                row = {k: v for k, v in {"step": step, "reward_mean": 0.5, **phases,
                                         **extra}.items() if v is not None}
                f.write(json.dumps(row) + "\n")
        server, url = viewer.serve_in_thread(str(out))
        browser.open(url)
        browser.wait("document.querySelectorAll('#curves .panel').length")
        shown[name] = browser.js(
            "[...document.querySelectorAll('#curves .panel')].map(p => p.dataset.key)")
        server.should_exit = True
    assert shown["colocated"] == ["reward_mean", *phases]
    assert shown["separate"] == ["reward_mean"]


@needs_chromium
def test_page_shows_the_segment_tree_eval_thumbnails_and_axes(tree_run, browser):
    browser.open(tree_run)
    # the curves have axes: round ticks with labels on both, and the axes' names
    browser.wait("document.querySelectorAll('#curves .panel').length === 2")
    ticks = browser.js("[...document.querySelectorAll('#curves .panel')].map(p => "
                       "['x-axis', 'y-axis'].map(a => "
                       "[...p.querySelectorAll(`.${a} text.tick`)].map(t => t.textContent)))")
    assert ticks[0][0] == ["2", "4", "6", "8", "10", "12"] and ticks[0][1] == ["0.2", "0.4", "0.6"]
    assert len(ticks[1][0]) >= 4 and len(ticks[1][1]) >= 3
    labels = browser.js("[...document.querySelectorAll('#curves .panel text.label')]"
                        ".map(t => t.textContent)")
    assert labels == ["step", "reward_mean", "step", "loss"]
    # the held-out prompt: its text and a thumbnail of its image, no base64 in the text
    browser.wait("document.querySelectorAll('#evals tbody tr').length === 1")
    cell = browser.js("document.querySelector('#evals tbody td').textContent")
    assert "Which colour is this?" in cell and "system: Name colours." in cell
    assert "base64" not in cell
    assert browser.wait("(i => i && i.complete && [i.naturalWidth, i.naturalHeight])"
                        "(document.querySelector('#evals img.thumb'))") == [16, 12]
    # the attempt as a tree: both sub-agents' segments under the lead's, with when each began
    browser.js("location.hash = 'attempt=tree&file=00000003-tree.json'")
    browser.wait("document.querySelectorAll('#detail .segment').length === 3")
    tree = browser.js("[...document.querySelectorAll('#detail .tree-node')].map(n => "
                      "[n.querySelector('h3').textContent, n.parentElement.className])")
    assert [t[1] for t in tree] == ["", "subtree", "subtree"]
    assert "under segment 0" in tree[1][0] and "began at +1.50 s" in tree[1][0]
    assert "began at +1.75 s" in tree[2][0] and "under" not in tree[0][0]
    assert browser.js("document.querySelector('#detail .subtree').parentElement.querySelector('h3')"
                      ".textContent").startswith("segment 0")
    assert browser.errors == []


def wandb_records(path, block=32768):
    """The protobuf records of a W&B run file (run-ID.wandb): a 7-byte header, then LevelDB-log style blocks of
    records, each chunk behind a 7-byte header (CRC-32, length, kind: 1 full, 2 first, 3 middle, 4 last)."""
    import struct
    from wandb.proto import wandb_internal_pb2
    with open(path, "rb") as f:
        raw = f.read()
    assert raw[:4] == b":W&B"
    pos, chunk = 7, b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if n == 0 and kind == 0:
            break
        chunk, pos = chunk + raw[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            yield record
            chunk = b""


@pytest.fixture(scope="module")
def device():
    return train.init_distributed()[2]  # a gloo group of one rank, for the whole module (as test_loop's)


def test_live_during_a_tiny_run_then_over_its_directory(tmp_path, tiny_model_path, rollout_engine, device,
                                                        monkeypatch, request):
    """A 3-step run of the tiny default with the viewer served (view_port) and W&B offline: while it trains, the page
    shows the curves growing and the sampled attempts with the trainer's logprobs; after it, `python capture.py
    --view OUT_DIR` serves the same directory; W&B's offline run holds the config and the last numbers."""
    from test_loop import loop_config
    from weights_sync import free_port
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    cfg = loop_config(out, tiny_model_path, max_steps=3, view_port=free_port(), view_groups_per_step=1,
                      view_max_attempts=4, wandb_project="viewer-test")
    os.makedirs(out)
    model, optimizer, step, _ = train.build_trainer(cfg, 1, device)
    run = train.start_rollout(cfg, engines=[rollout_engine])
    url = f"http://127.0.0.1:{cfg['view_port']}"
    add, add_s = run.recorder.add, []  # what the sample costs the trainer's thread, per step

    live_checked = threading.Event()  # the trainer waits at step 2 until the page was checked live (a quiet
                                      # machine ran the 3 steps before Chromium had the page up)

    def timed_add(*args):
        t0 = time.perf_counter()
        add(*args)
        add_s.append(time.perf_counter() - t0)
        if len(add_s) == 2:  # step 1 is complete (its metrics row and sample written)
            live_checked.wait(timeout=600)
    run.recorder.add = timed_add
    done = threading.Event()
    failure = []

    def go():
        try:
            train.train(cfg, model, optimizer, run, step, 0, 1)
        except BaseException as e:
            failure.append(e)
        finally:
            done.set()
    thread = threading.Thread(target=go)
    thread.start()
    browser = None if NO_BROWSER else Browser(str(tmp_path / "profile"))
    browser and request.addfinalizer(browser.close)  # whatever fails below
    try:
        assert get(url + "/api/attempts", 401)  # up at once, and keyed
        if browser:
            key = run.view.config.app.state.key
            browser.open(f"{url}/?key={key}")
            # live: the first step's curve and sampled attempts appear while the run goes on
            browser.wait("document.querySelectorAll('#curves .panel').length && "
                         "document.querySelectorAll('#attempts tbody tr').length", timeout=300)
            steps_seen = browser.js("document.getElementById('status').textContent")
            browser.js("document.querySelector('#attempts tbody tr').click()")
            browser.wait("document.querySelectorAll('#detail .tok.gen').length")
            assert browser.js("document.querySelector('#detail').textContent").count("trained at policy version") == 1
            live_during_run = not done.is_set()
    finally:
        live_checked.set()
        thread.join()
        train.stop_rollout(run)
    assert not failure, failure
    assert len(add_s) == 3
    print(f"Recorder.add on the trainer's thread: {', '.join(f'{1e3 * s:.2f}' for s in add_s)} ms per step")
    if browser:
        assert live_during_run, "the run ended before the page showed it: no live check happened"
        print("live page:", steps_seen)

    # the rotating sample: one group (2 attempts) a step, the newest 4 attempts kept, each with the trainer's
    # logprob of every generated token, aligned with the engine's (same weights at step 1: rounding apart)
    names = sorted(os.listdir(out / "view" / "attempts"))
    assert len(names) == 4 and names[0].startswith("00000002-") and names[-1].startswith("00000003-")
    trainer_lp, behavior_lp = [], []  # every generated token's, all attempts' in a row
    for name in names:
        with open(out / "view" / "attempts" / name) as f:
            summary, segments = json.loads(f.readline()), json.loads(f.readline())
        assert summary["step"] in (2, 3) and summary["advantage"] is not None
        for s in segments:
            gen = [i for i, m in enumerate(s["action_mask"]) if m]
            assert gen and all(s["trainer_logprobs"][i] is not None for i in gen)
            assert len(s["tokens"]) == len(s["token_ids"]) and s["segment_index"] >= 0
            gaps = [abs(s["trainer_logprobs"][i] - s["behavior_logprobs"][i]) for i in gen]
            print(f"{name}: max |trainer - behavior| {max(gaps):.4f} over {len(gen)} tokens")
            # measured: at most 0.05 (a token one version stale), 0.003 on the same weights
            assert max(gaps) < 0.15
            trainer_lp += [s["trainer_logprobs"][i] for i in gen]
            behavior_lp += [s["behavior_logprobs"][i] for i in gen]
            assert all(0 <= s["token_versions"][i] <= summary["policy_version"] for i in gen)  # sampled before
    # negative control, over the four attempts' generated tokens in a row: read one token off, they are far away
    # (within one attempt of two tokens the pair can by chance be as close as 0.05)
    off = [abs(t - b) for t, b in zip(trainer_lp[1:], behavior_lp)]
    print(f"read one token off: max |trainer - behavior| {max(off):.4f} over {len(off)} tokens")
    assert len(off) >= 3 and max(off) > 0.15, off

    # W&B, offline: the run's log under out_dir/wandb holds the config once and every step's numbers
    import glob
    runs = glob.glob(str(out / "wandb" / "offline-run-*" / "*.wandb"))
    assert len(runs) == 1
    records = list(wandb_records(runs[0]))
    configs = [r.run.config for r in records if r.WhichOneof("record_type") == "run"] + [
        r.config for r in records if r.WhichOneof("record_type") == "config"]
    assert len(configs) == 1
    logged = {i.key: json.loads(i.value_json) for i in configs[0].update}
    assert {k: logged.get(k) for k in cfg} == json.loads(json.dumps(cfg))  # the resolved config, every key
    history = [(r.history.step.num, {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
               for r in records if r.WhichOneof("record_type") == "history"]
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [s for s, _ in history] == [r["step"] for r in rows] == [1, 2, 3]
    assert [h["reward_mean"] for _, h in history] == [r["reward_mean"] for r in rows]
    assert [h["loss"] for _, h in history] == [r["loss"] for r in rows]

    # after the run: the plain command over its directory
    proc = subprocess.Popen([sys.executable, "capture.py", "--view", str(out), "--port", str(free_port())], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, env=child_env())
    try:
        line = proc.stdout.readline()
        assert line.startswith("viewer: http://127.0.0.1:"), line
        address = line.split()[1]
        listed = get(address.replace("/?key=", "/api/attempts?key="))
        assert sorted(a["file"] for a in listed["attempts"]) == names
        if browser:
            browser.open(address)
            assert browser.wait("document.querySelectorAll('#attempts tbody tr').length") == 4
            browser.wait("document.querySelectorAll('#curves .panel').length >= 4")
            browser.js("document.querySelector('#attempts tbody tr').click()")
            browser.wait("document.querySelectorAll('#detail .tok.gen').length")
            assert browser.errors == []
            assert browser.screenshot(tmp_path / "viewer-run.png") > 10_000
    finally:
        proc.terminate()
        proc.wait(30)
