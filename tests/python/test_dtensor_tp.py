#!/usr/bin/python3
"""PyTorch's own tensor parallelism (DTensor's parallelize_module with ColwiseParallel,
RowwiseParallel and SequenceParallel; torch 2.x only) trains on the lockstep backend as on gloo,
two workers under `lockstep run`: the loss falls and the final parameters and every loss equal
gloo's bit for bit. They can: each all-reduce and reduce-scatter sums two ranks' values (a sum of
two floats is the same in any order), and the all-gathers only move bytes.
"""
import os
import unittest

import torch

import harness

SCRIPT = os.path.join(harness.HERE, "dtensor_tp_train.py")
TORCH_2 = int(torch.__version__.split(".")[0]) >= 2


@unittest.skipUnless(TORCH_2, f"DTensor's tensor parallelism needs torch 2.x (this is {torch.__version__})")
class DTensorTensorParallel(harness.TestCase):
    def train(self, backend):
        return self.train_two_workers(SCRIPT, backend, "dtensor_tp_")

    def test_equals_gloo_bit_for_bit(self):
        reference = self.train("gloo")
        run = self.train("lockstep")
        self.assertEqual(run["backend"], "lockstep")
        self.assertEqual(run["losses"], reference["losses"])
        for k, v in reference["state"].items():
            self.assertTrue(torch.equal(run["state"][k], v),
                            f"{k} differs by {(run['state'][k] - v).abs().max().item():.3g}")


if __name__ == "__main__":
    unittest.main(verbosity=2)
