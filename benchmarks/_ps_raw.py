"""The bare pyzmq reference paths of ``ps.py`` (its children): ``raw``, ``raw-duplex`` and ``raw-ps``.

Every process reads one JSON spec: ``server_ports`` (one per server), ``client_ports`` (one per
client, all 0 for a reply over the request's own connection), ``frames`` (per server, the byte sizes
of the pieces it holds, as the PS path places them) and ``whole`` (per frame, whether it is a whole
variable), ``work`` (the ``raw-ps`` variant) with its ``server`` and ``client`` ways (below), ``lr``,
``warmup``, ``iters`` and ``start_at`` (the wall-clock time the clients start their timed steps);
with ``ps.py --hosts``, ``server_addresses`` and ``client_addresses`` (index -> the address of the
emulated host each runs on; loopback otherwise).

- ``raw``/``raw-duplex``: a server answers each request with as many bytes, in one multipart
  message, doing nothing with the data; a client sends every server its frames before waiting for
  any reply.
- ``raw-ps``: the minimal parameter server over the same transport. The server holds a float32 value
  array per frame and, for each gradient frame received, applies SGD (``lr * grad`` then ``value -
  that``, the ufuncs stratagem's SGD runs, in 256 KB chunks) and sends that frame's new values at
  once, as a message of its own (zero-copy), so that the next frame's update overlaps this one's
  transfer. A zero-copy reply must never see its array modified; two ways (``server``):

  - ``spare``: each frame's values are double-buffered: the update writes the new version into the
    array that is not current (through a preallocated scratch chunk), after waiting (``track=True``)
    until no reply still reads it.
  - ``inplace``: the update is written into the received gradient frame itself (ZeroMQ's buffer,
    writable, ours once received), which becomes the frame's values: no second array, no tracker,
    nothing to wait for; the old values are dropped once their reply is sent.

  The client gets each reply frame into its variables (``client``): ``copy`` copies it into a
  preallocated float32 array (``np.copyto``), as a stratagem worker does when something holds the
  variable's array; ``adopt`` keeps a frame that is a whole variable as that variable (no copy), as
  a stratagem worker does when nothing else holds it, and copies a slice of a variable (a frame
  that is not ``whole``) into the variable's array. Keeping every frame would not be the same work:
  a variable sliced into several frames must end up as one array for the user.

  The spec's ``server`` and ``client`` pick the ways (default ``spare`` and ``copy``); ``ps.py``
  runs the ways it is given (``--raw-ps-ways``) and takes the fastest (median) as the baseline.
"""

from __future__ import annotations

import json
import time

import numpy as np

CHUNK = 64 * 1024  # float32 elements per SGD chunk: 256 KB


def _address(spec: dict, role: str, index: int) -> str:
    """Where server or client ``index`` listens: its emulated host's address (``server_addresses``,
    ``client_addresses``: ``ps.py --hosts``), else loopback."""
    return spec.get(f"{role}_addresses", {}).get(str(index), "127.0.0.1")


def _f32(frame) -> np.ndarray:
    return np.frombuffer(frame.buffer, np.float32)


class Shard:
    """A ``raw-ps`` server's values: two float32 arrays per frame and the trackers of their replies."""

    def __init__(self, sizes: list[int], lr: float):
        self.lr = np.float32(lr)
        self.arrays = [[np.zeros(n // 4, np.float32), np.zeros(n // 4, np.float32)] for n in sizes]
        self.current = [0] * len(sizes)
        self.trackers: list[list] = [[None, None] for _ in sizes]
        self.scratch = np.empty(CHUNK, np.float32)

    def update(self, k: int, grad: np.ndarray) -> np.ndarray:
        """SGD on frame ``k`` into its spare array (once no reply reads it); returns the new values."""
        old_index = self.current[k]
        new_index = 1 - old_index
        tracker = self.trackers[k][new_index]
        if tracker is not None and not tracker.done:
            tracker.wait()
        old, new = self.arrays[k][old_index], self.arrays[k][new_index]
        for i in range(0, old.size, CHUNK):
            j = min(i + CHUNK, old.size)
            scratch = self.scratch[: j - i]
            np.multiply(grad[i:j], self.lr, out=scratch)
            np.subtract(old[i:j], scratch, out=new[i:j])
        self.current[k] = new_index
        return new

    def sent(self, k: int, tracker) -> None:
        self.trackers[k][self.current[k]] = tracker


class InPlaceShard:
    """A ``raw-ps`` server's values, ``inplace``: each update is written into the received gradient
    frame, which becomes the values (the previous values array is only read, never written)."""

    def __init__(self, sizes: list[int], lr: float):
        self.lr = np.float32(lr)
        self.values = [np.zeros(n // 4, np.float32) for n in sizes]

    def update(self, k: int, grad: np.ndarray) -> np.ndarray:
        old = self.values[k]
        for i in range(0, old.size, CHUNK):
            g = grad[i:i + CHUNK]
            np.multiply(g, self.lr, out=g)
            np.subtract(old[i:i + CHUNK], g, out=g)
        self.values[k] = grad
        return grad

    def sent(self, k: int, tracker) -> None:
        pass


def server(spec: dict, index: int) -> None:
    import zmq

    sizes = spec["frames"][index]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"tcp://{_address(spec, 'server', index)}:{spec['server_ports'][index]}")
    back = {}
    for client, client_port in enumerate(spec["client_ports"]):
        if client_port:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.IDENTITY, f"s{index}".encode())
            dealer.connect(f"tcp://{_address(spec, 'client', client)}:{client_port}")
            back[f"c{client}".encode()] = dealer
    inplace = spec.get("server", "spare") == "inplace"
    shard = (InPlaceShard if inplace else Shard)(sizes, spec["lr"]) if spec["work"] else None
    reply = [np.ones(n, np.uint8) for n in sizes]
    for _ in range(len(spec["client_ports"]) * (spec["warmup"] + spec["iters"])):
        ident, *payload = sock.recv_multipart(copy=False)
        out = back.get(ident.bytes)
        if shard is None:
            if out is not None:
                out.send_multipart(reply, copy=False)
            else:
                sock.send_multipart([ident, *reply], copy=False)
            continue
        for k, frame in enumerate(payload):
            values = shard.update(k, _f32(frame))
            if out is not None:
                tracker = out.send(values, copy=False, track=not inplace)
            else:
                sock.send(ident, zmq.SNDMORE)
                tracker = sock.send(values, copy=False, track=not inplace)
            shard.sent(k, tracker)
    # Close only once the last replies are out: on a slow link (ps.py --hosts) they are still queued
    # seconds after the last push came in, and linger=0 would drop them.
    time.sleep(0.5)
    ctx.destroy(linger=60_000)


def client(spec: dict, out: str, index: int) -> None:
    import zmq

    ctx = zmq.Context()
    socks = []
    for server, port in enumerate(spec["server_ports"]):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"c{index}".encode())
        sock.connect(f"tcp://{_address(spec, 'server', server)}:{port}")
        socks.append(sock)
    inbox = None
    if spec["client_ports"][index]:
        inbox = ctx.socket(zmq.ROUTER)
        inbox.bind(f"tcp://{_address(spec, 'client', index)}:{spec['client_ports'][index]}")
    work = spec["work"]
    adopt = spec.get("client", "copy") == "adopt"
    dtype = np.float32 if work else np.uint8
    payloads = [[np.full(n // np.dtype(dtype).itemsize, 1e-3 if work else 1, dtype) for n in sizes]
                for sizes in spec["frames"]]
    variables = [[np.zeros(n // 4, np.float32) for n in sizes] for sizes in spec["frames"]] if work else None
    poller = zmq.Poller()
    for sock in ([inbox] if inbox is not None else socks):
        poller.register(sock, zmq.POLLIN)
    server_of = {sock: s for s, sock in enumerate(socks)}

    def receive_values() -> None:
        """Every server's frames, each copied into its variable as it arrives, in arrival order."""
        got = [0] * len(socks)
        left = sum(len(sizes) for sizes in spec["frames"])
        while left:
            for sock, _ in poller.poll():
                while left:
                    try:
                        parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    s = int(parts[0].bytes[1:]) if inbox is not None else server_of[sock]
                    if adopt and spec["whole"][s][got[s]]:
                        variables[s][got[s]] = _f32(parts[-1])
                    else:
                        np.copyto(variables[s][got[s]], _f32(parts[-1]))
                    got[s] += 1
                    left -= 1

    def round_trip() -> None:
        trackers = [sock.send_multipart(payload, copy=False, track=True) for sock, payload in zip(socks, payloads)]
        if work:
            receive_values()
        else:
            for sock in socks:
                (inbox or sock).recv_multipart(copy=False)
        for tracker in trackers:
            tracker.wait()

    for _ in range(spec["warmup"]):
        round_trip()
    time.sleep(max(0.0, spec["start_at"] - time.time()))
    times, start, cpu = [], time.time(), time.process_time()
    for _ in range(spec["iters"]):
        began = time.perf_counter()
        round_trip()
        times.append(time.perf_counter() - began)
    end, cpu = time.time(), time.process_time() - cpu
    with open(out, "w") as f:
        json.dump({"start": start, "end": end, "cpu_s": cpu, "times": times, "shards": len(socks),
                   "bytes_each_way": sum(sum(sizes) for sizes in spec["frames"])}, f)
    ctx.destroy(linger=0)
