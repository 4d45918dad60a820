"""A task that reports what `stratagem launch` told it, as one JSON line, and checks its port is free.

It prints a hash of the secret rather than the secret itself, so test logs never hold one. It also
writes a line to stderr and ends stdout with an unterminated line, which the launcher must flush.
"""

import hashlib
import json
import os
import socket
import sys

config = json.loads(os.environ["STRATAGEM_CONFIG"])
task = config["task"]
address = config["cluster"][task["type"]][task["index"]]
host, _, port = address.rpartition(":")
with socket.socket() as sock:
    sock.bind((host, int(port)))  # fails if the launcher gave this task a port someone holds
    sock.listen()
    secret = os.environ.get("STRATAGEM_SECRET", "")
    print(json.dumps({
        "config": config,
        "secret_sha256": hashlib.sha256(secret.encode()).hexdigest() if secret else None,
        "secret_length": len(secret),
        "transport": os.environ.get("STRATAGEM_TRANSPORT"),
        "unbuffered": os.environ.get("PYTHONUNBUFFERED"),
    }))
    print(f"to stderr from {task['type']}:{task['index']}", file=sys.stderr)
    sys.stdout.write("unterminated last line")
