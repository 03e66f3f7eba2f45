"""The committed gRPC stubs are exactly what `make protos` generates from moray.proto."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ("moray_pb2.py", "moray_pb2.pyi", "moray_pb2_grpc.py")


def test_stubs_are_up_to_date(tmp_path):
    pytest.importorskip("grpc_tools")
    src = tmp_path / "protos" / "moray" / "v1"
    src.mkdir(parents=True)
    shutil.copy(ROOT / "protos/moray/v1/moray.proto", src)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            ".",
            "--python_out=.",
            "--pyi_out=.",
            "--grpc_python_out=.",
            "protos/moray/v1/moray.proto",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    for name in GENERATED:
        assert (src / name).read_text() == (ROOT / "protos/moray/v1" / name).read_text(), f"{name} is stale: run `make protos`"


def test_service_shape():
    from protos.moray.v1 import moray_pb2

    service = moray_pb2.DESCRIPTOR.services_by_name["Moray"]
    methods = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    assert methods == {"Generate": (False, True), "Complete": (False, False), "ListModels": (False, False), "Health": (False, False)}
    assert moray_pb2.DESCRIPTOR.package == "moray.v1"
