#!/usr/bin/python3
"""Pipeline parallelism: lockstep's pipelined GPT against PyTorch's own pipelining, its bubble
against its schedule's, its memory by schedule, and across two machines against DDP, in one run.

Every side trains the byte-level GPT of examples/gpt (bench/torch_gpt.py's twin on the PyTorch side)
on the fortune corpus, one intra-op and one BLAS thread per worker, dropout 0, no clipping (PyTorch's
pipelining has none across stages). Parts:

  peer     2 stages on 2 workers: each lockstep schedule (built on Debian's libtorch, --build, and
           on the wheel's, --build2, when given) against its torch.distributed.pipelining
           counterpart (bench/torch_pipeline.py: GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble;
           ZBV, which lockstep does not build, on its own), every pair with the same blocks per stage
           (--pipeline-split on lockstep's side), and lockstep's 1f1b against DeepSpeed's
           PipelineModule with its own schedule (bench/deepspeed_pipeline.py, from the venv
           bench/peers/setup makes), all on the torch 2.x venv over gloo; every side once a round,
           --repeat rounds, median tokens/s and range. A peer that does not run is reported with
           its error.
  bubble   lockstep, P 2, m 8: each schedule's measured bubble per pipeline rank (the share of each
           step it did not compute), its schedule's with the time each action took (the step's table
           simulated), and the textbook figure for equal forward and backward times.
  memory   lockstep, P 2: the first stage's activation memory (rank 0's tensor growth within a step,
           metrics.jsonl's step_tensor_bytes) under 1f1b and gpipe as the micro-batches grow, in units
           of one micro-batch's (the same run with m 1).
  links    (root) two machines as network namespaces (compare_cluster.py's), one worker each, their
           links limited with tc tbf to --rates: a GPT whose gradients outweigh its activations
           (8 x 512, 25 M parameters, m 8 micro-batches of --link-micro-batches sequences) as a
           2-stage pipeline (exact), as 2-way DDP (exact; with one worker per machine hier is
           gloo), and as DDP with --sync-every 8 (local SGD: not exact); tokens/s, and the link
           speed where the pipeline and DDP cross.

    /usr/bin/python3 bench/compare_pipeline.py [--build build] [--build2 build-torch2]
        [--parts peer,bubble,memory,links] [--repeat 3] [--steps 30] [--rates 1gbit,100mbit]
        [--link-micro-batches 1,2] [--link-steps 12]
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
import peer_env

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WARMUP_WINDOWS = 1  # the first logging window of every lockstep run is not timed
PEER_RUNS = {}  # (side, schedule): tokens/s of each run, for --json
DS_PARTS = []  # DeepSpeed's stage boundaries over its layers (embedding, blocks, norm, head), as it printed them
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def events(path, kind):
    with open(path) as f:
        return [e for e in map(json.loads, filter(str.strip, f)) if e.get("event") == kind]


def gpt_flags(out, steps, m, micro_batch, extra=()):
    # m micro-batches: the gradient accumulation steps (a pipeline's default --num-microbatches).
    return ["--output-dir", out, "--per-device-train-batch-size", str(micro_batch),
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

def torch_pipelining(python, build, schedule, m, micro_batch, steps, split):
    cmd = [f"{build}/tools/lockstep", "run", "--nproc-per-node", "2", python, f"{HERE}/torch_pipeline.py",
           "--schedule", schedule, "--microbatches", str(m), "--micro-batch", str(micro_batch), "--steps",
           str(steps), "--warmup", "10", "--split", ",".join(map(str, split))]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **ONE_THREAD))
    if done.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{done.stdout}{done.stderr}")
    line = next(l for l in done.stdout.splitlines() if "tokens_per_s" in l)
    return json.loads(line[line.index("{"):])["tokens_per_s"]


def lockstep_split(blocks):
    """lockstep's --pipeline-split (units: the embedding, each block, the head) for the stages that
    hold `blocks` blocks each, the first with the embedding and the last with the head, as the torch
    peer cuts its stages."""
    units = list(blocks)
    units[0] += 1
    units[-1] += 1
    return ",".join(map(str, units))


def deepspeed_pipeline(python, build, m, micro_batch, steps):
    cmd = [f"{build}/tools/lockstep", "run", "--nproc-per-node", "2", python, f"{HERE}/deepspeed_pipeline.py",
           "--microbatches", str(m), "--micro-batch", str(micro_batch), "--steps", str(steps), "--warmup", "10"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **ONE_THREAD))
    if done.returncode != 0:
        return None, (done.stdout + done.stderr).strip().splitlines()[-1]
    line = next(l for l in done.stdout.splitlines() if "tokens_per_s" in l)
    record = json.loads(line[line.index("{"):])
    DS_PARTS[:] = record.get("parts", [])
    return record["tokens_per_s"], None


# Each lockstep schedule and its torch.distributed.pipelining counterpart: (label, lockstep flags,
# torch's schedule, stages per rank). lockstep's zb with one chunk has no counterpart in torch (its
# zero-bubble schedules are the interleaved and V ones), nor torch's ZBV in lockstep (not built).
PEER_PAIRS = [
    ("gpipe", ["--pipeline-schedule", "gpipe"], "gpipe", 1),
    ("1f1b", ["--pipeline-schedule", "1f1b"], "1f1b", 1),
    ("interleaved, v 2", ["--pipeline-schedule", "interleaved", "--virtual-stages", "2"], "interleaved-1f1b", 2),
    ("interleaved zb, v 2", ["--pipeline-schedule", "zb", "--virtual-stages", "2"], "interleaved-zb", 2),
    ("zb (ZB-H1), v 1", ["--pipeline-schedule", "zb"], None, 1),
    ("ZBV", None, "zbv", 2),
]
TORCH = "torch.distributed.pipelining (2.15, gloo)"
DEEPSPEED = "DeepSpeed PipelineModule (2.15, gloo, its TrainSchedule: 1f1b)"


def part_peer(args):
    """Each lockstep schedule against its torch counterpart with the same blocks per stage, and
    lockstep's 1f1b against DeepSpeed's 1f1b-like TrainSchedule, all sides interleaved, medians."""
    m, mb, p, layers = 8, 2, 2, 4
    builds = [("lockstep (Debian libtorch 1.13, OpenBLAS)", args.build)]
    if args.build2:
        builds.append(("lockstep (torch 2.15 wheel's libtorch, MKL)", args.build2))
    ds_python, errors = peer_env.peers()
    ds_error = errors.get("deepspeed") or errors.get("setup")
    runs = {}
    splits = {}
    for _ in range(args.repeat):
        for label, flags, torch_schedule, chunks in PEER_PAIRS:
            count = p * chunks
            blocks = [layers // count + (1 if s < layers % count else 0) for s in range(count)]
            splits[label] = blocks
            for name, build in builds if flags else []:
                extra = ["--pipeline-parallel", str(p), "--pipeline-split", lockstep_split(blocks)] + flags
                logs = lockstep_run(build, p, lambda out: gpt_flags(out, args.steps, m, mb, extra))
                runs.setdefault((name, label), []).append(mean_of(logs, "tokens_per_second"))
            if torch_schedule:
                runs.setdefault((TORCH, label), []).append(
                    torch_pipelining(args.torch2_python, args.build, torch_schedule, m, mb, args.steps, blocks))
        if ds_python and not ds_error:
            rate, ds_error = deepspeed_pipeline(ds_python, args.build, m, mb, args.steps)
            if rate:
                runs.setdefault((DEEPSPEED, "1f1b"), []).append(rate)
        print({k: round(v[-1]) for k, v in runs.items()}, flush=True)
    PEER_RUNS.update(runs)
    med = {k: statistics.median(v) for k, v in runs.items()}
    spread = {k: f"{min(v):.0f}-{max(v):.0f}" for k, v in runs.items()}
    lines = [f"## Against PyTorch's and DeepSpeed's pipelines: {p} stages, {layers} x 256 GPT, m {m} micro-batches of {mb} x 128 bytes",
             "", f"{args.repeat} rounds, every side once a round, in turn; tokens/s over {args.steps} steps after 10 untimed "
             "ones, each step timed from cutting its micro-batches to the end of its optimizer step on every side. "
             "Each schedule against its torch counterpart, with the same blocks per stage (printed; the first stage also "
             "holds the embeddings, the last the final norm and the head). lockstep's head is tied to the embedding "
             "(its gradient crosses to the first stage every micro-batch); torch's is an untied copy on the last stage "
             "(nothing crosses) except under ZBV, whose first and last stages share rank 0 and the weight.", "",
             "| schedule | blocks per stage | side | tokens/s (median) | range | torch's counterpart (median) | range | lockstep / torch |",
             "|---|---|---|---|---|---|---|---|"]
    for label, flags, torch_schedule, chunks in PEER_PAIRS:
        theirs = med.get((TORCH, label))
        for name, _ in builds if flags else [(None, None)]:
            ours = med.get((name, label)) if name else None
            lines.append(f"| {label} | {','.join(map(str, splits[label]))} | {name or '(not built in lockstep)'} | "
                         f"{f'{ours:.0f}' if ours else '-'} | {spread.get((name, label), '-')} | "
                         f"{f'{theirs:.0f}' if theirs else '- (none)'} | {spread.get((TORCH, label), '-')} | "
                         f"{f'{ours / theirs:.2f}x' if ours and theirs else '-'} |")
    ds = med.get((DEEPSPEED, "1f1b"))
    lines += ["", "| lockstep 1f1b | DeepSpeed (median) | range | lockstep / DeepSpeed |", "|---|---|---|---|"]
    for name, _ in builds:
        ours = med.get((name, "1f1b"))
        lines.append(f"| {name}: {ours:.0f} | {f'{ds:.0f}' if ds else '-'} | {spread.get((DEEPSPEED, '1f1b'), '-')} | "
                     f"{f'{ours / ds:.2f}x' if ds else '-'} |")
    lines += ["", f"DeepSpeed: {'ran, its stage boundaries over its layers (the embedding, the blocks, the norm, the head) ' + str(DS_PARTS) if ds else 'not run: ' + (ds_error or 'unknown')}", ""]
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
    two = ["--virtual-stages", "2"]
    for label, schedule, extra in [("gpipe", "gpipe", []), ("1f1b", "1f1b", []), ("interleaved", "interleaved", two),
                                   ("zb", "zb", []), ("zb, v 2", "zb", two)]:
        measured, analytic, rate = [], [], []
        for _ in range(args.repeat):
            logs = lockstep_run(args.build, p, lambda out: gpt_flags(out, args.steps, m, mb, ["--pipeline-parallel", str(p),
                                                                                               "--pipeline-schedule", schedule] + extra))
            measured.append(per_rank(logs, "pipeline_bubble"))
            analytic.append(per_rank(logs, "pipeline_bubble_analytic"))
            rate.append(mean_of(logs, "tokens_per_second"))
        idle[label] = statistics.mean(statistics.mean(r) for r in measured)
        for r in range(p):
            b = statistics.mean(x[r] for x in measured)
            a = statistics.mean(x[r] for x in analytic)
            book = f"{100 * textbook[label]:.1f}%" if label in textbook else "-"
            lines.append(f"| {label} | {r} | {100 * b:.1f}% | {100 * a:.1f}% | {100 * (b - a):+.1f} points | {book} | "
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


def cluster_run(cluster, build, flags, nproc=1, on_begin=None):
    """examples/gpt with `nproc` workers on each machine of `cluster`; machine 0's log windows.
    on_begin, when given, sees the run's train_begin records."""
    with tempfile.TemporaryDirectory(prefix="pipebench-", dir="/tmp") as out:
        env = dict(os.environ, **ONE_THREAD, LOCKSTEP_TOKEN="bench-token")
        procs = []
        for machine in range(cluster.n):
            argv = [f"{build}/tools/lockstep", "run", "--nnodes", str(cluster.n), "--node-rank", str(machine),
                    "--nproc-per-node", str(nproc), "--master-addr", cluster.address(0), "--master-port",
                    str(compare_cluster.PORT), f"{build}/examples/gpt"] + flags(out)
            procs.append(subprocess.Popen(cluster.on(machine, argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, env=env))
        outputs = [p.communicate(timeout=3600)[0] for p in procs]
        for p, o in zip(procs, outputs):
            if p.returncode != 0:
                raise SystemExit(f"failed: {' '.join(flags(out))}\n{o}")
        if on_begin:
            for begin in events(os.path.join(out, "metrics.jsonl"), "train_begin"):
                on_begin(begin)
        return events(os.path.join(out, "metrics.jsonl"), "log")[WARMUP_WINDOWS:]


def crossover(per_token):
    """The link speed (bytes/s) where the pipeline and DDP train alike: each side's seconds per token
    fitted as a + b / speed through the two slowest links measured; None when the fits do not meet
    at a positive speed."""
    pipe, ddp = per_token["pipeline, 2 stages (1f1b)"], per_token["DDP, 2 workers (exact)"]
    r1, r2 = sorted(ddp)[:2]

    def fit(t):
        b = (t[r1] - t[r2]) / (1 / r1 - 1 / r2)
        return t[r1] - b / r1, b
    (ap, bp), (ad, bd) = fit(pipe), fit(ddp)
    if abs(ap - ad) < 1e-15 or (bd - bp) / (ap - ad) <= 0:
        return None
    return (bd - bp) / (ap - ad)


def part_links(args):
    if os.geteuid() != 0:
        return ["## Across two machines", "", "not run: the links part makes network namespaces; run as root", ""]
    m = 8
    pipe = ["--pipeline-parallel", "2", "--pipeline-schedule"]
    once = ["--pipeline-tied-gradient", "step"]
    sides = {"pipeline, 2 stages (1f1b)": pipe + ["1f1b"],
             "pipeline, 2 stages (zb)": pipe + ["zb"],
             "pipeline, 2 stages (1f1b), tied gradient once a step": pipe + ["1f1b"] + once,
             "pipeline, 2 stages (zb), tied gradient once a step": pipe + ["zb"] + once,
             "DDP, 2 workers (exact)": [],
             "DDP --sync-every 8 (local SGD, not exact)": ["--sync-every", "8"]}
    lines = ["## Across two machines: 8 x 512 GPT (25 M parameters), one worker per machine, m 8 micro-batches",
             "", "Per micro-batch of b x 128 bytes the pipeline sends b x 256 KB of activations one way and as many "
             "gradients the other, plus the tied embedding's gradient (512 KB: 256 x 512 floats; with "
             "--pipeline-tied-gradient step once a step, summed: equal up to rounding, not bitwise) and once a step "
             "its value; DDP all-reduces the 100 MB of gradients every step. Each worker: one core of the two.", "",
             "| link | micro-batch | side | tokens/s | vs DDP |", "|---|---|---|---|---|"]
    for mb in args.link_micro_batches:
        per_token = {s: {} for s in sides}
        for rate in args.rates.split(","):
            link = float(rate.replace("gbit", "e9").replace("mbit", "e6")) / 8
            cluster = compare_cluster.Cluster(2, rate)
            try:
                runs = {s: [] for s in sides}
                for _ in range(args.repeat):
                    for side, extra in sides.items():
                        logs = cluster_run(cluster, args.build,
                                           lambda out: gpt_flags(out, args.link_steps, m, mb, BIG_GPT + extra))
                        runs[side].append(mean_of(logs, "tokens_per_second"))
                        print(rate, mb, side, runs[side][-1], flush=True)
                ddp_rate = statistics.median(runs["DDP, 2 workers (exact)"])
                for side, values in runs.items():
                    med = statistics.median(values)
                    per_token[side][link] = 1 / med
                    lines.append(f"| {rate} | {mb} x 128 | {side} | {med:.0f} | {med / ddp_rate:.2f}x |")
            finally:
                cluster.close()
        if len(args.rates.split(",")) >= 2:
            cross = crossover(per_token)
            lines += [f"| crossover, {mb} x 128 | | pipeline (1f1b) and DDP alike at " +
                      (f"about {cross * 8 / 1e9:.2f} Gbit/s (seconds per token fitted as a + b / speed)" if cross
                       else "no speed the fit reaches") + " | | |"]
    return lines + [""]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--build2", default="", help="a build on the torch 2.x wheel (LOCKSTEP_TORCH=pip), also measured")
    ap.add_argument("--parts", default="peer,bubble,memory,links")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--link-steps", type=int, default=12)
    ap.add_argument("--rates", default="1gbit,100mbit")
    ap.add_argument("--link-micro-batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2],
                    help="the links part's micro-batch sizes (sequences of 128 bytes)")
    ap.add_argument("--torch2-python", default=os.path.expanduser("~/.cache/lockstep/venv-torch-2.15.0/bin/python"))
    ap.add_argument("--out", default="")
    ap.add_argument("--json", help="also write the peer part's tokens/s here (bench/run-headline reads it)")
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"peer": [{"side": name, "schedule": schedule, "tokens_per_s": rates}
                                for (name, schedule), rates in PEER_RUNS.items()]}, f, indent=1)


if __name__ == "__main__":
    main()
