"""A rank that all-reduces 16 MiB over ``shm`` until it is killed (tests/test_shm_transport.py).

Arguments: CLUSTER_JSON TASK.
"""

import sys

import numpy as np

from stratagem.core.cluster import ClusterSpec, TaskId
from stratagem.collectives.communicator import Communicator
from stratagem.transports.shm.transport import ShmTransport

transport = ShmTransport(ClusterSpec.from_json(sys.argv[1]), TaskId.parse(sys.argv[2]), timeout=60, peer_timeout=3)
transport.start()
comm = Communicator(transport, timeout=60)
x = np.ones(4 << 20, np.float32)
while True:
    comm.allreduce(x)
