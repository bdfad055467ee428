#!/usr/bin/python3
"""What ZeRO adds to tensor parallelism: 2 data x 2 tensor ranks (sequence parallel) of the 4x GPT,
without ZeRO and under --zero-stage 2 and 3, in one run on this machine.

Each worker's parameters, gradients and AdamW state as the Trainer records them at start
(train_begin: its shards, then ZeRO's slices of them), its peak RSS, the tokens/s of the last
log window and the loss at the last step (the layouts train the same model: the losses agree to
rounding). One intra-op and one BLAS thread per worker; the sides run one after another, --repeat
times interleaved, and the table gives the medians.

    /usr/bin/python3 bench/compare_tp_zero.py [--build build] [--steps 20] [--repeat 3]
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile

import compare_ddp

MODEL = ["--n-layer", "4", "--n-head", "8", "--n-embd", "512", "--block-size", "128", "--dropout", "0.1",
         "--per-device-train-batch-size", "8", "--tensor-parallel", "2", "--sequence-parallel"]
STAGES = [0, 2, 3]


def run(args, stage, env):
    with tempfile.TemporaryDirectory(prefix="compare-tp-zero-") as out:
        cmd = [os.path.join(args.build, "tools", "lockstep"), "run", "--nproc-per-node", "4",
               os.path.join(args.build, "examples", "gpt"), "--output-dir", out, "--max-steps", str(args.steps),
               "--logging-steps", str(args.steps // 2), "--eval-strategy", "no", "--save-strategy", "no",
               "--train-limit", "4000", "--disable-tqdm", "--zero-stage", str(stage)] + MODEL
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
        if done.returncode != 0:
            raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
        begin, last = None, None
        with open(os.path.join(out, "metrics.jsonl")) as f:
            for line in f:
                j = json.loads(line)
                if j.get("event") == "train_begin":
                    begin = j
                elif j.get("event") == "log":
                    last = j
        return {"parameters": begin["worker_parameter_bytes"], "gradients": begin["worker_gradient_bytes"],
                "optimizer": begin["worker_optimizer_state_bytes"], "peak_rss": last["peak_rss_bytes"],
                "tokens_per_s": last["tokens_per_second"], "loss": last["loss"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    args.build = os.path.abspath(args.build)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    detected = compare_ddp.openblas_core(os.path.join(args.build, "bench", "ddp_bench"), env)
    print(f"The 4x GPT (4 x 512, 8 heads, 128 bytes), 2 data x 2 tensor ranks (sequence parallel), batch 8 per "
          f"data rank, 1 intra-op + 1 BLAS thread per worker; {compare_ddp.cpu_name()}, {os.cpu_count()} cores; "
          f"lockstep: {args.build}, BLAS {compare_ddp.blas()}, OpenBLAS kernels {detected or 'unknown'}")
    got = {stage: [] for stage in STAGES}
    for _ in range(args.repeat):
        for stage in STAGES:
            got[stage].append(run(args, stage, env))
    print(f"\n| --zero-stage | parameters MB | gradients MB | AdamW state MB | state total vs none | peak RSS MB | "
          f"tokens/s (median of {args.repeat}, range) | loss at step {args.steps} |")
    print("|---|---|---|---|---|---|---|---|")
    total = lambda r: r["parameters"] + r["gradients"] + r["optimizer"]
    base = total(got[0][0])
    for stage in STAGES:
        r = got[stage][0]
        tokens = [x["tokens_per_s"] for x in got[stage]]
        rss = statistics.median(x["peak_rss"] for x in got[stage])
        print(f"| {stage or 'none'} | {r['parameters'] / 1e6:.1f} | {r['gradients'] / 1e6:.1f} | "
              f"{r['optimizer'] / 1e6:.1f} | {total(r) / base:.2f}x | {rss / 1e6:.0f} | "
              f"{statistics.median(tokens):.0f} ({min(tokens):.0f}-{max(tokens):.0f}) | {r['loss']:.6f} |")


if __name__ == "__main__":
    main()
