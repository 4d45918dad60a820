"""User models for tests/test_advise_cli.py, loaded with ``stratagem advise --model advise_models:build_...``."""

import os

from stratagem.bench.models import MLP


class Small(MLP):
    """The bench's MLP, shrunk so a probe is quick: 32-64-10, 32 rows."""

    name, batch_size = "small-mlp", 32
    sizes = (32, 64, 10)


class BrokenStep(Small):
    """``loss_and_grads`` raises everywhere: advise must refuse the model before starting any job."""

    name = "broken-step"

    def loss_and_grads(self, params, batch):
        raise ValueError("shapes do not match (on purpose)")


class FailsInTask(Small):
    """Works in the parent process, raises inside a launched task: the probe job fails."""

    name = "fails-in-task"

    def loss_and_grads(self, params, batch):
        if os.environ.get("STRATAGEM_CONFIG"):
            raise RuntimeError("boom inside a probe task (on purpose)")
        return super().loss_and_grads(params, batch)


def build_small():
    return Small()


def build_broken_step():
    return BrokenStep()


def build_fails_in_task():
    return FailsInTask()
