#!/usr/bin/python3
"""Several machines, for real network traffic, on one host: lockstep's hier and flat gloo backends,
its gradient codecs between machines, and PyTorch DDP, side by side in one run.

The machines are Linux network namespaces, each with its own hostname and /dev/shm, joined by
veth links to a bridge, each machine's egress limited with a token bucket (tc tbf) to --rates
(default 1gbit and 10gbit). One `lockstep run` per machine, as a user would; --shapes lists the
jobs as MACHINESxWORKERS (default 2x2). Needs root (ip, tc, unshare, mount). For each rate and
shape it measures:

  all-reduce   (2x2 only) `lockstep bench allreduce` over hier and over gloo, --sizes bytes (f32
               sum): the time per all-reduce (slowest rank), and the bytes machine 0's link
               carried in each direction per all-reduce (its /sys statistics, before and after,
               over the number of all-reduces of that size the bench ran), against S, the size.
  DDP          training throughput of the 784-1024-1024-10 MLP, batch 64 per worker, SGD with
               momentum (bench/ddp_bench.cc and its PyTorch twin bench/torch_ddp.py): lockstep
               hier, lockstep gloo, lockstep hier with bf16 gradients everywhere, with PowerSGD
               (rank 4) or auto between machines (--sides), PyTorch DDP (gloo,
               GLOO_SOCKET_IFNAME=eth0: PyTorch needs it where hostnames do not resolve;
               `pytorch` is Debian's 1.13, `pytorch2` the torch 2.x venv's, --torch2-python),
               --repeat times interleaved, median samples/s of all workers; hier-syncK is local
               SGD (--sync-every K: DDP inside each machine, the machines averaging their models
               every K steps; --steps should be a multiple of K), hier-powersgd:N PowerSGD with N
               exchanges per step (--powersgd-rounds), no-comm the ceiling (every step
               under no_sync: the compute alone, on these shared cores). The compressing
               sides run 15 unmeasured steps first (10 exact ones, then auto's decision) and,
               as the Trainer does with these hooks, no small first bucket.

Every worker runs one intra-op and one BLAS thread; all workers share this host's cores, so the
compute is slower than on real machines: the ratios, measured in one run, are what matters.

    sudo /usr/bin/python3 bench/compare_cluster.py [--build build] [--rates 1gbit,10gbit]
        [--shapes 2x2,4x1,3x2] [--sides hier,gloo,hier-bf16,hier-powersgd,hier-auto,pytorch]
        [--sizes 4194304,67108864] [--repeat 3] [--steps 100] [--out bench/CLUSTER.md]
        [--torch2-python ~/.cache/lockstep/venv-torch-2.15.0/bin/python]
"""
import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PORT = 29400


def sh(*cmd, check=True):
    return subprocess.run(cmd, capture_output=True, text=True, check=check).stdout


class Cluster:
    """Network namespaces lstb<pid>m<i> joined through a bridge in lstb<pid>sw."""

    def __init__(self, machines, rate):
        self.prefix = f"lstb{os.getpid()}"
        self.n = machines
        self.made = []
        # A benchmark stopped with kill (SIGTERM) unwinds through its finally blocks, which close
        # the cluster: no namespaces are left behind.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            self._make(rate)
        except Exception:
            self.close()
            raise

    def _make(self, rate):
        sw = self.prefix + "sw"
        sh("ip", "netns", "add", sw)
        self.made.append(sw)
        sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", sw, "link", "set", "br0", "up")
        for m in range(self.n):
            ns = self.ns(m)
            sh("ip", "netns", "add", ns)
            self.made.append(ns)
            sh("ip", "-n", sw, "link", "add", f"p{m}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "-n", sw, "link", "set", f"p{m}", "master", "br0", "up")
            sh("ip", "-n", ns, "addr", "add", self.address(m) + "/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate, "burst", "512kb",
               "latency", "20ms")

    def ns(self, m):
        return f"{self.prefix}m{m}"

    def address(self, m):
        return f"10.202.7.{m + 1}"

    def on(self, m, argv):
        script = f"mount -t tmpfs -o size=2g tmpfs /dev/shm && hostname node{m} && exec \"$@\""
        return ["ip", "netns", "exec", self.ns(m), "unshare", "--mount", "--uts", "--ipc", "--propagation",
                "private", "/bin/sh", "-c", script, "sh"] + argv

    def bytes(self, m):
        stats = json.loads(sh("ip", "-n", self.ns(m), "-s", "-j", "link", "show", "eth0"))[0]["stats64"]
        return stats["tx"]["bytes"], stats["rx"]["bytes"]

    def close(self):
        for ns in reversed(self.made):
            for pid in sh("ip", "netns", "pids", ns, check=False).split():
                subprocess.run(["kill", "-9", pid], check=False)
            sh("ip", "netns", "del", ns, check=False)
        self.made = []


def launch(cluster, build, nproc, program, env_extra=None, timeout=900):
    """One `lockstep run` per machine; returns rank 0's JSON line (or every node's output)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", LOCKSTEP_TOKEN="bench-token")
    env.update(env_extra or {})
    procs = []
    for m in range(cluster.n):
        argv = [f"{build}/tools/lockstep", "run", "--nnodes", str(cluster.n), "--node-rank", str(m),
                "--nproc-per-node", str(nproc), "--master-addr", cluster.address(0), "--master-port", str(PORT)]
        procs.append(subprocess.Popen(cluster.on(m, argv + program), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=env))
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outputs):
        if p.returncode != 0:
            raise SystemExit(f"failed ({p.returncode}): {' '.join(program)}\n{out}")
    text = "\n".join(line.split("] ", 1)[-1] if line.startswith("[rank") else line
                     for line in outputs[0].splitlines())
    start = text.find("{")
    return json.JSONDecoder().raw_decode(text[start:])[0]


def allreduce(cluster, build, backend, size, iters):
    before = cluster.bytes(0)
    doc = launch(cluster, build, 2, [f"{build}/tools/lockstep", "bench", "allreduce", "--backend", backend,
                                     "--min-bytes", str(size), "--max-bytes", str(size), "--iters", str(iters),
                                     "--warmup", "1", "--json"])
    after = cluster.bytes(0)
    row = doc["rows"][0]
    runs = 1 + 1 + iters  # the correctness check, the warm-up, the timed ones
    return {"backend": backend, "bytes": size, "time_s": row["time_us"] / 1e6, "wrong": row["wrong"],
            "tx_per_allreduce": (after[0] - before[0]) / runs, "rx_per_allreduce": (after[1] - before[1]) / runs}


SIDES = {"hier": ("hier", "none"), "gloo": ("gloo", "none"), "hier-bf16": ("hier", "bf16"),
         "hier-powersgd": ("hier", "powersgd"), "hier-int8": ("hier", "int8"), "hier-auto": ("hier", "auto"),
         "gloo-auto": ("gloo", "auto")}


def ddp(cluster, build, side, steps, nproc, torch2_python):
    if side in ("pytorch", "pytorch2"):
        python = "/usr/bin/python3" if side == "pytorch" else torch2_python
        program = [python, f"{HERE}/torch_ddp.py", "--model", "mlp", "--steps", str(steps)]
        return launch(cluster, build, nproc, program, {"GLOO_SOCKET_IFNAME": "eth0"})["samples_per_s"]
    if side == "no-comm":  # the ceiling: the same steps with no gradient sent at all
        program = [f"{build}/bench/ddp_bench", "--model", "mlp", "--steps", str(steps), "--no-sync"]
        return launch(cluster, build, nproc, program)["samples_per_s"]
    if side.startswith("hier-sync"):  # local SGD: hier-sync8 meets every 8 steps
        program = [f"{build}/bench/ddp_bench", "--model", "mlp", "--steps", str(steps), "--backend", "hier",
                   "--sync-every", side[len("hier-sync"):]]
        return launch(cluster, build, nproc, program)["samples_per_s"]
    name, _, rounds = side.partition(":")  # hier-powersgd:6: PowerSGD with 6 exchanges per step
    backend, hook = SIDES[name]
    program = [f"{build}/bench/ddp_bench", "--model", "mlp", "--steps", str(steps), "--backend", backend,
               "--comm-hook", hook] + (["--powersgd-rounds", rounds] if rounds else [])
    if hook in ("powersgd", "int8", "auto"):  # as the Trainer does: no small first bucket; past auto's choice
        program += ["--warmup", "15", "--first-bucket-cap-mb", "25"]
    return launch(cluster, build, nproc, program)["samples_per_s"]


def cpu():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--rates", default="1gbit,10gbit")
    ap.add_argument("--sizes", default=f"{4 << 20},{64 << 20}")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--shapes", default="2x2", help="MACHINESxWORKERS, comma-separated")
    ap.add_argument("--sides", default="hier,gloo,hier-bf16,hier-powersgd,hier-auto,pytorch")
    ap.add_argument("--out", default=os.path.join(HERE, "CLUSTER.md"))
    ap.add_argument("--torch2-python", default=os.path.expanduser("~/.cache/lockstep/venv-torch-2.15.0/bin/python"),
                    help="the python of a torch 2.x venv, for the pytorch2 side")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("compare_cluster.py makes network namespaces: run it as root")
    sides = args.sides.split(",")
    if "pytorch2" in sides and not os.path.exists(args.torch2_python):
        raise SystemExit(f"the pytorch2 side needs a torch 2.x python: {args.torch2_python} does not exist "
                         "(run LOCKSTEP_TORCH=pip ./scripts/test once, or pass --torch2-python)")
    lines = [f"# Machines as network namespaces: hier, flat gloo, gradient codecs and PyTorch DDP",
             "",
             f"{datetime.date.today()}, {cpu()}, {os.cpu_count()} cores shared by every machine, commit "
             f"{sh('git', '-C', ROOT, 'rev-parse', '--short', 'HEAD').strip()}; one intra-op "
             f"and one BLAS thread per worker (BLAS: {os.path.realpath('/etc/alternatives/libblas.so.3-x86_64-linux-gnu')}).",
             f"Command: `sudo /usr/bin/python3 bench/compare_cluster.py {' '.join(sys.argv[1:])}`", ""]
    for rate in args.rates.split(","):
        link = float(rate.replace("gbit", "e9").replace("mbit", "e6")) / 8
        for shape in args.shapes.split(","):
            machines, nproc = (int(x) for x in shape.split("x"))
            cluster = Cluster(machines, rate)
            try:
                lines += [f"## Link {rate} ({link / 1e6:.0f} MB/s each way), {machines} machines x {nproc} workers", ""]
                if shape == "2x2" and args.sizes:
                    lines += allreduce_table(cluster, args, link)
                results = {s: [] for s in sides}
                for _ in range(args.repeat):
                    for s in sides:
                        results[s].append(ddp(cluster, args.build, s, args.steps, nproc, args.torch2_python))
                        print(rate, shape, s, results[s][-1], flush=True)
                med = {s: statistics.median(v) for s, v in results.items()}
                lines += [f"| DDP, MLP 784-1024-1024-10, batch 64 x {machines * nproc} workers | samples/s (median) | "
                          "range | vs flat gloo | vs PyTorch 1.13 DDP | vs PyTorch 2.x DDP |", "|---|---|---|---|---|---|"]
                for s in sides:
                    versus = lambda peer: f"{med[s] / med[peer]:.2f}x" if peer in med else ""
                    lines.append(f"| {s} | {med[s]:.0f} | {min(results[s]):.0f}-{max(results[s]):.0f} | "
                                 f"{versus('gloo')} | {versus('pytorch')} | {versus('pytorch2')} |")
                lines.append("")
            finally:
                cluster.close()
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


def allreduce_table(cluster, args, link):
    lines = ["| all-reduce of S | backend | time | S / link rate | bytes out per all-reduce | bytes in | "
             "out / S | wrong |", "|---|---|---|---|---|---|---|---|"]
    for size in [int(s) for s in args.sizes.split(",")]:
        for backend in ["hier", "gloo"]:
            r = allreduce(cluster, args.build, backend, size, args.iters)
            lines.append(f"| {size >> 20} MiB | {backend} | {r['time_s']:.3f} s | {size / link:.3f} s | "
                         f"{r['tx_per_allreduce'] / 1e6:.1f} MB | {r['rx_per_allreduce'] / 1e6:.1f} MB | "
                         f"{r['tx_per_allreduce'] / size:.3f} | {r['wrong']} |")
            print(lines[-1], flush=True)
    return lines + [""]


if __name__ == "__main__":
    main()
