"""The sandbox for model-written Python (agents/sandbox.py): real subprocesses, real limits.

    .venv/bin/python -m pytest tests/test_sandbox.py -q        # ~20 s

Each runaway (an infinite loop, a huge allocation, a network attempt, a print loop, a child that outlives its
parent) must be stopped and reported in the text the agent sends back as the tool result; both ways of cutting the
network (a network namespace, the audit-hook fallback) are tested where the first is available.
"""
import asyncio
import os

import pytest

from sandbox import namespace_command, network_isolation, run_python

# both modes always: where no network namespace can be made the namespace cases show as skipped (with the reason),
# and test_namespace_mode_without_unshare_is_one_clear_error runs instead
NO_NAMESPACE = pytest.mark.skipif(namespace_command() is None, reason="no network namespace here (unshare -n and "
                                  "unshare -rn both fail): the audit hook is the isolation in force")
ISOLATIONS = ["audit-hook", pytest.param("namespace", marks=NO_NAMESPACE)]


def run(code, **kw):
    return asyncio.run(run_python(code, **kw))


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_ordinary_code_runs_in_a_fresh_temp_dir(isolation):
    code = "import os, sys\nprint(sum(i * i for i in range(1, 8)))\nprint(os.getcwd())\nprint(sorted(os.listdir()))"
    result = run(code, isolation=isolation)
    lines = result.output.splitlines()
    assert result.ok and not result.timed_out and lines[0] == "140"
    workdir = lines[1]
    assert os.path.basename(workdir).startswith("sandbox-") and lines[2] == "['main.py']"
    assert not os.path.exists(workdir)  # removed afterwards
    assert result.report().endswith("[exit code 0]") and result.network_isolation == isolation


def test_infinite_loop_is_stopped_at_the_time_limit():
    result = run("while True:\n    pass", time_limit_s=1.5)
    assert result.timed_out and result.exit_code is None and not result.ok
    assert "time limit of 1.5 s exceeded" in result.report()


def test_partial_output_of_a_stopped_program_is_kept():
    result = run("import time\nprint('started', flush=True)\nwhile True:\n    time.sleep(0.01)", time_limit_s=1.5)
    assert result.timed_out and result.output.startswith("started")


def test_huge_allocation_fails_with_memory_error():
    result = run("x = bytearray(10**10)\nprint('never')", memory_mb=200)
    assert result.out_of_memory and "never" not in result.output
    assert "MemoryError" in result.report() and "memory limit of 200 MB exceeded" in result.report()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_network_attempt_fails(isolation):
    code = ("import socket\n"
            "s = socket.create_connection(('1.1.1.1', 80), timeout=2)\n"
            "print('connected')")
    result = run(code, isolation=isolation, time_limit_s=10)
    assert result.exit_code == 1 and "connected" not in result.output  # a traceback shows only the failing line
    expected = "Network is unreachable" if isolation == "namespace" else "network access and new processes are disabled"
    assert expected in result.report()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_loopback_is_unusable_too(isolation):
    # a server on the host's loopback (the capture server, a Ray port) must be out of reach as well
    import socket
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('reached the host')"
        result = run(code, isolation=isolation, time_limit_s=10)
    assert result.exit_code == 1 and "reached the host" not in result.output


def test_audit_hook_also_refuses_new_processes():
    result = run("import subprocess\nsubprocess.run(['curl', 'http://example.com'])", isolation="audit-hook")
    assert result.exit_code == 1 and "subprocess.Popen" in result.output


def test_print_loop_is_stopped_and_truncated():
    result = run("while True:\n    print('x' * 99)", max_output_chars=400, max_output_mb=0.5, time_limit_s=30)
    assert result.output_limited and result.truncated and not result.timed_out
    assert len(result.output) < 600 and "bytes of output cut" in result.output
    assert "output limit of 0.5 MB exceeded" in result.report()


def test_long_output_keeps_head_and_tail():
    result = run("for i in range(2000):\n    print(i)", max_output_chars=200)
    assert result.ok and result.truncated
    assert result.output.startswith("0\n1\n2\n") and result.output.endswith("1998\n1999\n")


@pytest.mark.parametrize("start", ["subprocess.Popen([sys.executable, '-c', 'pass'])", "os.fork()", "os.system('true')",
                                   "os.posix_spawn(sys.executable, [sys.executable, '-c', 'pass'], os.environ)",
                                   "os.execv(sys.executable, [sys.executable, '-c', 'pass'])",
                                   "multiprocessing.get_context('fork').Process(target=print).start()"])
def test_audit_hook_refuses_the_usual_ways_to_start_a_process(start):
    # not multiprocessing's spawn start method: it starts its interpreter by _posixsubprocess.fork_exec, which raises
    # no audit event; the process-group kill still ends that child (test_children_are_killed_with_the_program)
    result = run(f"import multiprocessing, os, subprocess, sys\n{start}\nprint('started')", isolation="audit-hook")
    assert result.exit_code == 1 and "started" not in result.output, result.output
    assert "network access and new processes are disabled" in result.output, result.output


CHILDREN = {  # a child that would outlive the program: namespace mode lets it start one; under the audit hook the
    # one way through is multiprocessing's spawn (no audit event); the program exits without waiting for it
    "namespace": "import subprocess, sys\np = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                 "print(p.pid, flush=True)",
    "audit-hook": "import multiprocessing, os, time\np = multiprocessing.get_context('spawn').Process(target=time.sleep, "
                  "args=(600,))\np.start()\nprint(p.pid, flush=True)\nos._exit(0)"}


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_children_are_killed_with_the_program(isolation):
    result = run(CHILDREN[isolation], isolation=isolation)
    pid = int(result.output.split()[0])
    assert result.ok
    for _ in range(100):  # the kill is delivered at once; reaping may take a moment
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split()[2] == "Z":  # a zombie waiting for its (dead) parent's reaper: already gone
                break
        asyncio.run(asyncio.sleep(0.05))
    else:
        pytest.fail(f"the child {pid} outlived the sandboxed program")


@pytest.mark.skipif(namespace_command() is not None, reason="a network namespace can be made here")
def test_namespace_mode_without_unshare_is_one_clear_error():
    with pytest.raises(RuntimeError, match="needs `unshare -n`"):
        run("print(1)", isolation="namespace")
    assert network_isolation() == "audit-hook"


def test_bad_isolation_argument_is_one_clear_error():
    with pytest.raises(ValueError, match="isolation must be"):
        run("print(1)", isolation="docker")
    assert network_isolation() == ("namespace" if namespace_command() is not None else "audit-hook")
