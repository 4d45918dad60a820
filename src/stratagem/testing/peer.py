"""A peer task in its own process, for tests that kill it for real (SIGKILL).

Run as ``python -m stratagem.testing.peer --transport zmq --cluster JSON --task worker:1``: it starts
the transport, sends ``{"ready": pid}`` under tag ``ready`` to ``--notify``, echoes every message
received under tag ``echo`` back to its sender, and otherwise waits until killed.

:func:`spawn_peer` starts one and guarantees it is reaped.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from typing import Iterator

from stratagem.core.cluster import ClusterSpec, TaskId
from stratagem.core.errors import TransportClosed, TransportTimeout
from stratagem.core.transport import Message


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", required=True)
    parser.add_argument("--cluster", required=True, help="cluster spec as JSON")
    parser.add_argument("--task", required=True)
    parser.add_argument("--notify", required=True, help="task to send the ready message to")
    parser.add_argument("--peer-timeout", type=float, default=30.0)
    parser.add_argument("--lifetime", type=float, default=120.0, help="exit after this many seconds")
    args = parser.parse_args(argv)
    from stratagem.plugins.manager import plugin_manager

    secret = os.environ.get("STRATAGEM_SECRET")
    transport = plugin_manager().create_transport(
        args.transport, cluster=ClusterSpec.from_json(args.cluster), task=TaskId.parse(args.task),
        secret=secret.encode() if secret else None, peer_timeout=args.peer_timeout)
    transport.start()
    transport.send(TaskId.parse(args.notify), "ready", Message({"pid": os.getpid()}))
    remaining = args.lifetime
    while remaining > 0:
        try:
            msg = transport.recv(None, "echo", timeout=1.0)
        except TransportTimeout:
            remaining -= 1.0
            continue
        except TransportClosed:
            break
        transport.send(msg.src, "echo", msg)
    transport.close()
    return 0


@contextlib.contextmanager
def spawn_peer(transport: str, cluster: ClusterSpec, task: TaskId, notify: TaskId, *,
               secret: bytes | None = None, peer_timeout: float = 30.0) -> Iterator[subprocess.Popen]:
    """Start a peer process for ``task``; it is killed and reaped when the block exits."""
    env = dict(os.environ)
    env.pop("STRATAGEM_SECRET", None)
    if secret:
        env["STRATAGEM_SECRET"] = secret.decode()
    proc = subprocess.Popen(
        [sys.executable, "-m", "stratagem.testing.peer", "--transport", transport,
         "--cluster", cluster.to_json(), "--task", task.short, "--notify", notify.short,
         "--peer-timeout", str(peer_timeout)],
        env=env, start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
