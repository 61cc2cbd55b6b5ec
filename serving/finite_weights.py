"""Is every floating-point value of a safetensors file finite? Read with numpy from the file's own layout, so the
fleet supervisor checks an adapter before any engine loads it without importing torch.

Layout (the safetensors format): an 8-byte little-endian header length N, N bytes of JSON naming each tensor's
dtype, shape and [begin, end) byte offsets into the data that follows. A float is non-finite exactly when its
exponent bits are all ones, so each dtype is checked on its raw bits: bfloat16, which numpy lacks, included.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

# dtype -> (unsigned view, exponent mask): all exponent bits set is inf or NaN. F8_E4M3 has no inf: NaN is
# S.1111.111, so its mask covers exponent and mantissa.
_EXPONENT = {
    "F64": (np.uint64, 0x7FF0_0000_0000_0000),
    "F32": (np.uint32, 0x7F80_0000),
    "F16": (np.uint16, 0x7C00),
    "BF16": (np.uint16, 0x7F80),
    "F8_E5M2": (np.uint8, 0x7C),
    "F8_E4M3": (np.uint8, 0x7F),
}
_EXACT = {"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"}  # integers: always finite


def first_non_finite(path: str | Path, chunk_bytes: int = 64 << 20) -> str | None:
    """The name of the first tensor of `path` holding NaN or inf, or None if all are finite. Raises ValueError
    on a file that is not safetensors or a dtype it does not know (rather than calling it finite)."""
    path = Path(path)
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path.name}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path.name}: not a safetensors file (header is not JSON: {e})") from e
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = meta["dtype"]
        if dtype in _EXACT:
            continue
        if dtype not in _EXPONENT:
            raise ValueError(
                f"{path.name}: tensor {name} has dtype {dtype}, which the finiteness check does not know; "
                f"expected one of {sorted(_EXPONENT)} or an integer type"
            )
        view, mask = _EXPONENT[dtype]
        begin, end = meta["data_offsets"]
        step = chunk_bytes - chunk_bytes % np.dtype(view).itemsize
        for at in range(begin, end, step):  # bounded memory for large tensors
            bits = data[at : min(end, at + step)].view(view)
            if np.any((bits & view(mask)) == view(mask)):
                return name
    return None
