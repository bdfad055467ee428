#!/usr/bin/python3
"""Where lockstep's GPT step goes on this CPU: `perf record` around one worker of examples/gpt
(through `lockstep run`, so with the launcher's malloc settings), its samples grouped by what
they compute: the products (oneDNN's jitted kernels and the BLAS), each fused kernel, libtorch's
element-wise ops by kind, the optimizer, the casts, the operating system. A markdown table of each
group's share of the worker's samples and its milliseconds per step (the share of the timed
windows' mean step), then the largest symbols outside the products.

    /usr/bin/python3 bench/gpt_profile.py [--build build-torch2] [--bf16] [--steps 60]
        [--model 4x|default] [--top 25]

Needs `perf` (Debian's linux-perf) and the permission to sample (root, or
kernel.perf_event_paranoid <= 1). One thread per worker, as the GPT comparisons run. The first
logged window (warm-up) is left out of the step time; the samples cover the whole run, start-up
included, so use enough steps that the start-up is a small part (it is named in the table).
"""
import argparse
import json
import os
import re
import subprocess
import tempfile

MODELS = {"default": [], "4x": ["--n-embd", "512", "--n-head", "8"]}

# (group, pattern over "dso symbol"), first match wins.
GROUPS = [
    ("products (oneDNN jitted kernels, BLAS)", r"^\[JIT\]|dnnl|gemm|openblas|libblas|mkl_|brgemm"),
    ("fused bias + GELU (models::fast_bias_gelu)", r"bias_gelu"),
    ("fused layer norm (models::fast_layer_norm)", r"layer_norm_(forward|backward)"),
    ("fused softmax + dropout of the attention (models::causal_softmax_dropout)", r"causal_softmax_dropout"),
    ("dropout and dropout + residual (models::fast_dropout*)", r"chunk_draws|DropoutAdd|Dropout|mask_chunk|dropout"),
    ("libtorch layer norm", r"LayerNorm|RowwiseMoments"),
    ("softmax", r"softmax"),
    ("casts and copies", r"copy_kernel|reduced_float_copy|copy_|transpose_contiguous|cast"),
    ("optimizer (AdamW)", r"adam"),
    ("sums (bias gradients, reductions)", r"outer_sum|reduce|sum_kernel"),
    ("other element-wise ops (add, mul, fill, masks)", r"mul_kernel|add_kernel|binary_kernel|fill|masked|where|VectorizedLoop|cpu_kernel|cpu_serial"),
    ("operating system (page faults, memory)", r"^\[kernel"),
    ("malloc and free", r"^libc\.so.*(malloc|free|_int_|unlink_chunk|consolidate)"),
    ("autograd and dispatch", r"autograd|Dispatcher|OperatorEntry|c10::impl|TensorImpl|intrusive_ptr|boxed"),
]


def run_profiled(args, out_dir, data):
    cmd = ["perf", "record", "-F", str(args.frequency), "-o", data, "--",
           os.path.join(args.build, "tools", "lockstep"), "run", "--nproc-per-node", "1",
           os.path.join(args.build, "examples", "gpt"), "--output-dir", out_dir, "--logging-steps", "10",
           "--eval-strategy", "no", "--save-strategy", "no", "--disable-tqdm", "--max-steps", str(args.steps),
           "--eval-limit", "32"] + MODELS[args.model] + (["--bf16"] if args.bf16 else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"gpt_profile: failed ({done.returncode}): {' '.join(cmd)}\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        logs = [e for e in map(json.loads, filter(str.strip, f)) if e.get("event") == "log"][1:]
    if not logs:
        raise SystemExit("gpt_profile: no timed log windows: raise --steps")
    return sum(e["step_seconds"] for e in logs) / len(logs), logs[-1].get("tokens_per_second")


def samples(data):
    """(share %, dso, symbol) of the worker's samples, from perf report."""
    done = subprocess.run(["perf", "report", "-i", data, "--comm", "gpt", "--no-children", "--sort", "dso,symbol",
                           "--stdio", "--percent-limit", "0"], capture_output=True, text=True)
    out = []
    for line in done.stdout.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+(?: tid \d+)?)\s+\[[.k]\]\s+(.*\S)", line)
        if m:  # the symbol is followed by perf's padding and empty columns
            out.append((float(m.group(1)), m.group(2), re.split(r"\s{2,}", m.group(3))[0]))
    if not out:
        raise SystemExit(f"gpt_profile: perf report gave no samples:\n{done.stderr[-2000:]}")
    return out


def group_of(dso, symbol):
    key = f"{dso} {symbol}"
    for name, pattern in GROUPS:
        if re.search(pattern, key, re.IGNORECASE):
            return name
    return "the rest"


def short(symbol, width=100):
    """A long template instance cut to its start, with the kernel names inside it (libtorch's
    element-wise loops are named by the lambda's kernel deep inside the template arguments)."""
    if len(symbol) <= width:
        return symbol
    names = list(dict.fromkeys(re.findall(r"(\w*(?:kernel|softmax|copy|adam|norm)\w*)", symbol[40:])))
    return f"{symbol[:40]}... [{', '.join(names[:3])}]" if names else symbol[:width] + "..."


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build-torch2"))
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--model", choices=MODELS, default="4x")
    ap.add_argument("--frequency", type=int, default=499, help="samples per second")
    ap.add_argument("--top", type=int, default=25, help="the largest symbols outside the products to list")
    args = ap.parse_args()
    args.build = os.path.abspath(args.build)
    with tempfile.TemporaryDirectory(prefix="gpt-profile-") as tmp:
        step_s, tokens_per_s = run_profiled(args, os.path.join(tmp, "out"), os.path.join(tmp, "perf.data"))
        rows = samples(os.path.join(tmp, "perf.data"))
    total = sum(r[0] for r in rows)
    shares = {}
    for share, dso, symbol in rows:
        g = group_of(dso, symbol)
        shares[g] = shares.get(g, 0.0) + share / total
    print(f"GPT {args.model}, one worker, {'bf16 autocast' if args.bf16 else 'fp32'}, {args.steps} steps, "
          f"build {os.path.relpath(args.build)}: {step_s * 1e3:.0f} ms per step in the timed windows "
          f"({tokens_per_s:.0f} tokens/s in the last)\n")
    print("| what | share of samples | ms per step |\n|---|---|---|")
    for g, share in sorted(shares.items(), key=lambda kv: -kv[1]):
        print(f"| {g} | {share:.1%} | {share * step_s * 1e3:.1f} |")
    print(f"\nThe largest {args.top} symbols outside the products:\n")
    print("| share | where | symbol |\n|---|---|---|")
    products = GROUPS[0][0]
    listed = [r for r in rows if group_of(r[1], r[2]) != products][:args.top]
    for share, dso, symbol in listed:
        print(f"| {share / total:.1%} | {dso} | `{short(symbol)}` |")


if __name__ == "__main__":
    main()
