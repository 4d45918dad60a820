"""The ``solo`` strategy: runs each step as is and counts them; runs on in-process transports only."""

from stratagem.strategies.base import Strategy


class SoloStrategy(Strategy):
    name = "solo"
    options = {"verbose": False}

    def __init__(self, transport="loopback", **kwargs):
        super().__init__(transport, **kwargs)
        self.steps = 0

    @classmethod
    def supports(cls, transport_class):
        if not transport_class.in_process:
            return "solo keeps every replica in one process; use an in-process transport ('loopback' or 'local')"
        return None

    def _run_impl(self, fn, args, kwargs):      # the extension hook: run() has checked the arguments
        result = super()._run_impl(fn, args, kwargs)
        self.steps += 1
        if self.config["verbose"]:
            print(f"solo: step {self.steps} on {self.task}")
        return result
