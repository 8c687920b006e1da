"""Every entry point that starts engines leaves no process behind on SIGTERM or SIGINT: no VLLM::EngineCore, no
Ray worker, nothing of its process tree.

    .venv/bin/python -m pytest tests/test_shutdown.py -q     # three engine starts, ~2 minutes on 2 cores

- `python capture.py` started with SIGINT ignored (as `python capture.py &` from a script does), then SIGINT while
  it serves: it exits 0 with its engine process (SIGTERM: test_capture_load.py, after its load tests);
- `python train.py` (the tiny default), SIGTERM or SIGINT as soon as its engine process exists: it exits, and its
  Ray cluster and engine go with it.
"""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import child_env, kill_tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.stack  # engines, in processes of their own


def run_until(args, log_path, ready, preexec_fn=None, timeout_s=600):
    """Start `args` in its own session; poll until ready(log text, names of its descendants). Returns (process,
    its descendants at that moment)."""
    proc = subprocess.Popen(args, cwd=ROOT, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            env=child_env(PYTHONUNBUFFERED="1"), start_new_session=True, preexec_fn=preexec_fn)
    deadline, tree = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        try:
            tree = psutil.Process(proc.pid).children(recursive=True) or tree
            names = [p.name() for p in tree if p.is_running()]
        except psutil.NoSuchProcess:
            names = []
        if ready(open(log_path).read(), names):
            return proc, tree
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    kill_tree(proc, tree)
    pytest.fail(f"{args} did not get ready:\n{open(log_path).read()[-3000:]}")


def check_gone(proc, tree, log_path, sig, returncodes):
    """Send `sig`; the process exits with one of `returncodes` and every descendant it had is gone."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True) or tree  # workers started since
        os.kill(proc.pid, sig)
        code = proc.wait(timeout=120)
        assert code in returncodes, f"exit code {code}:\n{open(log_path).read()[-3000:]}"
        _, alive = psutil.wait_procs(tree, timeout=90)
        assert not alive, f"left behind: {[(p.pid, p.name()) for p in alive]}"
    finally:
        kill_tree(proc, tree)


def has_engine(names):
    return any("EngineCore" in n for n in names)


def test_capture_py_with_sigint_ignored_stops_on_sigint(tmp_path):
    log = tmp_path / "capture.log"
    proc, tree = run_until([sys.executable, "capture.py"], log, lambda text, names: "capture server for" in text,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert has_engine(p.name() for p in tree)
    check_gone(proc, tree, log, signal.SIGINT, (0,))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_train_py_stops_with_its_engines(tmp_path, tiny_model_path, sig):
    log = tmp_path / "train.log"
    args = [sys.executable, "train.py", f"--out_dir={tmp_path / 'run'}", f"--model_path={tiny_model_path}",
            "--engine_max_model_len=1024", "--engine_memory_fraction=0.3"]
    proc, tree = run_until(args, log, lambda text, names: has_engine(names))
    # SIGTERM: Ray's handler in the driver aborts it (-6) or it dies of the signal; SIGINT: KeyboardInterrupt (1)
    check_gone(proc, tree, log, sig, (-signal.SIGABRT, -signal.SIGTERM, 1) if sig == signal.SIGTERM else (1,))
