#!/usr/bin/python3
"""PyTorch's own pipelining (torch.distributed.pipelining, torch 2.4 and later) runs on the
lockstep backend: two stages under Schedule1F1B on two workers started by `lockstep run`, whose
point-to-point sends and recvs carry the activations and gradients. The per-micro-batch losses
and both stages' final parameters equal gloo's bit for bit: the backend only moves the bytes.
"""
import os
import unittest

import torch

import harness

SCRIPT = os.path.join(harness.HERE, "pipelining_train.py")
VERSION = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


@unittest.skipUnless(VERSION >= (2, 4), f"torch.distributed.pipelining needs torch 2.4 or later (this is {torch.__version__})")
class Pipelining(harness.TestCase):
    def train(self, backend):
        out = self.tmpdir(prefix="pipelining_")
        prefix = os.path.join(out, "run")
        code, output = harness.run_launcher_for(backend, 2, [harness.PYTHON, SCRIPT, backend, prefix], out, timeout=300)
        self.assertEqual(code, 0, output)
        return [torch.load(f"{prefix}.rank{r}.pt") for r in range(2)]

    def test_one_f_one_b_gives_gloos_losses_and_parameters(self):
        gloo, lockstep = self.train("gloo"), self.train("lockstep")
        losses = torch.stack(lockstep[1]["losses"])
        self.assertEqual(losses.shape, (10, 4))
        self.assertLess(losses[-1].mean().item(), losses[0].mean().item(), f"the loss did not fall: {losses}")
        self.assertTrue(torch.equal(losses, torch.stack(gloo[1]["losses"])), f"{losses} vs {gloo[1]['losses']}")
        for rank in range(2):
            for name, value in gloo[rank]["state"].items():
                self.assertTrue(torch.equal(lockstep[rank]["state"][name], value), f"stage {rank}: {name} differs")


if __name__ == "__main__":
    unittest.main(verbosity=2)
