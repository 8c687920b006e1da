"""The nanoGPT-style config system: defaults, config files, type-checked overrides, one-sentence errors, and every
key checked before any work (plan.check_config).

    .venv/bin/python -m pytest tests/test_config.py -q
"""
import json
import os
import subprocess
import sys

import pytest

import model
import train
from plan import ConfigError
from train import configure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_defaults_file_and_overrides(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("# python train.py --config c.py\nmax_steps = 7\nlearning_rate = 1e-4\nout_dir = 'out/x'\n")
    cfg = configure(["--config", str(f), "--max_steps=9", "--eps_high=0.3", "--loss_type=gspo",
                     "--speculative_config={'method': 'mtp', 'num_speculative_tokens': 1}"])
    assert cfg["max_steps"] == 9 and cfg["learning_rate"] == 1e-4 and cfg["out_dir"] == "out/x"
    assert cfg["eps_high"] == 0.3 and cfg["loss_type"] == "gspo"
    assert cfg["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 1}
    assert configure([])["max_steps"] == train.max_steps
    assert configure(["--learning_rate=1"])["learning_rate"] == 1.0  # an int where a float is expected is fine


def test_every_shipped_config_resolves():
    """Each file of configs/ opens with the command that runs it, and resolves to the defaults with exactly the file's
    assignments over them (values of the defaults' types: configure raises on any other)."""
    names = sorted(n for n in os.listdir(os.path.join(ROOT, "configs")) if n.endswith(".py"))
    assert "tiny.py" in names and len(names) >= 6
    defaults = configure([])
    for name in names:
        path = os.path.join(ROOT, "configs", name)
        with open(path) as f:
            text = f.read()
        first = text.splitlines()[0]
        assert first.startswith("# ") and f"--config configs/{name}" in first and (
            "python train.py" in first or "./torchrun.sh" in first), (name, first)
        scope = {}
        exec(compile(text, path, "exec"), {}, scope)
        assigned = {k: v for k, v in scope.items() if not k.startswith("_")}
        assert assigned and set(assigned) <= set(defaults), (name, set(assigned) - set(defaults))
        cfg = configure(["--config", path])
        assert set(cfg) == set(defaults), name
        assert {k: cfg[k] for k in cfg if cfg[k] != defaults[k]} == {
            k: v for k, v in assigned.items() if v != defaults[k]}, name


def test_a_lora_run_schedules_lora_learning_rate():
    from plan import check_config
    full, adapters = configure([]), configure(["--lora_rank=8"])
    assert adapters["learning_rate"] == full["learning_rate"] < adapters["lora_learning_rate"]
    top, end = full["warmup_steps"] - 1, full["max_steps"]  # the warm-up's last step, and the end of the decay
    assert train.learning_rate_at(top, full) == full["learning_rate"]
    assert train.learning_rate_at(top, adapters) == adapters["lora_learning_rate"]
    assert train.learning_rate_at(end, adapters) == pytest.approx(adapters["min_lr"])
    # --learning_rate moves full fine-tuning's rate only; --lora_learning_rate the LoRA run's
    peak = adapters["lora_learning_rate"]
    assert train.learning_rate_at(top, configure(["--lora_rank=8", "--learning_rate=1e-5"])) == peak
    assert train.learning_rate_at(top, configure(["--lora_rank=8", "--lora_learning_rate=2e-3"])) == 2e-3
    with pytest.raises(ConfigError, match=r"min_lr \(0.01\) is above lora_learning_rate \(0.005\)"):
        check_config(configure(["--lora_rank=8", "--min_lr=0.01"]))
    with pytest.raises(ConfigError, match="lora_learning_rate=0.0 is not accepted: it must be > 0"):
        check_config(configure(["--lora_rank=8", "--lora_learning_rate=0"]))


@pytest.mark.parametrize("argv,msg", [
    (["--no_such_key=1"], "unknown config key 'no_such_key'"),
    (["--max_steps=abc"], "config key 'max_steps' .* must be int, got str"),
    (["--resume=1"], "config key 'resume' .* must be bool, got int"),
    (["--config", "configs/does_not_exist.py"], "config file 'configs/does_not_exist.py' does not exist"),
    (["max_steps=3"], "cannot parse argument 'max_steps=3'"),
])
def test_bad_config_is_one_clear_sentence(argv, msg):
    with pytest.raises(ConfigError, match=msg):
        configure(argv)


def test_bad_key_in_config_file(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text("max_stepz = 3\n")
    with pytest.raises(ConfigError, match=f"unknown config key 'max_stepz' \\({f}\\)"):
        configure(["--config", str(f)])


@pytest.mark.stack
def test_bad_config_stops_the_run_before_any_work(tmp_path):
    r = subprocess.run([sys.executable, "train.py", "--max_steps=x", f"--out_dir={tmp_path}/o"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "config error: config key 'max_steps' (--max_steps) must be int, got str 'x'" in r.stderr
    assert not os.path.exists(f"{tmp_path}/o")


# each bad value a new user tried, and the range cases: (override, the sentence's key=value and what it accepts)
BAD_VALUES = [
    ("--advantage_estimator=gpro", "advantage_estimator='gpro' is not one of grpo, drgrpo, rloo, reinforce, distill"),
    ("--loss_type=ppo2", "loss_type='ppo2' is not one of ppo, gspo"),
    ("--is_level=tok", "is_level='tok' is not one of token, sequence, geometric, none"),
    ("--is_mode=reject", "is_mode='reject' is not one of truncate, clip, mask"),
    ("--failed_group_rule=keep", "failed_group_rule='keep' is not one of drop, complete"),
    ("--param_dtype=bf16", "param_dtype='bf16' is not one of float32, bfloat16"),
    ("--group_size=0", "group_size=0 is not accepted: it must be >= 1"),
    ("--groups_per_batch=0", "groups_per_batch=0 is not accepted: it must be >= 1"),
    ("--max_tokens=0", "max_tokens=0 is not accepted: it must be >= 1"),
    ("--learning_rate=0", "learning_rate=0.0 is not accepted: it must be > 0"),
    ("--learning_rate=-1e-3", "learning_rate=-0.001 is not accepted: it must be > 0"),
    ("--temperature=0", "temperature=0.0 is not accepted: it must be > 0"),
    ("--top_p=1.5", "top_p=1.5 is not accepted: it must be in (0, 1]"),
    ("--max_staleness=-1", "max_staleness=-1: must be an int >= 0"),
    ("--eps_low=1.5", "eps_low=1.5, eps_high=0.28: need 0 <= eps_low < 1"),
    ("--engine_memory_fraction=0", "engine_memory_fraction=0.0 is not accepted: it must be in (0, 1]"),
    ("--min_lr=1.0", "min_lr (1.0) is above learning_rate (0.0005)"),
    ("--ep_size=3", "train_world_size (1) is not divisible by ep_size (3): expert-parallel groups need whole sets"),
    ("--agent=agents/no_such_agent.py", "agent='agents/no_such_agent.py': no such file"),
    ("--prompts=no_such_prompts.jsonl", "prompts='no_such_prompts.jsonl': no such file"),
    ("--model_path=/no/such/model", "model_path='/no/such/model' has no config.json"),
    ("--resume=True", "resume=True needs a checkpoint, and out_dir="),
]


@pytest.mark.parametrize("override,sentence", BAD_VALUES)
def test_every_bad_value_stops_before_any_work(override, sentence, tmp_path, monkeypatch):
    """train.main exits with one sentence, and none of what a run starts (process group, tiny model build, trainer,
    Ray, engines) was called."""
    def started(*args, **kwargs):
        raise AssertionError(f"{override}: work started before the config was checked")
    for name in ("init_distributed", "ensure_tiny_model", "build_trainer", "connect_ray", "start_rollout"):
        monkeypatch.setattr(train, name, started)
    with pytest.raises(SystemExit) as exit_:
        train.main([override, f"--out_dir={tmp_path}/o"])
    assert str(exit_.value).startswith("config error: ") and sentence in str(exit_.value), str(exit_.value)
    assert str(exit_.value).count("\n") == 0
    assert not os.path.exists(f"{tmp_path}/o")


def test_unsupported_model_type_is_one_sentence(tmp_path, monkeypatch):
    """A model we do not implement (a Llama) stops in the config check, naming the model types model.py supports."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    monkeypatch.setattr(train, "init_distributed", lambda *a: pytest.fail("work started before the config check"))
    with pytest.raises(SystemExit) as exit_:
        train.main([f"--model_path={tmp_path}", f"--out_dir={tmp_path}/o"])
    msg = str(exit_.value)
    assert msg.startswith(f"config error: model_path={str(tmp_path)!r}: model_type 'llama' is not "), msg
    assert msg.endswith(f"must be one of {', '.join(model.MODEL_TYPES)})"), msg  # model.py's list, hybrids included
    assert "qwen3_5_moe" in model.MODEL_TYPES and "\n" not in msg and not os.path.exists(tmp_path / "o")


@pytest.mark.stack
def test_bad_value_exit_status_and_no_ray(tmp_path):
    """The real process: exit status 1, the sentence on stderr, no Ray session or engine started."""
    env = dict(os.environ, RAY_TMPDIR=str(tmp_path / "ray"))
    r = subprocess.run([sys.executable, "train.py", "--loss_type=ppo2", f"--out_dir={tmp_path}/o"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == "config error: loss_type='ppo2' is not one of ppo, gspo"
    assert not os.path.exists(tmp_path / "ray") and "Traceback" not in r.stderr and "vllm" not in r.stderr.lower()
