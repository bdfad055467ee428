#!/usr/bin/python3
"""ZeRO stage 3 (plain, and with one copy of the gathered units per machine: "3-hybrid") against
stage 2 on 2 machines x 2 workers (network namespaces), each machine's processes in a memory
cgroup of --cap: the largest GPT each trains (--steps steps, then a sharded checkpoint) before the
kernel's OOM killer ends it; and the throughput of each on one GPT at --rates (no cap). Needs root
(namespaces, cgroups).

Largest: the GPT is --n-embd wide (default 512) with as many layers as fit; a binary search over
the layer count per stage, each try a whole job (exit 0, or killed for memory). The variant
"fsdp2" is PyTorch 2.x's peer: bench/torch_gpt.py, the same GPT, with FSDP2's fully_shard per block
and a DCP checkpoint at the end, under the same launcher, namespaces and caps (--torch2-python);
"fsdp2-jemalloc" the same with jemalloc preloaded (Debian's libjemalloc2), an allocator that hands
freed memory back. Each layer is 3.1 M parameters at width 512: 12.6 MB of float32, 50 MB with
its gradient and AdamW's moments.

    sudo /usr/bin/python3 bench/compare_zero3.py [--build build] [--cap 2g] [--min-layers 0] [--max-layers 64]
        [--variants 2,3,3-hybrid,fsdp2] [--rates 10gbit,1gbit] [--throughput-layers 8] [--out bench/ZERO3.md]
        [--torch2-python ~/.cache/lockstep/venv-torch-2.15.0/bin/python]
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from compare_cluster import Cluster, PORT, cpu, sh  # noqa: E402
from compare_ddp import torch_build  # noqa: E402
from compare_gpt import json_line  # noqa: E402


def parse_bytes(text):
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].lower()]) if text[-1].lower() in units else int(text)


class MemoryCgroup:
    def __init__(self, name, limit):
        self.path = f"/sys/fs/cgroup/memory/{name}"
        os.makedirs(self.path, exist_ok=True)
        for f in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
            if os.path.exists(f"{self.path}/{f}"):
                open(f"{self.path}/{f}", "w").write(str(limit))

    def around(self, argv):
        return ["/bin/sh", "-c", f"echo $$ > {self.path}/cgroup.procs && exec \"$@\"", "sh"] + argv

    def close(self):
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def stage_flags(variant):
    """"2" -> --zero-stage 2; "3-hybrid" -> --zero-stage 3 --zero-shared-parameters."""
    stage, _, mode = variant.partition("-")
    return ["--zero-stage", stage] + (["--zero-shared-parameters"] if mode == "hybrid" else [])


JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"


def label(variant):
    return {"fsdp2": "FSDP2 (PyTorch 2.x)", "fsdp2-jemalloc": "FSDP2 (PyTorch 2.x), jemalloc"}.get(
        variant, f"stage {variant}")


def fsdp2_program(args, layers, out, steps, save):
    """bench/torch_gpt.py as the peer of the lockstep job below: the same GPT and batch, FSDP2."""
    program = [args.torch2_python, os.path.join(HERE, "torch_gpt.py"), "--fsdp2", "--n-embd", str(args.n_embd),
               "--n-layer", str(layers), "--n-head", "8", "--block-size", "64", "--batch", "1",
               "--max-steps", str(steps), "--warmup", "0", "--train-limit", "400", "--eval-limit", "8"]
    return program + (["--save-steps", str(steps), "--save-dir", out] if save else [])


def job(cluster, args, variant, layers, out, cgroups=None, steps=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", LOCKSTEP_TOKEN="bench-token")
    if variant.startswith("fsdp2"):
        # As the lockstep job: a checkpoint at the end when searching for the largest model. Gloo
        # needs the interface named where the machine's hostname does not resolve.
        env["GLOO_SOCKET_IFNAME"] = "eth0"
        if variant == "fsdp2-jemalloc":
            if not os.path.exists(JEMALLOC):
                raise SystemExit(f"fsdp2-jemalloc needs {JEMALLOC}: apt-get install libjemalloc2")
            env["LD_PRELOAD"] = JEMALLOC
        return launch(cluster, args.build, fsdp2_program(args, layers, out, steps or args.steps, steps is None),
                      cgroups, env)
    program = [f"{args.build}/examples/gpt", "--n-embd", str(args.n_embd), "--n-layer", str(layers), "--n-head", "8",
               "--block-size", "64", "--per-device-train-batch-size", "1", *stage_flags(variant),
               "--max-steps", str(steps or args.steps), "--logging-steps", "1", "--eval-strategy", "no",
               "--save-strategy", "steps", "--save-steps", str(steps or args.steps), "--train-limit", "400", "--eval-limit", "8",
               "--disable-tqdm", "--output-dir", out, "--save-in-background=false"]
    return launch(cluster, args.build, program, cgroups, env)


def launch(cluster, build, program, cgroups, env):
    """`program` under lockstep run on every machine; (all exited 0, one ran out of memory, rank 0's output)."""
    procs = []
    for m in range(cluster.n):
        argv = [f"{build}/tools/lockstep", "run", "--nnodes", str(cluster.n), "--node-rank", str(m),
                "--nproc-per-node", "2", "--master-addr", cluster.address(0), "--master-port", str(PORT)] + program
        argv = cluster.on(m, argv)
        if cgroups:
            argv = cgroups[m].around(argv)
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    outputs = [p.communicate(timeout=3600)[0] for p in procs]
    ok = all(p.returncode == 0 for p in procs)
    oom = any("ran out of memory" in o for o in outputs)
    return ok, oom, outputs[0]


def largest(cluster, args, variant, cgroups, tmp):
    lo, hi, report = args.min_layers, args.max_layers + 1, []  # lo fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ok, oom, text = job(cluster, args, variant, mid, os.path.join(tmp, f"s{variant}-l{mid}"), cgroups)
        report.append((mid, "trained" if ok else ("out of memory" if oom else "failed")))
        print(f"{label(variant)}, {mid} layers: {report[-1][1]}", flush=True)
        if not ok and not oom:
            raise SystemExit(text[-3000:])
        lo, hi = (mid, hi) if ok else (lo, mid)
    return lo, report


def throughput(cluster, args, variant, tmp):
    out = os.path.join(tmp, f"t{variant}-{len(os.listdir(tmp))}")
    ok, _, text = job(cluster, args, variant, args.throughput_layers, out, None, steps=12)
    if not ok:
        raise SystemExit(text[-3000:])
    if variant.startswith("fsdp2"):
        return json_line(text)["plain_step_s_median"]
    metrics = os.path.join(out, "metrics.jsonl")
    logs = [json.loads(l) for l in open(metrics) if '"event": "log"' in l or '"event":"log"' in l]
    steps = sorted(l["step_seconds"] for l in logs[3:])
    return steps[len(steps) // 2]


def parameters(layers, n_embd):
    return 12 * layers * n_embd * n_embd + 13 * layers * n_embd + (256 + 64) * n_embd + 2 * n_embd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--cap", default="2g")
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--max-layers", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rates", default="10gbit,1gbit")
    ap.add_argument("--throughput-layers", type=int, default=8)
    ap.add_argument("--parts", default="largest,throughput")
    ap.add_argument("--min-layers", type=int, default=0, help="the search starts knowing this many fit")
    ap.add_argument("--variants", default="2,3,3-hybrid", help="stage 2, stage 3, stage 3 with one copy per machine")
    ap.add_argument("--repeat", type=int, default=2, help="throughput: interleaved runs of each, best kept")
    ap.add_argument("--out", default=os.path.join(HERE, "ZERO3.md"))
    ap.add_argument("--torch2-python", default=os.path.expanduser("~/.cache/lockstep/venv-torch-2.15.0/bin/python"),
                    help="the python of the fsdp2 variant")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if any(v.startswith("fsdp2") for v in variants) and not os.path.exists(args.torch2_python):
        raise SystemExit(f"the fsdp2 variant needs PyTorch 2.x: no {args.torch2_python} (--torch2-python)")
    if os.geteuid() != 0:
        raise SystemExit("compare_zero3.py makes namespaces and cgroups: run it as root")
    lines = ["# ZeRO stage 3 against stage 2, 2 machines x 2 workers", "",
             f"{datetime.date.today()}, {cpu()}, {os.cpu_count()} cores shared by both machines, commit "
             f"{sh('git', '-C', ROOT, 'rev-parse', '--short', 'HEAD').strip()}; the GPT {args.n_embd} wide, 64 "
             "tokens of context, batch 1 per worker, AdamW; one intra-op and one BLAS thread per worker. "
             + (f"fsdp2: {torch_build(args.torch2_python)}, FSDP2 fully_shard per block and at the root "
                "(parameters, gradients and AdamW state sharded: ZeRO-3), gloo, a DCP checkpoint at the end."
                if any(v.startswith("fsdp2") for v in variants) else ""),
             f"Command: `sudo /usr/bin/python3 bench/compare_zero3.py {' '.join(sys.argv[1:])}`", ""]
    with tempfile.TemporaryDirectory(prefix="lockstep-zero3-", dir="/var/tmp") as tmp:
        if "largest" in args.parts:
            cap = parse_bytes(args.cap)
            cluster = Cluster(2, "10gbit")
            cgroups = [MemoryCgroup(f"lockstep-bench-{os.getpid()}-m{m}", cap) for m in range(2)]
            try:
                found = {v: largest(cluster, args, v, cgroups, tmp) for v in variants}
            finally:
                cluster.close()
                for g in cgroups:
                    g.close()
            lines += [f"## The largest GPT that trains {args.steps} steps and saves, each machine capped at {args.cap}", "",
                      "| variant | layers | parameters | tries (layers: outcome) |", "|---|---|---|---|"]
            for s, (layers, tries) in found.items():
                lines.append(f"| {label(s)} | {layers} | {parameters(layers, args.n_embd) / 1e6:.1f} M | "
                             + ", ".join(f"{l}: {o}" for l, o in tries) + " |")
            lines.append("")
            if "2" in found:
                two = parameters(found["2"][0], args.n_embd)
                for v in variants:
                    if v != "2":
                        lines.append(f"{label(v)[0].upper() + label(v)[1:]} trains a model {parameters(found[v][0], args.n_embd) / two:.2f}x the "
                                     "parameters of stage 2's largest.")
                lines.append("")
        if "throughput" in args.parts:
            lines += [f"## Throughput, the GPT at {args.throughput_layers} layers "
                      f"({parameters(args.throughput_layers, args.n_embd) / 1e6:.1f} M parameters), no cap", "",
                      "| link | " + " | ".join(f"{label(v)} step" for v in variants) + " | " +
                      " | ".join(f"{label(v)} / stage 2 throughput" for v in variants if v != "2") + " |",
                      "|---|" + "---|" * (2 * len(variants) - 1)]
            for rate in args.rates.split(","):
                cluster = Cluster(2, rate)
                try:
                    # interleaved, best of --repeat: noise only ever adds time
                    steps = {v: [] for v in variants}
                    for _ in range(args.repeat):
                        for v in variants:
                            steps[v].append(throughput(cluster, args, v, tmp))
                    t = {v: min(steps[v]) for v in variants}
                finally:
                    cluster.close()
                lines.append(f"| {rate} | " + " | ".join(f"{t[v] * 1e3:.0f} ms" for v in variants) + " | " +
                             " | ".join(f"{t['2'] / t[v]:.2f}x" for v in variants if v != "2") + " |")
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
