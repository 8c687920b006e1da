"""placement="colocated": the trainer and the engine take turns on one GPU. The engine's sleep mode
and the in-place (CUDA IPC) weight sync on a GPU; on CPU, bench.py loop's smoke run (the CPU engine
has no sleep mode: the same loop, the engine awake). The config checks, the dry run's colocated plan
(tests/test_dry_run.py) and the in-place sync through shared memory (tests/test_weights_sync.py)
run on CPU too.

    .venv/bin/python -m pytest tests/test_colocated.py -q            # CPU: the bench smoke run
    make test-gpu                                                     # one GPU: the tests below too
"""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import EngineThread, child_env, starts_stack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="vLLM's sleep mode and CUDA IPC: needs CUDA")


@pytest.fixture  # closed after its test: the colocated runs below measure the GPU alone
@starts_stack
def sleepy_engine(tiny_model_path):
    """The tiny model in a GPU engine started with vLLM's sleep mode (placement="colocated")."""
    from engine import Engine
    on = EngineThread(Engine(tiny_model_path, max_model_len=2048, memory_fraction=0.3, seed=0,
                             enable_sleep_mode=True))
    on.run(on.engine.start())
    yield on
    on.close()


@needs_cuda
def test_engine_sleeps_frees_its_memory_and_wakes_with_the_synced_weights(sleepy_engine,
                                                                           tiny_model_path):
    from test_weights_sync import (MAX_DIFF, MEAN_DIFF, fixed_sequence, trained_model,
                                   trainer_logprobs_bf16)
    from weights_sync import WeightSender, connect_engines, sleep_engines, sync_weights
    run, engine = sleepy_engine.run, sleepy_engine.engine
    ids = fixed_sequence(seed=4)
    model = trained_model(tiny_model_path, ids, steps=6)
    want = trainer_logprobs_bf16(model, ids)
    before = torch.tensor(run(engine.prompt_logprobs(ids))[1:])
    assert (before - want).abs().mean() > 1.0  # control: the trained weights are far from these
    sender = WeightSender(bucket_bytes=256 << 10, in_place=True)  # on the GPU: CUDA IPC
    assert run(connect_engines([engine], sender)) == 2

    async def held_across_a_sleep():
        # a request in flight when the engine sleeps is frozen, then finishes on the new weights
        held = engine.stream(fixed_sequence(8), {"max_tokens": 1500, "ignore_eos": True,
                                                  "temperature": 1.0, "seed": 0}, "held")
        await held.__anext__()  # its first tokens, sampled by version 0
        free = torch.cuda.mem_get_info()[0]
        await sleep_engines([engine])
        freed = torch.cuda.mem_get_info()[0] - free
        asleep = await engine.is_sleeping()
        stats = await sync_weights([engine], sender, model.cuda(), 1, asleep=True)
        async for out in held:
            pass
        return out, freed, asleep, stats

    out, freed, asleep, stats = run(held_across_a_sleep())
    sender.close()
    budget = 0.3 * torch.cuda.mem_get_info()[1]
    print(f"sleep freed {freed / 2**30:.2f} GiB of the engine's {budget / 2**30:.2f} GiB; sync "
          f"{stats['transfer_s'] * 1e3:.0f} ms, waking {stats['wake_s'] * 1e3:.0f} ms")
    assert asleep and freed > 0.5 * budget  # level 2: weights and KV cache both released
    assert stats["wake_s"] > 0 and stats["bytes"] == sum(
        b["nbytes"] for b in sender.layout(model)[0])
    versions = out["token_versions"]
    assert len(versions) == 1500 and versions[0] == 0 and versions[-1] == 1  # sampled by both
    assert versions == sorted(versions)
    after = torch.tensor(run(engine.prompt_logprobs(ids))[1:])
    diff = (after - want.to(after.device)).abs()
    assert diff.max() <= MAX_DIFF and diff.mean() <= MEAN_DIFF, (diff.max().item(),
                                                                 diff.mean().item())
    assert not run(engine.is_sleeping())


@needs_cuda
@pytest.mark.stack
def test_a_tiny_colocated_run_completes_on_one_gpu(tmp_path, tiny_model_path):
    # the whole loop with placement="colocated": every step the engine sleeps, the trainer steps,
    # the weights go in place and the engine wakes; with groups_in_flight = groups_per_batch every
    # batch is on-policy
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "train.py", "--placement=colocated", "--max_steps=3",
                        "--eval_every=0", "--groups_in_flight=8", "--engine_memory_fraction=0.3",
                        f"--model_path={tiny_model_path}", f"--out_dir={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=child_env())
    seconds = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [row for row in rows if row["step"] > 0]
    assert [row["policy_version"] for row in steps] == [1, 2, 3]
    for row in steps:
        assert row["sleep_s"] > 0 and 0 < row["wake_s"] < row["sync_s"], row
        assert row["staleness"] == 0 and row["stale_dropped"] == 0, row
        assert row["idle_s"] >= 0, row  # the phases do not overlap within the step
    shown = ("step_time_s", "batch_wait_s", "sleep_s", "train_step_s", "sync_s", "wake_s",
             "mismatch_kl")
    print(f"{seconds:.0f} s; steps:", [{k: round(row[k], 3) for k in shown} for row in steps])
    assert max(row["mismatch_kl"] for row in steps) < 0.05  # the in-place syncs landed


@needs_cuda  # on CPU the loop's placement is "separate", which the loop tests run; `python bench.py
@pytest.mark.stack  # loop --smoke` runs there by hand (a minute of make test's budget)
def test_bench_loop_smoke_runs_the_loop_and_its_ceiling():
    r = subprocess.run([sys.executable, "bench.py", "loop", "--smoke"], cwd=ROOT,
                       capture_output=True, text=True, timeout=900,
                       env=child_env(OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    cuda = torch.cuda.is_available()
    assert result["placement"] == ("colocated" if cuda else "separate") and result["steps"] == 2
    assert result["trained_tokens_per_s_per_gpu"] > 0 and 0 < result["ratio"] < 2
    assert sum(result["split"].values()) == pytest.approx(1.0, abs=0.01)
    assert result["split"]["generate"] > 0 and result["split"]["train"] > 0
    assert all(v > 0 for v in result["ceiling"].values())
