"""Processes the entry-point tests start (`moray serve`, `ray start`) and what they leave behind: each test's
Ray lives under its own RAY_TMPDIR, and what it caused is found by that marker and by descent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def env(ray_tmp: str, **extra) -> dict:
    e = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "RAY_TMPDIR": ray_tmp}
    for key in ("JAX_NUM_CPU_DEVICES", "RAY_ADDRESS"):
        e.pop(key, None)
    return {**e, **extra}


def without_suite_xla_cache(env: dict) -> dict:
    """A subprocess's environment without the suite's compilation cache (conftest.py): its engines compile
    for real, as a test of compiling or of a slow start-up needs."""
    return {k: v for k, v in env.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}


def _process_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, command line) of every process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        table[int(entry)] = (int(fields[1]), fields[0], cmdline)
    return table


def _has_ray_tmpdir(pid: int, marker: str) -> bool:
    try:
        return f"RAY_TMPDIR={marker}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def caused_processes(roots: set[int] = frozenset(), marker: str | None = None) -> set[int]:
    """Live processes descended from `roots`, or of the Ray under RAY_TMPDIR `marker` (named in their command
    line or inherited in their environment: orphaned workers too), and their descendants."""
    table = _process_table()
    found = {pid for pid in roots if pid in table}
    if marker:
        found |= {pid for pid, (_, _, cmd) in table.items() if marker in cmd or _has_ray_tmpdir(pid, marker)}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return {pid for pid in found if table[pid][1] != "Z"}


def named(pids: set[int]) -> list[tuple[int, str, str]]:
    table = _process_table()
    return [(pid, *table[pid][1:]) for pid in pids if pid in table]


def alive(pids: set[int]) -> set[int]:
    table = _process_table()
    return {pid for pid in pids if pid in table and table[pid][1] != "Z"}


def assert_all_gone(pids: set[int], within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = alive(pids)
    table = _process_table()
    assert not left, [table[p][2][:160] for p in left if p in table]


def kill_all(pids: set[int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in alive(pids):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while alive(pids) and time.monotonic() < deadline:
            time.sleep(0.2)


def start_moray_serve(args: list[str], e: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [str(BIN / "moray"), "serve", *args],
        cwd=ROOT,
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


class Output:
    """A process's stdout, collected by a thread, so a test can wait for a line without blocking on the pipe."""

    def __init__(self, proc: subprocess.Popen):
        import threading

        self.proc, self.lines = proc, []
        self.thread = threading.Thread(target=lambda: self.lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        self.thread.start()

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(needle in line for line in list(self.lines)):
            if time.monotonic() > deadline or (self.proc.poll() is not None and not self.thread.is_alive()):
                pytest.fail(f"no {needle!r} within {timeout}s; output:\n{self.text()}")
            time.sleep(0.2)

    def finish(self, timeout: float) -> str:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the process did not exit within {timeout}s; output:\n{self.text()}")
        self.thread.join(timeout=10)
        return self.text()
