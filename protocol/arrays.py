"""Numpy-backed array fields for protocol messages.

Token arrays never travel as Python lists of floats. Inside a process and through Ray's object
store a field holds a 1-D ``numpy.ndarray`` (pickled as one buffer); in JSON (HTTP) it is written as
``{"dtype": "float32", "b64": "<base64 of the little-endian bytes>"}``. Reading accepts an ndarray,
that JSON form (a dtype with an explicit byte order, e.g. ``">f4"``, is read in that order), or a
plain list (convenient in tests and hand-written requests).
"""

from __future__ import annotations

import base64
from typing import Annotated, Any

import numpy as np
from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema


def _to_array(dtype: str):
    target = np.dtype(dtype).newbyteorder("<")

    def convert(value: Any) -> np.ndarray:
        if isinstance(value, dict):
            if set(value) != {"dtype", "b64"}:
                raise ValueError(f"array object must have keys 'dtype' and 'b64', got {sorted(value)}")
            if not isinstance(value["b64"], str) or not isinstance(value["dtype"], str):
                raise ValueError("array object: 'dtype' and 'b64' must be strings")
            raw = base64.b64decode(value["b64"], validate=True)
            try:
                src = np.dtype(value["dtype"])
            except TypeError:
                raise ValueError(f"array dtype: {value['dtype']!r} is not a numpy dtype") from None
            # an explicit byte order (">f4", "<f4") is honoured; none means little-endian
            src = src if src.byteorder == ">" else src.newbyteorder("<")
            if len(raw) % src.itemsize:
                raise ValueError(f"array bytes ({len(raw)}) not a multiple of {src} itemsize")
            value = np.frombuffer(raw, dtype=src)
        arr = np.asarray(value)
        if arr.ndim != 1:
            raise ValueError(f"array must be 1-D, got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "biuf":
            raise ValueError(f"array must be numeric, got dtype {arr.dtype}")
        if target.kind in "iu" and arr.dtype.kind == "f":
            if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
                raise ValueError("integer array received non-integer values")
        if target.kind in "iu" and arr.size:
            lo, hi = np.iinfo(target).min, np.iinfo(target).max
            if arr.min() < lo or arr.max() > hi:
                raise ValueError(f"values [{arr.min()}, {arr.max()}] outside {target.name} range [{lo}, {hi}]")
        out = np.ascontiguousarray(arr, dtype=target)
        out.setflags(write=False)
        return out

    return convert


def _to_json(arr: np.ndarray) -> dict[str, str]:
    le = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    return {"dtype": le.dtype.name, "b64": base64.b64encode(le.tobytes()).decode("ascii")}


def _array_type(dtype: str):
    return Annotated[
        np.ndarray,
        BeforeValidator(_to_array(dtype)),
        PlainSerializer(_to_json, when_used="json"),
        WithJsonSchema(
            {
                "type": "object",
                "properties": {"dtype": {"type": "string"}, "b64": {"type": "string"}},
                "description": f"1-D {dtype} array, base64 of little-endian bytes",
            }
        ),
    ]


Int32Array = _array_type("int32")
Int8Array = _array_type("int8")
Float32Array = _array_type("float32")
