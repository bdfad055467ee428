"""One backend's run of PyTorch's distributed suite, for run.py (which sets BACKEND, WORLD_SIZE,
TEMP_DIR): the upstream runner's test class, and a result that keeps each test's outcome.

    suite_child.py JSON_OUT [PATTERN ...]
"""
import json
import sys
import unittest

from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend


class Recorder(unittest.TextTestResult):
    """A TextTestResult that also keeps each test's outcome and the first line of its reason."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes = {}

    @staticmethod
    def _name(test):
        return test.id().rsplit(".", 1)[-1]

    def _note(self, test, outcome, detail=""):
        lines = [line for line in str(detail).strip().splitlines() if line.strip()]
        self.outcomes[self._name(test)] = {"outcome": outcome, "reason": lines[-1][:200] if lines else ""}

    def addSuccess(self, test):
        super().addSuccess(test)
        self._note(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._note(test, "failed", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._note(test, "error", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._note(test, "skipped", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._note(test, "expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._note(test, "passed")


# At module level: the spawned ranks unpickle the test case by importing this file.
class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


def run(json_path, pattern):
    loader = unittest.TestLoader()
    if pattern:
        loader.testNamePatterns = [f"*{p}*" for p in pattern]
    suite = loader.loadTestsFromTestCase(TestDistBackendWithSpawn)
    runner = unittest.TextTestRunner(resultclass=Recorder, verbosity=2, stream=sys.stderr)
    result = runner.run(suite)
    with open(json_path, "w") as f:
        json.dump(result.outcomes, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2:])
