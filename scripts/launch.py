"""Start a data-parallel run's processes on this machine, as torchrun does.

    python scripts/launch.py --nproc 2 -- scripts/train.py --config configs/tiny.yaml [k=v ...]

Starts `--nproc` copies of the command (a Python script and its arguments), each given
`distributed.coordinator=127.0.0.1:PORT distributed.num_processes=N distributed.process_id=I`
(a free port, or --port), and prefixes every line they print with `[I] `. If one exits non-zero,
the others get --grace seconds to notice and stop by themselves (a training process names the
lost one in its error), then SIGTERM, then SIGKILL 5 s later; the launcher exits with the first
failed process's code (128 + N for a signal N); 0 when all finish cleanly. Ctrl-C (SIGINT or
SIGTERM) is passed on to every process.
Once a process has failed, the others' stderr is passed on only in its `error: ...` lines: what
else they print while they stop is JAX's own log of the lost connection (a C++ fatal error and its
stack, when process 0, which serves the coordinator, is the one lost), not the cause, which the
first failure's line and the launcher's name. (A line of that log may come before the failed
process is seen gone: such a line waits up to CPP_LOG_WAIT_S for it, and is printed if none has
failed.)
On several hosts, start one process per host with the same three keys yourself (or
distributed.coordinator=auto under SLURM / Open MPI, where JAX reads them from the cluster).
"""

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A line of JAX's C++ log (glog: severity, date, time): when process 0 is lost, the others log
# its loss before the launcher can see it gone, so such a line waits for that a moment first.
CPP_LOG = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d")
CPP_LOG_WAIT_S = 2.0


def _pump(stream, out, prefix: str, lock: threading.Lock, quiet=None):
    """Copies stream's lines to out, prefixed; while quiet() only the `error: ...` lines."""
    for line in iter(stream.readline, ""):
        if quiet is not None:
            if CPP_LOG.match(line):
                deadline = time.time() + CPP_LOG_WAIT_S
                while not quiet() and time.time() < deadline:
                    time.sleep(0.02)
            if quiet() and not line.startswith("error:"):
                continue
        with lock:
            out.write(prefix + line)
            out.flush()
    stream.close()


def _failed(code) -> bool:
    return code not in (None, 0)


def _how(code: int) -> str:
    """A failed process's exit code in words."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"exited with code {code} (killed by {name}: lost)"


def _wait_all(procs, seconds: float):
    deadline = time.time() + seconds
    while any(p.poll() is None for p in procs) and time.time() < deadline:
        time.sleep(0.05)


def _stop(procs, grace: float):
    _wait_all(procs, grace)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.time() + 5
    for p in procs:
        while p.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        if p.poll() is None:
            p.kill()
            p.wait()


def launch(nproc: int, command: list, *, port: int = 0, grace: float = 10.0) -> int:
    """Runs the processes; returns the launcher's exit code."""
    port = port or free_port()
    lock = threading.Lock()
    procs, pumps = [], []
    for i in range(nproc):
        argv = [sys.executable, *command, f"distributed.coordinator=127.0.0.1:{port}",
                f"distributed.num_processes={nproc}", f"distributed.process_id={i}"]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                bufsize=1, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        procs.append(proc)
        # Another process has failed: this one's stderr is its noise of stopping, but its error.
        others_failed = lambda i=i: any(_failed(p.poll()) for j, p in enumerate(procs) if j != i)
        for stream, out, quiet in ((proc.stdout, sys.stdout, None),
                                   (proc.stderr, sys.stderr, others_failed)):
            t = threading.Thread(target=_pump, args=(stream, out, f"[{i}] ", lock, quiet),
                                 daemon=True)
            t.start()
            pumps.append(t)

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    first_bad = None  # (process, exit code) of the first seen to fail
    try:
        while any(p.poll() is None for p in procs):
            first_bad = next(((i, p.returncode) for i, p in enumerate(procs)
                              if _failed(p.returncode)), None)
            if first_bad:
                with lock:
                    print(f"launch: process {first_bad[0]} {_how(first_bad[1])}; stopping the "
                          f"others (in {grace:g} s at most)", file=sys.stderr, flush=True)
                _stop(procs, grace)
                break
            time.sleep(0.1)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    for t in pumps:
        t.join(timeout=5)
    if first_bad is None:  # all ended between two looks: the first failed one, if any
        first_bad = next(((i, p.returncode) for i, p in enumerate(procs) if p.returncode), None)
        if first_bad:
            print(f"launch: process {first_bad[0]} {_how(first_bad[1])}", file=sys.stderr,
                  flush=True)
    if first_bad is None:
        return 0
    code = first_bad[1]
    return code if code > 0 else 128 - code  # killed by signal n: the shell's 128 + n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     usage="launch.py --nproc N [--port P] -- SCRIPT [ARGS ...]")
    parser.add_argument("--nproc", type=int, required=True, help="processes to start")
    parser.add_argument("--port", type=int, default=0,
                        help="coordinator port (default: a free one)")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds the others get to stop by themselves after one failed")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.nproc < 1:
        print(f"error: --nproc must be >= 1, got {args.nproc}", file=sys.stderr)
        return 2
    if not command:
        print("error: no command to launch (launch.py --nproc 2 -- scripts/train.py ...)",
              file=sys.stderr)
        return 2
    if not os.path.isfile(command[0]):
        print(f"error: {command[0]}: no such script", file=sys.stderr)
        return 2
    return launch(args.nproc, command, port=args.port, grace=args.grace)


if __name__ == "__main__":
    sys.exit(main())
