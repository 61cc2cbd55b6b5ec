"""The supervisor's finiteness check of safetensors files, read with numpy, against files torch writes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from serving.finite_weights import first_non_finite

FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e5m2, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_is_found_in_every_float_dtype(tmp_path, dtype, bad):
    ok = torch.linspace(-3, 3, 1000).to(dtype)
    broken = torch.linspace(-3, 3, 5000)
    broken[4321] = bad
    broken = broken.to(dtype)
    f = tmp_path / "w.safetensors"
    save_file({"a.ok": ok, "b.ints": torch.arange(7, dtype=torch.int64), "c.broken": broken}, str(f))
    holds_non_finite = not torch.isfinite(broken.float()).all()  # e4m3fn turns inf into NaN; both are caught
    # a small chunk makes the bad value land in a later chunk of its tensor
    assert first_non_finite(f, chunk_bytes=64) == ("c.broken" if holds_non_finite else None)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_finite_extremes_are_finite(tmp_path, dtype):
    info = torch.finfo(dtype)
    t = torch.tensor([info.max, info.min, info.tiny, -info.tiny, 0.0, -0.0], dtype=torch.float64).to(dtype)
    f = tmp_path / "w.safetensors"
    save_file({"x": t}, str(f), metadata={"format": "pt"})
    assert first_non_finite(f) is None


def test_not_a_safetensors_file_is_refused_not_called_finite(tmp_path):
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00notjs")
    with pytest.raises(ValueError, match="not a safetensors file"):
        first_non_finite(f)
    f.write_bytes(b"\x01")
    with pytest.raises(ValueError, match="not a safetensors file"):
        first_non_finite(f)
