"""A task for ``stratagem launch --restart-workers`` tests: ``restartable.py DIR FAILING HOW [WAIT]``.

The first process of task FAILING (``worker:2``) ends HOW: ``exit3`` (exit code 3), ``kill``
(SIGKILL itself) or ``always`` (exit 3 in every process). A process started again (STRATAGEM_RESTARTS
set to n) prints ``restarted n`` and creates ``DIR/restarted-n``. With WAIT (a number) the chief waits
(up to 20 s) for ``DIR/restarted-WAIT`` before it ends, so that the launcher restarts while the chief
runs. Every task prints ``task <name> at <address>`` first and ``done`` when it ends normally.
"""

import json
import os
import signal
import sys
import time

out, failing, how = sys.argv[1:4]
wait = sys.argv[4] if len(sys.argv) > 4 else None
config = json.loads(os.environ["STRATAGEM_CONFIG"])
name = f"{config['task']['type']}:{config['task']['index']}"
address = config["cluster"][config["task"]["type"]][config["task"]["index"]]
restarts = os.environ.get("STRATAGEM_RESTARTS")
print(f"task {name} at {address}", flush=True)
if restarts is not None:
    print(f"restarted {restarts}", flush=True)
    open(os.path.join(out, f"restarted-{restarts}"), "w").close()
if name == failing and (restarts is None or how == "always"):
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3)
if wait and name == "worker:0":
    deadline = time.monotonic() + 20
    while not os.path.exists(os.path.join(out, f"restarted-{wait}")) and time.monotonic() < deadline:
        time.sleep(0.05)
print("done", flush=True)
