"""The nanoGPT-style config system: defaults, config files, type-checked overrides, one-sentence errors.

    .venv/bin/python -m pytest tests/test_config.py -q
"""
import os
import subprocess
import sys

import pytest

import train
from train import ConfigError, configure

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
    for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
        if name.endswith(".py"):
            configure(["--config", os.path.join(ROOT, "configs", name)])


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


def test_bad_config_stops_the_run_before_any_work(tmp_path):
    r = subprocess.run([sys.executable, "train.py", "--max_steps=x", f"--out_dir={tmp_path}/o"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "config error: config key 'max_steps' (--max_steps) must be int, got str 'x'" in r.stderr
    assert not os.path.exists(f"{tmp_path}/o")
