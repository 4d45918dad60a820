"""A task that streams large messages to another over ``shm`` until it is killed
(tests/test_shm_transport.py kills it with SIGKILL in the middle of a message).

Arguments: CLUSTER_JSON TASK TARGET.
"""

import sys

import numpy as np

from stratagem.core.cluster import ClusterSpec, TaskId
from stratagem.core.transport import Message
from stratagem.transports.shm.transport import ShmTransport

cluster, task, target = ClusterSpec.from_json(sys.argv[1]), TaskId.parse(sys.argv[2]), TaskId.parse(sys.argv[3])
transport = ShmTransport(cluster, task, timeout=60, peer_timeout=3)
transport.start()
payload = np.arange(8 << 20, dtype=np.float32)  # 32 MiB: four times the ring
i = 0
while True:
    payload[0] = i
    transport.send(target, "stream", Message({"i": i}, [payload]))
    i += 1
