"""A task that reports where it runs (a plain script, as a user writes one): its hostname, its network
interfaces, its network namespace and its address from STRATAGEM_CONFIG, which it binds; then it sleeps
for argv[1] seconds (default 0), except task argv[2] (e.g. worker:1), which exits 3 once every other
task has reported (it listens on its address after printing, so a connection means it printed: a test
that counts the reports never races the failure). For tests/test_hosts.py."""

import json
import os
import socket
import sys
import time

config = json.loads(os.environ["STRATAGEM_CONFIG"])
me = config["cluster"][config["task"]["type"]][config["task"]["index"]]
ip, port = me.rsplit(":", 1)
listener = socket.socket()
listener.bind((ip, int(port)))  # the task's own address exists where it runs
print(json.dumps({"hostname": socket.gethostname(), "interfaces": sorted(n for _, n in socket.if_nameindex()),
                  "netns": os.stat("/proc/self/ns/net").st_ino, "address": me, "pid": os.getpid()}), flush=True)
listener.listen(16)
if len(sys.argv) > 2 and sys.argv[2] == f"{config['task']['type']}:{config['task']['index']}":
    others = [a for tasks in config["cluster"].values() for a in tasks if a != me]
    deadline = time.monotonic() + 30
    for address in others:
        host, _, port = address.rpartition(":")
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
    sys.exit(3)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0)
