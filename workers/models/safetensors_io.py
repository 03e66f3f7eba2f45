"""Memory-mapped safetensors reading with numpy, single-file or sharded via `model.safetensors.index.json`.

We parse the header ourselves (8-byte little-endian length, then JSON) so that bf16/fp8 tensors map
straight onto `ml_dtypes` without torch, a slice reads only the bytes it covers, and a corrupt file is
reported with the file name and what is wrong with it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from .config import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file


def _corrupt(path: Path, why: str) -> ModelLoadError:
    return ModelLoadError(f"corrupt safetensors header in {path.name}: {why}")


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parses and validates one file's header; returns name -> TensorInfo."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _corrupt(path, "file shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER_BYTES):
            raise _corrupt(path, f"header length {n} exceeds the file size {size}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _corrupt(path, f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    data_start = 8 + n
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(s) for s in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise _corrupt(path, f"bad entry for tensor '{name}': {entry!r}") from None
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - begin != expected or begin < 0 or data_start + end > size:
            raise _corrupt(path, f"tensor '{name}' offsets {begin}..{end} do not fit its shape/dtype or the file")
        infos[name] = TensorInfo(path, dtype, shape, data_start + begin)
    return infos


class CheckpointReader:
    """All tensors of a checkpoint directory, read lazily through memory maps."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.tensors: dict[str, TensorInfo] = {}
        for file in self._files():
            for name, info in read_header(file).items():
                if name in self.tensors:
                    raise ModelLoadError(f"tensor '{name}' appears in more than one safetensors file")
                self.tensors[name] = info
        self._maps: dict[Path, np.memmap] = {}

    def _files(self) -> list[Path]:
        index = self.model_dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ModelLoadError(f"{INDEX_FILE} is malformed: {e}") from None
            files = sorted({self.model_dir / f for f in weight_map.values()})
        elif (self.model_dir / SINGLE_FILE).is_file():
            files = [self.model_dir / SINGLE_FILE]
        else:
            files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"no safetensors files in {self.model_dir}")
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{INDEX_FILE} names a missing file: {f.name}")
        return files

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def keys(self) -> set[str]:
        return set(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def array(self, name: str) -> np.ndarray:
        """A read-only memory-mapped view of the whole tensor (no bytes are read until sliced)."""
        info = self.tensors[name]
        mm = self._maps.get(info.file)
        if mm is None:
            mm = self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        nbytes = int(np.prod(info.shape, dtype=np.int64)) * info.dtype.itemsize
        return mm[info.offset : info.offset + nbytes].view(info.dtype).reshape(info.shape)
