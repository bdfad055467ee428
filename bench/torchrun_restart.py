#!/usr/bin/python3
"""torchrun's restart after a worker dies, against lockstep run's, on one machine, in one run.

Both launchers start 2 workers on this machine (loopback) with one restart allowed
(--max-restarts 1); both jobs are the same MLP (784-512-256-10), batch 64 per worker, AdamW,
one intra-op and one BLAS thread per worker, a checkpoint every --save-steps steps, and rank 0
printing a line after every step. When rank 0 reports step --kill-at, the rank-1 worker is
SIGKILLed; each launcher then has to notice, stop the survivor, start a new group, which
resumes from the last checkpoint. Each output line is timestamped as it arrives, and we take:

  kill -> reported     the launcher reports the failure (it then stops the survivor and restarts)
  kill -> resumed      the new group's rank 0 says which checkpoint it resumed from
  kill -> next step    the first step the new group completes
  kill -> caught up    the first step past the last one the old group completed
  steps redone         the old group's last step minus the checkpoint's

The torchrun side is Debian's python3-torch (1.13, under /usr/bin/python3), DDP over gloo, with
this file as its worker (--worker), and again the torchrun of PyTorch 2.x (--torch2-python; skipped
when absent); the data are random (seeded), which a restart does not care
about. The lockstep side is build/examples/fashion_mnist --model mlp (the real Fashion-MNIST,
loaded at start; lockstep's own choice of backend on one machine). Runs alternate, --repeat of
each; the medians, every run and the ratio torchrun / lockstep go to --out as markdown.

    /usr/bin/python3 bench/torchrun_restart.py [--build build] [--repeat 3] [--kill-at 140]
        [--save-steps 50] [--torchrun-monitor-interval S] [--out bench/TORCHRUN_RESTART.md]
        [--torch2-python ~/.cache/lockstep/venv-torch-2.15.0/bin/python]

Threading model: the driver's main thread starts one launcher at a time; a reader thread per
launcher appends (arrival time, line) under a condition variable, which the main thread waits
on, with a deadline for every wait.
"""
import argparse
import datetime
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TORCH_PYTHON = "/usr/bin/python3"  # Debian's, which has python3-torch; the first python3 on PATH may not
WAIT_SECONDS = 180                # the longest any one wait may take
STEP_LINE = re.compile(r"(?:^|\] )step (\d+)\b")


# ---------------------------------------------------------------------------------------------
# The torchrun worker (run by torchrun as `python3 -u this_file --worker ...`)

def worker_main(args):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    checkpoint = os.path.join(args.checkpoint_dir, "checkpoint.pt")
    step = 0
    if os.path.exists(checkpoint):
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    if rank == 0:
        # The driver takes this line as the new group's start when restart > 0.
        print(f"resumed from step {step} (restart {restart})", flush=True)
    ddp = DistributedDataParallel(model)
    while step < args.max_steps:
        # Each (rank, step) has its own batch, so a resumed run sees what the first one saw.
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank * 65_537 + step)
        inputs = torch.randn(64, 784, generator=gen)
        labels = torch.randint(0, 10, (64,), generator=gen)
        loss = F.cross_entropy(ddp(inputs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if rank == 0 and step % args.save_steps == 0:
            tmp = checkpoint + ".tmp"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
            os.replace(tmp, checkpoint)  # a worker killed mid-save leaves the previous checkpoint whole
        if rank == 0:
            print(f"step {step}", flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Processes

def parent_and_start(pid):
    """(parent pid, start time in clock ticks) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[19])


def descendants(root):
    """{pid: start time} of every live process below `root`."""
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            info = parent_and_start(int(name))
            if info:
                children.setdefault(info[0], []).append((int(name), info[1]))
    found, todo = {}, [root]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            found[pid] = start
            todo.append(pid)
    return found


def local_rank_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for entry in f.read().split(b"\0"):
                if entry.startswith(b"LOCAL_RANK="):
                    return int(entry.split(b"=", 1)[1])
    except (OSError, ValueError):
        pass
    return None


class Job:
    """One launcher in its own session; every line of its output (stdout and stderr) with the
    monotonic time it arrived."""

    def __init__(self, argv, env, is_worker):
        self.argv = argv
        self.is_worker = is_worker  # pid -> whether it is one of this launcher's training processes
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self.lines = []
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            now = time.monotonic()
            with self.changed:
                self.lines.append((now, line.rstrip("\n")))
                self.changed.notify_all()
        with self.changed:
            self.lines.append((time.monotonic(), None))  # end of output
            self.changed.notify_all()

    def wait_line(self, accept, start=0, timeout=WAIT_SECONDS):
        """(index, time, value) of the first line at or after index `start` for which accept(line)
        returns something other than None."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for i in range(start, len(self.lines)):
                    t, line = self.lines[i]
                    if line is None:
                        raise RuntimeError(f"{self.argv[0]} ended (exit {self.proc.wait(5)}) before the line "
                                           f"awaited:\n{self.text()}")
                    value = accept(line)
                    if value is not None:
                        return i, t, value
                start = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"{self.argv[0]}: no awaited line within {timeout} s:\n{self.text()}")
                self.changed.wait(left)

    def text(self, last=60):
        return "\n".join(line for _, line in self.lines[-last:] if line is not None)

    def find_worker(self, local_rank, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for pid in descendants(self.proc.pid):
                if local_rank_of(pid) == local_rank and self.is_worker(pid):
                    return pid
            time.sleep(0.05)  # pacing a scan of /proc
        raise RuntimeError(f"no worker of local rank {local_rank} under {self.argv[0]} within {timeout} s")

    def stop(self):
        """SIGTERM to the launcher's session, SIGKILL after 20 s, then SIGKILL to anything it started
        that is still alive (a worker may have made its own session)."""
        left = descendants(self.proc.pid)
        if self.proc.poll() is None:
            for sig, grace in [(signal.SIGTERM, 20), (signal.SIGKILL, 10)]:
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    pass
                try:
                    self.proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        left.update(descendants(self.proc.pid) if self.proc.poll() is None else {})
        for pid, start in left.items():
            info = parent_and_start(pid)
            if info and info[1] == start:  # the same process, not a reused pid
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.reader.join(timeout=10)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env():
    return dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------
# The two sides

def torchrun_job(args, work, max_steps, python):
    logs = os.path.join(work, "logs")
    checkpoints = os.path.join(work, "checkpoints")
    os.makedirs(logs)
    os.makedirs(checkpoints)
    monitor = ["--monitor_interval", str(args.torchrun_monitor_interval)] if args.torchrun_monitor_interval else []
    # torch 1.13 on Python 3.11 parses --redirects/--tee values of 0 and 3 (0, the default, too) to
    # None: iterating an IntFlag no longer yields its zero or multi-bit members. So rank 1's stdout
    # goes to a file and its stderr to a file and the console (tee implies redirect); rank 0's
    # output, which we time, goes straight to our pipe.
    argv = [python, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
            "--max_restarts", "1", "--master_port", str(free_port()), *monitor, "--redirects", "1:1",
            "--tee", "1:2", "--log_dir", logs, os.path.abspath(__file__), "--worker", "--checkpoint-dir",
            checkpoints, "--save-steps", str(args.save_steps), "--max-steps", str(max_steps)]
    script = os.path.abspath(__file__).encode()

    def is_worker(pid):
        words = cmdline(pid)
        return script in words and b"--worker" in words

    return Job(argv, job_env(), is_worker)


def lockstep_job(args, work, max_steps, python=None):
    argv = [os.path.join(args.build, "tools", "lockstep"), "run", "--nproc-per-node", "2", "--max-restarts", "1",
            "--master-port", str(free_port()), os.path.join(args.build, "examples", "fashion_mnist"), "--model", "mlp",
            "--per-device-train-batch-size", "64", "--max-steps", str(max_steps), "--logging-steps", "1",
            "--eval-strategy", "no", "--disable-tqdm", "--save-strategy", "steps", "--save-steps",
            str(args.save_steps), "--learning-rate", "0.001", "--lr-scheduler-type", "constant",
            "--max-grad-norm", "0", "--output-dir", os.path.join(work, "out")]
    return Job(argv, job_env(), lambda pid: comm(pid).startswith("fashion_mnist"))


# The launcher's first line about the failure: it has seen a worker exit and is about to restart.
SIDE_NAMES = {"torchrun": "torchrun 1.13", "torchrun2": "torchrun 2.x", "lockstep": "lockstep run"}
FAILURE_REPORT = {"torchrun": r"failed \(exitcode: ", "torchrun2": r"failed \(exitcode: ",
                  "lockstep": r"job FAILED \(attempt 1 "}


def new_group_line(side):
    """accept(line) -> the checkpoint step the new group resumed from, for its first line."""
    if side.startswith("torchrun"):
        pattern = re.compile(r"resumed from step (\d+) \(restart [1-9]")
    else:
        pattern = re.compile(r"resumed from \S*checkpoint-(\d+) at step")

    def accept(line):
        m = pattern.search(line)
        return int(m.group(1)) if m else None
    return accept


def step_of(line):
    m = STEP_LINE.search(line)
    return int(m.group(1)) if m else None


def measure(side, args, work):
    make = torchrun_job if side.startswith("torchrun") else lockstep_job
    job = make(args, work, args.kill_at + 400, args.torch2_python if side == "torchrun2" else TORCH_PYTHON)
    try:
        job.wait_line(step_of)
        victim = job.find_worker(1)
        job.wait_line(lambda line: (s := step_of(line)) is not None and s >= args.kill_at or None)
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        noticed = re.compile(FAILURE_REPORT[side])
        _, noticed_t, _ = job.wait_line(lambda line: noticed.search(line))
        try:
            first_new, resumed_t, resumed_at = job.wait_line(new_group_line(side))
        except RuntimeError as e:  # a launcher that never restarted: a result too, not the end of the run
            print(e, flush=True)
            errors = [line for line in str(e).splitlines() if "Error: " in line]
            then = (f"then its new group failed: {errors[-1].split(']:', 1)[-1].strip()[:160]}"
                    if "ended (exit" in str(e) and errors else f"then no new group within {WAIT_SECONDS} s")
            return {"side": side, "failed": f"reported the failure {noticed_t - killed:.2f} s after the kill, {then}"}
        with job.changed:
            old = [s for _, line in job.lines[:first_new] if line is not None and (s := step_of(line)) is not None]
        done_before = max(old)
        _, next_t, next_step = job.wait_line(step_of, first_new)
        _, caught_t, _ = job.wait_line(lambda line: (s := step_of(line)) is not None and s > done_before or None,
                                       first_new)
        return {"side": side, "killed_after": done_before, "resumed_at": resumed_at, "next_step": next_step,
                "noticed": noticed_t - killed, "resumed": resumed_t - killed, "next": next_t - killed,
                "caught_up": caught_t - killed, "redone": done_before - resumed_at}
    finally:
        job.stop()


# ---------------------------------------------------------------------------------------------
# Report

def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def report(args, runs, command, sides):
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            timeout=30).stdout.strip()
    blas = os.path.realpath("/etc/alternatives/libblas.so.3-x86_64-linux-gnu")
    versions = {side: subprocess.run([args.torch2_python if side == "torchrun2" else TORCH_PYTHON, "-c",
                                      "import torch; print(torch.__version__)"],
                                     capture_output=True, text=True, timeout=120).stdout.strip()
                for side in sides if side.startswith("torchrun")}
    monitor = (f"--monitor_interval {args.torchrun_monitor_interval}" if args.torchrun_monitor_interval
               else "torchrun's default --monitor_interval (5 s)")
    keys = ["noticed", "resumed", "next", "caught_up", "redone"]
    done = [r for r in runs if "failed" not in r]
    med = {side: {k: statistics.median([r[k] for r in done if r["side"] == side] or [float("nan")]) for k in keys}
           for side in sides}
    torchruns = [side for side in sides if side.startswith("torchrun")]
    lines = ["# torchrun's restart after a worker is killed, against lockstep run's", "",
             f"{datetime.date.today()}, {cpu_model()}, {os.cpu_count()} cores, commit {commit}, BLAS {blas}; "
             + ", ".join(f"{SIDE_NAMES[side]}: torch {versions[side]}" for side in torchruns) + ".",
             f"Command (in the repository's root): `{command}`", "",
             f"One machine, 2 workers over loopback, --max-restarts 1; MLP 784-512-256-10, batch 64 per worker, "
             f"AdamW lr 1e-3, one intra-op and one BLAS thread per worker, a checkpoint every {args.save_steps} "
             f"steps; the rank-1 worker SIGKILLed when rank 0 reports step {args.kill_at}. torchrun: DDP over gloo, "
             f"random data, {monitor}. lockstep run: build/examples/fashion_mnist --model mlp (Fashion-MNIST "
             f"loaded at start), its default backend and --monitor-interval (0.1 s). {args.repeat} runs of each, "
             f"in turn; times from the kill to the line's arrival at this script.", "",
             "| median of runs | " + " | ".join(SIDE_NAMES[s] for s in sides) + " | "
             + " | ".join(f"{SIDE_NAMES[t]} / lockstep" for t in torchruns) + " |",
             "|---|" + "---|" * (len(sides) + len(torchruns))]
    for key, label in [("noticed", "kill -> the launcher reports the failure"),
                       ("resumed", "kill -> new group resumed from its checkpoint"),
                       ("next", "kill -> next completed step"), ("caught_up", "kill -> caught up (first step past "
                                                                              "the old group's last)")]:
        lines.append(f"| {label} | " + " | ".join(f"{med[s][key]:.2f} s" for s in sides) + " | "
                     + " | ".join(f"{med[t][key] / med['lockstep'][key]:.1f}x" for t in torchruns) + " |")
    lines += ["| steps redone | " + " | ".join(f"{med[s]['redone']:g}" for s in sides) + " |" + " |" * len(torchruns),
              "| runs that restarted | " + " | ".join(
                  f"{sum(r['side'] == s for r in done)} of {sum(r['side'] == s for r in runs)}" for s in sides)
              + " |" + " |" * len(torchruns),
              "", "| run | launcher | killed after step | resumed from | kill -> reported | kill -> resumed | "
              "kill -> next step | kill -> caught up | steps redone |", "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(runs):
        if "failed" in r:
            lines.append(f"| {i // len(sides) + 1} | {SIDE_NAMES[r['side']]} | {r['failed']} |||||||")
            continue
        lines.append(f"| {i // len(sides) + 1} | {SIDE_NAMES[r['side']]} | "
                     f"{r['killed_after']} | {r['resumed_at']} | {r['noticed']:.2f} s | {r['resumed']:.2f} s | "
                     f"{r['next']:.2f} s (step {r['next_step']}) | {r['caught_up']:.2f} s | {r['redone']} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help="run as torchrun's worker (internal)")
    ap.add_argument("--checkpoint-dir", help="worker: where its checkpoint lives")
    ap.add_argument("--max-steps", type=int, default=1000, help="worker: steps to train")
    ap.add_argument("--seed", type=int, default=42, help="worker: model and data seed")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--kill-at", type=int, default=140, help="SIGKILL rank 1 when rank 0 reports this step")
    ap.add_argument("--save-steps", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--torchrun-monitor-interval", type=float,
                    help="passed to torchrun as --monitor_interval (default: torchrun's own, 5 s)")
    ap.add_argument("--out", default=os.path.join(HERE, "TORCHRUN_RESTART.md"))
    ap.add_argument("--torch2-python", default=os.path.expanduser("~/.cache/lockstep/venv-torch-2.15.0/bin/python"),
                    help="a python with PyTorch 2.x, whose torchrun is measured too (skipped when absent)")
    args = ap.parse_args()
    if args.worker:
        worker_main(args)
        return
    if args.kill_at < args.save_steps:
        raise SystemExit("--kill-at must be at least --save-steps, so that there is a checkpoint to restart from")
    args.build = os.path.abspath(args.build)
    command = shlex.join([sys.executable, os.path.relpath(os.path.abspath(__file__), ROOT), *sys.argv[1:]])
    # SIGTERM (like Ctrl-C) unwinds through the finally blocks that stop the jobs and remove their files.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    work = tempfile.mkdtemp(prefix="torchrun-restart-", dir="/tmp")
    runs = []
    sides = ["torchrun"] + (["torchrun2"] if os.path.exists(args.torch2_python) else []) + ["lockstep"]
    try:
        for i in range(args.repeat):
            for side in sides:
                run_dir = os.path.join(work, f"{side}-{i}")
                os.makedirs(run_dir)
                r = measure(side, args, run_dir)
                runs.append(r)
                shutil.rmtree(run_dir, ignore_errors=True)
                if "failed" in r:
                    print(f"{side} run {i + 1}: {r['failed']}", flush=True)
                    continue
                print(f"{side} run {i + 1}: killed after step {r['killed_after']}, resumed from {r['resumed_at']}; "
                      f"kill -> reported {r['noticed']:.2f} s, resumed {r['resumed']:.2f} s, next step "
                      f"{r['next']:.2f} s, caught up {r['caught_up']:.2f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = report(args, runs, command, sides)
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
