"""Checkpoints: nested state dicts saved to and loaded from safetensors files.

A checkpoint is usually ``{"model": model.state_dict(), "optimizer": opt.state_dict(),
"epoch": 3}``. Arrays are stored as safetensors tensors under dotted keys
(``model.fc.weight``); everything else (ints, floats, strings, lists of them) goes into the
header's ``__metadata__``, one JSON string per dotted key. The exact nesting is recorded in
the metadata entry ``needle.tree`` so ``load`` rebuilds the very dict that was saved, even
though module keys themselves contain dots. Files without that entry (written by other
tools) load as a flat ``{name: NDArray}`` dict.

The format is written and parsed here rather than through the ``safetensors`` package so
that bfloat16 works, writes are atomic (temp file, fsync, ``os.replace``: a crash never
leaves a half-written checkpoint behind), and every inconsistency in a file is reported as a
``ModelFormatError`` naming the file. Pickle is never involved.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
from collections.abc import Mapping
from glob import escape as glob_escape
from pathlib import Path

import numpy as np

from .backend_ndarray import NDArray, default_device
from .backend_ndarray.dtypes import canonical, to_numpy_dtype
from .errors import ArgumentError, ArgumentTypeError, DTypeError, ModelFormatError

__all__ = ["load", "save"]

_ST_DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64",
              "int32": "I32", "int64": "I64", "bool": "BOOL", "uint8": "U8", "int8": "I8"}
_NEEDLE_DTYPES = {v: k for k, v in _ST_DTYPES.items()}
_TREE_KEY = "needle.tree"
# Written beside the tree since format 1: a file that has it but lacks the tree was written by
# needle and damaged (a flipped byte in the tree's key would otherwise load as a flat dict and
# silently drop every non-tensor value).
_FORMAT_KEY, _FORMAT = "needle.format", "1"
_MAX_HEADER = 100 * 2**20  # the safetensors reference implementation's limit
_TENSOR, _VALUE = "tensor", "value"


def _is_array(x) -> bool:
    """NDArrays, Tensors and numpy arrays are stored as tensors; anything else is a value."""
    return isinstance(x, (np.ndarray, NDArray)) or (hasattr(x, "numpy") and hasattr(x, "shape"))


def _host(x) -> np.ndarray:
    """A leaf's data on the host, fetched one tensor at a time while writing."""
    return np.ascontiguousarray(x if isinstance(x, np.ndarray) else x.numpy())


def _flatten(obj, path: tuple[str, ...], tensors: dict, values: dict, where: str):
    """Walk ``obj``; fill ``tensors``/``values`` by dotted key; return the structure tree."""
    if isinstance(obj, Mapping):
        tree = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise ModelFormatError(f"cannot save {where}: key {k!r} at "
                                       f"{'.'.join(path) or 'top level'} is not a string")
            tree[k] = _flatten(v, path + (k,), tensors, values, where)
        return tree
    key = ".".join(path)
    if not path:
        raise ModelFormatError(f"cannot save {where}: a checkpoint must be a dict, "
                               f"got {type(obj).__name__}")
    if key in tensors or key in values or key in (_TREE_KEY, _FORMAT_KEY):
        raise ModelFormatError(f"cannot save {where}: two entries flatten to the key {key!r}; "
                               "rename one of them")
    if _is_array(obj):
        tensors[key] = obj
        return _TENSOR
    try:
        values[key] = json.dumps(obj.item() if isinstance(obj, np.generic) else obj)
    except TypeError:
        raise ModelFormatError(f"cannot save {where}: {key!r} holds a {type(obj).__name__}; "
                               "checkpoints hold arrays, numbers, strings, None and lists of "
                               "them") from None
    return _VALUE


def _path(path, where: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentTypeError(f"{where}: path must be a str or os.PathLike, got "
                                f"{type(path).__name__}")
    return Path(path)


def save(state: Mapping, path: str | os.PathLike) -> None:
    """Write the (nested) dict ``state`` to ``path`` as a safetensors file, atomically."""
    path = _path(path, "save")
    tensors: dict = {}
    values: dict[str, str] = {}
    tree = _flatten(state, (), tensors, values, str(path))
    header: dict = {"__metadata__": {**values, _TREE_KEY: json.dumps(tree),
                                     _FORMAT_KEY: _FORMAT}}
    offset = 0
    for key, array in tensors.items():
        try:
            dtype = canonical(array.dtype)
        except DTypeError as e:
            raise ModelFormatError(f"cannot save {path}: {key!r}: {e}") from None
        shape = [int(d) for d in array.shape]
        nbytes = math.prod(shape) * to_numpy_dtype(dtype).itemsize
        header[key] = {"dtype": _ST_DTYPES[dtype], "shape": shape,
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned

    _check_directory(path)
    _remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path, os.getpid()), suffix=".tmp",
                               dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for key, array in tensors.items():
                data = _host(array)
                begin, end = header[key]["data_offsets"]
                if data.nbytes != end - begin:  # a leaf whose numpy() disagrees with it
                    raise ModelFormatError(f"cannot save {path}: {key!r} gave {data.nbytes} "
                                           f"bytes of data for {end - begin}")
                f.write(data.view(np.uint8).data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _check_directory(path: Path) -> None:
    """Refuse to invent directories: a typo in a path should not scatter checkpoints."""
    if path.is_dir():
        raise ArgumentError(f"cannot save to {path}: it is a directory; give a file name such "
                            "as model.safetensors")
    if not path.parent.is_dir():
        raise ArgumentError(f"cannot save to {path}: the directory {path.parent} does not "
                            "exist; create it first (e.g. Path(...).mkdir(parents=True))")


def _temp_prefix(path: Path, pid: int) -> str:
    """Temp files carry their writer's pid, so a later save can tell a dead writer's leftover
    from a save in progress in another process."""
    return f".{path.name}.{pid}."


def _remove_stale_temps(path: Path) -> None:
    """Delete temp files left by writers of ``path`` that died mid-save (killed, power loss)."""
    for temp in path.parent.glob(f".{glob_escape(path.name)}.*.tmp"):
        pid_text = temp.name[len(path.name) + 2:].split(".", 1)[0]
        if pid_text.isdigit() and not _process_alive(int(pid_text)):
            temp.unlink(missing_ok=True)


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # someone else's live process, or a platform that cannot tell: keep it
    return True


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable; not every platform lets a directory be opened for this."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_header(path: Path) -> tuple[dict, int, int]:
    """Parse and check a safetensors header; returns (header, data start, data length).

    Shared by checkpoints and model loading, so every malformed file gets the same errors.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelFormatError(f"{path} is not a safetensors file: it is {size} bytes, "
                                       "shorter than the 8-byte header length (truncated?)")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER):
                raise ModelFormatError(f"{path} is truncated or not safetensors: its header "
                                       f"length {n} does not fit in a file of {size} bytes")
            raw = f.read(n)
    except FileNotFoundError:
        raise ModelFormatError(f"checkpoint {path} does not exist") from None
    except IsADirectoryError:
        raise ModelFormatError(f"checkpoint {path} is a directory, not a file") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise ModelFormatError(f"{path}: the safetensors header nests too deeply to be a "
                               "safetensors header; the file is corrupt") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: the safetensors header is not valid JSON ({e}); "
                               "the file is corrupt") from None
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path}: the safetensors header is not a JSON object")
    return header, 8 + n, size - 8 - n


def _check_entries(path: Path, header: dict, data_len: int) -> dict[str, tuple]:
    """Validate every tensor entry; returns name -> (dtype, shape, begin, end)."""
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _NEEDLE_DTYPES.get(info["dtype"])
            shape = tuple(_header_int(d) for d in info["shape"])
            begin, end = (_header_int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ModelFormatError(f"{path}: tensor {name!r} has a malformed header entry "
                                   f"{info!r}") from None
        if dtype is None:
            raise ModelFormatError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which "
                                   f"needle does not support ({', '.join(_NEEDLE_DTYPES)})")
        expected = math.prod(shape) * to_numpy_dtype(dtype).itemsize
        if min(shape, default=0) < 0 or begin < 0 or end - begin != expected:
            raise ModelFormatError(f"{path}: tensor {name!r} of shape {shape} and dtype {dtype} "
                                   f"needs {expected} bytes but its offsets give {end - begin}")
        entries[name] = (dtype, shape, begin, end)
    position = 0
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda e: e[1][2:]):
        if begin != position:
            raise ModelFormatError(f"{path}: tensor {name!r} starts at byte {begin}, expected "
                                   f"{position}; the data section is corrupt")
        position = end
    if position != data_len:
        raise ModelFormatError(f"{path}: the tensors need {position} bytes of data but the file "
                               f"holds {data_len}; the file is truncated or corrupt")
    return entries


def _header_int(value) -> int:
    """A non-negative integer from a header; a float such as 2.7 is an error, not truncated."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(value)
    return value


def _unflatten(tree, path: tuple[str, ...], arrays: dict, values: dict, where: Path):
    if isinstance(tree, dict):
        return {k: _unflatten(v, path + (k,), arrays, values, where) for k, v in tree.items()}
    key = ".".join(path)
    source = arrays if tree == _TENSOR else values if tree == _VALUE else None
    if source is None or key not in source:
        raise ModelFormatError(f"{where}: the needle.tree metadata names {key!r} but the file "
                               "has no such entry; the file is corrupt")
    return source[key]


def load(path: str | os.PathLike, device=None) -> dict:
    """Read a checkpoint written by ``save`` (or any safetensors file) onto ``device``.

    Arrays come back as NDArrays on ``device`` (default: ``default_device()``), plain values
    as the Python objects that were saved, in the nesting that was saved.
    """
    path = _path(path, "load")
    header, start, data_len = read_header(path)
    entries = _check_entries(path, header, data_len)
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ModelFormatError(f"{path}: __metadata__ must be a JSON object of strings")
    device = device or default_device()
    arrays = {}
    if entries:
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=start, shape=(data_len,))
        for name, (dtype, shape, begin, end) in entries.items():
            host = data[begin:end].view(to_numpy_dtype(dtype)).reshape(shape)
            arrays[name] = NDArray(host, device=device, dtype=dtype)
        del data
    if _TREE_KEY not in metadata:
        if _FORMAT_KEY in metadata:
            raise ModelFormatError(f"{path} was written by needle but its {_TREE_KEY} metadata "
                                   "entry is missing; the file is corrupt (its tensors can be "
                                   "read with safetensors, its other values are lost)")
        return arrays
    own = (_TREE_KEY, _FORMAT_KEY)
    try:
        tree = json.loads(metadata[_TREE_KEY])
        values = {k: json.loads(v) for k, v in metadata.items() if k not in own}
        if not isinstance(tree, dict):
            raise ModelFormatError(f"{path}: the needle.tree metadata is not a JSON object")
        return _unflatten(tree, (), arrays, values, path)
    except (TypeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: needle metadata is not valid JSON ({e})") from None
    except RecursionError:
        raise ModelFormatError(f"{path}: the needle metadata nests too deeply; the file is "
                               "corrupt") from None
