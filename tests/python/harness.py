"""Real processes for the lockstep_torch tests: ranks started the way torchrun starts them
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), or by `lockstep run`, with the build
tree's python/ on PYTHONPATH (which registers the "lockstep" backend in every program that
imports torch.distributed). Every wait has a deadline; nothing sleeps.

The build directory comes from LOCKSTEP_BUILD_DIR (ctest sets it). Every file a test writes goes
into a temporary directory of its TestCase (TestCase.tmpdir), removed when the test ends.
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import unittest

PYTHON = sys.executable  # ctest runs the tests with the python the extension was built for
HERE = os.path.dirname(os.path.abspath(__file__))


SKIPPED = 77  # the exit code ctest reads as "skipped" (SKIP_RETURN_CODE in tests/python/CMakeLists.txt)


def require_hugging_face():
    """Imports transformers, accelerate, tokenizers and safetensors, or ends the test: a failure
    under ./scripts/test (LOCKSTEP_REQUIRE_HF=1: it installs them, so their absence is a broken
    set-up), elsewhere a skip that says what is missing."""
    try:
        import accelerate, safetensors, tokenizers, transformers  # noqa: F401,E401
    except ImportError as e:
        required = os.environ.get("LOCKSTEP_REQUIRE_HF") == "1"
        print(f"{'FAIL' if required else 'SKIP'}: {PYTHON} cannot import Hugging Face's libraries ({e}); "
              "./scripts/test installs them into its venv (scripts/common.sh)", flush=True)
        sys.exit(1 if required else SKIPPED)


def build_dir():
    build = os.environ.get("LOCKSTEP_BUILD_DIR")
    if not build:
        sys.exit("set LOCKSTEP_BUILD_DIR to the build directory (ctest does)")
    return os.path.abspath(build)


def lockstep_binary():
    return os.path.join(build_dir(), "tools", "lockstep")


def base_env(extra=None):
    """The environment of a worker: the caller's, one thread per process, the build tree's python/."""
    inherited_job = ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "GROUP_", "ROLE_", "TORCHELASTIC_",
                     "LOCKSTEP_STORE_ADDR", "LOCKSTEP_TOKEN", "LOCKSTEP_RUN_ID", "LOCKSTEP_RESTART_COUNT",
                     "LOCKSTEP_BACKEND")
    env = {k: v for k, v in os.environ.items() if not k.startswith(inherited_job)}
    env["PYTHONPATH"] = os.path.join(build_dir(), "python")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rank:
    """One worker process and what it printed."""

    def __init__(self, rank, process, out_path):
        self.rank, self.process, self.out_path = rank, process, out_path
        self.returncode = None
        self.output = ""
        self.exited_at = None

    def finish(self, deadline):
        try:
            self.returncode = self.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.returncode = self.process.wait()
            self.output = f"(killed: still running at the test's deadline)\n"
        self.exited_at = time.monotonic()
        with open(self.out_path) as f:
            self.output += f.read()
        return self

    def records(self):
        """The JSON objects the rank printed, one per line starting with '{'."""
        return [json.loads(line) for line in self.output.splitlines() if line.startswith("{")]


class TestCase(unittest.TestCase):
    def tmpdir(self, prefix="lockstep_torch_"):
        """A fresh directory, removed (with everything in it) when the test ends."""
        holder = tempfile.TemporaryDirectory(prefix=prefix)
        self.addCleanup(holder.cleanup)
        return holder.name

    def train_two_workers(self, script, backend, prefix):
        """Runs `script BACKEND OUT_FILE` on 2 workers under `lockstep run`, which saves rank 0's
        {"state", "losses", "backend"} to OUT_FILE; asserts it succeeded and its loss fell (the
        mean of the last 5 losses under 0.95x that of the first 5); returns what it saved."""
        import torch  # the workers' torch, which saved the file
        out = self.tmpdir(prefix=prefix)
        result = os.path.join(out, "rank0.pt")
        code, output = run_launcher_for(backend, 2, [PYTHON, script, backend, result], out, timeout=300)
        self.assertEqual(code, 0, output)
        run = torch.load(result)
        losses = run["losses"]
        self.assertLess(sum(losses[-5:]) / 5, 0.95 * sum(losses[:5]) / 5, f"the loss did not fall: {losses}")
        return run


def start_ranks(world, argv, workdir, env_extra=None, per_rank_env=None, pipe_rank=None):
    """Starts `world` processes of `argv` with torchrun's environment, in `workdir` (which also
    receives their output); returns their Ranks. The stdout of rank `pipe_rank` is a pipe
    (process.stdout) the caller reads, not a file."""
    port = free_port()
    ranks = []
    for r in range(world):
        env = base_env(env_extra)
        env.update({"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                    "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        env.update((per_rank_env or {}).get(r, {}))
        out_path = os.path.join(workdir, f"rank{r}.out")
        with open(out_path, "w") as out:
            p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE if r == pipe_rank else out,
                                 stderr=out, cwd=workdir)
        ranks.append(Rank(r, p, out_path))
    return ranks


def run_ranks(world, argv, workdir, timeout=300, **kwargs):
    """Runs `world` ranks to the end (or the deadline); returns their Ranks."""
    deadline = time.monotonic() + timeout
    ranks = start_ranks(world, argv, workdir, **kwargs)
    return [r.finish(deadline) for r in ranks]


def run_launcher(nproc, argv, workdir, timeout=300, env_extra=None):
    """`lockstep run --nproc-per-node nproc argv...` in `workdir`; returns (exit code, output).
    The launcher's own --timeout stops the workers 15 s before `timeout` (which kills the launcher)."""
    cmd = [lockstep_binary(), "run", "--timeout", str(max(timeout - 15, 5)), "--nproc-per-node", str(nproc)] + argv
    out = subprocess.run(cmd, env=base_env(env_extra), capture_output=True, text=True, timeout=timeout,
                         cwd=workdir)
    return out.returncode, out.stdout + out.stderr


def run_launcher_for(backend, nproc, argv, workdir, timeout=300, env_extra=None):
    """run_launcher for a script that trains on `backend`. A run on torch's own "gloo" is the
    reference a lockstep run is compared with, and torch's gloo job has been seen to abort once at
    exit in CI (rank 0: "terminate called without an active exception", the other ranks fine):
    such a run is tried once more, saying why. Runs on lockstep are never retried."""
    code, output = run_launcher(nproc, argv, workdir, timeout, env_extra)
    if code != 0 and backend == "gloo":
        print(f"the gloo reference run failed; running it again. Its output:\n{output}", flush=True)
        code, output = run_launcher(nproc, argv, workdir, timeout, env_extra)
    return code, output


def describe(ranks):
    return "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output}" for r in ranks)
