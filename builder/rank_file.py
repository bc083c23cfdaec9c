"""A safetensors file laid out up front and filled in pieces: a rank's tensors are never held together."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from runtime.io.checkpoint import SAFETENSORS_CODES
from builder.validation import BuildError


class RankFileWriter:
    """A safetensors file laid out up front: the header is written when the file is opened, and
    `write` fills each tensor's bytes, in any order and in pieces, without holding them."""

    def __init__(self, path: Path, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]):
        self.path, self.specs = path, specs
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        self._offsets: dict[str, int] = {}
        end = 0
        for name, (dtype, shape) in specs.items():
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": SAFETENSORS_CODES[dtype], "shape": list(shape), "data_offsets": [end, end + nbytes]}
            self._offsets[name] = end
            end += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._data_start = 8 + len(raw)
        self._written = dict.fromkeys(specs, 0)
        self._file = open(path, "wb")
        self._file.write(len(raw).to_bytes(8, "little") + raw)
        self._file.truncate(self._data_start + end)

    def write(self, name: str, tensor: Tensor, offset: int = 0) -> None:
        """Write `tensor` as elements offset.. of `name` (row-major)."""
        dtype, shape = self.specs[name]
        if tensor.dtype != dtype or offset + tensor.numel() > math.prod(shape):
            raise BuildError(
                f"{self.path}: tensor {name!r} piece of {tensor.dtype} x {tensor.numel()} at {offset} does not fit "
                f"{dtype} {list(shape)}"
            )
        self._file.seek(self._data_start + self._offsets[name] + offset * dtype.itemsize)
        self._file.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self._written[name] += tensor.numel()

    def __enter__(self) -> "RankFileWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Close the file; after a clean exit, every tensor must have been written exactly once."""
        self._file.close()
        if exc_type is None:
            for name, (_, shape) in self.specs.items():
                if self._written[name] != math.prod(shape):
                    raise BuildError(f"{self.path}: tensor {name!r} got {self._written[name]} of {math.prod(shape)} elements")
