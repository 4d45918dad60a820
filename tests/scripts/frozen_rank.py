"""One rank of an all-reduce loop that a test freezes a peer of (tests/test_zmq_hostile_peers.py).

    frozen_rank.py --peer-timeout S        (cluster and task from STRATAGEM_CONFIG)

Like a user script: it opens a communicator over zmq, prints ``{"up": true}`` after its first
all-reduce and all-reduces in a loop. When a call fails it prints ``{"at": time.monotonic(),
"error", "task", "message"}`` and lets the error end the script. The test SIGSTOPs one rank
meanwhile, so every other rank must fail naming it.
"""

import argparse
import faulthandler
import json
import logging
import signal
import time

import numpy as np

import stratagem


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


faulthandler.register(signal.SIGUSR1)  # a test can ask a stuck rank where it is
logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)d %(name)s %(message)s")
parser = argparse.ArgumentParser()
parser.add_argument("--peer-timeout", type=float, required=True)
args = parser.parse_args()

comm = stratagem.communicator(transport="zmq", timeout=60.0, transport_options={"peer_timeout": args.peer_timeout})
x = np.ones(1024, np.float32)
comm.allreduce(x)
say(up=True)
try:
    while True:
        comm.allreduce(x)
        time.sleep(0.005)  # keeps four ranks on two cores affordable
except Exception as exc:
    say(at=time.monotonic(), error=type(exc).__name__, task=str(getattr(exc, "task", None)), message=str(exc))
    raise
