"""
A sandboxed subprocess for model-written Python: a wall-clock and CPU time
limit, an address-space limit, no network, a fresh temporary directory as
the working directory, and output truncated to a size a context can hold.

    result = await run_python("print(2 + 2)", time_limit_s=5, memory_mb=256)
    result.report()   # "4\n[exit code 0]": what an agent sends back as the tool result

    .venv/bin/python -m pytest tests/test_sandbox.py -q

No network: the child runs in a new, empty network namespace (`unshare -n`, or `unshare -rn` as
an unprivileged user where user namespaces are allowed): no interface but a loopback that is
down, for the child and anything it starts. Where neither works (some containers), an audit hook
in the child refuses to create sockets and to start processes; `network_isolation()` says which
one is in force. Either way this stops honest-but-buggy code (runaway loops, huge allocations,
stray downloads) from hurting the run; it is not a jail for adversarial code, which needs a
container or a VM (the child can still read the file system with the trainer's permissions).
"""
import asyncio
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

# Runs in the child before the model's code: limits first, then (in audit
# mode) the hook, then main.py. setrlimit here rather than in preexec_fn:
# preexec_fn is not safe in a process with threads (the rollout pool's is).
PRELUDE = r"""
import resource, sys
memory_bytes, cpu_s, file_bytes, audit = (int(a) for a in sys.argv[1:5])
resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if audit:
    BLOCKED = ("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "subprocess.Popen",
               "os.system", "os.exec", "os.posix_spawn", "os.fork", "os.forkpty", "pty.spawn", "ctypes.dlopen")
    def no_network(event, args):
        if event in BLOCKED:
            raise PermissionError(f"{event}: network access and new processes are disabled in this sandbox")
    sys.addaudithook(no_network)
import traceback
del resource, memory_bytes, cpu_s, file_bytes, audit
sys.argv = ["main.py"]
with open("main.py") as f:
    source = f.read()
try:
    exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as e:  # the traceback of the model's own lines: library frames cost context and say little
    sys.stdout.flush()
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == "main.py"]
    print("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
          + "".join(traceback.format_exception_only(e)), end="", file=sys.stderr)
    sys.exit(1)
"""


@dataclass
class SandboxResult:
    output: str            # stdout and stderr interleaved, truncated
                           # to max_output_chars (head and tail kept)
    exit_code: int | None  # None when the sandbox killed the process
    timed_out: bool        # the wall-clock limit fired
    output_limited: bool   # killed for writing more than max_output_mb
    truncated: bool        # output was cut
    network_isolation: str  # "namespace" or "audit-hook"
    limits: dict           # time_limit_s, memory_mb: what the report names

    @property
    def ok(self):
        return self.exit_code == 0

    @property
    def out_of_memory(self):
        return self.exit_code not in (0, None) and "MemoryError" in self.output

    def report(self):
        """The output plus one status line, as the model should see it in the tool result."""
        if self.timed_out:
            status = f"stopped: time limit of {self.limits['time_limit_s']:g} s exceeded"
        elif self.output_limited:
            status = f"stopped: output limit of {self.limits['max_output_mb']:g} MB exceeded"
        elif self.exit_code is not None and self.exit_code < 0:
            name = signal.Signals(-self.exit_code).name if -self.exit_code in signal.valid_signals() else "?"
            why = {"SIGXCPU": " (CPU time limit)", "SIGXFSZ": " (file size limit)"}.get(name, "")
            status = f"stopped: killed by {name}{why}"
        elif self.out_of_memory:
            status = f"stopped: memory limit of {self.limits['memory_mb']} MB exceeded (exit code {self.exit_code})"
        else:
            status = f"exit code {self.exit_code}"
        return f"{self.output}{'' if not self.output or self.output.endswith(chr(10)) else chr(10)}[{status}]"


@functools.cache
def namespace_command():
    """The command prefix that runs a program in a new network namespace here, or None."""
    if shutil.which("unshare") is None:
        return None
    # root; an unprivileged user with user namespaces
    for prefix in (["unshare", "-n"], ["unshare", "-rn"]):
        try:
            if subprocess.run(prefix + ["true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            pass
    return None


def network_isolation():
    """"namespace" where `unshare` can give the child
    an empty network namespace, else "audit-hook"."""
    return "namespace" if namespace_command() is not None else "audit-hook"


async def run_python(code, *, time_limit_s=5.0, memory_mb=256, max_output_chars=4000,
                     max_output_mb=1, max_file_mb=16, isolation="auto", python=sys.executable):
    """Run `code` as main.py in a fresh temporary directory and return a SandboxResult. The
    process group is killed at the time limit or once it has written max_output_mb (and
    always at the end, so nothing it started lives on); the directory is removed. The result
    keeps max_output_chars of the output, its start and its end. isolation: "auto" (a
    network namespace when available, else the audit hook), "namespace" or "audit-hook"."""
    if isolation == "auto":
        isolation = network_isolation()
    if isolation == "namespace":
        prefix = namespace_command()
        if prefix is None:
            raise RuntimeError(
                "isolation='namespace' needs `unshare -n` (root) or `unshare -rn` (user "
                "namespaces), "
                "and neither works here; use isolation='auto'")
    elif isolation == "audit-hook":
        prefix = []
    else:
        raise ValueError(f"isolation must be 'auto', 'namespace' or 'audit-hook', got {isolation!r}")
    workdir = tempfile.mkdtemp(prefix="sandbox-")
    with open(os.path.join(workdir, "main.py"), "w") as f:
        f.write(code)
    cpu_s = int(time_limit_s) + 1  # the wall-clock limit normally fires
                                   # first; this one also stops busy children
    audit = int(isolation == "audit-hook")
    args = [str(int(memory_mb * 2**20)), str(cpu_s), str(int(max_file_mb * 2**20)), str(audit)]
    output_limit = int(max_output_mb * 2**20)
    # -I: ignore PYTHON* variables and the user's site-packages;
    # the environment holds nothing of the trainer's
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
           "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    head, tail, total = bytearray(), bytearray(), 0
    half = max_output_chars // 2
    too_much_output = asyncio.Event()

    async def read_output(stream):
        nonlocal head, tail, total
        while chunk := await stream.read(1 << 16):
            total += len(chunk)
            if total > output_limit:  # a print loop: it is being killed;
                                      # drain the pipe, keep nothing more
                too_much_output.set()
                continue
            if len(head) < half:
                head += chunk[:half - len(head)]
            tail = (tail + chunk)[-half:]

    proc = await asyncio.create_subprocess_exec(
        *prefix, python, "-I", "-c", PRELUDE, *args, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    async def exit_code_of(proc):
        # polled: asyncio's proc.wait() (Python 3.11) also waits for the pipe to close, which
        # a child of the program may hold open long after the program itself has exited
        while proc.returncode is None:
            await asyncio.sleep(0.02)
        return proc.returncode

    reader = asyncio.ensure_future(read_output(proc.stdout))
    exited, limited = asyncio.ensure_future(exit_code_of(proc)), asyncio.ensure_future(
        too_much_output.wait())
    try:
        done, _ = await asyncio.wait([exited, limited], timeout=time_limit_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        timed_out = not done
    finally:  # also when the attempt is cancelled
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole session: children and grandchildren too
        except ProcessLookupError:
            pass
        limited.cancel()
        exit_code = await exited
        try:  # the rest of the output: every writer is dead now (unless one left the process group)
            await asyncio.wait_for(reader, 5)
        except TimeoutError:
            pass
        shutil.rmtree(workdir, ignore_errors=True)
    truncated = total > 2 * half
    if truncated:  # head and tail each hold `half` bytes: keep
                   # the start and the end (where tracebacks are)
        text = (head.decode(errors="replace")
                + f"\n... [{total - 2 * half} bytes of output cut] ...\n"
                + tail.decode(errors="replace"))
    else:  # head, then what the tail holds beyond it
        text = (head + tail[len(tail) - (total - len(head)):]).decode(errors="replace")
    output_limited = total > output_limit and not timed_out
    return SandboxResult(output=text, exit_code=None if timed_out or output_limited else exit_code,
                         timed_out=timed_out, output_limited=output_limited, truncated=truncated,
                         network_isolation=isolation,
                         limits=dict(time_limit_s=time_limit_s, memory_mb=memory_mb,
                                     max_output_mb=max_output_mb))
