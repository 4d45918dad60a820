#!/usr/bin/env python3
"""All-reduce benchmark: stratagem's communicator side by side with torch.distributed (gloo) and MPI.

    python benchmarks/allreduce.py                               # the default run (a few minutes)
    python benchmarks/allreduce.py --np 2 --sizes 4K,64M --json out.json
    python benchmarks/allreduce.py --backends stratagem --transports zmq --sizes 1M-64Mx2

Float32 sum all-reduce. Every (world size, backend) pair runs in its own set of processes, one job
after another (never two at once). See benchmarks/README.md for how to read the tables; the timing
method is described in benchmarks/_allreduce_worker.py. Tables go to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_allreduce_worker.py")
BACKENDS = ("stratagem", "gloo", "mpi4py")
#: The figures we report against: (world size, bytes, what, bound).
TARGET_BW_BYTES = 64 << 20
TARGET_LAT_BYTES = 4 << 10
#: Sizes up to this get a latency ratio column.
LATENCY_BYTES = 64 << 10


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- sizes and repeats -----------------------------------------------------------------------------

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4096, 4K, 64M, 1G)")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def parse_sizes(text: str) -> list[int]:
    """``4K-256M`` (powers of 4 from 4K), ``4K-256Mx2`` (powers of 2), ``4K,64M``, or a mix."""
    sizes: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        m = re.fullmatch(r"([^-x]+)-([^-x]+)(?:x(\d+))?", item)
        if m:
            lo, hi, step = parse_bytes(m.group(1)), parse_bytes(m.group(2)), int(m.group(3) or 4)
            if step < 2 or lo < 4 or hi < lo:
                raise argparse.ArgumentTypeError(f"bad size range {item!r}")
            s = lo
            while s <= hi:
                sizes.add(s)
                s *= step
        else:
            sizes.add(parse_bytes(item))
    bad = [s for s in sizes if s < 4 or s % 4]
    if bad or not sizes:
        raise argparse.ArgumentTypeError(f"sizes must be positive multiples of 4 bytes (float32): {text!r}")
    return sorted(sizes)


def human(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def schedule(sizes: list[int], max_repeats: int, min_repeats: int, volume: int,
             warmup: int | None) -> list[dict]:
    """Timed repeats per size: ``volume / size`` clamped to [min_repeats, max_repeats] (so large
    sizes get fewer), warm-ups a tenth of that (2..20). The same schedule for every backend."""
    plan = []
    for s in sizes:
        repeats = max(min_repeats, min(max_repeats, volume // s))
        w = warmup if warmup is not None else max(2, min(20, repeats // 10))
        plan.append({"bytes": s, "warmup": max(1, w), "repeats": repeats})
    return plan


# -- child processes -------------------------------------------------------------------------------

def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def run_process_job(cmd: list[str], env: dict, timeout: float) -> tuple[int, str]:
    """Run ``cmd`` in its own process group (its output to our stderr); always reap the whole group."""
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(),
                            stderr=sys.stderr.fileno(), start_new_session=True, preexec_fn=_die_with_parent)
    why = ""
    try:
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc, why = 124, f"timed out after {timeout:g}s"
        return rc, why or (f"exited with {rc}" if rc else "")
    finally:
        _stop_group(proc)


def _stop_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM the process group, SIGKILL after ``grace``; leftovers in the group go too."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


_netns_ok: tuple[bool, str] | None = None


def private_netns() -> tuple[bool, str]:
    """Whether ``unshare -n`` works here (a network namespace holding only loopback)."""
    global _netns_ok
    if _netns_ok is None:
        if shutil.which("unshare") is None:
            _netns_ok = (False, "unshare(1) not found")
        else:
            try:
                r = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up 2>/dev/null; true"],
                                   stdin=subprocess.DEVNULL, capture_output=True, timeout=20)
                _netns_ok = (r.returncode == 0, r.stderr.decode(errors="replace").strip()
                             or f"unshare -n exited with {r.returncode}")
            except (OSError, subprocess.TimeoutExpired) as exc:
                _netns_ok = (False, f"unshare -n failed: {exc}")
    return _netns_ok


def in_netns(cmd: list[str]) -> list[str]:
    """``cmd`` run inside a fresh network namespace with loopback up (nothing else to listen on)."""
    return ["unshare", "-n", "sh", "-c", 'ip link set lo up 2>/dev/null; exec "$@"', "sh", *cmd]


def child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    # One thread of math per rank for every backend (2 cores; ranks share them).
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


@dataclass
class JobResult:
    backend: str                      # "stratagem-zmq", "gloo", "mpi4py"
    np: int
    sizes: list[dict] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    skipped: str | None = None       # why there are no figures
    seconds: float = 0.0
    loadavg: tuple | None = None

    def by_size(self) -> dict[int, dict]:
        return {s["bytes"]: s for s in self.sizes}


def _job(label: str, n: int, plan: list[dict], runner, extra_spec: dict | None, timeout: float) -> JobResult:
    log(f"[{label} np={n}] starting")
    started = time.monotonic()
    result = JobResult(label, n, loadavg=os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="stratagem-bench-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump({"label": label, "sizes": plan, "timeout": min(timeout, 300), "job_timeout": timeout,
                       **(extra_spec or {})}, f)
        rc, why = runner(spec_path, out_path)
        if os.path.exists(out_path):
            with open(out_path) as f:
                out = json.load(f)
            result.sizes, result.info = out["sizes"], out.get("backend_info", {})
        if rc != 0 or not os.path.exists(out_path):
            result.skipped = f"failed: {why or 'no results written'}"
    result.seconds = time.monotonic() - started
    log(f"[{label} np={n}] {'done' if not result.skipped else result.skipped} in {result.seconds:.1f}s")
    return result


def run_stratagem(n: int, plan: list[dict], transport: str, options: dict, timeout: float,
                  mpiexec_args: list[str] = ()) -> JobResult:
    from stratagem.core.launcher import launch
    from stratagem.plugins.manager import plugin_manager

    label = f"stratagem-{transport}"
    try:
        why = plugin_manager().usable("transport", transport, check=True)
    except Exception as exc:  # unknown transport name
        why = str(exc)
    if why is None and transport == "local":
        why = "the local transport connects threads of one process only"
    if why is None and transport == "mpi":
        why = "mpiexec not found on PATH" if shutil.which("mpiexec") is None else None
        ok, reason = private_netns()
        if why is None and not ok:
            why = f"cannot make a private network namespace ({reason}) for Open MPI's launcher"
    if why:
        log(f"[{label}] skipped: {why}")
        return JobResult(label, n, skipped=f"skipped: {why}")

    def runner(spec_path, out_path):
        if transport == "mpi":  # the ranks of one mpiexec job, started exactly as mpi4py's are
            cmd = [shutil.which("mpiexec"), *MPIEXEC_ARGS, *mpiexec_args, "-n", str(n), sys.executable, WORKER,
                   "stratagem", spec_path, out_path]
            return run_process_job(in_netns(cmd), child_env(), timeout)
        result = launch([sys.executable, WORKER, "stratagem", spec_path, out_path], workers=n,
                        output=sys.stderr, error_output=sys.stderr, timeout=timeout,
                        env=child_env())
        if result.interrupted_by is not None:
            raise KeyboardInterrupt
        return result.exit_code, "" if result.ok else result.reason

    spec = {"stratagem": {"transport": transport, **options}}
    result = _job(label, n, plan, runner, spec, timeout)
    if transport == "mpi":
        result.info["mpiexec_args"] = MPIEXEC_ARGS + list(mpiexec_args)
    return result


def run_gloo(n: int, plan: list[dict], timeout: float) -> JobResult:
    try:
        import torch  # noqa: F401
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_gloo_available():
            raise ImportError("torch.distributed with gloo is not available in this build")
    except ImportError as exc:
        log(f"[gloo] skipped: {exc}")
        return JobResult("gloo", n, skipped=f"skipped: torch not importable ({exc})")
    ok, _ = private_netns()
    cmd = [sys.executable, WORKER, "gloo-spawn", "SPEC", "OUT", str(n)]
    # torch's TCPStore listens on every address; inside a private namespace "every" is loopback only.
    # Without unshare, rendezvous through a file instead (no listening socket at all).
    env = child_env({"GLOO_SOCKET_IFNAME": "lo", "TORCH_CPP_LOG_LEVEL": "ERROR", "BENCH_GLOO_RENDEZVOUS": "tcp" if ok else "file"})

    def runner(spec_path, out_path):
        c = [spec_path if a == "SPEC" else out_path if a == "OUT" else a for a in cmd]
        return run_process_job(in_netns(c) if ok else c, env, timeout)

    return _job("gloo", n, plan, runner, None, timeout)


MPIEXEC_ARGS = ["--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]


def run_mpi(n: int, plan: list[dict], timeout: float, extra_args: list[str]) -> JobResult:
    mpiexec = shutil.which("mpiexec")
    why = None
    if mpiexec is None:
        why = "mpiexec not found on PATH"
    else:
        try:
            import mpi4py  # noqa: F401
        except ImportError as exc:
            why = f"mpi4py not importable ({exc})"
    if why is None:
        ok, reason = private_netns()
        if not ok:
            why = (f"cannot make a private network namespace ({reason}); Open MPI's launcher would listen "
                   f"on every address, so mpi4py is not run")
    if why:
        log(f"[mpi4py] skipped: {why}")
        return JobResult("mpi4py", n, skipped=f"skipped: {why}")

    def runner(spec_path, out_path):
        cmd = [mpiexec, *MPIEXEC_ARGS, *extra_args, "-n", str(n), sys.executable, WORKER, "mpi4py",
               spec_path, out_path]
        return run_process_job(in_netns(cmd), child_env(), timeout)

    result = _job("mpi4py", n, plan, runner, None, timeout)
    result.info["mpiexec_args"] = MPIEXEC_ARGS + extra_args
    return result


# -- statistics and tables -------------------------------------------------------------------------

def stats(entry: dict, n: int) -> dict:
    times = entry["times_s"]
    if not times:
        return {}
    med, lo = statistics.median(times), min(times)
    size = entry["bytes"]
    factor = 2 * (n - 1) / n
    return {
        "median_us": med * 1e6, "min_us": lo * 1e6, "mean_us": statistics.fmean(times) * 1e6,
        "max_us": max(times) * 1e6,
        "p90_us": sorted(times)[min(len(times) - 1, int(math.ceil(0.9 * len(times))) - 1)] * 1e6,
        "algbw_GBps": size / med / 1e9, "busbw_GBps": factor * size / med / 1e9,
        "busbw_best_GBps": factor * size / lo / 1e9,
    }


def _fmt_us(us: float) -> str:
    if us >= 1e5:
        return f"{us / 1e3:,.0f}ms"
    if us >= 1e4:
        return f"{us / 1e3:,.1f}ms"
    return f"{us:,.0f}" if us >= 100 else f"{us:.1f}"


def _fmt_ratio(r: float | None) -> str:
    return "" if r is None else f"{r:.2f}x"


def build_tables(results: list[JobResult], sizes: list[int], nps: list[int], console) -> None:
    from rich.table import Table

    for n in nps:
        jobs = [r for r in results if r.np == n]
        if not jobs:
            continue
        labels = [j.backend for j in jobs]
        table = Table(title=f"float32 sum all-reduce, {n} processes (median / min of iteration time = slowest "
                            f"rank; busbw = 2(n-1)/n x size / median)", title_justify="left")
        table.add_column("size", justify="right")
        for label in labels:
            short = label.replace("stratagem-", "S-")
            table.add_column(f"{short}\nmedian us", justify="right")
            table.add_column(f"{short}\nmin us", justify="right")
            table.add_column(f"{short}\nbusbw GB/s", justify="right")
        strat = [j for j in jobs if j.backend.startswith("stratagem")]
        refs = [j for j in jobs if not j.backend.startswith("stratagem")]
        pairs = [(s, r) for s in strat for r in refs]
        for s, r in pairs:
            pre = "S" if len(strat) == 1 else s.backend.replace("stratagem-", "S-")
            table.add_column(f"busbw\n{pre}/{r.backend}", justify="right")
        for s, r in pairs:
            pre = "S" if len(strat) == 1 else s.backend.replace("stratagem-", "S-")
            table.add_column(f"latency\n{pre}/{r.backend}", justify="right")
        for size in sizes:
            row = [human(size)]
            st = {}
            for j in jobs:
                e = j.by_size().get(size)
                if e is None or not e["times_s"]:
                    row += ["-", "-", "-"]
                    continue
                s_ = stats(e, n)
                st[j.backend] = s_
                mark = "" if e["correct"] else " WRONG"
                row += [_fmt_us(s_["median_us"]) + mark, _fmt_us(s_["min_us"]), f"{s_['busbw_GBps']:.3f}"]
            for s, r in pairs:
                a, b = st.get(s.backend), st.get(r.backend)
                row.append(_fmt_ratio(a["busbw_GBps"] / b["busbw_GBps"]) if a and b else "")
            for s, r in pairs:
                a, b = st.get(s.backend), st.get(r.backend)
                small = size <= LATENCY_BYTES
                row.append(_fmt_ratio(a["median_us"] / b["median_us"]) if a and b and small else "")
            table.add_row(*row)
        console.print(table)
        for j in jobs:
            if j.skipped:
                console.print(f"  {j.backend} (np={n}): {j.skipped}", markup=False, highlight=False)
        console.print()


def targets(results: list[JobResult]) -> list[dict]:
    """The two figures we report against, for every stratagem transport that ran with np=2."""
    out = []

    def find(label, n, size):
        for r in results:
            if r.backend == label and r.np == n:
                e = r.by_size().get(size)
                if e and e["times_s"]:
                    return e, stats(e, n)
        return None, None

    for r in results:
        if not r.backend.startswith("stratagem") or r.np != 2:
            continue
        # The mpi transport is held to raw mpi4py (same MPI, same mpiexec), the others to gloo.
        goals = ([(TARGET_BW_BYTES, "bandwidth", "mpi4py", 0.9)] if r.backend == "stratagem-mpi" else
                 [(TARGET_BW_BYTES, "bandwidth", "gloo", 1.0), (TARGET_LAT_BYTES, "latency", "gloo", 2.0)])
        for size, kind, ref, bound in goals:
            se, s = find(r.backend, 2, size)
            ge, g = find(ref, 2, size)
            if s is None or g is None:
                out.append({"backend": r.backend, "bytes": size, "kind": kind, "reference": ref,
                            "verdict": "not measured"})
                continue
            if kind == "bandwidth":
                ratio = s["busbw_GBps"] / g["busbw_GBps"]
                ratio_best = s["busbw_best_GBps"] / g["busbw_best_GBps"]
                ok = ratio >= bound and se["correct"]
                text = (f"{human(size)}, 2 processes: {r.backend} busbw {s['busbw_GBps']:.3f} GB/s vs {ref} "
                        f"{g['busbw_GBps']:.3f} GB/s = {ratio:.2f}x (best-case {ratio_best:.2f}x); target >= {bound}x")
            else:
                ratio = s["median_us"] / g["median_us"]
                ratio_best = s["min_us"] / g["min_us"]
                ok = ratio <= bound and se["correct"]
                text = (f"{human(size)}, 2 processes: {r.backend} latency {s['median_us']:.1f} us vs {ref} "
                        f"{g['median_us']:.1f} us = {ratio:.2f}x (min {s['min_us']:.1f} vs {g['min_us']:.1f} us "
                        f"= {ratio_best:.2f}x); target <= {bound}x")
            out.append({"backend": r.backend, "bytes": size, "kind": kind, "ratio_median": ratio,
                        "ratio_best": ratio_best, "met": ok, "verdict": ("MET" if ok else "MISSED"),
                        "text": text})
    return out


# -- environment -----------------------------------------------------------------------------------

def environment() -> dict:
    env: dict = {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(terse=True),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "loadavg_at_start": os.getloadavg(),
        "omp_num_threads_in_workers": 1,
    }
    try:
        with open("/proc/cpuinfo") as f:
            models = {line.split(":", 1)[1].strip() for line in f if line.startswith("model name")}
        env["cpu_model"] = ", ".join(sorted(models))
    except OSError:
        pass
    try:
        import numpy
        env["numpy"] = numpy.__version__
    except ImportError:
        pass
    try:
        import zmq
        env["pyzmq"], env["libzmq"] = zmq.__version__, zmq.zmq_version()
    except ImportError:
        pass
    try:
        import stratagem
        env["stratagem"] = stratagem.__version__
        rev = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", HERE, "status", "--porcelain", "--", "../src"],
                               capture_output=True, text=True, timeout=10)
        if rev.returncode == 0:
            env["stratagem_git"] = rev.stdout.strip() + ("+uncommitted" if dirty.stdout.strip() else "")
        # The code on the measured path, hashed: the git revision alone misses uncommitted edits.
        import hashlib
        pkg = os.path.dirname(stratagem.__file__)
        env["stratagem_sources_sha256"] = {
            rel: hashlib.sha256(open(os.path.join(pkg, rel), "rb").read()).hexdigest()[:12]
            for rel in ("core/collectives.py", "core/communicator.py", "core/mailbox.py", "core/wire.py",
                        "transports/zmq.py", "transports/mpi.py", "transports/mpi_collectives.py")
            if os.path.exists(os.path.join(pkg, rel))
        }
    except Exception:
        pass
    try:
        import torch
        env["torch"] = torch.__version__
    except ImportError:
        env["torch"] = None
    try:
        import mpi4py
        env["mpi4py"] = mpi4py.__version__
        r = subprocess.run([sys.executable, "-c", "from mpi4py import MPI; print(MPI.Get_library_version())"],
                           capture_output=True, text=True, timeout=60)
        if r.returncode == 0:
            env["mpi_library"] = r.stdout.replace("\x00", "").strip().splitlines()[0]
    except Exception:
        env.setdefault("mpi4py", None)
    return env


# -- main ------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Tables go to stdout, progress to stderr. See benchmarks/README.md.")
    p.add_argument("--np", type=int, nargs="+", default=[2, 3], metavar="N", help="world sizes (default: 2 3)")
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes("4K-256M"),
                   help="message sizes: A-B (powers of 4), A-Bx2 (powers of 2), or a list (default: 4K-256M)")
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help=f"comma list of {', '.join(BACKENDS)} (default: all)")
    p.add_argument("--transports", default="zmq", help="stratagem transports, comma list (default: zmq)")
    p.add_argument("--repeats", type=int, default=200, metavar="N",
                   help="timed iterations per size at most (default 200); large sizes get volume/size")
    p.add_argument("--min-repeats", type=int, default=5, metavar="N", help="timed iterations at least (default 5)")
    p.add_argument("--volume", type=parse_bytes, default=parse_bytes("1G"),
                   help="bytes of all-reduce per size and backend, which sets repeats for large sizes (default 1G)")
    p.add_argument("--warmup", type=int, default=None, metavar="N",
                   help="warm-up iterations per size (default: repeats/10, 2..20)")
    p.add_argument("--chunk-bytes", type=parse_bytes, default=None, help="stratagem chunk_bytes (default: the library's)")
    p.add_argument("--small-bytes", type=parse_bytes, default=None, help="stratagem small_bytes (default: the library's)")
    p.add_argument("--zero-copy-bytes", type=parse_bytes, default=None,
                   help="zmq transport zero_copy_bytes (default: the library's)")
    p.add_argument("--mpiexec-args", default="", help="extra mpiexec arguments, e.g. '--mca btl self,tcp'")
    p.add_argument("--rounds", type=int, default=2, metavar="R",
                   help="run every job R times, alternating the order, and pool the iterations (default 2)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per job before it is stopped (default 600)")
    p.add_argument("--json", metavar="PATH", help="write every figure and the environment here")
    args = p.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in args.backends if b not in BACKENDS]
    if unknown:
        p.error(f"unknown backend(s) {', '.join(unknown)}; choose from {', '.join(BACKENDS)}")
    args.transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if any(n < 1 for n in args.np):
        p.error("--np values must be >= 1")
    if args.repeats < 1 or args.min_repeats < 1 or args.rounds < 1:
        p.error("--repeats and --min-repeats must be >= 1")
    return args


def stratagem_options(args) -> dict:
    opts: dict = {}
    if args.chunk_bytes is not None:
        opts["chunk_bytes"] = args.chunk_bytes
    if args.small_bytes is not None:
        opts["small_bytes"] = args.small_bytes
    if args.zero_copy_bytes is not None:
        opts["transport_options"] = {"zero_copy_bytes": args.zero_copy_bytes}
    return opts


def make_console():
    from rich.console import Console

    width = None if sys.stdout.isatty() else 220
    return Console(file=sys.stdout, width=width)


def merge_rounds(rounds: list[list[JobResult]]) -> list[JobResult]:
    """One JobResult per (backend, np): every round's iterations pooled, each round's median kept."""
    merged: dict[tuple[str, int], JobResult] = {}
    for i, round_results in enumerate(rounds):
        for r in round_results:
            key = (r.backend, r.np)
            m = merged.setdefault(key, JobResult(r.backend, r.np, info=dict(r.info), loadavg=r.loadavg))
            m.seconds += r.seconds
            if r.skipped:
                m.skipped = r.skipped if not m.sizes else f"round {i + 1} {r.skipped}"
            if not m.info:
                m.info = dict(r.info)
            have = m.by_size()
            for e in r.sizes:
                med = statistics.median(e["times_s"]) if e["times_s"] else None
                if e["bytes"] in have:
                    t = have[e["bytes"]]
                    t["times_s"] = t["times_s"] + e["times_s"]
                    t["repeats"] += e["repeats"]
                    t["correct"] = t["correct"] and e["correct"]
                    t["round_medians_s"].append(med)
                else:
                    m.sizes.append({**e, "round_medians_s": [med]})
    return list(merged.values())


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    args = parse_args(argv)
    # SIGTERM stops the run like Ctrl-C does: the current job's processes are stopped and reaped.
    signal.signal(signal.SIGTERM, _terminate)
    plan = schedule(args.sizes, args.repeats, min(args.min_repeats, args.repeats), args.volume, args.warmup)
    log("plan: " + ", ".join(f"{human(p['bytes'])} {p['warmup']}+{p['repeats']}" for p in plan)
        + f" (warm-up + timed iterations per size), {args.rounds} round(s)")
    env = environment()
    jobs = []
    for n in args.np:
        for backend in args.backends:
            if backend == "stratagem":
                jobs += [(n, "stratagem", t) for t in args.transports]
            else:
                jobs.append((n, backend, None))
    rounds: list[list[JobResult]] = []
    interrupted = False
    started = time.monotonic()
    try:
        for i in range(args.rounds):
            # Alternate the order, so a burst of outside load does not always hit the same backend.
            order = jobs if i % 2 == 0 else [j for n in args.np for j in reversed([j for j in jobs if j[0] == n])]
            rounds.append([])
            if args.rounds > 1:
                log(f"round {i + 1}/{args.rounds}")
            for n, backend, transport in order:
                if backend == "stratagem":
                    rounds[-1].append(run_stratagem(n, plan, transport, stratagem_options(args), args.timeout,
                                                    args.mpiexec_args.split()))
                elif backend == "gloo":
                    rounds[-1].append(run_gloo(n, plan, args.timeout))
                elif backend == "mpi4py":
                    rounds[-1].append(run_mpi(n, plan, args.timeout, args.mpiexec_args.split()))
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: every child process has been stopped; reporting what finished")
    results = merge_rounds(rounds)
    order_key = {(n, b if b != "stratagem" else f"stratagem-{t}"): k for k, (n, b, t) in enumerate(jobs)}
    results.sort(key=lambda r: order_key.get((r.np, r.backend), 0))
    env["loadavg_at_end"] = os.getloadavg()
    env["total_seconds"] = round(time.monotonic() - started, 1)

    console = make_console()
    build_tables(results, args.sizes, args.np, console)
    verdicts = targets(results)
    for v in verdicts:
        if "text" in v:
            console.print(f"target [{v['verdict']}]: {v['text']}", markup=False, highlight=False)
        else:
            console.print(f"target [not measured]: {human(v['bytes'])} {v['kind']} for {v['backend']} "
                          f"(needs np=2, that size and {v.get('reference', 'gloo')})", markup=False, highlight=False)
    if args.json:
        doc = {
            "benchmark": "allreduce", "dtype": "float32", "op": "sum",
            "command": [os.path.basename(sys.argv[0]), *(sys.argv[1:] if argv is None else argv)],
            "timing": "per iteration: barrier, then each rank times its own call with perf_counter; the "
                      "iteration's time is the max over ranks (max-reduced after the size's loop)",
            "environment": env, "plan": plan, "rounds": args.rounds, "targets": verdicts, "interrupted": interrupted,
            "jobs": [
                {"backend": r.backend, "np": r.np, "skipped": r.skipped, "info": r.info,
                 "seconds": round(r.seconds, 2), "loadavg_at_start": r.loadavg,
                 "sizes": [{**e, **stats(e, r.np)} for e in r.sizes]}
                for r in results
            ],
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        log(f"wrote {args.json}")
    log(f"total {env['total_seconds']}s")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
