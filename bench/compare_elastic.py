#!/usr/bin/python3
"""What a failure costs: lockstep's elastic jobs against restarting from a checkpoint, in one run.

Two machines as network namespaces (bench/compare_cluster.py's Cluster), each with a 1 Gbit/s
link, one worker each, and a third namespace for the store (`lockstep store`). The job is the
Fashion-MNIST example's MLP (784-512-256-10; --model cnn: its CNN), batch 64 per worker, AdamW, one intra-op and one BLAS
thread per worker; rank 0 logs every step, and this script timestamps each line as it arrives.

  recovery   an elastic job (--nnodes 1:2); machine 1's worker is SIGKILLed at step --kill-at: the
             time from the kill to the next completed step, with its parts from the survivor's
             membership_change record (agree, rebuild, state; detection is the rest), and the
             completed steps lost.
  torchft    (torchft pinned in the peers venv bench/peers/setup makes, or --torch2-python's;
             reported with its error when it does not install) the same kill in a torchft job: a
             torchft_lighthouse in the third namespace, one replica group per machine started by
             PyTorch 2.x's torchrun (bench/torchft_worker.py: the same MLP, random data), and the
             time from the kill to the survivor's next committed step.
  restart    the same job with a fixed membership (--nnodes 2, --max-restarts 1, a checkpoint every
             --save-steps): the time from the kill to the first step after the restart, and the
             completed steps taken again (back to the last checkpoint).
  churn      the elastic job with --max-restarts 100 and a worker killed every --churn-every
             seconds for --churn-seconds (its launcher starts a new one, which joins), against the
             same job for as long with no failure: the ratio of steps per second.
  overhead   one machine, 2 workers over shm, no failure: the elastic job against the fixed one,
             --repeat times interleaved: the ratio of their median samples/s.

With --zero-stage 1 or 2 every job (fixed and elastic) shards with ZeRO; the elastic one also
keeps each rank's slices mirrored on the other machine (ddp/zero.h), which is what its overhead
part measures against the fixed ZeRO job.

    sudo /usr/bin/python3 bench/compare_elastic.py [--build build] [--churn-seconds 300]
        [--churn-every 30] [--repeat 3] [--zero-stage 0] [--out bench/ELASTIC.md]
        [--torch2-python PYTHON_WITH_TORCHFT]
"""
import argparse
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from compare_cluster import Cluster, cpu, sh  # noqa: E402
import peer_env  # noqa: E402

STORE_PORT = 29500
MASTER_PORT = 29400
LIGHTHOUSE_PORT = 29510
STEP = re.compile(r"step (\d+)/")
TRAINER_FLAGS = []  # every job's, from the command line (--zero-stage)
MODEL = ["mlp"]     # the example's --model, from the command line


class Launcher:
    """One `lockstep run` in a namespace; every line of its output with the time it arrived."""

    def __init__(self, cluster, m, argv, env):
        self.proc = subprocess.Popen(cluster.on(m, argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        self.lines = []
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self.lock:
                self.lines.append((time.monotonic(), line.rstrip("\n")))

    def steps(self):
        """(time, step) of every progress line so far."""
        with self.lock:
            return [(t, int(m.group(1))) for t, line in self.lines if (m := STEP.search(line))]

    def wait_for(self, pattern, timeout=300, after=0.0):
        """(arrival time, line) of the first line that matches `pattern` and arrived after `after`."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while time.monotonic() < deadline:
            with self.lock:
                for t, line in self.lines:
                    if t > after and regex.search(line):
                        return t, line
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.02)  # polling a log, not synchronisation
        raise SystemExit(f"never saw /{pattern}/:\n" + self.text())

    def step_after(self, step, since, timeout=300):
        """When the first progress line of `step` or later arrived after time `since` (a step whose
        log collective failed prints no line)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = [t for t, s in self.steps() if s >= step and t > since]
            if hits:
                return hits[0]
            time.sleep(0.02)  # polling a log, not synchronisation
        raise SystemExit(f"step {step} never came after the kill:\n" + self.text())

    def text(self):
        with self.lock:
            return "\n".join(line for _, line in self.lines)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def env():
    return dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", LOCKSTEP_TOKEN="bench-token",
                LOCKSTEP_PEER_CHECK="1")


def program(build, out, steps, extra=()):
    return [f"{build}/examples/fashion_mnist", "--model", MODEL[0], "--per-device-train-batch-size", "64",
            "--max-steps", str(steps), "--logging-steps", "1", "--eval-strategy", "no", "--disable-tqdm",
            "--output-dir", out, *TRAINER_FLAGS, *extra]


def kill_worker(cluster, m):
    """SIGKILL to the training process on machine m (not its launcher)."""
    for pid in sh("ip", "netns", "pids", cluster.ns(m), check=False).split():
        try:
            if open(f"/proc/{pid}/comm").read().strip().startswith("fashion_mnist"):
                os.kill(int(pid), signal.SIGKILL)
                return
        except OSError:
            pass
    raise SystemExit(f"no worker on machine {m} to kill")


def membership_changes(out):
    path = os.path.join(out, "metrics.jsonl")
    return [json.loads(l) for l in open(path) if '"membership_change"' in l] if os.path.exists(path) else []


def elastic_job(cluster, build, out, steps, restarts=0):
    """Machine 0's launcher first (it becomes machine 0, which holds rank 0), then machine 1's."""
    store = f"{cluster.address(2)}:{STORE_PORT}"
    argv = [f"{build}/tools/lockstep", "run", "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", store,
            "--max-restarts", str(restarts), "--run-id", os.path.basename(out)] + program(build, out, steps,
                                                                                            ["--save-strategy", "no"])
    first = Launcher(cluster, 0, argv, env())
    first.wait_for("this is machine 0")
    second = Launcher(cluster, 1, argv, env())
    first.wait_for(r"2 workers x 64")
    return first, second


def measure_recovery(cluster, build, kill_at):
    out = f"/tmp/lockstep-elastic-bench-recovery-{os.getpid()}"
    first, second = elastic_job(cluster, build, out, kill_at + 200)
    try:
        first.wait_for(rf"step {kill_at}/")
        killed = time.monotonic()
        kill_worker(cluster, 1)
        changed_at, _ = first.wait_for(r"membership 1: 2 -> 1 workers")
        # A step in flight at the kill can still complete with both workers: the recovered step is
        # the first one after the survivor's membership change.
        done_before = max(s for t, s in first.steps() if t <= changed_at)
        next_step_at = first.step_after(done_before + 1, changed_at)
        record = membership_changes(out)[0]
        total = next_step_at - killed
        step_time = statistics.median(b - a for (a, _), (b, _) in zip(first.steps()[5:kill_at - 1],
                                                                      first.steps()[6:kill_at]))
        return {"total": total, "agree": record["agree_seconds"], "rebuild": record["rebuild_seconds"],
                "state": record["state_seconds"], "recovery": record["recovery_seconds"], "step": step_time,
                "detection": total - record["recovery_seconds"] - step_time, "steps_lost": record["steps_lost"],
                "killed_after": done_before}
    finally:
        first.stop()
        second.stop()


def measure_restart(cluster, build, kill_at, save_steps):
    out = f"/tmp/lockstep-elastic-bench-restart-{os.getpid()}"
    nodes = []
    for m in range(2):
        argv = [f"{build}/tools/lockstep", "run", "--nnodes", "2", "--node-rank", str(m), "--nproc-per-node", "1",
                "--master-addr", cluster.address(0), "--master-port", str(MASTER_PORT), "--max-restarts", "1",
                "--grace-period", "1"] + program(build, out, kill_at + 200,
                                                 ["--save-strategy", "steps", "--save-steps", str(save_steps)])
        nodes.append(Launcher(cluster, m, argv, env()))
    try:
        nodes[0].wait_for(rf"step {kill_at}/")
        killed = time.monotonic()
        kill_worker(cluster, 1)
        resumed, _ = nodes[0].wait_for(r"resumed from")
        done_before = max(s for t, s in nodes[0].steps() if t <= killed)
        resumed_at = done_before // save_steps * save_steps
        return {"total": nodes[0].step_after(resumed_at + 1, resumed) - killed,
                "caught_up": nodes[0].step_after(done_before + 1, resumed) - killed,
                "steps_redone": done_before - resumed_at, "killed_after": done_before}
    finally:
        for n in nodes:
            n.stop()


def torchft_version(python):
    return subprocess.run([python, "-c", "import importlib.metadata as m; print('torchft', m.version('torchft'))"],
                          capture_output=True, text=True).stdout.strip()


TORCHFT_MISSING = ["the python given has no torchft"]  # why the torchft column is empty, for the report


def has_torchft(python):
    return python and os.path.exists(python) and subprocess.run([python, "-c", "import torchft"], capture_output=True).returncode == 0


def kill_torchft_worker(cluster, m):
    """SIGKILL to machine m's torchft worker (not its torchrun agent, whose command line names it too)."""
    for pid in sh("ip", "netns", "pids", cluster.ns(m), check=False).split():
        try:
            words = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if any(w.endswith(b"torchft_worker.py") for w in words) and b"torch.distributed.run" not in words:
            os.kill(int(pid), signal.SIGKILL)
            return
    raise SystemExit(f"no torchft worker on machine {m} to kill")


def measure_torchft(cluster, python, kill_at):
    """The kill of measure_recovery in a torchft job: the lighthouse as its examples start it
    (--min_replicas 1, --quorum_tick_ms 100, --join_timeout_ms 10000; its heartbeat timeout, 5 s,
    left as it is), one replica group of one worker per machine."""
    lighthouse = Launcher(cluster, 2, [os.path.join(os.path.dirname(python), "torchft_lighthouse"), "--min_replicas",
                                       "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000", "--bind",
                                       f"0.0.0.0:{LIGHTHOUSE_PORT}"], env())
    replicas = []
    try:
        lighthouse.wait_for("listening on")
        for m in range(2):
            argv = [python, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "1", "--max_restarts",
                    "0", "--master_addr", cluster.address(m), "--master_port", str(MASTER_PORT),
                    os.path.join(HERE, "torchft_worker.py"), "--max-steps", "1000000", "--hostname",
                    cluster.address(m)]
            replicas.append(Launcher(cluster, m, argv, dict(
                env(), REPLICA_GROUP_ID=str(m), GLOO_SOCKET_IFNAME="eth0",
                TORCHFT_LIGHTHOUSE=f"http://{cluster.address(2)}:{LIGHTHOUSE_PORT}")))
        first = replicas[0]
        # Each replica trains alone until the other joins its quorum; the kill comes kill_at steps
        # after both are in, as in the lockstep job.
        _, line = first.wait_for(r"step \d+/\d+ participants 2")
        target = int(STEP.search(line).group(1)) + kill_at
        first.wait_for(rf"step {target}/\d+ participants 2")
        killed = time.monotonic()
        kill_torchft_worker(cluster, 1)
        done_before = max(s for t, s in first.steps() if t <= killed)
        # A step in flight at the kill may still commit with both; what counts is the first step
        # the survivor commits on its own.
        steps = [(t, s) for t, s in first.steps() if t <= killed][-40:]
        step_time = statistics.median(b - a for (a, _), (b, _) in zip(steps, steps[1:]))
        try:
            alone_at, alone_line = first.wait_for(r"participants 1 ", after=killed)
        except SystemExit:  # the survivor ended instead: say how
            errors = [line for line in first.text().splitlines() if re.search(r"^\w*(Error|Exception)\b", line)]
            print("torchft: the survivor failed:\n" + first.text()[-3000:], flush=True)
            return {"failed": errors[-1] if errors else "exited", "step": step_time, "killed_after": done_before}
        print("torchft: killed after step", done_before, "; alone at:", alone_line, flush=True)
        return {"total": alone_at - killed, "step": step_time, "killed_after": done_before,
                "steps_lost": done_before - (int(STEP.search(alone_line).group(1)) - 1)}
    finally:
        for r in replicas:
            r.stop()
        lighthouse.stop()


def torchft_runs(cluster, args):
    """measure_torchft --repeat times: the median of the runs whose survivor went on, and why the
    others' did not."""
    runs = [measure_torchft(cluster, args.torch2_python, args.kill_at) for _ in range(args.repeat)]
    survived = [r for r in runs if "failed" not in r]
    median = (lambda key: statistics.median(r[key] for r in survived)) if survived else (lambda key: float("nan"))
    return {"runs": len(runs), "survived": len(survived), "failures": [r["failed"] for r in runs if "failed" in r],
            "total": median("total"), "step": statistics.median(r["step"] for r in runs),
            "steps_lost": max((r["steps_lost"] for r in survived), default=0)}


def steps_per_second(launcher, start, end):
    inside = [(t, s) for t, s in launcher.steps() if start <= t <= end]
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def measure_churn(cluster, build, seconds, every):
    rates = {}
    for side in ["no failure", "a failure every %d s" % every]:
        out = f"/tmp/lockstep-elastic-bench-churn-{os.getpid()}-{len(rates)}"
        first, second = elastic_job(cluster, build, out, 10 ** 7, restarts=100)
        try:
            first.wait_for(r"step 20/")
            start = time.monotonic()
            kills = 0
            while time.monotonic() < start + seconds:
                time.sleep(min(every, start + seconds - time.monotonic()))  # pacing the failures
                if side != "no failure" and time.monotonic() < start + seconds - 1:
                    kill_worker(cluster, 1)
                    kills += 1
            rates[side] = (steps_per_second(first, start, time.monotonic()), kills, len(membership_changes(out)))
        finally:
            first.stop()
            second.stop()
    return rates


def measure_overhead(build, repeat, steps):
    """One machine, 2 workers over shm: the elastic job against the fixed one, no failure."""
    sides = {"fixed": [], "elastic": []}
    for i in range(repeat):
        for side in sides:
            out = f"/tmp/lockstep-elastic-bench-overhead-{os.getpid()}-{side}-{i}"
            nnodes = ["--nnodes", "1:1", "--master-port", str(MASTER_PORT + 1)] if side == "elastic" else []
            argv = [f"{build}/tools/lockstep", "run", "--nproc-per-node", "2", *nnodes] + program(
                build, out, steps, ["--save-strategy", "no", "--logging-steps", "50"])
            subprocess.run(argv, check=True, capture_output=True, env=env(), timeout=900)
            logs = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"event": "log"' in l
                    or '"event":"log"' in l]
            sides[side].append(statistics.median(l["samples_per_second"] for l in logs[1:]))
            print("overhead", side, sides[side][-1], flush=True)
    return {s: statistics.median(v) for s, v in sides.items()}, sides


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--kill-at", type=int, default=140)
    ap.add_argument("--save-steps", type=int, default=50)
    ap.add_argument("--churn-seconds", type=float, default=300)
    ap.add_argument("--churn-every", type=float, default=30)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--overhead-steps", type=int, default=600)
    ap.add_argument("--parts", default="recovery,churn,overhead",
                    help="which to run: recovery (with restart), churn, overhead")
    ap.add_argument("--zero-stage", type=int, default=0, help="every job shards with ZeRO stage 1 or 2")
    ap.add_argument("--model", default="mlp", choices=["mlp", "cnn"], help="the Fashion-MNIST example's model")
    ap.add_argument("--out", default=os.path.join(HERE, "ELASTIC.md"))
    ap.add_argument("--torch2-python", default=None,
                    help="a python with PyTorch 2.x and torchft for the torchft column (default: the peers "
                         "venv bench/peers/setup makes, torchft pinned)")
    args = ap.parse_args()
    if args.torch2_python is None and "recovery" in args.parts.split(","):
        args.torch2_python, errors = peer_env.peers()
        TORCHFT_MISSING[0] = peer_env.why_not(errors, "torchft")
    MODEL[0] = args.model
    if args.zero_stage:
        TRAINER_FLAGS.extend(["--zero-stage", str(args.zero_stage)])
    parts = set(args.parts.split(","))
    if os.geteuid() != 0:
        raise SystemExit("compare_elastic.py makes network namespaces: run it as root")
    lines = ["# What a failure costs: elastic membership against restarts", "",
             f"{datetime.date.today()}, {cpu()}, {os.cpu_count()} cores shared by every machine, commit "
             f"{sh('git', '-C', ROOT, 'rev-parse', '--short', 'HEAD').strip()}; the Fashion-MNIST {args.model.upper()}, batch 64 per "
             f"worker, one intra-op and one BLAS thread per worker (BLAS: "
             f"{os.path.realpath('/etc/alternatives/libblas.so.3-x86_64-linux-gnu')}); "
             f"{'ZeRO stage %d in every job' % args.zero_stage if args.zero_stage else 'DDP'}.",
             f"Command: `sudo /usr/bin/python3 bench/compare_elastic.py {' '.join(sys.argv[1:])}`", ""]
    cluster = Cluster(3, "1gbit") if parts & {"recovery", "churn"} else None
    store = Launcher(cluster, 2, [f"{args.build}/tools/lockstep", "store", "--port", str(STORE_PORT)],
                     env()) if cluster else None
    try:
        if store:
            store.wait_for("serving on")
        lines += cluster_parts(cluster, args, parts)
    finally:
        if store:
            store.stop()
        if cluster:
            cluster.close()
    if "overhead" in parts:
        lines += overhead_part(args)
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


def cluster_parts(cluster, args, parts):
    lines = []
    if "recovery" in parts:
        r = measure_recovery(cluster, args.build, args.kill_at)
        print("recovery", r, flush=True)
        s = measure_restart(cluster, args.build, args.kill_at, args.save_steps)
        print("restart", s, flush=True)
        ft = torchft_runs(cluster, args) if has_torchft(args.torch2_python) else None
        print("torchft", ft, flush=True)
        if not ft:
            lines += [f"torchft: not run: {TORCHFT_MISSING[0]}", ""]
        head = f" torchft (PyTorch 2.x, {torchft_version(args.torch2_python)}) |" if ft else ""
        col = (lambda text: f" {text} |") if ft else (lambda text: "")
        ft_total = ft and (f"{ft['total']:.2f} s" if ft["survived"] else "none went on")
        lines += ["## One worker of two SIGKILLed (2 machines, 1 Gbit/s)", "",
                  *(["torchft: the time to the survivor's first step committed without the dead replica "
                     "(its lighthouse drops a replica whose heartbeats stop for --heartbeat_timeout_ms, "
                     "5 s by default; steps before that fail and are not committed), median of the runs "
                     f"whose survivor went on: {ft['survived']} of {ft['runs']}."
                     + (f" In the others the survivor itself ended: {'; '.join(sorted(set(ft['failures'])))}"
                        if ft["failures"] else ""), ""] if ft else []),
                  "| | elastic (--nnodes 1:2) | restart from checkpoint (--max-restarts 1, --save-steps "
                  f"{args.save_steps}) |" + head, "|---|---|---|" + ("---|" if ft else ""),
                  f"| kill to the next completed step | {r['total']:.2f} s | {s['total']:.2f} s |" + col(ft_total),
                  f"| kill to the first step past the one reached | {r['total']:.2f} s | {s['caught_up']:.2f} s |"
                  + col(ft_total),
                  f"| ... detection | {r['detection']:.2f} s | |" + col(""),
                  f"| ... agreement on the new membership | {r['agree']:.3f} s | |" + col(""),
                  f"| ... communicator rebuild | {r['rebuild']:.3f} s | |" + col(""),
                  f"| ... state transfer | {r['state']:.3f} s | |" + col(""),
                  f"| ... the step itself (median step before) | {r['step']:.3f} s | |"
                  + col(ft and f"{ft['step']:.3f} s"),
                  f"| completed steps lost | {r['steps_lost']} | {s['steps_redone']} (killed after step "
                  f"{s['killed_after']}, resumed from {s['killed_after'] // args.save_steps * args.save_steps}) |"
                  + col(ft and (str(max(0, ft["steps_lost"])) if ft["survived"] else "-")), ""]
    if "churn" in parts:
        c = measure_churn(cluster, args.build, args.churn_seconds, args.churn_every)
        base = c["no failure"][0]
        lines += [f"## Churn: {args.churn_seconds:.0f} s of training, elastic (--nnodes 1:2, --max-restarts 100)", "",
                  "| | steps/s | vs no failure | workers killed | membership changes |", "|---|---|---|---|---|"]
        for side, (rate, kills, changes) in c.items():
            lines.append(f"| {side} | {rate:.2f} | {rate / base:.3f} | {kills} | {changes} |")
        lines.append("")
    return lines


def overhead_part(args):
    med, all_runs = measure_overhead(args.build, args.repeat, args.overhead_steps)
    lines = ["## No failure: the cost of being elastic (one machine, 2 workers, shm)", "",
              "| job | samples/s (median) | runs | vs fixed |", "|---|---|---|---|"]
    for side in ["fixed", "elastic"]:
        lines.append(f"| {side} | {med[side]:.0f} | {', '.join(f'{v:.0f}' for v in all_runs[side])} | "
                     f"{med[side] / med['fixed']:.3f} |")
    return lines


if __name__ == "__main__":
    main()
