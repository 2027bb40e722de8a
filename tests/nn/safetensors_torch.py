"""safetensors files for PyTorch tensors, written from the format's description
(Debian has no safetensors package), independently of tandem's C++ code:

    header_bytes: u64 little-endian | header: UTF-8 JSON | data
    header = {"__metadata__": {str: str}  (optional),
              name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...}

Offsets are relative to the start of the data part; the tensors cover it
without gaps or overlaps. The tests use this module to carry weights and
outputs between tandem and torch in both directions.
"""
import json
import struct

import torch

_DTYPES = {
    "F32": torch.float32,
    "F64": torch.float64,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "U8": torch.uint8,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def save(path, tensors, metadata=None):
    """Writes {name: tensor} (in dict order) and optional {str: str} metadata."""
    header = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    blobs = []
    offset = 0
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        if t.dtype not in _NAMES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {t.dtype}")
        # Raw little-endian bytes through a uint8 view (works for bfloat16 too).
        blob = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def load(path):
    """Returns ({name: tensor}, metadata), checking the layout as it reads."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{path}: {len(raw)} bytes, shorter than the header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise ValueError(f"{path}: header length {n} exceeds the file")
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = raw[8 + n:]
    metadata = header.pop("__metadata__", {})
    tensors = {}
    spans = []
    for name, entry in header.items():
        dtype = _DTYPES[entry["dtype"]]
        shape = entry["shape"]
        begin, end = entry["data_offsets"]
        count = 1
        for d in shape:
            count *= d
        if end - begin != count * torch.tensor([], dtype=dtype).element_size():
            raise ValueError(f"{path}: {name}: {end - begin} bytes for shape {shape}")
        buf = bytearray(data[begin:end])
        flat = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        tensors[name] = flat.view(dtype).reshape(shape).clone()
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise ValueError(f"{path}: {name} starts at {begin}, expected {position}")
        position = end
    if position != len(data):
        raise ValueError(f"{path}: {len(data) - position} bytes after the last tensor")
    return tensors, metadata
