"""Stopping child processes (servers, browsers) the benchmarks and tests start."""

from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen, timeout: float) -> int:
    """SIGTERM ``proc``, give it ``timeout`` seconds to exit, SIGKILL it if it has not, and
    return its exit code. A process that has already exited is left as it is."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
