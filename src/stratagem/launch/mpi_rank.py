"""What ``stratagem launch --mpi`` runs as each MPI rank: the user's command as its child, tied to the
job, and how the rank ended told to the launcher.

``python -m stratagem.launch.mpi_rank [--job-session] COMMAND...`` (Linux):

- **Dies with the job.** It gets SIGKILL when its parent, Open MPI's launcher, dies
  (``PR_SET_PDEATHSIG``, which survives exec), and so does the command when this process dies. After
  the ``prctl`` it checks that its parent has not died already, and with ``--job-session`` (which
  ``stratagem launch --mpi`` passes: there the leader of the rank's session is the job's mpiexec) that
  the session's leader has not either: a rank forked just before mpiexec was killed may read its
  parent only after that death, when the parent it reads is init, which never dies. Then it does not
  start the command (exit status 1). Without the flag the session is not the job's (a shell, a CI
  runner whose leader may be long gone) and its leader says nothing.
- **Passes on** the signals Open MPI's launcher sends its ranks (SIGTERM, SIGINT, SIGHUP, SIGQUIT,
  SIGUSR1, SIGUSR2, SIGTSTP, SIGCONT) to the command.
- **Reports how the rank ended.** The launcher sees mpiexec only, and a rank's failure report
  (:mod:`stratagem.core.failures`) is written by the exception hook: a ``sys.exit(3)`` is seen by no
  hook, and a process killed outright writes nothing. So when the command exits non-zero or is killed
  by a signal that did not come from the job's launcher (passed on here), and wrote no report, this
  process writes the rank's report (``exited with code 3``, ``was killed by SIGKILL``), then ends
  with the command's status (killed by the same signal, or exiting with the same code).

    >>> import subprocess, sys
    >>> subprocess.run([sys.executable, "-m", "stratagem.launch.mpi_rank", "sh", "-c", "exit 3"]).returncode
    3
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

#: ``prctl(PR_SET_PDEATHSIG, ...)``.
_PR_SET_PDEATHSIG = 1
#: Signals Open MPI's launcher may send a rank; each is passed on to the command.
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGTSTP, signal.SIGCONT)
#: Those that stop a rank: the job is being stopped from outside, so the rank's end is no failure of it.
_STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _die_with_parent(libc) -> bool:
    """``PR_SET_PDEATHSIG`` to SIGKILL; False if the parent died before it took effect."""
    parent = os.getppid()
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    return os.getppid() == parent


def how_it_ended(code: int) -> str:
    """``exited with code 3``, ``was killed by SIGKILL`` (``code``: a ``Popen.returncode``)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"was killed by {name}"


#: The flag that says this process's session is the MPI job's, led by its mpiexec.
JOB_SESSION = "--job-session"


def main(argv: list[str]) -> None:
    """Run the command in ``argv`` (``[--job-session] COMMAND...``) as this rank (see the module doc);
    never returns: the process ends with its status."""
    job_session = bool(argv) and argv[0] == JOB_SESSION
    command = argv[1:] if job_session else argv
    if not command:
        print(f"usage: python -m stratagem.launch.mpi_rank [{JOB_SESSION}] COMMAND [ARGS...]", file=sys.stderr)
        os._exit(2)
    libc = ctypes.CDLL(None)
    if not _die_with_parent(libc) or (job_session and not _alive(os.getsid(0))):
        os._exit(1)   # mpiexec died before prctl took effect
    me = os.getpid()
    child = os.fork()
    if child == 0:
        try:
            if os.getppid() != me or not _die_with_parent(libc):
                os._exit(1)
            os.execvp(command[0], command)
        except OSError as exc:
            os.write(2, f"stratagem launch --mpi: cannot run {command[0]!r}: {exc}\n".encode())
        finally:
            os._exit(127)
    passed: list[int] = []

    def pass_on(signum, frame) -> None:
        passed.append(signum)
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for sig in PASSED_ON:
        signal.signal(sig, pass_on)
    _, status = os.waitpid(child, 0)      # retried after a signal handler ran (PEP 475)
    code = os.waitstatus_to_exitcode(status)
    if code != 0 and not any(sig in _STOPPING for sig in passed):
        from stratagem.core.failures import report_failure

        report_failure(f"the rank's process {how_it_ended(code)}")   # unless the rank wrote its own
    for sig in PASSED_ON:
        signal.signal(sig, signal.SIG_DFL)
    if code < 0:
        os.kill(me, -code)
        code = 128 - code      # a signal that does not end a process
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
