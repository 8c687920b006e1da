"""A run killed with SIGKILL in the middle of a step resumes from its last checkpoint.

    .venv/bin/python -m pytest tests/test_resume.py -q     # CPU: a real engine, Ray and the tiny run, a few minutes

The tiny default run (`python train.py`, a real vLLM engine actor, the calculator agent) checkpoints every step and
is SIGKILLed as soon as the step-1 checkpoint is complete, while step 2's rollouts are in flight (the checkpoint's
data position counts the groups_in_flight groups started beyond the one batch trained, and no step 2 was logged).
Then:
- the trainer a resumed run builds (train.build_trainer, as main() does) holds exactly the checkpoint's parameters
  and AdamW state (read straight from the checkpoint files), at step 1, with the policy version and data position
  saved beside them;
- the killed run leaves no process behind (its in-flight rollouts die with its Ray cluster);
- `python train.py --resume=True` goes on with step 2 at policy version 2, its prompts continue the prompt stream
  where the checkpoint left it (the groups in flight at the kill are not replayed), and its weights move on from the
  checkpoint's;
- `python train.py --export_hf_dir=DIR` writes that last checkpoint as an HF directory that transformers loads.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import checkpoint
import train
import weights_sync
from conftest import child_env, kill_tree

pytestmark = pytest.mark.stack
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_args(out_dir, model_path, prompts):
    return [f"--out_dir={out_dir}", f"--model_path={model_path}", f"--prompts={prompts}", "--max_steps=4",
            "--checkpoint_every=1", "--group_size=2", "--groups_per_batch=2", "--groups_in_flight=3",
            "--engine_max_model_len=1024", "--engine_memory_fraction=0.3", "--warmup_steps=0", "--save_trajectories=True",
            "--eval_every=0",  # no held-out evaluation rows (step 0) in the log
            "--entropy_coef=0.01"]  # the random-init model earns no exact-answer reward: the bonus moves the weights


def start(args, log_path):
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env=child_env(PYTHONUNBUFFERED="1"), start_new_session=True)


def exited(proc, tree):
    """Keep `tree` up to date with proc's descendants (Ray, the engine actor, vLLM's engine process) while it runs,
    so that they can be waited for, or ended, after it is gone. True once proc has exited."""
    try:
        tree[:] = psutil.Process(proc.pid).children(recursive=True) or tree
    except psutil.NoSuchProcess:
        pass
    return proc.poll() is not None


def log_tail(path):
    with open(path) as f:
        return f.read()[-4000:]


def wait_for(predicate, proc, log_path, timeout_s):
    """Poll predicate() until true; fail with the run's log if `proc` (when given) exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the run exited ({proc.returncode}) early:\n{log_tail(log_path)}")
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout_s}s:\n{log_tail(log_path)}")


def read_checkpoint(path, tmp_path):
    """The checkpoint's tensors as saved (experts global), via torch's DCP -> torch.save converter."""
    flat = tmp_path / "checkpoint.pt"
    dcp_to_torch_save(path, flat)
    return torch.load(flat, weights_only=False)


def questions(path, first_line=0):
    """The user question of each segment written to trajectories.jsonl from line `first_line` on."""
    with open(path) as f:
        rows = [json.loads(line) for line in f][first_line:]
    return [row["text"].split("What is ", 1)[1].split("?", 1)[0] for row in rows]


def test_sigkill_mid_step_then_resume(tmp_path, tiny_model_path):
    from agentrl import read_prompts
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as f:  # every question distinct, so that a question tells its place in the stream
        for a in range(20):
            for b in range(20):
                f.write(json.dumps({"prompt": f"What is {a} + {b}? Use the calculator.", "label": f"{a} + {b}"}) + "\n")
    out = tmp_path / "run"
    args = run_args(out, tiny_model_path, prompts)
    latest = out / "checkpoints" / "latest"

    # 1. run, and SIGKILL the driver the moment the step-1 checkpoint is complete (step 2 is being rolled out)
    proc = start(args, tmp_path / "run1.log")
    tree = []
    try:
        def checkpointed():
            exited(proc, tree)
            return latest.is_file() and latest.read_text().strip() == "step_000001"
        wait_for(checkpointed, proc, tmp_path / "run1.log", timeout_s=900)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert tree, "the run started no Ray or engine processes"
    except BaseException:
        kill_tree(proc, tree)
        raise
    # in-flight rollouts are discarded with the run: its Ray cluster and engine go away on their own, within 90 s.
    # Waited for beside steps 2 and 3: Ray's dashboard and runtime-env agents take about a minute (they report the
    # raylet's unexpected end to the dead GCS, with a 60 s RPC timeout, before they exit)
    killed, left = tree, []
    waiter = threading.Thread(target=lambda: left.extend(psutil.wait_procs(killed, timeout=90)[1]), daemon=True)
    waiter.start()
    with open(out / "metrics.jsonl") as f:
        rows_before = [json.loads(line) for line in f]
    assert [r["step"] for r in rows_before] == [1]  # killed before step 2 ended
    lines_before = sum(1 for _ in open(out / "trajectories.jsonl"))

    # 2. what a resumed trainer holds equals the checkpoint files: parameters, AdamW state, step, version, data position
    ckpt = checkpoint.latest_checkpoint(str(out))
    assert ckpt.endswith("step_000001")
    saved = read_checkpoint(ckpt, tmp_path)
    cfg = train.configure(args + ["--resume=True"])
    device = train.init_distributed()[2]  # a gloo group of one rank (shared with other tests in this process)
    model, optimizer, step, extra = train.build_trainer(cfg, 1, device)
    assert step == 1
    state = get_model_state_dict(model)
    assert set(state) == set(saved["model"])
    for name, value in state.items():
        assert torch.equal(weights_sync.gather(model, name, value), saved["model"][name]), name
    optim = get_optimizer_state_dict(model, optimizer)["state"]
    assert set(optim) == set(saved["optimizer"]["state"])
    for name, moments in optim.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            mine, theirs = weights_sync.gather(model, name, moments[key]), saved["optimizer"]["state"][name][key]
            assert torch.equal(mine, theirs), (name, key)
    assert extra["policy_version"] == 1  # what main() hands the rollout pool and the trainer
    assert "data_position" in extra, ("the checkpoint must record how many prompts the run has drawn from its "
                                      "prompt stream (extra['data_position']) so that a resumed run continues it")
    position = extra["data_position"]
    # the groups step 1 trained, and the pool's groups_in_flight started after it took them: step 2's, in flight
    assert position == cfg["groups_per_batch"] + cfg["groups_in_flight"]

    # 3. resume: step 2 at version 2, prompts continue the stream, the weights move on
    proc = start(args + ["--resume=True", "--max_steps=2"], tmp_path / "run2.log")
    tree = []
    try:
        wait_for(lambda: exited(proc, tree), None, tmp_path / "run2.log", timeout_s=900)
        assert proc.returncode == 0, log_tail(tmp_path / "run2.log")
        psutil.wait_procs(tree, timeout=60)
    finally:
        kill_tree(proc, tree)
        waiter.join()
        kill_tree(proc, left)
    assert not left, f"processes of the killed run still alive 90 s after the kill: {[p.pid for p in left]}"
    assert f"resumed from {ckpt} at step 1" in open(tmp_path / "run2.log").read()
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [(r["step"], r["policy_version"]) for r in rows] == [(1, 1), (2, 2)]
    assert checkpoint.latest_checkpoint(str(out)).endswith("step_000002")

    stream = [row["prompt"].split("What is ", 1)[1].split("?", 1)[0]
              for row, _ in zip(read_prompts(str(prompts), seed=cfg["seed"]), range(400))]
    resumed = questions(out / "trajectories.jsonl", first_line=lines_before)
    assert resumed
    # the resumed run's groups start at the checkpoint's position (the first of them may be the one not finished)
    first = min(stream.index(q) for q in resumed)
    assert position <= first < position + cfg["groups_in_flight"], (first, position)

    after = read_checkpoint(checkpoint.latest_checkpoint(str(out)), tmp_path)["model"]
    assert any(not torch.equal(after[k], saved["model"][k]) for k in saved["model"])

    # 4. the export command: the last checkpoint as an HF directory (bf16), loaded by transformers
    from transformers import AutoModelForCausalLM
    exported = tmp_path / "hf"
    r = subprocess.run([sys.executable, "train.py", *args, f"--export_hf_dir={exported}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=child_env())
    assert r.returncode == 0 and f"exported step 2 of {out} to {exported}" in r.stdout, r.stderr[-3000:]
    hf = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).state_dict()
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.mlp.gate.weight"):
        torch.testing.assert_close(hf[name], after[name].to(torch.bfloat16).float(), rtol=0, atol=0)
    assert (exported / "tokenizer.json").is_file()
