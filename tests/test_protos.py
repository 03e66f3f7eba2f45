"""The committed gRPC stubs are exactly what `make protos` generates from moray.proto."""

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ("moray_pb2.py", "moray_pb2.pyi", "moray_pb2_grpc.py")

# The generators stamp their own versions into the stubs: which grpcio and protobuf runtimes the stubs
# accept (they refuse to import under older ones). A newer grpcio-tools in a fresh venv changes only these.
_GRPC_STAMP = re.compile(r"^GRPC_GENERATED_VERSION = '([^']*)'$", re.M)
_PROTOBUF_COMMENT = re.compile(r"^# Protobuf Python Version: .*$", re.M)
_PROTOBUF_STAMP = re.compile(r"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,)\s*(\d+),\s*(\d+),\s*(\d+),")


def _without_stamps(text: str) -> str:
    text = _GRPC_STAMP.sub("GRPC_GENERATED_VERSION = <version>", text)
    text = _PROTOBUF_COMMENT.sub("# Protobuf Python Version: <version>", text)
    return _PROTOBUF_STAMP.sub(r"\1 <version>,", text)


def _stamped_versions() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(grpcio, protobuf) versions the committed stubs require."""
    stubs = ROOT / "protos/moray/v1"
    grpc_version = _GRPC_STAMP.search((stubs / "moray_pb2_grpc.py").read_text()).group(1)
    protobuf_version = _PROTOBUF_STAMP.search((stubs / "moray_pb2.py").read_text()).groups()[1:]
    return tuple(int(x) for x in grpc_version.split(".")), tuple(int(x) for x in protobuf_version)


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
        fresh, committed = (src / name).read_text(), (ROOT / "protos/moray/v1" / name).read_text()
        assert _without_stamps(fresh) == _without_stamps(committed), f"{name} is stale: run `make protos`"


def test_the_stubs_import_under_every_runtime_the_project_allows():
    """pyproject's lowest grpcio and protobuf are at least what the committed stubs require: the stubs
    raise at import under an older runtime (a CI venv with a newer grpcio-tools once changed the stamp alone)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]

    def lowest(package: str) -> tuple[int, ...]:
        spec = next(d for d in deps if re.match(rf"{package}>=", d))
        return tuple(int(x) for x in spec.split(">=", 1)[1].split("."))

    grpc_needs, protobuf_needs = _stamped_versions()
    assert lowest("grpcio") >= grpc_needs, (lowest("grpcio"), grpc_needs)
    assert lowest("protobuf") >= protobuf_needs, (lowest("protobuf"), protobuf_needs)
    assert _without_stamps("GRPC_GENERATED_VERSION = '1.85.4'\n") == _without_stamps("GRPC_GENERATED_VERSION = '1.85.1'\n")


def test_service_shape():
    from protos.moray.v1 import moray_pb2

    service = moray_pb2.DESCRIPTOR.services_by_name["Moray"]
    methods = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    assert methods == {"Generate": (False, True), "Complete": (False, False), "ListModels": (False, False), "Health": (False, False)}
    assert moray_pb2.DESCRIPTOR.package == "moray.v1"
