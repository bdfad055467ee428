#!/usr/bin/python3
"""FSDP2's fully_shard trains on the lockstep backend as on gloo (torch 2.x only: torch 1.13 has
no FSDP2), two workers under `lockstep run`: the loss falls and the final parameters equal gloo's
bit for bit. They can: every reduce-scatter sums two ranks' gradients (a sum of two floats is
the same in any order) and divides by two, and the gathers only move bytes. Run as "lockstep"
and as "cpu:lockstep", the device-qualified form torch 2.x's register_backend(devices=["cpu"])
makes valid.
"""
import os
import unittest

import torch

import harness

SCRIPT = os.path.join(harness.HERE, "fsdp2_train.py")
TORCH_2 = int(torch.__version__.split(".")[0]) >= 2


@unittest.skipUnless(TORCH_2, f"FSDP2 needs torch 2.x (this is {torch.__version__})")
class FullyShard(harness.TestCase):
    def train(self, backend):
        return self.train_two_workers(SCRIPT, backend, "fsdp2_")

    def test_equals_gloo_bit_for_bit(self):
        reference = self.train("gloo")
        for backend in ("lockstep", "cpu:lockstep"):
            with self.subTest(backend=backend):
                run = self.train(backend)
                self.assertEqual(run["backend"], backend)
                for k, v in reference["state"].items():
                    self.assertTrue(torch.equal(run["state"][k], v),
                                    f"{k} differs by {(run['state'][k] - v).abs().max().item():.3g}")


if __name__ == "__main__":
    unittest.main(verbosity=2)
