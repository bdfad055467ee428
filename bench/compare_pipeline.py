#!/usr/bin/python3
"""Pipeline parallelism: lockstep's pipelined GPT against PyTorch's own pipelining, its bubble
against its schedule's, its memory by schedule, and across two machines against DDP, in one run.

Every side trains the byte-level GPT of examples/gpt (bench/torch_gpt.py's twin on the PyTorch side)
on the fortune corpus, one intra-op and one BLAS thread per worker, dropout 0, no clipping (PyTorch's
pipelining has none across stages). Parts:

  peer     2 stages on 2 workers, the same GPT split (embeddings + blocks | blocks + head), the same
           schedule and micro-batches: lockstep's examples/gpt --pipeline-parallel 2 (built on
           Debian's libtorch, --build, and on the wheel's, --build2, when given) against
           torch.distributed.pipelining on the torch 2.x venv (bench/torch_pipeline.py, gloo), sides
           interleaved --repeat times, median tokens/s. DeepSpeed's PipelineModule when the venv has
           deepspeed; otherwise the reason it does not run.
  bubble   lockstep, P 2, m 8: each schedule's measured bubble per pipeline rank (the share of each
           step it did not compute), its schedule's with the time each action took (the step's table
           simulated), and the textbook figure for equal forward and backward times.
  memory   lockstep, P 2: the first stage's activation memory (rank 0's tensor growth within a step,
           metrics.jsonl's step_tensor_bytes) under 1f1b and gpipe as the micro-batches grow, in units
           of one micro-batch's (the same run with m 1).
  links    (root) two machines as network namespaces (compare_cluster.py's), one worker each, their
           links limited with tc tbf to --rates: a GPT whose gradients outweigh its activations
           (8 x 512, 25 M parameters) as a 2-stage pipeline (exact), as 2-way DDP (exact; with one
           worker per machine hier is gloo), and as DDP with --sync-every 8 (local SGD: not exact);
           tokens/s, and the link speed where the pipeline and DDP cross.

    /usr/bin/python3 bench/compare_pipeline.py [--build build] [--build2 build-torch2]
        [--parts peer,bubble,memory,links] [--repeat 3] [--steps 30] [--rates 1gbit,100mbit]
        [--torch2-python ~/.cache/lockstep/venv-torch-2.15.0/bin/python] [--out out.md]

Both builds and both peers share this machine's two cores: the ratios, measured in one run, are
what matters. The header names the CPU and each side's BLAS.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

import compare_cluster
import compare_ddp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WARMUP_WINDOWS = 1  # the first logging window of every lockstep run is not timed
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def events(path, kind):
    with open(path) as f:
        return [e for e in map(json.loads, filter(str.strip, f)) if e.get("event") == kind]


def gpt_flags(out, steps, m, micro_batch, extra=()):
    return ["--output-dir", out, "--num-microbatches", str(m), "--per-device-train-batch-size", str(micro_batch),
            "--gradient-accumulation-steps", str(m), "--max-steps", str(steps), "--logging-steps", str(steps // 3),
            "--eval-strategy", "no", "--save-strategy", "no", "--disable-tqdm", "--dropout", "0",
            "--max-grad-norm", "0", "--train-limit", "4000"] + list(extra)


def lockstep_run(build, nproc, flags, env=None):
    """examples/gpt under `lockstep run`; its log windows after the first."""
    with tempfile.TemporaryDirectory(prefix="pipebench-") as out:
        cmd = [f"{build}/tools/lockstep", "run", "--nproc-per-node", str(nproc), f"{build}/examples/gpt"]
        done = subprocess.run(cmd + flags(out), capture_output=True, text=True, env=dict(os.environ, **ONE_THREAD, **(env or {})))
        if done.returncode != 0:
            raise SystemExit(f"failed: {' '.join(cmd + flags(out))}\n{done.stdout}{done.stderr}")
        return events(os.path.join(out, "metrics.jsonl"), "log")[WARMUP_WINDOWS:]


def mean_of(logs, key):
    return statistics.mean(e[key] for e in logs)


def per_rank(logs, key):
    return [statistics.mean(e[key][r] for e in logs) for r in range(len(logs[0][key]))]


# ----------------------------------------------------------------------------------------------
# peer

def torch_pipelining(python, build, schedule, m, micro_batch, steps):
    cmd = [f"{build}/tools/lockstep", "run", "--nproc-per-node", "2", python, f"{HERE}/torch_pipeline.py",
           "--schedule", schedule, "--microbatches", str(m), "--micro-batch", str(micro_batch), "--steps",
           str(steps), "--warmup", "10"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **ONE_THREAD))
    if done.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{done.stdout}{done.stderr}")
    line = next(l for l in done.stdout.splitlines() if "tokens_per_s" in l)
    return json.loads(line[line.index("{"):])["tokens_per_s"]


def deepspeed_status(python):
    done = subprocess.run([python, "-c", "import deepspeed; print(deepspeed.__version__)"], capture_output=True, text=True)
    if done.returncode == 0:
        return done.stdout.strip(), None
    return None, (done.stderr.strip().splitlines() or ["(no output)"])[-1]


def part_peer(args):
    m, mb, schedules = 8, 2, ["1f1b", "gpipe"]
    builds = [("lockstep (Debian libtorch 1.13, OpenBLAS)", args.build)]
    if args.build2:
        builds.append(("lockstep (torch 2.15 wheel's libtorch, MKL)", args.build2))
    lines = ["## Against torch.distributed.pipelining: 2 stages, 4 x 256 GPT, m 8 micro-batches of 2 x 128 bytes", "",
             "| schedule | side | tokens/s (median) | range | vs PyTorch pipelining |", "|---|---|---|---|---|"]
    for schedule in schedules:
        runs = {name: [] for name, _ in builds}
        runs["torch.distributed.pipelining (2.15, gloo, MKL)"] = []
        for _ in range(args.repeat):
            for name, build in builds:
                logs = lockstep_run(build, 2, lambda out: gpt_flags(out, args.steps, m, mb,
                                                                    ["--pipeline-parallel", "2", "--pipeline-schedule", schedule]))
                runs[name].append(mean_of(logs, "tokens_per_second"))
                print(schedule, name, runs[name][-1], flush=True)
            runs["torch.distributed.pipelining (2.15, gloo, MKL)"].append(
                torch_pipelining(args.torch2_python, args.build, schedule, m, mb, args.steps))
            print(schedule, "torch", runs["torch.distributed.pipelining (2.15, gloo, MKL)"][-1], flush=True)
        peer = statistics.median(runs["torch.distributed.pipelining (2.15, gloo, MKL)"])
        for name, values in runs.items():
            med = statistics.median(values)
            lines.append(f"| {schedule} | {name} | {med:.0f} | {min(values):.0f}-{max(values):.0f} | {med / peer:.2f}x |")
    version, error = deepspeed_status(args.torch2_python)
    lines += ["", f"DeepSpeed: {'installed (' + version + ')' if version else 'not run: ' + error}", ""]
    return lines


# ----------------------------------------------------------------------------------------------
# bubble

def part_bubble(args):
    p, m, mb = 2, 8, 2
    lines = [f"## Bubble: P {p}, m {m}, 4 x 256 GPT ({args.repeat} runs of {args.steps} steps, windows after the first)", "",
             "| schedule | pipeline rank | measured bubble | its schedule's (each action's time) | measured - schedule | "
             "textbook, equal F and B | tokens/s |", "|---|---|---|---|---|---|---|"]
    textbook = {"gpipe": (p - 1) / (m + p - 1), "1f1b": (p - 1) / (m + p - 1), "interleaved": (p - 1) / (2 * m + p - 1)}
    idle = {}
    for schedule, extra in [("gpipe", []), ("1f1b", []), ("interleaved", ["--virtual-stages", "2"]), ("zb", [])]:
        measured, analytic, rate = [], [], []
        for _ in range(args.repeat):
            logs = lockstep_run(args.build, p, lambda out: gpt_flags(out, args.steps, m, mb, ["--pipeline-parallel", str(p),
                                                                                               "--pipeline-schedule", schedule] + extra))
            measured.append(per_rank(logs, "pipeline_bubble"))
            analytic.append(per_rank(logs, "pipeline_bubble_analytic"))
            rate.append(mean_of(logs, "tokens_per_second"))
        idle[schedule] = statistics.mean(statistics.mean(r) for r in measured)
        for r in range(p):
            b = statistics.mean(x[r] for x in measured)
            a = statistics.mean(x[r] for x in analytic)
            book = f"{100 * textbook[schedule]:.1f}%" if schedule in textbook else "-"
            lines.append(f"| {schedule} | {r} | {100 * b:.1f}% | {100 * a:.1f}% | {100 * (b - a):+.1f} points | {book} | "
                         f"{statistics.median(rate):.0f} |")
            print(lines[-1], flush=True)
    order = sorted(idle, key=idle.get)
    lines += ["", "Mean measured idle over the ranks, lowest first: " +
              " < ".join(f"{s} ({100 * idle[s]:.1f}%)" for s in order), ""]
    return lines


# ----------------------------------------------------------------------------------------------
# memory

def part_memory(args):
    mb = 2
    base = lockstep_run(args.build, 2, lambda out: gpt_flags(out, args.steps, 1, mb, ["--pipeline-parallel", "2"]))
    one = mean_of(base, "step_tensor_bytes")
    lines = ["## Memory: the first stage's activations, 2 stages, micro-batches of 2 x 128 bytes", "",
             f"One micro-batch's (m 1): {one / 1e6:.1f} MB of tensor growth within a step on rank 0 (stage 0).", "",
             "| m | 1f1b: MB | in micro-batches | gpipe: MB | in micro-batches |", "|---|---|---|---|---|"]
    for m in (2, 4, 8, 16):
        row = [str(m)]
        for schedule in ("1f1b", "gpipe"):
            logs = lockstep_run(args.build, 2, lambda out: gpt_flags(out, args.steps, m, mb, ["--pipeline-parallel", "2",
                                                                                               "--pipeline-schedule", schedule]))
            grown = mean_of(logs, "step_tensor_bytes")
            row += [f"{grown / 1e6:.1f}", f"{grown / one:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    return lines + [""]


# ----------------------------------------------------------------------------------------------
# links

BIG_GPT = ["--n-layer", "8", "--n-embd", "512", "--n-head", "8"]


def cluster_run(cluster, build, flags):
    """examples/gpt with one worker on each machine of `cluster`; machine 0's log windows."""
    with tempfile.TemporaryDirectory(prefix="pipebench-", dir="/tmp") as out:
        env = dict(os.environ, **ONE_THREAD, LOCKSTEP_TOKEN="bench-token")
        procs = []
        for machine in range(cluster.n):
            argv = [f"{build}/tools/lockstep", "run", "--nnodes", str(cluster.n), "--node-rank", str(machine),
                    "--nproc-per-node", "1", "--master-addr", cluster.address(0), "--master-port",
                    str(compare_cluster.PORT), f"{build}/examples/gpt"] + flags(out)
            procs.append(subprocess.Popen(cluster.on(machine, argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, env=env))
        outputs = [p.communicate(timeout=3600)[0] for p in procs]
        for p, o in zip(procs, outputs):
            if p.returncode != 0:
                raise SystemExit(f"failed: {' '.join(flags(out))}\n{o}")
        return events(os.path.join(out, "metrics.jsonl"), "log")[WARMUP_WINDOWS:]


def crossover(rates, pipe, ddp):
    """The link speed (bytes/s) where the sides' step times meet, each side's step time fitted as
    a + b / rate through the two slowest rates measured; None when they do not meet."""
    (r1, r2) = sorted(rates)[:2]
    def fit(t):
        b = (t[r1] - t[r2]) / (1 / r1 - 1 / r2)
        return t[r1] - b / r1, b
    (ap, bp), (ad, bd) = fit(pipe), fit(ddp)
    if abs(ap - ad) < 1e-12 or (bd - bp) / (ap - ad) <= 0:
        return None
    return (bd - bp) / (ap - ad)


def part_links(args):
    if os.geteuid() != 0:
        return ["## Across two machines", "", "not run: the links part makes network namespaces; run as root", ""]
    m, mb, tokens_per_step = 8, 2, 8 * 2 * 128
    sides = {"pipeline, 2 stages (1f1b)": ["--pipeline-parallel", "2", "--pipeline-schedule", "1f1b"],
             "pipeline, 2 stages (zb)": ["--pipeline-parallel", "2", "--pipeline-schedule", "zb"],
             "DDP, 2 workers (exact)": [],
             "DDP --sync-every 8 (local SGD, not exact)": ["--sync-every", "8"]}
    lines = ["## Across two machines: 8 x 512 GPT (25 M parameters), one worker per machine, m 8 micro-batches of 2 x 128 bytes",
             "", "Per step the pipeline sends 8 activations and 8 gradients of 0.5 MB each way plus the tied embedding's "
             "gradient (0.5 MB per micro-batch) and value; DDP all-reduces 100 MB of gradients.", "",
             "| link | side | tokens/s (median) | step s | vs DDP |", "|---|---|---|---|---|"]
    step_seconds = {s: {} for s in sides}
    for rate in args.rates.split(","):
        link = float(rate.replace("gbit", "e9").replace("mbit", "e6")) / 8
        cluster = compare_cluster.Cluster(2, rate)
        try:
            runs = {s: [] for s in sides}
            for _ in range(args.repeat):
                for side, extra in sides.items():
                    logs = cluster_run(cluster, args.build, lambda out: gpt_flags(out, args.link_steps, m, mb, BIG_GPT + extra))
                    runs[side].append(mean_of(logs, "tokens_per_second"))
                    print(rate, side, runs[side][-1], flush=True)
            ddp_rate = statistics.median(runs["DDP, 2 workers (exact)"])
            for side, values in runs.items():
                med = statistics.median(values)
                step_seconds[side][link] = tokens_per_step * 2 / med if "DDP" in side else tokens_per_step / med
                lines.append(f"| {rate} | {side} | {med:.0f} | {step_seconds[side][link]:.2f} | {med / ddp_rate:.2f}x |")
        finally:
            cluster.close()
    links = list(step_seconds["DDP, 2 workers (exact)"])
    if len(links) >= 2:
        cross = crossover(links, step_seconds["pipeline, 2 stages (1f1b)"], step_seconds["DDP, 2 workers (exact)"])
        lines += ["", "Crossover (step times fitted as a + b / link speed): " +
                  (f"the pipeline and DDP train alike at about {cross * 8 / 1e9:.2f} Gbit/s; below it the pipeline is faster"
                   if cross else "none in reach of the fit"), ""]
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--build2", default="", help="a build on the torch 2.x wheel (LOCKSTEP_TORCH=pip), also measured")
    ap.add_argument("--parts", default="peer,bubble,memory,links")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--link-steps", type=int, default=12)
    ap.add_argument("--rates", default="1gbit,100mbit")
    ap.add_argument("--torch2-python", default=os.path.expanduser("~/.cache/lockstep/venv-torch-2.15.0/bin/python"))
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    parts = args.parts.split(",")
    lines = [f"# Pipeline parallelism ({datetime.date.today()}, {compare_ddp.cpu_name()}, {os.cpu_count()} cores)", "",
             f"Command: `{' '.join(sys.argv)}`; lockstep at commit "
             f"{subprocess.run(['git', '-C', ROOT, 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()}; "
             f"one intra-op and one BLAS thread per worker; Debian's BLAS: {compare_ddp.blas()}; the wheel multiplies "
             "with its own MKL.", ""]
    for part in parts:
        lines += {"peer": part_peer, "bubble": part_bubble, "memory": part_memory, "links": part_links}[part](args)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
