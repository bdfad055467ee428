#!/usr/bin/python3
"""Which kernels the GPT's step should take on this CPU, each alternative timed in one process,
one thread, on the 4x GPT's shapes (4 layers, 512 wide, 8 heads, 16 sequences of 128 tokens):

  attention   causal attention forward and backward, stepwise (scores, mask, softmax, weighted
              values: what libtorch 1.x and attention dropout need) against the fused kernel
              (scaled_dot_product_attention, PyTorch 2.x), in float32 and bfloat16
  adamw       one AdamW step over the model's 12.8 M float32 parameters: the per-parameter loop
              (libtorch's C++ AdamW, torch.optim.AdamW's default on the CPU), foreach, and the
              fused kernel (PyTorch 2.4 and later)

lockstep's GPT and Trainer follow what this finds (models/gpt.h, train/foreach_adamw.h); the
choices are written where they are made. Run it with the interpreter of the libtorch the build
uses (PyTorch 2.x's wheel for build-torch2):

    ~/.cache/lockstep/venv-torch-2.15.0/bin/python bench/gpt_kernels.py [--repeat 20]
"""
import argparse
import math
import time

import torch
import torch.nn.functional as F

BATCH, HEADS, T, D = 16, 8, 128, 64
WIDTH, LAYERS, VOCAB = 512, 4, 256


def stepwise(q, k, v):
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v


def fused(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def milliseconds(fn, repeat):
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def attention(repeat):
    print("| attention | dtype | forward ms | forward + backward ms |")
    print("|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for name, fn in (("stepwise", stepwise), ("fused", fused)):
            if name == "fused" and not hasattr(F, "scaled_dot_product_attention"):
                continue
            q, k, v = (torch.randn(BATCH, HEADS, T, D, dtype=dtype, requires_grad=True) for _ in range(3))

            def both():
                y = fn(q, k, v)
                y.backward(torch.ones_like(y))

            def forward():
                with torch.no_grad():
                    fn(q, k, v)

            print(f"| {name} | {str(dtype)[6:]} | {milliseconds(forward, repeat):.1f} | "
                  f"{milliseconds(both, repeat):.1f} |")


def gpt_parameter_shapes():
    block = [(3 * WIDTH, WIDTH), (3 * WIDTH,), (WIDTH, WIDTH), (WIDTH,), (4 * WIDTH, WIDTH), (4 * WIDTH,),
             (WIDTH, 4 * WIDTH), (WIDTH,)] + [(WIDTH,)] * 4  # the two LayerNorms
    return [(VOCAB, WIDTH), (T, WIDTH)] + block * LAYERS + [(WIDTH,), (WIDTH,)]


def adamw(repeat):
    params = [torch.nn.Parameter(torch.randn(s)) for s in gpt_parameter_shapes()]
    for p in params:
        p.grad = torch.randn_like(p)
    print(f"\n| AdamW over {sum(p.numel() for p in params) / 1e6:.1f} M parameters | ms per step |")
    print("|---|---|")
    for name, kwargs in (("loop", {"foreach": False}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
        try:
            opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **kwargs)
        except (TypeError, RuntimeError) as e:  # fused before 2.4, or not on the CPU
            print(f"| {name} | not in this PyTorch ({e}) |")
            continue
        print(f"| {name} | {milliseconds(opt.step, repeat):.1f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)  # as each of lockstep's workers runs
    print(f"PyTorch {torch.__version__}, one thread\n")
    attention(args.repeat)
    adamw(args.repeat)


if __name__ == "__main__":
    main()
