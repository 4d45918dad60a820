"""One rank of ``hosts_allreduce.py`` (started by it on an emulated host; not run by hand).

    python3 _hosts_allreduce_worker.py BACKEND NBYTES ITERS

BACKEND: ``stratagem`` (``stratagem.communicator()``, transport from ``STRATAGEM_TRANSPORT``;
``stratagem-out``: the same into one result array kept across calls; ``zmq-ring``: the flat ring over
zmq, ``algorithm="ring"``; ``shm-ring``: the same over ``shm`` with ``remote='zmq'``; ``hierarchical``:
``hierarchical=True`` over ``shm`` with ``remote='zmq'``; ``hierarchical-zmq``: over zmq alone), ``ring``
(the plain TCP ring of ``plain_tcp_ring.py``), ``gloo`` (``torch.distributed``; rank and world from
``STRATAGEM_CONFIG``, rendezvous at rank 0's address), ``mpi4py`` (``MPI.COMM_WORLD.Allreduce``, under
``mpiexec``) or ``pyzmq`` (the plain pyzmq ring of ``plain_pyzmq_ring.py``). Two warm-up calls come
first (the first one's result checked, and held through the second, as a loop holds its last result);
each timed call is preceded by the backend's own barrier and timed on its own. Every rank prints one
JSON line: its times, and the CPU seconds (all threads) and wall seconds of the timed calls (and the
user and system parts of the CPU and the page faults, from ``getrusage``).
"""
import json, os, resource, sys, time

import numpy as np

backend, nbytes, iters = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
x = None

if backend == "mpi4py":
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = comm.rank, comm.size
    out = np.empty(nbytes // 4, np.float32)
    call = lambda: comm.Allreduce(x, out) or out  # noqa: E731
    barrier = comm.Barrier
else:
    config = json.loads(os.environ["STRATAGEM_CONFIG"])
    addresses, rank = config["cluster"]["worker"], config["task"]["index"]
    n = len(addresses)
    if backend in ("stratagem", "stratagem-out", "zmq-ring", "shm-ring", "hierarchical", "hierarchical-zmq"):
        import stratagem

        if backend in ("stratagem", "stratagem-out"):   # (no new options: --before runs it with older code)
            comm = stratagem.communicator(timeout=120)
        elif backend in ("shm-ring", "hierarchical"):   # shared memory inside a host, zmq between hosts
            comm = stratagem.communicator(transport="shm", transport_options={"remote": "zmq"}, timeout=120,
                                          hierarchical=backend == "hierarchical")
        else:
            comm = stratagem.communicator(transport="zmq", timeout=120, hierarchical=backend == "hierarchical-zmq")
        algorithm = "ring" if backend.endswith("-ring") else "auto"
        call = lambda: comm.allreduce(x, algorithm=algorithm)  # noqa: E731
        if backend == "stratagem-out":  # into a result array kept across calls, as the pyzmq ring does
            result_array = np.empty(nbytes // 4, np.float32)
            call = lambda: comm.allreduce(x, out=result_array)  # noqa: E731
        barrier = comm.barrier
    elif backend == "ring":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from plain_tcp_ring import allreduce, connect

        left, right = connect(addresses, rank)
        call = lambda: allreduce(x, left, right, rank, n)  # noqa: E731
        barrier = lambda: allreduce(np.zeros(n, np.float32), left, right, rank, n)  # noqa: E731
    elif backend == "pyzmq":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import plain_pyzmq_ring as pyzmq_ring  # binds and connects its ring as it is imported

        out = np.empty(nbytes // 4, np.float32)
        call = lambda: pyzmq_ring.allreduce(x, out)  # noqa: E731
        barrier = pyzmq_ring.barrier
    elif backend == "gloo":
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")  # the host's link (its hostname resolves to loopback)
        dist.init_process_group("gloo", init_method=f"tcp://{addresses[0]}", rank=rank, world_size=n,
                                timeout=datetime.timedelta(seconds=120))

        def call():
            t = torch.from_numpy(x.copy())  # all_reduce works in place: a fresh input each call, as the others
            dist.all_reduce(t)
            return t.numpy()
        barrier = dist.barrier
    else:
        raise SystemExit(f"unknown backend {backend!r}")

x = np.full(nbytes // 4, rank + 1, np.float32)
barrier()
result = call()
assert result[0] == result[-1] == n * (n + 1) / 2, (result[0], result[-1])
barrier()
call()  # a second warm-up, the first result still held: as in a loop, whose last result lives on
times = []
usage = resource.getrusage(resource.RUSAGE_SELF)
cpu, wall = time.process_time(), time.perf_counter()
for _ in range(iters):
    barrier()
    started = time.perf_counter()
    call()
    times.append(time.perf_counter() - started)
cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
after = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"rank": rank, "times": times, "cpu": cpu, "wall": wall, "user": after.ru_utime - usage.ru_utime,
                  "sys": after.ru_stime - usage.ru_stime, "minflt": after.ru_minflt - usage.ru_minflt,
                  "nvcsw": after.ru_nvcsw - usage.ru_nvcsw, "nivcsw": after.ru_nivcsw - usage.ru_nivcsw}), flush=True)
barrier()
if backend == "gloo":
    dist.destroy_process_group()  # before the peers' sockets close under it (gloo aborts then)
