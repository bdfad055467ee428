#!/usr/bin/python3
"""The GPT workload, lockstep against PyTorch 1.13 and 2.x, in one run on this machine.

Both sides train the same byte-level GPT on the same fortune blocks with the same initialisation,
AdamW, schedule and clipping (examples/gpt.cc against bench/torch_gpt.py), per-worker batch 16
blocks of 128 bytes, one intra-op thread and one BLAS thread per worker. PyTorch 2.x steps with
AdamW(fused=True), the kernel lockstep's Trainer uses on a 2.x libtorch (1.13 has none). Five parts:

  throughput  tokens/s of lockstep 1 process, lockstep DDP 2 workers, PyTorch 1 process and
              PyTorch DDP (gloo) 2 workers, for PyTorch 1.13 (Debian's) and 2.x (the venv's python,
              --torch2-python; skipped when absent), interleaved --repeat times, on the default model
              (4 layers, 256 wide) and one 4x larger (4 layers, 512 wide, 8 heads): median
              tokens/s, scaling efficiency (2 workers over twice the same side's 1 process) and
              lockstep DDP over PyTorch DDP. The first 10 steps of every run are not timed.
  memory      2 workers, default model, with and without gradient checkpointing, both sides:
              tokens/s, the growth of tensor memory within a step (lockstep: its counting
              allocator; PyTorch: one step under the autograd profiler's memory tracking), and
              the resident-memory high-water mark of rank 0.
  precision   2 workers, the 4x model, fp32 and --bf16 (autocast) on every side: tokens/s, and the
              model FLOPs utilisation against the matmul rates lockstep's workers measured at the
              model's shapes (LOCKSTEP_PROBE_MATMUL=1), PyTorch's from the same FLOPs and rates.
  loss        2 workers, default model, --loss-steps steps on both sides, then the validation
              loss over the whole validation split: lockstep's against PyTorch's.
  bf16-loss   2 workers, default model, --loss-steps steps in fp32 and with --bf16, lockstep and
              PyTorch 2.x: the validation loss each side's bf16 autocast reaches against its own
              fp32 (PyTorch's gap is the yardstick for lockstep's).
  context     2 workers, default model, --context bytes of context (1024), per-worker batch of
              2048 / context blocks (the other parts' tokens per step), fp32 and --bf16, with the
              attention dropout: tokens/s, the growth of tensor memory within a step and rank 0's
              resident high-water mark. (lockstep's GPT attends in strips from 512 tokens.)

    /usr/bin/python3 bench/compare_gpt.py [--build build] [--parts throughput,memory,precision,loss,bf16-loss,context]
        [--repeat 3] [--steps 40] [--loss-steps 300] [--json out.json] [--models default,4x] [--context 1024]
        [--torch2-python ~/.cache/lockstep/venv-torch-2.15.0/bin/python]

Every part runs the PyTorch side on both generations when the 2.x python is there. PyTorch 2.x
multiplies with the wheel's own BLAS (MKL on x86): the header names each side's.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import tempfile

import compare_ddp  # the BLAS set-up every comparison shares

HERE = os.path.dirname(os.path.abspath(__file__))
WARMUP = 10  # untimed steps at the start of every run
MODELS = {"default": [], "4x": ["--n-embd", "512", "--n-head", "8"]}


cpu_model = compare_ddp.cpu_name  # compare_zero and others call it by this name


def json_line(stdout):
    for line in stdout.splitlines():
        line = line.split("] ", 1)[-1] if line.startswith("[rank") else line
        if line.startswith("{"):
            return json.loads(line)
    return None


def events(path, kind):
    with open(path) as f:
        return [e for e in map(json.loads, filter(str.strip, f)) if e.get("event") == kind]


def lockstep_result(out_dir, world, step_tokens=16 * 128):
    """tokens/s over the logged windows after the first (the untimed warm-up), the memory the
    windows recorded, and the final evaluation, from what the Trainer wrote."""
    all_logs = events(os.path.join(out_dir, "metrics.jsonl"), "log")
    logs = all_logs[1:]
    if not logs:
        raise SystemExit(f"no timed log windows in {out_dir}/metrics.jsonl: raise --steps")
    begin = events(os.path.join(out_dir, "metrics.jsonl"), "train_begin")[-1]
    with open(os.path.join(out_dir, "eval_results.json")) as f:
        final = json.load(f)
    block_tokens = step_tokens * world  # per step: the per-device batch of blocks on every worker
    tokens = [(e["step"] - before["step"]) * block_tokens for before, e in zip(all_logs, logs)]
    seconds = [t / e["tokens_per_second"] for t, e in zip(tokens, logs)]
    return {"side": "lockstep", "world": world, "tokens_per_s": sum(tokens) / sum(seconds),
            "step_s": statistics.mean(e["step_seconds"] for e in logs),
            "exposed_comm_fraction": statistics.mean(e["exposed_comm_fraction"] for e in logs),
            "step_tensor_bytes": max(e.get("step_tensor_bytes", 0) for e in logs),
            "peak_rss_bytes": logs[-1].get("peak_rss_bytes"), "eval_loss": final["eval_loss"],
            "intra_op_threads": begin["intra_op_threads"], "blas_core": begin.get("blas_core"),
            "params": begin.get("parameters"), "flops_per_sample": begin.get("model_flops_per_sample"),
            "matmul_fp32": begin.get("matmul_fp32_flops_per_second"),
            "matmul_bf16": begin.get("matmul_bf16_flops_per_second"),
            "mfu": statistics.mean(e["mfu"] for e in logs) if all("mfu" in e for e in logs) else None}


def run_lockstep(build, world, flags, env, step_tokens=16 * 128):
    with tempfile.TemporaryDirectory(prefix="compare-gpt-") as out:
        cmd = [os.path.join(build, "tools", "lockstep"), "run", "--nproc-per-node", str(world),
               os.path.join(build, "examples", "gpt"), "--output-dir", out, "--logging-steps", "10",
               "--eval-strategy", "no", "--save-strategy", "no", "--disable-tqdm"] + flags
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
        if done.returncode != 0:
            raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
        return lockstep_result(out, world, step_tokens)


PYTHONS = {"pytorch": "/usr/bin/python3"}  # "pytorch2" added by main() when a 2.x python is there
SIDE_NAMES = {"lockstep": "lockstep", "pytorch": "PyTorch 1.13", "pytorch2": "PyTorch 2.x"}


def run_pytorch(build, world, flags, env, side="pytorch"):
    cmd = [PYTHONS[side], os.path.join(HERE, "torch_gpt.py"), "--warmup", str(WARMUP)] + flags
    if side == "pytorch2":  # its fastest AdamW on the CPU, the kernel lockstep's Trainer uses on a 2.x libtorch
        cmd.append("--fused-adamw")
    if world > 1:
        cmd = [os.path.join(build, "tools", "lockstep"), "run", "--nproc-per-node", str(world)] + cmd
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    result = json_line(done.stdout)
    if done.returncode != 0 or result is None:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
    return result


def run_side(side, build, world, flags, env):
    if side == "lockstep":
        return run_lockstep(build, world, flags, env)
    return run_pytorch(build, world, flags, env, side)  # torch_gpt.py spells the flags alike


def throughput(args, env):
    rows = []
    for model, shape in MODELS.items():
        if model not in args.models.split(","):
            continue
        flags = ["--max-steps", str(args.steps), "--eval-limit", "32"] + shape
        got = {(side, world): [] for side in ["lockstep"] + list(PYTHONS) for world in (1, 2)}
        for _ in range(args.repeat):
            for side, world in got:
                got[side, world].append(run_side(side, args.build, world, flags, env))
        rows.append((model, got))
    print("\n### Throughput: tokens/s, median of %d interleaved runs (range)\n" % args.repeat)
    print("| model | parameters | side | 1 process | DDP 2 workers | scaling eff. | exposed comm | DDP vs PyTorch 1.13 "
          "DDP | DDP vs PyTorch 2.x DDP |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, got in rows:
        med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in got.items()}
        rng = {k: (min(r["tokens_per_s"] for r in v), max(r["tokens_per_s"] for r in v)) for k, v in got.items()}
        params = got["lockstep", 1][0]["params"]
        for side in ["lockstep"] + list(PYTHONS):
            exposed = (f"{statistics.median(r['exposed_comm_fraction'] for r in got[side, 2]):.1%}"
                       if side == "lockstep" else "")
            versus2 = f"{med[side, 2] / med['pytorch2', 2]:.2f}x" if ("pytorch2", 2) in med else ""
            name = SIDE_NAMES[side]
            print(f"| {model} | {params / 1e6:.2f} M | {name} | {med[side, 1]:.0f} ({rng[side, 1][0]:.0f}-"
                  f"{rng[side, 1][1]:.0f}) | {med[side, 2]:.0f} ({rng[side, 2][0]:.0f}-{rng[side, 2][1]:.0f}) | "
                  f"{med[side, 2] / (2 * med[side, 1]):.0%} | {exposed} | "
                  f"{med[side, 2] / med['pytorch', 2]:.2f}x | {versus2} |")
    return {m: {f"{s} {w}": v for (s, w), v in got.items()} for m, got in rows}


def memory(args, env):
    flags = ["--max-steps", str(args.steps), "--eval-limit", "32"]
    got = {}
    for _ in range(args.repeat):
        for side in ["lockstep"] + list(PYTHONS):
            for ckpt in (False, True):
                extra = ["--gradient-checkpointing"] if ckpt else []
                if side != "lockstep":
                    extra.append("--measure-memory")
                got.setdefault((side, ckpt), []).append(run_side(side, args.build, 2, flags + extra, env))
    print("\n### Gradient checkpointing, 2 workers, default model (median of %d runs)\n" % args.repeat)
    print("| side | checkpointing | tokens/s | step time vs off | tensor growth within a step | vs off | "
          "peak RSS rank 0 |")
    print("|---|---|---|---|---|---|---|")
    for side in ["lockstep"] + list(PYTHONS):
        off = statistics.median(r["tokens_per_s"] for r in got[side, False])
        off_bytes = statistics.median(r["step_tensor_bytes"] for r in got[side, False])
        for ckpt in (False, True):
            runs = got[side, ckpt]
            tps = statistics.median(r["tokens_per_s"] for r in runs)
            grown = statistics.median(r["step_tensor_bytes"] for r in runs)
            rss = statistics.median(r["peak_rss_bytes"] for r in runs)
            print(f"| {SIDE_NAMES[side]} | {'on' if ckpt else 'off'} | {tps:.0f} | {off / tps:.2f}x | {grown / 2**20:.1f} MiB | "
                  f"{grown / off_bytes:.2f}x | {rss / 2**20:.0f} MiB |")
    return {f"{s} {'on' if c else 'off'}": v for (s, c), v in got.items()}


def versus(med, side, bf16, peer):
    """side's median tokens/s over peer's at the same precision, as a table cell."""
    return f"{med[side, bf16] / med[peer, bf16]:.2f}x" if (peer, bf16) in med else ""


def precision(args, env):
    """fp32 and bf16 autocast on both sides, the 4x model on 2 workers, and lockstep's model FLOPs
    utilisation against the matmul rates its workers measured at the model's shapes
    (LOCKSTEP_PROBE_MATMUL=1); PyTorch's utilisation from the same FLOPs per token and rates."""
    flags = ["--max-steps", str(args.steps), "--eval-limit", "32"] + MODELS["4x"]
    probe = dict(env, LOCKSTEP_PROBE_MATMUL="1")
    sides = ["lockstep"] + list(PYTHONS)
    got = {(side, bf16): [] for side in sides for bf16 in (False, True)}
    for _ in range(args.repeat):
        for side, bf16 in got:
            extra = ["--bf16"] if bf16 else []
            got[side, bf16].append(run_side(side, args.build, 2, flags + extra, probe if side == "lockstep" else env))
    ours = got["lockstep", False] + got["lockstep", True]
    per_token = ours[0]["flops_per_sample"] / 128
    rate = {False: statistics.median(r["matmul_fp32"] for r in ours),
            True: statistics.median(r["matmul_bf16"] for r in ours)}
    print(f"\n### Precision: the 4x model, 2 workers, median of {args.repeat} interleaved runs\n")
    print(f"Model FLOPs {per_token / 1e6:.1f} M per token (3x the forward's products). Matmul rate at the model's "
          f"shapes, per worker, measured by lockstep's workers: fp32 {rate[False] / 1e9:.0f} GFLOP/s, bf16 "
          f"{rate[True] / 1e9:.0f} GFLOP/s.\n")
    print("| side | precision | tokens/s (range) | model GFLOP/s per worker | utilisation of the matmul rate | "
          "vs PyTorch 1.13 same precision | vs PyTorch 2.x same precision |")
    print("|---|---|---|---|---|---|---|")
    med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in got.items()}
    for side in sides:
        for bf16 in (False, True):
            tps = [r["tokens_per_s"] for r in got[side, bf16]]
            achieved = med[side, bf16] * per_token / 2
            print(f"| {SIDE_NAMES[side]} | {'bf16' if bf16 else 'fp32'} | {med[side, bf16]:.0f} ({min(tps):.0f}-"
                  f"{max(tps):.0f}) | {achieved / 1e9:.0f} | {achieved / rate[bf16]:.0%} | "
                  f"{versus(med, side, bf16, 'pytorch')} | {versus(med, side, bf16, 'pytorch2')} |")
    return {f"{s} {'bf16' if b else 'fp32'}": v for (s, b), v in got.items()}


def loss(args, env):
    flags = ["--max-steps", str(args.loss_steps)]
    got = {side: run_side(side, args.build, 2, flags, env) for side in ["lockstep"] + list(PYTHONS)}
    print(f"\n### Validation loss after {args.loss_steps} steps, 2 workers, default model, whole validation split\n")
    print("| side | eval loss (nats/byte) | perplexity |")
    print("|---|---|---|")
    for side, r in got.items():
        print(f"| {SIDE_NAMES[side]} | {r['eval_loss']:.4f} | {math.exp(r['eval_loss']):.3f} |")
    a = got["lockstep"]["eval_loss"]
    for side in PYTHONS:
        b = got[side]["eval_loss"]
        print(f"\nlockstep's is {100 * (a - b) / b:+.2f}% of {SIDE_NAMES[side]}'s.")
    return got


def context(args, env):
    batch = max(1, 2048 // args.context)
    flags = ["--max-steps", str(args.steps), "--eval-limit", "8", "--block-size", str(args.context)]
    sides = ["lockstep"] + list(PYTHONS)
    got = {(side, bf16): [] for side in sides for bf16 in (False, True)}
    for _ in range(args.repeat):
        for side, bf16 in got:
            extra = ["--bf16"] if bf16 else []
            if side == "lockstep":
                got[side, bf16].append(run_lockstep(args.build, 2, flags + extra + [
                    "--per-device-train-batch-size", str(batch)], env, batch * args.context))
            else:
                got[side, bf16].append(run_pytorch(args.build, 2, flags + extra + [
                    "--batch", str(batch), "--measure-memory"], env, side))
    print(f"\n### {args.context} bytes of context: 2 workers, default model, {batch} blocks per worker, "
          f"attention dropout 0.1, median of {args.repeat} interleaved runs\n")
    print("| side | precision | tokens/s (range) | tensor growth within a step | peak RSS rank 0 | "
          "vs PyTorch 1.13 | vs PyTorch 2.x |")
    print("|---|---|---|---|---|---|---|")
    med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in got.items()}
    for side in sides:
        for bf16 in (False, True):
            runs = got[side, bf16]
            tps = [r["tokens_per_s"] for r in runs]
            grown = statistics.median(r["step_tensor_bytes"] for r in runs)
            rss = statistics.median(r["peak_rss_bytes"] for r in runs)
            print(f"| {SIDE_NAMES[side]} | {'bf16' if bf16 else 'fp32'} | {med[side, bf16]:.0f} ({min(tps):.0f}-"
                  f"{max(tps):.0f}) | {grown / 2**20:.1f} MiB | {rss / 2**20:.0f} MiB | "
                  f"{versus(med, side, bf16, 'pytorch')} | {versus(med, side, bf16, 'pytorch2')} |")
    return {f"{s} {'bf16' if b else 'fp32'}": v for (s, b), v in got.items()}


def bf16_loss(args, env):
    flags = ["--max-steps", str(args.loss_steps)]
    sides = ["lockstep"] + (["pytorch2"] if "pytorch2" in PYTHONS else [])
    got = {(side, bf16): run_side(side, args.build, 2, flags + (["--bf16"] if bf16 else []), env)
           for side in sides for bf16 in (False, True)}
    print(f"\n### bf16 against fp32: validation loss after {args.loss_steps} steps, 2 workers, default model\n")
    print("| side | fp32 eval loss (nats/byte) | bf16 eval loss | bf16 vs fp32 |")
    print("|---|---|---|---|")
    for side in sides:
        fp32, bf16 = got[side, False]["eval_loss"], got[side, True]["eval_loss"]
        print(f"| {SIDE_NAMES[side]} | {fp32:.4f} | {bf16:.4f} | {100 * (bf16 - fp32) / fp32:+.2f}% |")
    return {f"{side} {'bf16' if bf16 else 'fp32'}": r for (side, bf16), r in got.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--parts", default="throughput,memory,loss")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40, help="steps per throughput/memory run (10 untimed)")
    ap.add_argument("--loss-steps", type=int, default=300)
    ap.add_argument("--models", default="default,4x", help="the throughput part's models")
    ap.add_argument("--context", type=int, default=1024, help="the context part's bytes of context")
    ap.add_argument("--json", help="also write every measurement here")
    ap.add_argument("--torch2-python", default=os.path.expanduser("~/.cache/lockstep/venv-torch-2.15.0/bin/python"),
                    help="a python with torch 2.x for the 2.x rows (none: skip them)")
    args = ap.parse_args()
    args.build = os.path.abspath(args.build)
    if os.path.exists(args.torch2_python):
        PYTHONS["pytorch2"] = args.torch2_python
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env.setdefault("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824")
    detected = compare_ddp.openblas_core(os.path.join(args.build, "bench", "ddp_bench"), env)
    best = compare_ddp.best_openblas_core()
    if detected and compare_ddp.LEVEL.get(detected.lower(), 9) < compare_ddp.LEVEL.get(best.lower(), -1):
        env["OPENBLAS_CORETYPE"] = best
        kernels = f"OpenBLAS kernels {best} on both sides (by itself OpenBLAS picks {detected} here)"
    else:
        kernels = f"OpenBLAS kernels {detected or 'unknown'}, as OpenBLAS picked them"
    print(f"GPT on the fortune corpus, per-worker batch 16 x 128 bytes (the context part: 2048 bytes in blocks of "
          f"--context), 1 intra-op + 1 BLAS thread per worker; "
          f"{cpu_model()}, {os.cpu_count()} cores; lockstep and PyTorch 1.13: BLAS {compare_ddp.blas()}; {kernels}; "
          f"PyTorch 2.x: {compare_ddp.torch_build(PYTHONS.get('pytorch2'))}, AdamW(fused=True); "
          f"GLIBC_TUNABLES={env['GLIBC_TUNABLES']} on every side")
    results = {}
    for part in args.parts.split(","):
        results[part] = {"throughput": throughput, "memory": memory, "precision": precision, "loss": loss,
                         "bf16-loss": bf16_loss, "context": context}[part](args, env)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
