"""User models for tests/test_bench.py, loaded with ``stratagem bench --model bench_models:build_...``."""

import os
import time

from stratagem.bench.models import MLP, Linear


class Failing(Linear):
    """Raises on replica 1 at its third step: the run must be reported as failed, the others go on."""

    name = "failing"

    def batch(self, seed, replica, step, rows):
        if replica == 1 and step == 2:
            raise RuntimeError("boom: a user model failing on purpose")
        return super().batch(seed, replica, step, rows)


class Hanging(Linear):
    """Hangs on replica 1 at its third step: the run must be stopped at --timeout and reported."""

    name = "hanging"

    def batch(self, seed, replica, step, rows):
        if replica == 1 and step == 2:
            with open(os.path.join(os.environ["BENCH_TEST_DIR"], f"hung-{os.getpid()}"), "w"):
                pass
            time.sleep(3600)
        return super().batch(seed, replica, step, rows)


class TinyMLP(MLP):
    """The bench's mlp, small: 16-32-4, 64 rows a step; it has the mlp's test accuracy (chance: 25%)."""

    name, batch_size, learning_rate, target_loss = "tiny-mlp", 64, 0.5, None
    sizes = (16, 32, 4)
    test_rows = 1024


def build_tiny_mlp():
    return TinyMLP()


def build_failing():
    return Failing()


def build_hanging():
    return Hanging()


def build_incomplete():
    return object()
