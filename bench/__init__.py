"""Benchmarks run through `moray bench NAME`; each writes a JSON result file."""

import atexit
import shutil
import tempfile


def scratch_dir(prefix: str) -> str:
    """A temporary directory removed when the process exits (a generated model, logs of helper servers):
    a benchmark run many times must not fill /tmp."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
