#!/usr/bin/env python3
"""A plain pyzmq parameter server, written the way one would by hand: to check ``ps.py``'s ``raw-ps``.

    python benchmarks/plain_pyzmq_ps.py --workers 2 --steps 60

One server process (a ROUTER) holds a 10M-parameter float32 model in 13 frames of at most 4 MB (the
three weight matrices of ``ps.py``'s model cut by rows, and their biases: the frames ``ps.py`` uses
with one ps task). Each of ``--workers`` client processes (a DEALER each) sends every frame's gradient
in one multipart message (zero-copy), and the server, for each frame, writes ``value - lr * grad``
over the received gradient (numpy, 64K-element chunks), keeps it as the frame's values and sends it
back at once (zero-copy). A client keeps a reply frame that is a whole variable and copies a row
slice into its variable's array; then it pushes again. Nothing of stratagem is imported.

Prints the aggregate GB/s (bytes pushed and pulled by every client over the wall time from the first
client's first timed step to the last client's last), as ``ps.py`` computes it.
"""

import argparse
import multiprocessing as mp
import time

import numpy as np
import zmq

MODEL = [((2000, 2500), True), ((2500,), False), ((2500, 1600), True), ((1600,), False),
         ((1600, 625), True), ((625,), False)]            # (shape, a weight matrix)
LIMIT = 4 << 20                                           # bytes per frame at most
CHUNK = 64 * 1024


def frames():
    """(variable index, rows lo, rows hi) of every frame."""
    out = []
    for index, (shape, _) in enumerate(MODEL):
        row_bytes = 4 * int(np.prod(shape[1:]))
        per = max(1, LIMIT // row_bytes)
        count = -(-shape[0] // per)
        bounds = np.linspace(0, shape[0], count + 1).round().astype(int) if count > 1 else [0, shape[0]]
        out += [(index, int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]
    return out


def server(port, messages, lr=np.float32(1e-3)):
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    values = [np.zeros((hi - lo, *MODEL[v][0][1:]), np.float32).reshape(-1) for v, lo, hi in frames()]
    for _ in range(messages):
        ident, *grads = sock.recv_multipart(copy=False)
        for k, frame in enumerate(grads):
            g, old = np.frombuffer(frame.buffer, np.float32), values[k]
            for i in range(0, g.size, CHUNK):
                np.multiply(g[i:i + CHUNK], lr, out=g[i:i + CHUNK])
                np.subtract(old[i:i + CHUNK], g[i:i + CHUNK], out=g[i:i + CHUNK])
            values[k] = g
            sock.send_multipart([ident, g], copy=False)
    time.sleep(0.5)


def client(port, steps, warmup, barrier, times):
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    layout = frames()
    variables = [np.zeros(shape, np.float32) for shape, _ in MODEL]
    grads = [np.full((hi - lo, *MODEL[v][0][1:]), 1e-3, np.float32) for v, lo, hi in layout]

    def step():
        tracker = sock.send_multipart(grads, copy=False, track=True)
        for v, lo, hi in layout:
            value = np.frombuffer(sock.recv(copy=False).buffer, np.float32)
            if hi - lo == MODEL[v][0][0]:
                variables[v] = value.reshape(MODEL[v][0])          # a whole variable: keep it
            else:
                variables[v][lo:hi] = value.reshape(hi - lo, *MODEL[v][0][1:])
        tracker.wait()

    for _ in range(warmup):
        step()
    barrier.wait()
    start = time.time()
    for _ in range(steps):
        step()
    times.put((start, time.time()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--port", type=int, default=0, help="default: a free port")
    args = parser.parse_args()
    port = args.port
    if not port:
        probe = zmq.Context().socket(zmq.ROUTER)
        port = probe.bind_to_random_port("tcp://127.0.0.1")
        probe.close()
    barrier, times = mp.Barrier(args.workers), mp.Queue()
    procs = [mp.Process(target=server, args=(port, args.workers * (args.steps + args.warmup)))]
    procs += [mp.Process(target=client, args=(port, args.steps, args.warmup, barrier, times))
              for _ in range(args.workers)]
    for p in procs:
        p.start()
    spans = [times.get(timeout=600) for _ in range(args.workers)]
    for p in procs:
        p.join(60)
    nbytes = sum(4 * int(np.prod(shape)) for shape, _ in MODEL)
    wall = max(end for _, end in spans) - min(start for start, _ in spans)
    print(f"{args.workers} workers, {args.steps} steps, {len(frames())} frames: "
          f"{2 * nbytes * args.steps * args.workers / wall / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
