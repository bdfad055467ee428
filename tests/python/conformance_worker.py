"""One rank of the conformance test (test_conformance.py starts world-size many).

Every collective torch.distributed offers, over every dtype and reduce operator the lockstep
backend takes, in contiguous and strided layouts and sizes on both sides of the shm backend's
one-shot limit and slot size, run on the lockstep group (the default group, created from the
string "lockstep" alone) and checked twice:
  - against gloo: the same call on a gloo group of the same ranks, where gloo has that call and
    dtype (torch 1.13's gloo has no AVG, no reduce_scatter, no all_gather_into_tensor, no
    bfloat16 or bool reductions), with contiguous tensors (its results on strided ones are wrong:
    it reads numel() elements from data_ptr() as if the tensor were contiguous);
  - against the exact answer, which every rank can compute: inputs are a function of (rank,
    case), small integers whose sums are exact in every dtype.
Prints one JSON line {"rank", "checks", "gloo_checks", "failures"} and exits 1 on any failure.
"""
import datetime
import json
import sys
import time
import traceback
import zlib

import torch
import torch.distributed as dist

import lockstep_torch

NATIVE = {"f32": torch.float32, "f64": torch.float64, "f16": torch.float16, "bf16": torch.bfloat16,
          "i32": torch.int32, "i64": torch.int64}
EXTRA = {"u8": torch.uint8, "i8": torch.int8, "i16": torch.int16, "bool": torch.bool, "c64": torch.complex64}
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
       "product": dist.ReduceOp.PRODUCT, "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR,
       "bxor": dist.ReduceOp.BXOR}
BITWISE = ("band", "bor", "bxor")
# 1, odd, below the shm one-shot limit (64 KiB), above it, and above one shm slot (1 MiB) in f32.
SIZES = [1, 7, 1000, 70001]
LARGE = 400_003


class Checker:
    def __init__(self, rank, world, gloo):
        self.rank, self.world, self.gloo = rank, world, gloo
        self.checks = self.gloo_checks = 0
        self.failures = []

    def expect(self, case, got, want, exact=True, rtol=None, atol=0.0):
        self.checks += 1
        try:
            if exact:
                ok = got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=tolerance(got.dtype) if rtol is None else rtol, atol=atol)
                ok = True
        except AssertionError:
            ok = False
        if not ok:
            diff = ""
            if got.shape == want.shape and got.numel():
                bad = (got != want).nonzero()
                diff = f" first difference at {bad[0].tolist()}: got {got[tuple(bad[0])].item()}, " \
                       f"want {want[tuple(bad[0])].item()}" if len(bad) else ""
            self.failures.append(f"{case}: {got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}{diff}")

    def against_gloo(self, case, got, run_on_gloo):
        """Runs the same call on the gloo group; a call gloo does not have is skipped, not failed."""
        try:
            want = run_on_gloo()
        except RuntimeError as e:
            if "does not support" in str(e) or "Cannot use" in str(e) or "Unhandled" in str(e) \
                    or "not supported" in str(e) or "Invalid scalar type" in str(e) \
                    or "no support for" in str(e):
                return
            raise
        self.gloo_checks += 1
        self.expect(case + " vs gloo", got, want, exact=True)

    def guard(self, case, fn):
        try:
            fn()
        except Exception:
            self.failures.append(f"{case}: raised\n{traceback.format_exc()}")


def tolerance(dtype):
    """One unit in the last place: AVG divides in f32 and rounds once to half types, where the
    reference divides in f64 and rounds once; only half types can end up one ulp apart."""
    return {torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}.get(dtype, 0.0)


def values(rank, case, n, dtype):
    """Rank `rank`'s input of `case`: small integers, exact in every dtype, different per rank."""
    g = torch.Generator().manual_seed(zlib.crc32(case.encode()) * 131 + rank)
    if dtype is torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype is torch.uint8:
        return torch.randint(0, 60, (n,), generator=g).to(dtype)
    if dtype.is_complex:
        re, im = torch.randint(-4, 9, (2, n), generator=g).float()
        return torch.complex(re, im).to(dtype)
    return torch.randint(-4, 9, (n,), generator=g).to(dtype)


def laid_out(t, layout):
    """The same values in a strided (non-contiguous) tensor, or as they are."""
    if layout == "contiguous":
        return t.clone()
    holder = torch.zeros((t.numel(), 2), dtype=t.dtype)
    holder[:, 1] = t
    return holder[:, 1]


def integer_reduced(op, inputs, dtype):
    """PRODUCT and the bitwise operators on integer and bool tensors, in int64: exact, and an
    integer product wraps to `dtype` as torch's does."""
    wide = torch.stack([x.to(torch.int64) for x in inputs])
    out = wide[0].clone()
    for x in wide[1:]:
        out = {"product": out * x, "band": out & x, "bor": out | x, "bxor": out ^ x}[op]
    return out != 0 if dtype is torch.bool else out.to(dtype)


def reduced(op, inputs, dtype):
    """The exact reduction of every rank's input, in `dtype` (integer AVG truncates toward zero)."""
    if op in BITWISE or (op == "product" and not (dtype.is_floating_point or dtype.is_complex)):
        return integer_reduced(op, inputs, dtype)
    if op == "product":
        return torch.stack([x.to(torch.float64) for x in inputs]).prod(0).to(dtype)
    wide = torch.stack([x.to(torch.complex128 if dtype.is_complex else torch.float64) for x in inputs])
    if op == "sum":
        out = wide.sum(0)
    elif op == "min":
        out = wide.min(0).values
    elif op == "max":
        out = wide.max(0).values
    else:
        out = wide.sum(0) / len(inputs)
        if not (dtype.is_floating_point or dtype.is_complex):
            out = torch.trunc(out)
    if dtype is torch.bool:
        return out != 0
    return out.to(dtype)


def check_all_reduce(c):
    for dname, dtype in {**NATIVE, **EXTRA}.items():
        ops = ["sum", "avg"] if dtype.is_complex else ["sum", "avg", "min", "max", "product"]
        if not (dtype.is_floating_point or dtype.is_complex):
            ops += list(BITWISE)
        for op in ops:
            for n in SIZES:
                for layout in ("contiguous", "strided"):
                    case = f"all_reduce {dname} {op} n={n} {layout}"
                    inputs = [values(r, case, n, dtype) for r in range(c.world)]

                    def run(case=case, inputs=inputs, op=op, layout=layout, dtype=dtype):
                        t = laid_out(inputs[c.rank], layout)
                        dist.all_reduce(t, op=OPS[op])
                        # A 16-bit product is rounded at each of the W - 1 multiplications on gloo
                        # (shm rounds once): up to W ulp from the exact product rounded once.
                        half_product = op == "product" and dtype in (torch.float16, torch.bfloat16)
                        c.expect(case, t.contiguous(), reduced(op, inputs, dtype), exact=op != "avg" and not half_product,
                                 rtol=tolerance(dtype) * c.world if half_product else None)
                        if op != "avg" and not half_product:
                            def on_gloo():  # contiguous: torch 1.13's gloo misreads strided tensors
                                g = inputs[c.rank].clone()
                                dist.all_reduce(g, op=OPS[op], group=c.gloo)
                                return g
                            c.against_gloo(case, t.contiguous(), on_gloo)
                    c.guard(case, run)
    for op in ("sum", "avg"):  # several shm rounds
        case = f"all_reduce f32 {op} n={LARGE}"
        inputs = [values(r, case, LARGE, torch.float32) for r in range(c.world)]
        t = inputs[c.rank].clone()
        c.guard(case, lambda: (dist.all_reduce(t, op=OPS[op]),
                               c.expect(case, t, reduced(op, inputs, torch.float32))))
    # Random floats: equal to gloo bit for bit with two ranks (a + b is commutative); with more,
    # the summation order differs (lockstep: rank order; gloo: around its ring), so each sum of
    # W values may differ by a rounding or two: 1e-6 relative (8 ulp of f32) + 1e-6 absolute
    # (near zero, where cancellation makes relative error large).
    case = "all_reduce f32 sum random"
    t = torch.randn(10001, generator=torch.Generator().manual_seed(c.rank))
    g = t.clone()
    dist.all_reduce(t)
    dist.all_reduce(g, group=c.gloo)
    c.gloo_checks += 1
    c.expect(case + " vs gloo", t, g, exact=c.world <= 2, rtol=1e-6, atol=1e-6)


def check_all_reduce_forms(c):
    case = "all_reduce async future"
    x = values(c.rank, case, 1000, torch.float32)
    want = reduced("sum", [values(r, case, 1000, torch.float32) for r in range(c.world)], torch.float32)
    work = dist.all_reduce(x, async_op=True)
    chained = work.get_future().then(lambda fut: fut.value()[0] * 2)
    work.wait()
    c.expect(case, x, want)
    c.expect(case + " then", chained.wait(), want * 2)
    case = "all_reduce_coalesced"
    shapes = [(3, 5), (1,), (7,)]
    mine = [values(c.rank, case + str(i), int(torch.tensor(s).prod()), torch.float64).view(s)
            for i, s in enumerate(shapes)]
    c.guard(case, lambda: dist.all_reduce_coalesced(mine, op=dist.ReduceOp.MAX))
    for i, s in enumerate(shapes):
        want = reduced("max", [values(r, case + str(i), int(torch.tensor(s).prod()), torch.float64)
                               for r in range(c.world)], torch.float64).view(s)
        c.expect(f"{case} tensor {i}", mine[i], want)
    case = "all_reduce empty"
    e = torch.empty(0)
    dist.all_reduce(e)
    c.expect(case, e, torch.empty(0))


def check_broadcast_and_reduce(c):
    for root in range(c.world):
        for dname, dtype in {**NATIVE, **EXTRA}.items():
            for n in (1, 7, 1001):
                for layout in ("contiguous", "strided"):
                    case = f"broadcast {dname} root={root} n={n} {layout}"
                    src = values(root, case, n, dtype)
                    mine = values(c.rank, case, n, dtype)

                    def run(case=case, src=src, mine=mine, layout=layout, root=root):
                        t = laid_out(mine, layout)
                        dist.broadcast(t, src=root)
                        c.expect(case, t.contiguous(), src)
                        def on_gloo():  # contiguous: torch 1.13's gloo misreads strided tensors
                            g = mine.clone()
                            dist.broadcast(g, src=root, group=c.gloo)
                            return g
                        c.against_gloo(case, t.contiguous(), on_gloo)
                    c.guard(case, run)
        for dname, dtype in NATIVE.items():
            for op in ("sum", "max", "avg"):
                case = f"reduce {dname} {op} root={root}"
                inputs = [values(r, case, 1001, dtype) for r in range(c.world)]
                t = inputs[c.rank].clone()
                c.guard(case, lambda: dist.reduce(t, dst=root, op=OPS[op]))
                if c.rank == root:
                    c.expect(case, t, reduced(op, inputs, dtype), exact=op != "avg")
                else:  # lockstep leaves the other ranks' tensors as they were
                    c.expect(case + " (non-root unchanged)", t, inputs[c.rank])
    case = "broadcast empty"
    e = torch.empty(0, dtype=torch.int64)
    dist.broadcast(e, src=0)
    c.expect(case, e, torch.empty(0, dtype=torch.int64))


def check_gathers(c):
    W = c.world
    for dname, dtype in {**NATIVE, **EXTRA}.items():
        for n in (1, 7, 1001):
            case = f"all_gather {dname} n={n}"
            inputs = [values(r, case, n, dtype) for r in range(W)]

            def run_list(case=case, inputs=inputs, dtype=dtype, n=n):
                outs = [laid_out(torch.zeros(n, dtype=dtype), "strided" if r % 2 else "contiguous")
                        for r in range(W)]
                dist.all_gather(outs, laid_out(inputs[c.rank], "strided"))
                for r in range(W):
                    c.expect(f"{case} block {r}", outs[r].contiguous(), inputs[r])
                def on_gloo():
                    g = [torch.zeros(n, dtype=dtype) for _ in range(W)]
                    dist.all_gather(g, inputs[c.rank].clone(), group=c.gloo)
                    return torch.cat(g)
                c.against_gloo(case, torch.cat([o.contiguous() for o in outs]), on_gloo)
            c.guard(case, run_list)

            case = f"all_gather_into_tensor {dname} n={n}"
            inputs = [values(r, case, n, dtype) for r in range(W)]
            want = torch.cat(inputs)

            def run_tensor(case=case, inputs=inputs, want=want, dtype=dtype, n=n):
                out = torch.zeros(W * n, dtype=dtype)
                dist.all_gather_into_tensor(out, inputs[c.rank].clone())
                c.expect(case, out, want)
                strided = laid_out(torch.zeros(W * n, dtype=dtype), "strided")
                dist.all_gather_into_tensor(strided, inputs[c.rank].clone())
                c.expect(case + " strided output", strided.contiguous(), want)
                inplace = torch.zeros(W * n, dtype=dtype)
                inplace[c.rank * n:(c.rank + 1) * n] = inputs[c.rank]
                dist.all_gather_into_tensor(inplace, inplace[c.rank * n:(c.rank + 1) * n])
                c.expect(case + " in place", inplace, want)
                def on_gloo():
                    g = torch.zeros(W * n, dtype=dtype)
                    dist.all_gather_into_tensor(g, inputs[c.rank].clone(), group=c.gloo)
                    return g
                c.against_gloo(case, out, on_gloo)
            c.guard(case, run_tensor)

        for root in range(W):
            case = f"gather {dname} root={root}"
            inputs = [values(r, case, 33, dtype) for r in range(W)]

            def run_gather(case=case, inputs=inputs, dtype=dtype, root=root):
                outs = [torch.zeros(33, dtype=dtype) for _ in range(W)] if c.rank == root else None
                dist.gather(inputs[c.rank].clone(), gather_list=outs, dst=root)
                if c.rank == root:
                    c.expect(case, torch.cat(outs), torch.cat(inputs))
            c.guard(case, run_gather)

            case = f"scatter {dname} root={root}"
            blocks = [values(root, case + str(r), 33, dtype) for r in range(W)]

            def run_scatter(case=case, blocks=blocks, dtype=dtype, root=root):
                out = laid_out(torch.zeros(33, dtype=dtype), "strided")
                dist.scatter(out, scatter_list=[b.clone() for b in blocks] if c.rank == root else None, src=root)
                c.expect(case, out.contiguous(), blocks[c.rank])
                def on_gloo():
                    g = torch.zeros(33, dtype=dtype)
                    dist.scatter(g, scatter_list=[b.clone() for b in blocks] if c.rank == root else None, src=root,
                                 group=c.gloo)
                    return g
                c.against_gloo(case, out.contiguous(), on_gloo)
            c.guard(case, run_scatter)


def check_reduce_scatter(c):
    W = c.world
    for dname, dtype in {**NATIVE, "u8": torch.uint8, "c64": torch.complex64}.items():
        ops = ["sum", "avg"] if dtype.is_complex else ["sum", "avg", "min", "max"]
        for op in ops:
            for n in (1, 7, 1000, 70001):
                case = f"reduce_scatter_tensor {dname} {op} n={n}"
                inputs = [values(r, case, W * n, dtype) for r in range(W)]
                want = reduced(op, inputs, dtype)[c.rank * n:(c.rank + 1) * n]

                def run_tensor(case=case, inputs=inputs, want=want, op=op, dtype=dtype, n=n):
                    out = torch.zeros(n, dtype=dtype)
                    dist.reduce_scatter_tensor(out, inputs[c.rank].clone(), op=OPS[op])
                    c.expect(case, out, want, exact=op != "avg")
                    strided = laid_out(torch.zeros(n, dtype=dtype), "strided")
                    dist.reduce_scatter_tensor(strided, laid_out(inputs[c.rank], "strided"), op=OPS[op])
                    c.expect(case + " strided", strided.contiguous(), want, exact=op != "avg")
                c.guard(case, run_tensor)

                case = f"reduce_scatter {dname} {op} n={n}"
                inputs = [values(r, case, W * n, dtype) for r in range(W)]
                want = reduced(op, inputs, dtype)[c.rank * n:(c.rank + 1) * n]

                def run_list(case=case, inputs=inputs, want=want, op=op, dtype=dtype, n=n):
                    out = torch.zeros(n, dtype=dtype)
                    dist.reduce_scatter(out, list(inputs[c.rank].clone().chunk(W)), op=OPS[op])
                    c.expect(case, out, want, exact=op != "avg")
                c.guard(case, run_list)


def check_all_to_all(c):
    W = c.world
    for dname, dtype in {"f32": torch.float32, "i64": torch.int64, "bf16": torch.bfloat16, "u8": torch.uint8,
                         "bool": torch.bool, "c64": torch.complex64}.items():
        case = f"all_to_all_single {dname} equal"
        # block (s -> d) holds 3 rows of 2 elements
        inputs = [values(r, case, W * 6, dtype).view(W * 3, 2) for r in range(W)]
        want = torch.cat([inputs[s][c.rank * 3:(c.rank + 1) * 3] for s in range(W)])

        def run_equal(case=case, inputs=inputs, want=want, dtype=dtype):
            out = torch.zeros(W * 3, 2, dtype=dtype)
            dist.all_to_all_single(out, inputs[c.rank].clone())
            c.expect(case, out, want)
            def on_gloo():
                g = torch.zeros(W * 3, 2, dtype=dtype)
                dist.all_to_all_single(g, inputs[c.rank].clone(), group=c.gloo)
                return g
            c.against_gloo(case, out, on_gloo)
        c.guard(case, run_equal)

        case = f"all_to_all_single {dname} uneven"
        rows = lambda s, d: (s + 2 * d) % 3 + (1 if s == d else 0)  # rows rank s sends to rank d
        inputs = [values(s, case, sum(rows(s, d) for d in range(W)) * 2, dtype).view(-1, 2) for s in range(W)]

        def block(s, d, inputs=inputs):
            start = sum(rows(s, k) for k in range(d))
            return inputs[s][start:start + rows(s, d)]
        want = torch.cat([block(s, c.rank) for s in range(W)])

        def run_uneven(case=case, inputs=inputs, want=want, dtype=dtype):
            out = torch.zeros(want.shape, dtype=dtype)
            dist.all_to_all_single(out, inputs[c.rank].clone(),
                                   output_split_sizes=[rows(s, c.rank) for s in range(W)],
                                   input_split_sizes=[rows(c.rank, d) for d in range(W)])
            c.expect(case, out, want)
        c.guard(case, run_uneven)

        case = f"all_to_all {dname}"
        blocks = [[values(s, f"{case} {s}->{d}", s + d + 1, dtype) for d in range(W)] for s in range(W)]

        def run_list(case=case, blocks=blocks, dtype=dtype):
            outs = [laid_out(torch.zeros(s + c.rank + 1, dtype=dtype), "strided") for s in range(W)]
            dist.all_to_all(outs, [b.clone() for b in blocks[c.rank]])
            for s in range(W):
                c.expect(f"{case} from {s}", outs[s].contiguous(), blocks[s][c.rank])
        c.guard(case, run_list)


def check_objects_and_barrier(c):
    W = c.world
    gathered = [None] * W
    dist.all_gather_object(gathered, {"rank": c.rank, "text": "x" * (c.rank * 7 + 1)})
    c.checks += 1
    if gathered != [{"rank": r, "text": "x" * (r * 7 + 1)} for r in range(W)]:
        c.failures.append(f"all_gather_object: {gathered}")
    objects = [("from root", list(range(5)))] if c.rank == 0 else [None]
    dist.broadcast_object_list(objects, src=0)
    c.checks += 1
    if objects != [("from root", list(range(5)))]:
        c.failures.append(f"broadcast_object_list: {objects}")
    out = [None]
    dist.scatter_object_list(out, [f"for {r}" for r in range(W)] if c.rank == 0 else None, src=0)
    c.checks += 1
    if out != [f"for {c.rank}"]:
        c.failures.append(f"scatter_object_list: {out}")
    for _ in range(3):
        dist.barrier()
    work = dist.barrier(async_op=True)
    work.get_future().wait()
    c.checks += 1


def check_errors(c):
    t = torch.ones(4)
    for name in ("BAND", "BOR", "BXOR"):  # bitwise on a float tensor
        c.checks += 1
        try:
            dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
            c.failures.append(f"all_reduce {name} on float32 did not raise")
        except RuntimeError as e:
            if name not in str(e) or "lockstep" not in str(e):
                c.failures.append(f"all_reduce {name}: the error does not name the operator: {e}")


def ring_exchange(c, dtype, case, group=None, layout="strided"):
    """Each rank sends two tensors to the next with tags 1 and 2 (isend); the next posts the
    recv of tag 2 first, into a strided tensor (gloo takes contiguous ones only). Returns what
    arrived (tag 1, tag 2)."""
    W = c.world
    nxt, prv = (c.rank + 1) % W, (c.rank - 1) % W
    got1, got2 = torch.zeros(1001, dtype=dtype), laid_out(torch.zeros(33, dtype=dtype), layout)
    sends = [dist.isend(values(c.rank, case + " 1", 1001, dtype), nxt, group=group, tag=1),
             dist.isend(values(c.rank, case + " 2", 33, dtype), nxt, group=group, tag=2)]
    recvs = [dist.irecv(got2, prv, group=group, tag=2), dist.irecv(got1, prv, group=group, tag=1)]
    for w in sends + recvs:
        w.wait()
    return got1, got2.contiguous()


def check_point_to_point(c):
    """isend/irecv with tags on every dtype (checked against the sender's values, and against
    gloo's results where gloo takes the dtype), blocking send/recv, and recv from any source,
    which returns the sender."""
    W = c.world
    if W < 2:
        return
    prv = (c.rank - 1) % W
    for dname, dtype in {**NATIVE, **EXTRA}.items():
        case = f"send/recv {dname}"
        got1, got2 = ring_exchange(c, dtype, case)
        c.expect(case + " tag 1", got1, values(prv, case + " 1", 1001, dtype))
        c.expect(case + " tag 2", got2, values(prv, case + " 2", 33, dtype))
        c.against_gloo(case + " tag 1", got1, lambda: ring_exchange(c, dtype, case, c.gloo, "contiguous")[0])
    case = "recv from any source"
    if c.rank == 0:
        sources = []
        for _ in range(W - 1):
            t = torch.zeros(5, dtype=torch.int64)
            src = dist.recv(t)
            sources.append(src)
            c.expect(f"{case} {src}", t, torch.full((5,), src, dtype=torch.int64))
        c.checks += 1
        if sorted(sources) != list(range(1, W)):
            c.failures.append(f"{case}: the sources were {sources}")
    else:
        dist.send(torch.full((5,), c.rank, dtype=torch.int64), 0)
    case = "irecv completion"  # seen by polling is_completed(), and through a Future
    if c.rank == 0:
        a, b = torch.zeros(4), torch.zeros(4)
        polled, by_future = dist.irecv(a, 1, tag=8), dist.irecv(b, 1, tag=9)
        future = by_future.get_future()
        deadline = time.monotonic() + 60
        while not polled.is_completed() and time.monotonic() < deadline:
            pass
        c.expect(case + " polled", a, torch.full((4,), 8.0))
        future.wait()
        c.expect(case + " future", b, torch.full((4,), 9.0))
    elif c.rank == 1:
        dist.send(torch.full((4,), 8.0), 0, tag=8)
        dist.send(torch.full((4,), 9.0), 0, tag=9)
    c.checks += 1
    try:
        dist.send(torch.ones(3), dst=W)
        c.failures.append(f"send to rank {W} of a {W}-rank group did not raise")
    except (RuntimeError, ValueError) as e:
        if str(W) not in str(e):
            c.failures.append(f"send to rank {W}: the error does not name it: {e}")


def check_subgroup(c):
    """A group of every rank but rank 0, on lockstep too (new_group takes the default backend):
    each collective and a send/recv on it. Group ranks differ from global ones here (global rank
    r is group rank r - 1), and torch's calls take global ranks: the translation is tested too."""
    if c.world < 3:
        return
    members = list(range(1, c.world))
    sub = dist.new_group(members)
    if c.rank not in members:
        return
    n, k = 1001, len(members)
    c.checks += 1
    if dist.get_backend(sub) != "lockstep":
        c.failures.append(f"subgroup backend is {dist.get_backend(sub)}")
    case = "subgroup all_reduce"
    t = values(c.rank, case, n, torch.float32)
    dist.all_reduce(t, group=sub)
    c.expect(case, t, reduced("sum", [values(r, case, n, torch.float32) for r in members], torch.float32))
    case = "subgroup broadcast"
    root = members[-1]
    t = values(c.rank, case, n, torch.int64)
    dist.broadcast(t, src=root, group=sub)
    c.expect(case, t, values(root, case, n, torch.int64))
    case = "subgroup all_gather"
    outs = [torch.zeros(n, dtype=torch.float64) for _ in members]
    dist.all_gather(outs, values(c.rank, case, n, torch.float64), group=sub)
    for r, o in zip(members, outs):
        c.expect(f"{case} from {r}", o, values(r, case, n, torch.float64))
    case = "subgroup reduce_scatter"
    out = torch.zeros(n, dtype=torch.int32)
    dist.reduce_scatter(out, [values(c.rank, f"{case} {j}", n, torch.int32) for j in range(k)], group=sub)
    me = members.index(c.rank)
    c.expect(case, out, reduced("sum", [values(r, f"{case} {me}", n, torch.int32) for r in members], torch.int32))
    case = "subgroup all_to_all"
    got = torch.zeros(k * 3, dtype=torch.float32)
    dist.all_to_all_single(got, values(c.rank, case, k * 3, torch.float32), group=sub)
    want = torch.cat([values(r, case, k * 3, torch.float32)[me * 3:(me + 1) * 3] for r in members])
    c.expect(case, got, want)
    dist.barrier(group=sub)
    case = "subgroup send/recv"
    first, last = members[0], members[-1]
    t = torch.full((3,), float(c.rank))
    if c.rank == first:
        dist.send(t, last, group=sub, tag=4)
    elif c.rank == last:
        dist.recv(t, first, group=sub, tag=4)
        c.expect(case, t, torch.full((3,), float(first)))


def check_profiler(c):
    """Each collective shows in torch.profiler under its own name, as gloo's do ("gloo:all_reduce")."""
    t = torch.ones(1000)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dist.all_reduce(t)
        dist.broadcast(t, src=0)
        dist.all_gather([torch.empty(1000) for _ in range(c.world)], t)
    names = {e.name for e in prof.events()}
    for wanted in ("lockstep:all_reduce", "lockstep:broadcast", "lockstep:all_gather"):
        c.checks += 1
        if wanted not in names:
            c.failures.append(f"profiler: no '{wanted}' event among {sorted(n for n in names if ':' in n)}")


def check_monitored_barrier(c):
    """Passes when every rank comes; when the last rank stays away, every other rank raises
    naming it (last of the checks: the absent rank's count of monitored barriers falls behind)."""
    for wait_all in (False, True):
        c.checks += 1
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=60), wait_all_ranks=wait_all)
    if c.world < 2:
        return
    if c.rank == c.world - 1:
        return  # stays away
    c.checks += 1
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=1), wait_all_ranks=True)
        c.failures.append("monitored_barrier without the last rank did not raise")
    except RuntimeError as e:
        if f"Rank {c.world - 1} failed to pass monitoredBarrier in 1000 ms" not in str(e):
            c.failures.append(f"monitored_barrier: the error does not name rank {c.world - 1}: {e}")


def main():
    dist.init_process_group("lockstep")  # nothing imported for it: the build tree's hook registers it
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    c = Checker(rank, world, gloo)
    for check in (check_all_reduce, check_all_reduce_forms, check_broadcast_and_reduce, check_gathers,
                  check_reduce_scatter, check_all_to_all, check_objects_and_barrier, check_point_to_point, check_errors, check_subgroup, check_profiler, check_monitored_barrier):
        c.guard(check.__name__, lambda: check(c))
    backend = lockstep_torch.group_backend().comm_backend
    print(json.dumps({"rank": rank, "world": world, "comm_backend": backend, "checks": c.checks,
                      "gloo_checks": c.gloo_checks, "failures": c.failures[:30],
                      "failure_count": len(c.failures)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(1 if c.failures else 0)


if __name__ == "__main__":
    main()
