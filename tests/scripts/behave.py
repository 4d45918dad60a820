"""A task whose behaviour the test chooses per task: ``behave.py TASK=ACTION[,ACTION...] ...``.

TASK is ``worker:1`` or ``*`` (every task not named). Actions run in order:

- ``ignore-term``  ignore SIGTERM (so the launcher must SIGKILL this task)
- ``grandchild``   start a child of its own that sleeps forever; print ``grandchild <pid>``
- ``sleep:S``      sleep S seconds
- ``exit:N``       exit with code N
- ``kill:SIG``     kill itself with signal SIG (e.g. ``kill:SIGKILL``)
- ``forever``      sleep until killed
- ``mark:DIR``     create the file DIR/TASK (the others' ``await`` sees it)
- ``await:N:DIR``  wait until N files are in DIR (so a task fails only once the others run); exit 99
                   after 60 s

The task always starts by printing ``pid <pid>`` and, before blocking forever, ``ready``; with no
ending action it exits 0.
"""

import json
import os
import signal
import subprocess
import sys
import time

task = json.loads(os.environ["STRATAGEM_CONFIG"])["task"]
name = f"{task['type']}:{task['index']}"
plans = dict(arg.split("=", 1) for arg in sys.argv[1:])
actions = plans.get(name, plans.get("*", "")).split(",")
print(f"pid {os.getpid()}")
for action in filter(None, actions):
    verb, _, value = action.partition(":")
    if verb == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif verb == "grandchild":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
        print(f"grandchild {child.pid}")
    elif verb == "sleep":
        time.sleep(float(value))
    elif verb == "exit":
        sys.exit(int(value))
    elif verb == "kill":
        os.kill(os.getpid(), signal.Signals[value])
    elif verb == "mark":
        open(os.path.join(value, name), "w").close()
    elif verb == "await":
        count, _, folder = value.partition(":")
        deadline = time.monotonic() + 60
        while len(os.listdir(folder)) < int(count):
            if time.monotonic() > deadline:
                sys.exit(99)
            time.sleep(0.01)
    elif verb == "forever":
        print("ready")
        while True:
            time.sleep(1000)
    else:
        sys.exit(f"behave.py: unknown action {action!r}")
