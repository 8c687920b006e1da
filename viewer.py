"""
The trajectory viewer: one page (viewer.html, beside this file: plain HTML, CSS
and JavaScript, nothing fetched from elsewhere) on 127.0.0.1 over a run's
out_dir: the curves of metrics.jsonl, the held-out results of eval_results.jsonl,
the list of recorded attempts and one attempt's token-level record.

    python train.py --view_port=8600          # live, during the run: open the address it prints (its key included)
    python capture.py --view out/tiny         # a finished (or running) run's directory, on a free port

What it reads: the rotating sample of attempts the run records for it (Recorder:
out_dir/view/attempts/, one file per attempt with the trainer's logprobs of the tokens it
trained on) and, with save_trajectories=True, every attempt in out_dir/trajectories.jsonl.
A truncated or corrupt line is skipped and counted, a missing file is empty.
"""
import base64
import json
import os
import queue
import random
import secrets
import threading
import time
import traceback

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Route

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "viewer.html")
MAX_ROUTE_NUMBERS = 4 << 20  # routed expert ids kept per segment (T x L_moe
                             # x K); a larger segment is kept without them


def complete_lines(path, offset=0):
    """(offset, line) of each line of a file from byte `offset` on: an unterminated
    last line (being written) is left for later; a missing file has none."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            for line in f:
                if not line.endswith(b"\n"):
                    return
                yield offset, line
                offset += len(line)
    except FileNotFoundError:
        return


def read_jsonl(path, offset=0):
    """The rows of a JSONL file from byte `offset` on: (rows, bad lines, next
    offset). A missing file has no rows; a line that is not a JSON object is
    counted as bad; an unterminated last line (being written) is left for later."""
    rows, bad = [], 0
    for at, line in complete_lines(path, offset):
        offset = at + len(line)
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif line.strip():
            bad += 1
    return rows, bad, offset


def attempt_summary(segments, head=None, **fields):
    """The light fields the attempt list shows, from an attempt's segment dicts
    and `head`, the dict that holds the attempt's own (id, group, reward, failure;
    the first segment by default); `fields` add to them or replace them."""
    head = head or segments[0]
    generated = [v for s in segments for m, v in zip(s["action_mask"], s["token_versions"]) if m]
    error = head.get("error")
    return dict(dict(attempt_id=head["attempt_id"], group_id=head.get("group_id"),
                     reward=head.get("reward"), segments=len(segments),
                     tokens=sum(len(s["token_ids"]) for s in segments), generated=len(generated),
                     min_version=min(generated, default=None),
                     max_version=max(generated, default=None), failed=bool(head.get("failed")),
                     timed_out="timed out" in (error or ""), error=error), **fields)


class Run:
    """What the page reads of one out_dir, cached: attempt files never change once written,
    and trajectories.jsonl and the logs only grow, so each poll parses only what is new."""

    def __init__(self, out_dir):
        self.dir, self.lock = out_dir, threading.Lock()
        self.sampled = {}  # file name -> summary
        # attempt id -> [(offset, length)] of its lines
        self.traj_offset, self.traj_bad, self.traj = 0, 0, {}

    def attempts(self):
        """Every attempt's summary, newest first: the
        sampled ones, and those of trajectories.jsonl."""
        folder, bad = os.path.join(self.dir, "view", "attempts"), 0
        with self.lock:
            names = set(os.listdir(folder)) if os.path.isdir(folder) else set()
            self.sampled = {n: s for n, s in self.sampled.items() if n in names}  # rotated out
            for name in sorted(names - set(self.sampled)):
                try:
                    with open(os.path.join(folder, name)) as f:
                        self.sampled[name] = dict(json.loads(f.readline()), source="sample",
                                                  file=name)
                except (ValueError, OSError):  # being written, or broken
                    bad += 1
            self.read_trajectories()
            listed = {s["attempt_id"] for s in self.sampled.values()}
            out = sorted(self.sampled.values(), key=lambda s: s.get("step", 0), reverse=True)
            out += [s for a, (s, _) in reversed(self.traj.items()) if a not in listed]
            return dict(attempts=out, bad_lines=bad + self.traj_bad)

    def read_trajectories(self):
        for offset, line in complete_lines(os.path.join(self.dir, "trajectories.jsonl"),
                                           self.traj_offset):
            self.traj_offset = offset + len(line)
            try:
                seg = json.loads(line)
                summary = attempt_summary([seg], source="trajectories")
            except (ValueError, KeyError, TypeError, IndexError):
                self.traj_bad += 1
                continue
            old, spans = self.traj.pop(seg["attempt_id"], (None, []))
            if old is not None:  # one more segment of the attempt
                summary = dict(old, segments=old["segments"] + 1, tokens=old["tokens"]
                               + summary["tokens"],
                               generated=old["generated"] + summary["generated"])
            self.traj[seg["attempt_id"]] = summary, spans + [(offset, len(line))]

    def attempt(self, attempt_id, file=None):
        """One attempt: {"summary", "segments"}; None if the run holds no such attempt."""
        if file:  # a sampled attempt's file: line 1 its summary, line 2 its segments
            path = os.path.join(self.dir, "view", "attempts", os.path.basename(file))
            if not os.path.isfile(path):
                return None
            with open(path) as f:
                return dict(summary=json.loads(f.readline()), segments=json.loads(f.readline()))
        with self.lock:
            self.read_trajectories()
            summary, spans = self.traj.get(attempt_id, (None, []))
        if summary is None:
            return None
        segments = []
        with open(os.path.join(self.dir, "trajectories.jsonl"), "rb") as f:
            for offset, length in spans:
                f.seek(offset)
                segments.append(json.loads(f.read(length)))
        return dict(summary=summary,
                    segments=sorted(segments, key=lambda s: s.get("segment_index", 0)))


def make_app(out_dir, key):
    """The viewer's Starlette app over out_dir; every request needs `key`
    (?key= or an x-api-key header). The endpoints are plain functions:
    Starlette runs them on its thread pool, never on an event loop's thread."""
    run, logs = Run(out_dir), {"metrics": "metrics.jsonl", "evals": "eval_results.jsonl"}

    def check(request):
        given = request.query_params.get("key") or request.headers.get("x-api-key") or ""
        if not secrets.compare_digest(given.encode(), key.encode()):
            raise HTTPException(
                401, "This viewer needs the key it printed at start: open the printed address.")

    def page(request):
        with open(PAGE) as f:
            return HTMLResponse(f.read())

    def log(request):
        name = request.path_params["name"]
        if name not in logs:
            raise HTTPException(404, f"no log named {name!r}")
        try:
            offset = max(0, int(request.query_params.get("from", 0)))
        except ValueError:
            raise HTTPException(400, "from= must be a byte offset (an integer)")
        path = os.path.join(out_dir, logs[name])
        rows, bad, offset = read_jsonl(path, offset)
        return JSONResponse(dict(rows=rows, bad_lines=bad, next=offset,
                                 missing=not os.path.exists(path)))

    def attempts(request):
        return JSONResponse(dict(run.attempts(), out_dir=os.path.abspath(out_dir)))

    def attempt(request):
        try:
            found = run.attempt(request.query_params.get("id", ""),
                                request.query_params.get("file"))
        except (ValueError, OSError) as e:
            raise HTTPException(422, f"the attempt's record cannot be read: {e}")
        if found is None:
            raise HTTPException(
                404, "no such attempt in this run (a sampled one may have rotated out)")
        return JSONResponse(found)

    def error(request, e):
        return JSONResponse({"error": e.detail}, status_code=e.status_code)

    def keyed(endpoint):  # every endpoint checks the key first (a plain
                          # function: Starlette's thread pool runs it)
        return lambda request: check(request) or endpoint(request)
    app = Starlette(routes=[Route(path, keyed(endpoint)) for path, endpoint in (
        ("/", page), ("/api/log/{name}", log), ("/api/attempts", attempts),
        ("/api/attempt", attempt))],
        exception_handlers={HTTPException: error})
    app.state.key = key
    return app


def serve_in_thread(out_dir, port=0):
    """Serve the viewer over out_dir on 127.0.0.1:port (0: a free one) from a
    daemon thread with uvicorn; print its address with the key. Returns (the
    uvicorn server, its address): stop it with `server.should_exit = True`."""
    import uvicorn
    key = secrets.token_urlsafe(16)
    server = uvicorn.Server(uvicorn.Config(make_app(out_dir, key), host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, name="viewer", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(
                f"the viewer could not listen on 127.0.0.1:{port} (in use?): pick another view_port")
        time.sleep(0.01)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/?key={key}"
    print(f"viewer: {url}", flush=True)
    return server, url


def main(out_dir, port=0):
    """`python capture.py --view OUT_DIR`: serve until Ctrl-C."""
    if not os.path.isdir(out_dir):
        raise SystemExit(f"--view {out_dir}: no such directory; pass a run's out_dir (e.g. "
                         "out/tiny)")
    server, _ = serve_in_thread(out_dir, port)
    try:
        while not server.should_exit:
            time.sleep(0.5)
    except KeyboardInterrupt:
        server.should_exit = True


# -----------------------------------------------------------------------------
# the run's side: a bounded, rotating sample of attempts, recorded off the trainer's path


def start(cfg, cleanup):
    """Rank 0, with the rollout, from the run's config: {"recorder": a
    Recorder (None: view_groups_per_step 0), "view": the live page's uvicorn
    server (None: view_port 0), "cleanup": `cleanup`, then both stopped}."""
    recorder = Recorder(cfg["out_dir"], cfg["model_path"], cfg["view_groups_per_step"],
                        cfg["view_max_attempts"]) if cfg["view_groups_per_step"] else None
    view = serve_in_thread(cfg["out_dir"], cfg["view_port"])[0] if cfg["view_port"] else None

    def stop():
        cleanup()
        if recorder:
            recorder.close()  # writes what is queued
        if view:
            view.should_exit = True
    return dict(recorder=recorder, view=view, cleanup=stop)


def segment_record(arrays, tokenizer, trainer_logprobs=None):
    """A segment's per-token truth for the page: each token's text, mask,
    behavior logprob, policy version, the trainer's logprob where it
    computed one, routed experts (unless too many), images (base64)."""
    ids = [int(t) for t in arrays["token_ids"]]
    routes = arrays.get("routed_experts")  # left out when too many
    return dict(attempt_id=arrays["attempt_id"], segment_index=int(arrays["segment_index"]),
                opened=arrays.get("opened"), parent=arrays.get("parent"),
                started=arrays.get("started"),
                token_ids=ids, tokens=tokenizer.batch_decode([[t] for t in ids]),
                action_mask=[int(m) for m in arrays["action_mask"]],
                behavior_logprobs=[round(float(x), 5) for x in arrays["behavior_logprobs"]],
                token_versions=[int(v) for v in arrays["token_versions"]],
                trainer_logprobs=trainer_logprobs, routed_experts=None if routes is None
                or routes.size > MAX_ROUTE_NUMBERS
                else routes.tolist(),
                images=[base64.b64encode(bytes(b)).decode() for b in arrays.get("images") or []])


class Recorder:
    """Rank 0: each step, `groups_per_step` of the batch's GRPO groups (at random) are written
    to out_dir/view/attempts/, one file per attempt, the newest `max_attempts` kept. The trainer
    hands over its records and the logprobs it computed for its own segments (add: a copy of
    those rows); this thread fetches the attempts' segments from the object store, decodes their
    tokens and writes. When it falls behind, samples are skipped, never the trainer held up."""

    def __init__(self, out_dir, model_path, groups_per_step, max_attempts):
        self.dir, self.model_path = os.path.join(out_dir, "view", "attempts"), model_path
        self.groups_per_step, self.max_attempts, self.skipped = groups_per_step, max_attempts, 0
        os.makedirs(self.dir, exist_ok=True)
        self.queue = queue.Queue(maxsize=4)
        self.thread = threading.Thread(target=self.run, name="view-recorder", daemon=True)
        self.thread.start()

    def add(self, policy_version, records, segments, advantages, logprobs):
        """The batch trained at policy_version (its step is policy_version + 1): its
        records (all ranks'), this rank's segments and their advantages, and per
        microbatch they were packed into (segment_rows: which segment each row holds,
        None for padding; the trainer's logprobs (B, T)): train_step's "logprobs"."""
        step = policy_version + 1
        groups = sorted({r["group_id"] for r in records})
        chosen = set(random.Random(step).sample(groups, min(self.groups_per_step, len(groups))))
        picked = [r for r in records if r["group_id"] in chosen]
        ids, trained = {r["attempt_id"] for r in picked}, {}
        # (distillation's are per token)
        advantage = {s["attempt_id"]: float(a) for s, a in zip(segments, advantages)
                     if getattr(a, "ndim", 0) == 0}
        for rows, lp in logprobs:
            for row, i in enumerate(rows or []):
                s = segments[i] if i < len(segments) else {}  # none: the rank's one empty row
                if s.get("attempt_id") in ids:  # position t predicts token t + 1;
                                                # NOTE: a device-to-host copy of a row
                    lp_row = lp[row, :len(s["token_ids"]) - 1].float().cpu().tolist()
                    trained[(s["attempt_id"], int(s["segment_index"]))] = [None] + [
                        round(x, 5) if m else None for x, m in zip(lp_row, s["action_mask"][1:])]
        try:
            # rank 0's attempts only
            picked = [dict(r, advantage=advantage.get(r["attempt_id"])) for r in picked]
            self.queue.put_nowait((step, policy_version, picked, trained))
        except queue.Full:
            self.skipped += 1

    def run(self):
        import ray
        from transformers import AutoTokenizer
        # its own: tokenizers are not shared over threads
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        while (item := self.queue.get()) is not None:
            try:
                self.write(tokenizer, ray, *item)
            except Exception:  # the viewer's sample must never stop the run
                traceback.print_exc()

    def write(self, tokenizer, ray, step, policy_version, picked, trained):
        with_tokens = [r for r in picked if r["ref"] is not None]
        arrays = dict(zip(map(id, with_tokens), ray.get([r["ref"] for r in with_tokens])))
        by_attempt = {}
        for r in picked:
            by_attempt.setdefault(r["attempt_id"], []).append(r)
        for attempt_id, rs in by_attempt.items():
            segments = [segment_record(arrays[id(r)], tokenizer,
                                       trained.get((attempt_id, r["segment_index"])))
                        for r in sorted(rs, key=lambda r: r["segment_index"]) if id(r) in arrays]
            summary = attempt_summary(
                segments or [dict(action_mask=[], token_versions=[], token_ids=[])], rs[0],
                step=step, policy_version=policy_version, advantage=rs[0].get("advantage"))
            name = f"{step:08d}-{attempt_id}.json"
            with open(os.path.join(self.dir, name + ".tmp"), "w") as f:
                f.write(json.dumps(summary) + "\n" + json.dumps(segments) + "\n")
            # whole, or not at all
            os.replace(os.path.join(self.dir, name + ".tmp"), os.path.join(self.dir, name))
        names = sorted(n for n in os.listdir(self.dir) if n.endswith(".json"))
        for name in names[:max(0, len(names) - self.max_attempts)]:  # the oldest rotate out
            os.remove(os.path.join(self.dir, name))

    def close(self):
        """Write what is queued, then stop."""
        self.queue.put(None)
        self.thread.join()
