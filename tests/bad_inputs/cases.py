"""The bad-input catalogue: calls of needle's public API that must fail with a clear error.

Each case is ``(code, names)``: ``code`` is one Python statement run in the group's namespace
(see ``SETUP``), and ``names`` the word(s) of which at least one must appear in the error
message (case-insensitive): the argument that was wrong. The worker runs each group in its
own subprocess (a crash or hang fails that group, not the test run); the test asserts every
case raised a ``NeedleError`` naming its argument. CLI cases are argument lists for
``needle.cli.main``: they must exit non-zero with the name on stderr and no traceback.
"""

from __future__ import annotations

# ruff: noqa: E501 -- one case per line reads best

# -- setup code per group; DEVICE is substituted with each device the group runs on --------

SETUP = {
    "arrays": """
import numpy as np
from needle import backend_ndarray as nd
DEV = DEVICE
A = nd.array(np.arange(6, dtype=np.float32).reshape(2, 3), device=DEV)
V = nd.array(np.arange(3, dtype=np.float32), device=DEV)
S = nd.array(np.array(2.0, dtype=np.float32), device=DEV)
I = nd.array(np.array([0, 1, 2], dtype=np.int32), device=DEV)
OTHER = nd.cpu() if DEV == nd.cpu_numpy() else nd.cpu_numpy()
""",
    "ops": """
import numpy as np
import needle as ndl
from needle import ops
DEV = DEVICE
T = ndl.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3), device=DEV, requires_grad=True)
U = ndl.Tensor(np.ones((4, 5), dtype=np.float32), device=DEV)
X = ndl.Tensor(np.ones((1, 5, 5, 3), dtype=np.float32), device=DEV)   # NHWC
W = ndl.Tensor(np.ones((3, 3, 3, 4), dtype=np.float32), device=DEV)   # KKCiCo
Q = ndl.Tensor(np.ones((1, 2, 4, 8), dtype=np.float32), device=DEV)
LOGITS = ndl.Tensor(np.zeros((3, 4), dtype=np.float32), device=DEV)
EMB = ndl.Tensor(np.ones((10, 4), dtype=np.float32), device=DEV)
""",
    "nn": """
import numpy as np
import needle as ndl
from needle import nn
DEV = DEVICE
X = ndl.Tensor(np.ones((2, 5), dtype=np.float32), device=DEV)
IMG = ndl.Tensor(np.ones((1, 3, 6, 6), dtype=np.float32), device=DEV)   # NCHW
SEQ = ndl.Tensor(np.ones((3, 2, 4), dtype=np.float32), device=DEV)      # (T, B, D)
LOGITS = ndl.Tensor(np.zeros((3, 4), dtype=np.float32), device=DEV)
LIN = nn.Linear(4, 3, device=DEV)
""",
    "optim": """
import math
import numpy as np
import needle as ndl
from needle import nn, optim
MODEL = nn.Linear(3, 2)
P = list(MODEL.parameters())
OPT = optim.Adam(P, lr=0.01)
""",
    "data": """
import numpy as np
import needle as ndl
from needle import data
DS = data.ArrayDataset(np.zeros((10, 3), dtype=np.float32), np.zeros(10, dtype=np.int64))
IDS = np.arange(100)
""",
    "serialization": """
import json, os, struct, tempfile
import numpy as np
import needle as ndl
TMP = tempfile.mkdtemp()
T = ndl.Tensor(np.ones((2, 2), dtype=np.float32))

def raw(header, data=b"", name="x.safetensors"):
    path = os.path.join(TMP, name)
    h = json.dumps(header).encode() if not isinstance(header, bytes) else header
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)
    return path

def fp32(shape, offsets):
    return {"t": {"dtype": "F32", "shape": shape, "data_offsets": offsets}}

GOOD = os.path.join(TMP, "good.safetensors")
ndl.save({"w": T}, GOOD)
""",
    "models": """
import json, os, shutil, tempfile
import numpy as np
import needle as ndl
from needle import models, serve
TMP = tempfile.mkdtemp()
MODEL_DIR = os.path.join(TMP, "tiny")
import torch, transformers
_cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
torch.manual_seed(0)
transformers.LlamaForCausalLM(_cfg).save_pretrained(MODEL_DIR, safe_serialization=True)
M = models.load_pretrained(MODEL_DIR, device=ndl.cpu_numpy())

def variant(**changes):
    path = tempfile.mkdtemp(dir=TMP)
    for f in os.listdir(MODEL_DIR):
        shutil.copy(os.path.join(MODEL_DIR, f), path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path

def with_file(name, text):
    path = variant()
    with open(os.path.join(path, name), "w") as f:
        f.write(text)
    return path
""",
    "cli": """
import os, tempfile
TMP = tempfile.mkdtemp()
EMPTY = os.path.join(TMP, "empty"); os.mkdir(EMPTY)
SCRIPT = os.path.join(TMP, "job.py"); open(SCRIPT, "w").write("pass")
""",
}

# groups that run once per device (the expressions replace DEVICE)
DEVICES = {
    "arrays": ["nd.cpu_numpy()", "nd.cpu()"],
    "ops": ["ndl.cpu_numpy()", "ndl.cpu()"],
    "nn": ["ndl.cpu_numpy()", "ndl.cpu()"],
}


def _arrays() -> list[tuple[str, str | tuple[str, ...]]]:
    c: list[tuple[str, str | tuple[str, ...]]] = []
    for bad in ["None", "'abc'", "(2.5,)", "(-2, 3)", "(4, 4)", "(-1, -1)", "(2, 'x')",
                "(1e30,)"]:
        c.append((f"A.reshape({bad})", "shape"))
    for bad in ["(0,)", "(0, 0)", "(0, 5)", "('a', 1)", "5", "(0, 1, 2)", "(1.0, 0)"]:
        c.append((f"A.permute({bad})", ("axes", "axis")))
    for bad in ["(3, 3)", "(3,)", "None", "(2, -3)", "('a', 3)"]:
        c.append((f"A.broadcast_to({bad})", "shape"))
    for fn in ["sum", "max", "min", "mean", "argmax"]:
        for bad in ["5", "-3", "'a'", "1.5"]:
            c.append((f"A.{fn}(axis={bad})", "axis"))
    c.append(("S.sum(axis=0)", "axis"))
    for bad in ["5", "-3", "(0, 0)", "'a'"]:
        c.append((f"A.flip({bad})", "ax"))
    for bad in ["A[5]", "A[0, 0, 0]", "A['a']", "A[1.5]", "A[:, 7]", "A[-3]", "A[::0]",
                "A[[0, 5]]"]:
        c.append((bad, ("index", "indices", "axis", "step", "slice")))
    c.append(("A.__setitem__(0, nd.array(np.ones(2, dtype=np.float32), device=DEV))", "shape"))
    c.append(("A.__setitem__(0, 'x')", ("value", "dtype")))
    c.append(("A.__setitem__(7, 1.0)", "index"))
    c.append(("A.broadcast_to((4, 2, 3)).__setitem__(0, 1.0)", ("broadcast", "stride")))
    for bad in ["(1, 1)", "None", "((1, 1), (1, -1))", "((1, 1),)", "((1,), (1, 1))", "5"]:
        c.append((f"A.pad({bad})", ("pad", "axes")))
    for bad in ["'float8'", "3", "'int128'"]:
        c.append((f"A.astype({bad})", "dtype"))
    c.append(("A @ A", ("shape", "dimension")))
    c.append(("A @ 5", ("matmul", "operand", "other")))
    c.append(("V @ A", ("shape", "dimension")))
    c.append(("A + nd.array(np.ones((3, 2), dtype=np.float32), device=DEV)", ("broadcast", "shape")))
    c.append(("A + 'x'", ("operand", "other", "scalar")))
    c.append(("A + None", ("operand", "other", "scalar")))
    c.append(("A * [1.0, 2.0]", ("broadcast", "shape")))
    c.append(("A += nd.array(np.ones((3, 2, 3), dtype=np.float32), device=DEV)", ("in-place", "shape")))
    c.append(("nd.concatenate([S, S])", ("0-d", "dimension", "scalar")))
    c.append(("nd.concatenate([A, V])", ("dimension", "shape")))
    c.append(("nd.concatenate([])", ("array", "empty")))
    c.append(("nd.concatenate([A, A], axis=5)", "axis"))
    c.append(("nd.concatenate([A, 5])", ("arrays", "NDArray")))
    c.append(("nd.stack([A, V])", "shape"))
    c.append(("nd.stack([])", ("array", "empty")))
    c.append(("nd.stack([A, A], axis=4)", "axis"))
    c.append(("nd.array('abc', device=DEV)", ("str", "array", "number")))
    c.append(("nd.array([[1, 2], [3]], device=DEV)", ("ragged", "shape", "sequence")))
    c.append(("nd.array(np.array(['a']), device=DEV)", "dtype"))
    c.append(("nd.array(object(), device=DEV)", ("array", "object")))
    c.append(("nd.array([1.0], dtype='foo', device=DEV)", "dtype"))
    c.append(("nd.array([1.0], device='gpu')", "device"))
    c.append(("nd.array([1.0], device=-1)", "device"))
    c.append(("nd.array([1.0], device=3.5)", "device"))
    c.append(("nd.array(np.array([1, 2], dtype=np.complex64), device=DEV)", "dtype"))
    for fn in ["zeros", "ones", "empty"]:
        for bad in ["(2, 'a')", "-1", "(2.5,)", "None"]:
            c.append((f"nd.{fn}({bad}, device=DEV)", "shape"))
    c.append(("nd.full((2,), 'a', device=DEV)", ("fill", "value")))
    c.append(("nd.full((2,), 1.0, dtype='x', device=DEV)", "dtype"))
    c.append(("nd.from_dlpack([1, 2, 3])", ("dlpack", "DLPack")))
    c.append(("nd.from_dlpack(None)", ("dlpack", "DLPack")))
    c.append(("A.transpose(5)", ("axes", "axis")))
    c.append(("A.transpose((0, 2))", ("axes", "axis")))
    c.append(("A.swapaxes(0, 5)", "axis"))
    c.append(("A.item()", ("size", "element")))
    c.append(("A.fill('a')", "value"))
    c.append(("A.to('gpu9')", "device"))
    c.append(("A.as_strided((2, 3), (3, 9))", ("strides", "outside", "bounds")))
    c.append(("A.as_strided((2, 3), (1,))", "strides"))
    c.append(("A.as_strided((2, -3), (3, 1))", "shape"))
    c.append(("A.take(nd.array(np.array([0.5], dtype=np.float32), device=DEV))", ("indices", "dtype")))
    c.append(("A.take(nd.array(np.array([7], dtype=np.int32), device=DEV))", ("index", "indices")))
    c.append(("A.take(nd.array(np.array([-1], dtype=np.int32), device=DEV))", ("index", "indices")))
    c.append(("A.rmsnorm(V[:2], 1e-6)", ("weight", "shape")))
    c.append(("A.layernorm(V[:2], V[:2], 1e-5)", ("weight", "shape")))
    c.append(("nd.where(A > 1, A, V[:2])", ("broadcast", "shape")))
    c.append(("nd.maximum(A, 'x')", ("operand", "other", "scalar")))
    c.append(("nd.broadcast_shapes((2, 3), (4,))", ("broadcast", "shape")))
    for bad in ["2**31", "(-2**31 - 1)", "2**40"]:  # the CPU backends disagreed here
        c.append((f"I + {bad}", ("integer", "int32")))
        c.append((f"I.fill({bad})", ("integer", "int32")))
    c.append(("I.astype('int64') * 2**63", ("integer", "int64")))
    c.append(("A.astype('float32').reshape((2, 3)).permute((1,))", ("axes", "axis")))
    c += _decode_projections()
    return c


def _decode_projections() -> list[tuple[str, str | tuple[str, ...]]]:
    """nd.rmsnorm_matvec / nd.matvec_add: A (2, 3) is x, V (3,) the norm's weight, A also a
    (p=2, dim=3) projection, so total is (2, 2)."""
    c: list[tuple[str, str | tuple[str, ...]]] = []
    c.append(("nd.rmsnorm_matvec(A, V, A.transpose())", "weight"))           # (3, 2): dim 2
    c.append(("nd.rmsnorm_matvec(A, V, V)", "weight"))                       # not a matrix
    c.append(("nd.rmsnorm_matvec(A, V, A[:1], activation='swiglu')", "weight"))  # odd rows
    c.append(("nd.rmsnorm_matvec(A, V[:2], A)", "norm_weight"))
    c.append(("nd.rmsnorm_matvec(A, V, A.astype('float16'))", ("weight", "dtype")))
    c.append(("nd.rmsnorm_matvec(I, I, A)", "x"))                            # integer x
    c.append(("nd.rmsnorm_matvec(S, V, A)", "x"))                            # 0-d x
    c.append(("nd.rmsnorm_matvec(A, V, A, activation='gelu')", "activation"))
    c.append(("nd.rmsnorm_matvec(A, V, A, eps='a')", "eps"))
    c.append(("nd.rmsnorm_matvec(A, V, np.ones((2, 3), np.float32))", "weight"))
    c.append(("nd.rmsnorm_matvec(A, [1.0, 1.0, 1.0], A)", "norm_weight"))
    c.append(("nd.rmsnorm_matvec(np.ones((2, 3)), V, A)", "x"))
    c.append(("nd.rmsnorm_matvec(A, V, A.to(OTHER))", "weight"))
    c.append(("nd.rmsnorm_matvec(A, V.to(OTHER), A)", "norm_weight"))
    c.append(("nd.matvec_add(A, A, V)", "total"))                            # wrong shape
    c.append(("nd.matvec_add(A, A, nd.zeros((2, 4), device=DEV)[:, ::2])", "total"))  # non-compact
    c.append(("nd.matvec_add(A, A, nd.zeros((2, 2), dtype='float16', device=DEV))", "total"))
    c.append(("nd.matvec_add(A, A, nd.zeros((2, 2), device=OTHER))", "total"))
    c.append(("nd.matvec_add(A, A, 0.0)", "total"))
    c.append(("nd.matvec_add(A, A.transpose(), nd.zeros((2, 3), device=DEV))", "weight"))
    c.append(("nd.matvec_add(A, A.astype('float64'), nd.zeros((2, 2), device=DEV))", ("weight", "dtype")))
    c.append(("nd.matvec_add(I, A, nd.zeros((3,), device=DEV))", "a"))
    return c


def _ops() -> list[tuple[str, str | tuple[str, ...]]]:
    c: list[tuple[str, str | tuple[str, ...]]] = []
    c.append(("ndl.Tensor('abc', device=DEV)", ("str", "array", "number")))
    c.append(("ndl.Tensor([1.0, 2.0], dtype='float99', device=DEV)", "dtype"))
    c.append(("ndl.Tensor([1.0], device='tpu')", "device"))
    c.append(("ndl.Tensor([1.0], device=2.5)", "device"))
    c.append(("ndl.Tensor([[1.0], [2.0, 3.0]], device=DEV)", ("ragged", "shape", "sequence")))
    for bad in ["None", "(4, 4)", "'a'", "(2.5, 2)"]:
        c.append((f"ops.reshape(T, {bad})", "shape"))
    for bad in ["(0, 5)", "(1,)"]:
        c.append((f"ops.transpose(T, axes={bad})", ("axes", "axis")))
    c.append(("T.transpose(0, 5)", ("axes", "axis")))
    for bad in ["5", "(0, 0)", "'a'", "-4"]:
        c.append((f"ops.summation(T, axes={bad})", ("axes", "axis")))
        c.append((f"ops.max(T, axes={bad})", ("axes", "axis")))
        c.append((f"ops.logsumexp(T, axes={bad})", ("axes", "axis")))
    for bad in ["(4, 4)", "(3,)", "None"]:
        c.append((f"ops.broadcast_to(T, {bad})", "shape"))
    c.append(("ops.matmul(T, T)", ("shape", "dimension")))
    c.append(("ops.matmul(T, 5)", ("matmul", "operand", "Tensor")))
    c.append(("ops.split(T, axis=5)", "axis"))
    c.append(("ops.split(T, axis='a')", "axis"))
    c.append(("ops.stack([], 0)", ("tensor", "empty", "args")))
    c.append(("ops.stack([T, U], 0)", "shape"))
    c.append(("ops.stack([T, T], 5)", "axis"))
    c.append(("ops.concatenate([T, U], 0)", "shape"))
    c.append(("ops.pad(T, (1, 1))", ("pad", "axes")))
    c.append(("ops.flip(T, (5,))", ("axes", "axis")))
    c.append(("ops.dilate(T, (5,), 1)", ("axes", "axis")))
    c.append(("ops.dilate(T, (0,), -1)", "dilation"))
    c.append(("ops.dilate(T, (0,), 1.5)", "dilation"))
    c.append(("ops.conv(X, W, stride=1.5)", "stride"))
    c.append(("ops.conv(X, W, stride=0)", "stride"))
    c.append(("ops.conv(X, W, padding=-1)", "padding"))
    c.append(("ops.conv(X, W, padding='same')", "padding"))
    c.append(("ops.conv(X, ndl.Tensor(np.ones((3, 3, 2, 4), dtype=np.float32), device=DEV))", ("channel", "C_in", "shape")))
    c.append(("ops.conv(T, W)", ("shape", "dimension", "4-d", "NHWC")))
    c.append(("ops.conv(X, ndl.Tensor(np.ones((9, 9, 3, 4), dtype=np.float32), device=DEV))", ("kernel", "shape")))
    c.append(("ops.power_scalar(T, 'a')", ("scalar", "exponent")))
    c.append(("T + 'a'", ("operand", "other", "scalar")))
    c.append(("T * None", ("operand", "other", "scalar")))
    c.append(("T + U", ("broadcast", "shape")))
    c.append(("T / U", ("broadcast", "shape")))
    c.append(("ops.maximum(T, U)", ("broadcast", "shape")))
    c.append(("ops.embedding(EMB, ndl.Tensor([11], dtype='int32', device=DEV))", ("index", "ids")))
    c.append(("ops.embedding(EMB, ndl.Tensor([-1], dtype='int32', device=DEV))", ("index", "ids")))
    c.append(("ops.embedding(EMB, ndl.Tensor([0.5], device=DEV))", ("dtype", "ids", "indices", "integer")))
    c.append(("ops.softmax_cross_entropy(LOGITS, ndl.Tensor([0, 1, 2], dtype='int32', device=DEV))", "target"))
    c.append(("ops.softmax_cross_entropy(LOGITS, ndl.Tensor(np.zeros((3, 5), np.float32), device=DEV))", "target"))
    c.append(("ops.softmax_cross_entropy(ndl.Tensor(np.zeros(4, np.float32), device=DEV), ndl.Tensor(np.zeros(4, np.float32), device=DEV))", "logits"))
    c.append(("ops.layernorm(T, ndl.Tensor(np.ones(2, dtype=np.float32), device=DEV), ndl.Tensor(np.ones(3, dtype=np.float32), device=DEV), 1e-5)", ("weight", "shape")))
    c.append(("ops.rmsnorm(T, ndl.Tensor(np.ones(2, dtype=np.float32), device=DEV), 1e-6)", ("weight", "shape")))
    c.append(("ops.scaled_dot_product_attention(Q, Q, ndl.Tensor(np.ones((1, 2, 3, 8), dtype=np.float32), device=DEV))", ("shape", "value", "v")))
    c.append(("ops.scaled_dot_product_attention(Q, ndl.Tensor(np.ones((1, 3, 4, 8), dtype=np.float32), device=DEV), Q)", ("head", "shape")))
    c.append(("ops.scaled_dot_product_attention(T, T, T)", ("shape", "4-d", "dimension")))
    c.append(("ops.cast(T, 'x')", "dtype"))
    c.append(("ops.getitem(T, 7)", "index"))
    c.append(("T[0, 0, 0]", ("index", "indices")))
    c.append(("ops.where(T > 1, T, U)", ("broadcast", "shape")))
    c.append(("T.to('x')", "device"))
    c.append(("ops.mean(T, axes=9)", ("axes", "axis")))
    c.append(("ndl.grad(T.sum(), [5])", ("inputs", "Tensor")))
    c.append(("ndl.grad(5, [T])", ("output", "Tensor")))
    c.append(("T.exp().backward(ndl.Tensor(np.ones((3, 3), dtype=np.float32), device=DEV))", ("shape", "gradient")))
    c.append(("ndl.Tensor(np.ones(3, dtype=np.float32), device=DEV, requires_grad=False).sum().backward()", ("grad",)))
    c.append(("T.reshape(4, 4)", "shape"))
    c.append(("T.astype('x')", "dtype"))
    c.append(("ndl.tensor('abc')", ("str", "data", "number")))
    c.append(("ndl.arange(0, 10, 0)", "step"))
    c.append(("ndl.zeros((2, -1))", "shape"))
    c.append(("ndl.full((2,), 'a')", ("fill", "value")))
    c.append(("ndl.randn(2, 'a')", ("shape", "size")))
    c.append(("ndl.cat([T, U])", "shape"))
    c.append(("ndl.manual_seed('a')", "seed"))
    c.append(("T.view(7)", "shape"))
    c.append(("T.sum(dim=5)", ("dim", "axis", "axes")))
    c.append(("T.max(dim=5)", ("dim", "axis", "axes")))
    c.append(("ndl.autocast('int8').__enter__()", "dtype"))
    c.append(("ndl.amp.GradScaler(init_scale=0)", "init_scale"))
    c.append(("ndl.amp.GradScaler(growth_factor=0.5)", "growth_factor"))
    c.append(("ndl.compile(5)", ("fn", "callable")))
    c.append(("ndl.compile(lambda x: x, fuse='yes')", "fuse"))
    return c


def _nn() -> list[tuple[str, str | tuple[str, ...]]]:
    c: list[tuple[str, str | tuple[str, ...]]] = []
    for a, b, name in [("0", "4", "in_features"), ("-1", "4", "in_features"),
                       ("'4'", "4", "in_features"), ("4", "2.5", "out_features"),
                       ("4", "0", "out_features"), ("True", "4", "in_features")]:
        c.append((f"nn.Linear({a}, {b}, device=DEV)", name))
    c.append(("nn.Linear(4, 4, dtype='x', device=DEV)", "dtype"))
    c.append(("nn.Linear(4, 4, device='tpu')", "device"))
    c.append(("LIN(X)", ("shape", "features")))
    c.append(("LIN('x')", ("input", "Tensor")))
    for args, name in [("0, 4, 3", "in_channels"), ("3, 0, 3", "out_channels"),
                       ("3, 4, 0", "kernel_size"), ("3, 4, 3, stride=0", "stride"),
                       ("3, 4, 3, stride=1.5", "stride"), ("3, 4, 3, padding=-1", "padding"),
                       ("3, 4, 2.5", "kernel_size")]:
        c.append((f"nn.Conv({args}, device=DEV)", name))
    c.append(("nn.Conv(2, 4, 3, device=DEV)(IMG)", ("channel", "shape")))
    c.append(("nn.Conv(3, 4, 3, device=DEV)(X)", ("shape", "4-d", "NCHW", "dimension")))
    for args, name in [("0", "dim"), ("4, momentum=2", "momentum"), ("4, eps=-1", "eps"),
                       ("4, momentum=float('nan')", "momentum"), ("'4'", "dim")]:
        c.append((f"nn.BatchNorm1d({args}, device=DEV)", name))
    c.append(("nn.BatchNorm1d(4, device=DEV)(X)", ("shape", "features", "dim")))
    c.append(("nn.BatchNorm1d(5, device=DEV)(ndl.Tensor(np.ones((0, 5), dtype=np.float32), device=DEV))", ("empty", "batch")))
    c.append(("nn.BatchNorm2d(0, device=DEV)", "dim"))
    c.append(("nn.LayerNorm1d(0, device=DEV)", "dim"))
    c.append(("nn.LayerNorm1d(4, device=DEV)(X)", ("shape", "dim")))
    c.append(("nn.RMSNorm(0, device=DEV)", "dim"))
    c.append(("nn.RMSNorm(4, eps=-1, device=DEV)", "eps"))
    for bad in ["1.5", "-0.1", "'a'", "float('nan')"]:
        c.append((f"nn.Dropout({bad})", "p"))
    c.append(("nn.Embedding(0, 4, device=DEV)", "num_embeddings"))
    c.append(("nn.Embedding(10, -4, device=DEV)", "embedding_dim"))
    c.append(("nn.Embedding(10, 4, device=DEV)(ndl.Tensor([11], dtype='int32', device=DEV))", ("index", "ids")))
    c.append(("nn.Embedding(10, 4, device=DEV)(ndl.Tensor([0.5], device=DEV))", ("dtype", "ids", "indices", "integer")))
    c.append(("nn.MultiHeadAttention(8, 0, device=DEV)", "num_heads"))
    c.append(("nn.MultiHeadAttention(8, 3, device=DEV)", ("num_heads", "dim")))
    c.append(("nn.MultiHeadAttention(8, 4, num_kv_heads=3, device=DEV)", "num_kv_heads"))
    c.append(("nn.MultiHeadAttention(8, 2, dropout=2.0, device=DEV)", "dropout"))
    c.append(("nn.Sequential(nn.ReLU(), 5)", ("module", "Module")))
    c.append(("nn.Residual(5)", ("module", "fn", "Module")))
    c.append(("nn.RNN(0, 4, device=DEV)", "input_size"))
    c.append(("nn.RNN(4, 4, nonlinearity='foo', device=DEV)", "nonlinearity"))
    c.append(("nn.RNN(4, 4, num_layers=0, device=DEV)", "num_layers"))
    c.append(("nn.LSTM(4, 0, device=DEV)", "hidden_size"))
    c.append(("nn.RNN(5, 4, device=DEV)(SEQ)", ("shape", "input")))
    c.append(("nn.LSTM(5, 4, device=DEV)(SEQ)", ("shape", "input")))
    c.append(("nn.Transformer(8, 16, 0, device=DEV)", "num_layers"))
    c.append(("nn.Transformer(8, 16, 1, num_heads=3, device=DEV)", ("num_heads", "dim", "embedding_size")))
    c.append(("nn.TransformerLayer(8, 2, 0, device=DEV)", "hidden_size"))
    c.append(("nn.SoftmaxLoss()(LOGITS, ndl.Tensor([0, 1, 9], dtype='int32', device=DEV))", ("label", "target")))
    c.append(("nn.SoftmaxLoss()(LOGITS, ndl.Tensor([0, -1, 2], dtype='int32', device=DEV))", ("label", "target")))
    c.append(("nn.SoftmaxLoss()(LOGITS, ndl.Tensor([0.0, 1.5, 2.0], device=DEV))", ("label", "target")))
    c.append(("nn.SoftmaxLoss()(LOGITS, [0, 1, 2])", ("label", "target", "Tensor")))
    c.append(("LIN.load_state_dict(5)", ("state_dict", "mapping")))
    c.append(("LIN.load_state_dict({'weight': LIN.weight})", ("bias", "missing")))
    c.append(("LIN.load_state_dict({'weight': np.ones((9, 9), np.float32), 'bias': LIN.bias})", ("weight", "shape")))
    c.append(("LIN.load_state_dict({'weight': LIN.weight, 'bias': LIN.bias, 'extra': LIN.bias})", ("extra", "unexpected")))
    c.append(("LIN.to('x')", "device"))
    c.append(("nn.Flatten()(ndl.Tensor(np.float32(1.0), device=DEV))", ("dimension", "0-d", "shape")))
    return c


def _optim() -> list[tuple[str, str | tuple[str, ...]]]:
    c: list[tuple[str, str | tuple[str, ...]]] = []
    for cls in ["SGD", "Adam", "AdamW"]:
        for bad in ["'0.1'", "-1", "float('nan')", "float('inf')", "None"]:
            c.append((f"optim.{cls}(P, lr={bad})", "lr"))
        c.append((f"optim.{cls}([5])", ("param", "Tensor")))
        c.append((f"optim.{cls}(5)", ("param", "iterable")))
        c.append((f"optim.{cls}(P, weight_decay=-1)", "weight_decay"))
        c.append((f"optim.{cls}(P, weight_decay=float('nan'))", "weight_decay"))
    for bad in ["1.5", "-1", "'a'"]:
        c.append((f"optim.SGD(P, momentum={bad})", "momentum"))
    c.append(("optim.SGD(P, dampening=2)", "dampening"))
    c.append(("optim.SGD(P, nesterov=True)", ("nesterov", "momentum")))
    for cls in ["Adam", "AdamW"]:
        for arg, bad in [("beta1", "1.5"), ("beta1", "-0.1"), ("beta2", "1.0001"),
                         ("beta2", "float('nan')"), ("eps", "-1"), ("eps", "'a'")]:
            c.append((f"optim.{cls}(P, {arg}={bad})", arg))
    c.append(("OPT.load_state_dict(5)", ("state", "dict")))
    c.append(("OPT.load_state_dict({})", ("state", "missing")))
    c.append(("OPT.load_state_dict({'state': 'x', 'param_groups': []})", "state"))
    c.append(("OPT.load_state_dict({'state': {}, 'lr': 'x'})", ("lr", "state")))
    c.append(("optim.clip_grad_norm(P, max_norm=-1)", "max_norm"))
    c.append(("optim.clip_grad_norm(P, max_norm='a')", "max_norm"))
    c.append(("optim.clip_grad_norm(5, max_norm=1.0)", ("param", "iterable")))
    c.append(("optim.CosineDecay(OPT, total_steps=0)", "total_steps"))
    c.append(("optim.CosineDecay(OPT, total_steps=10, warmup_steps=-1)", "warmup_steps"))
    c.append(("optim.CosineDecay(OPT, total_steps=10, min_lr=-1)", "min_lr"))
    c.append(("optim.CosineDecay(5, total_steps=10)", ("optimizer", "Optimizer")))
    c.append(("optim.LinearWarmup(OPT, warmup_steps=-1)", "warmup_steps"))
    c.append(("optim.LinearWarmup(OPT, warmup_steps='a')", "warmup_steps"))
    return c


def _data() -> list[tuple[str, str | tuple[str, ...]]]:
    c: list[tuple[str, str | tuple[str, ...]]] = []
    for bad in ["'2'", "2.5", "None", "0", "-1", "True"]:
        c.append((f"data.DataLoader(DS, batch_size={bad})", "batch_size"))
    c.append(("data.DataLoader(5)", ("dataset", "Dataset")))
    c.append(("data.DataLoader(DS, seed='a')", "seed"))
    c.append(("data.DataLoader(DS, device='tpu')", "device"))
    c.append(("data.DataLoader(DS, num_workers=-1)", "num_workers"))
    c.append(("data.DataLoader(DS, prefetch_factor=0)", "prefetch_factor"))
    c.append(("data.DataLoader(DS, sampler=5)", "sampler"))
    c.append(("data.ArrayDataset(np.float32(1.0))", ("array", "scalar", "0-d")))
    c.append(("data.ArrayDataset(np.zeros(3), np.zeros(4))", ("length", "arrays")))
    c.append(("data.ArrayDataset()", ("array", "at least one")))
    c.append(("data.ArrayDataset('abc')", ("array", "str")))
    c.append(("DS[100]", "index"))
    c.append(("DS[-11]", "index"))
    c.append(("DS['a']", "index"))
    for bad in ["2.0", "-1", "'a'", "float('nan')"]:
        c.append((f"data.RandomFlipHorizontal(p={bad})", "p"))
    c.append(("data.RandomCrop(padding=-1)", "padding"))
    c.append(("data.RandomCrop(padding=1.5)", "padding"))
    c.append(("data.Normalize(mean=0.0, std=0.0)", "std"))
    c.append(("data.Normalize(mean='a', std=1.0)", "mean"))
    c.append(("data.batchify(IDS, 0)", "batch_size"))
    c.append(("data.batchify(IDS, 1000)", "batch_size"))
    c.append(("data.batchify(IDS, 'a')", "batch_size"))
    c.append(("data.get_batch(data.batchify(IDS, 4), 100, 5)", "i"))
    c.append(("data.get_batch(data.batchify(IDS, 4), 0, 0)", "bptt"))
    c.append(("data.TextCorpus('/nonexistent/corpus.txt')", ("path", "corpus")))
    c.append(("data.TextCorpus(__file__ if False else '/', max_lines=-1)", ("max_lines", "path")))
    c.append(("data.MNISTDataset('/nonexistent/a', '/nonexistent/b')", ("file", "path", "nonexistent")))
    c.append(("data.read_idx('/nonexistent/x.idx')", ("file", "path", "nonexistent")))
    return c


def _serialization() -> list[tuple[str, str | tuple[str, ...]]]:
    c: list[tuple[str, str | tuple[str, ...]]] = []
    c.append(("ndl.save({'w': T}, '/nonexistent/dir/x.safetensors')", ("directory", "path")))
    c.append(("ndl.save({'w': T}, TMP)", ("directory", "path")))
    c.append(("ndl.save({'w': object()}, os.path.join(TMP, 'o.safetensors'))", ("w", "value", "type")))
    c.append(("ndl.save({1: T}, os.path.join(TMP, 'k.safetensors'))", ("key", "str")))
    c.append(("ndl.save(5, os.path.join(TMP, 'n.safetensors'))", ("state", "mapping", "dict")))
    c.append(("ndl.save({'w': T}, 5)", "path"))
    c.append(("ndl.load('/nonexistent.safetensors')", ("path", "file", "nonexistent")))
    c.append(("ndl.load(TMP)", ("path", "directory", "file")))
    c.append(("ndl.load(GOOD, device='tpu')", "device"))
    c.append(("ndl.load(raw(b'garbage'))", ("header", "json")))
    c.append(("ndl.load(raw(fp32([2.7], [0, 8]), bytes(8)))", ("shape", "t")))
    c.append(("ndl.load(raw(fp32([2], [0, 8]), bytes(4)))", ("t", "offset", "data")))
    c.append(("ndl.load(raw(fp32([2], [0, 4]), bytes(8)))", ("t", "offset", "shape", "size")))
    c.append(("ndl.load(raw(fp32([-2], [0, 8]), bytes(8)))", ("shape", "t")))
    c.append(("ndl.load(raw({'t': {'dtype': 'Q9', 'shape': [1], 'data_offsets': [0, 4]}}, bytes(4)))", ("dtype", "Q9")))
    c.append(("ndl.load(raw({'t': {'dtype': 'F32', 'shape': [1]}}, bytes(4)))", ("data_offsets", "t")))
    c.append(("ndl.load(raw({'a': {'dtype': 'F32', 'shape': [2], 'data_offsets': [0, 8]}, 'b': {'dtype': 'F32', 'shape': [2], 'data_offsets': [4, 12]}}, bytes(12)))", ("overlap", "offset", "starts at")))
    c.append(("ndl.load(raw(b'[' * 100000 + b']' * 100000))", ("header", "deep", "nest")))
    c.append(("ndl.load(raw({'t': 5}, b''))", ("t", "entry")))
    c.append(("ndl.load(raw({'__metadata__': {'needle.tree': '{broken', 'needle.format': '1'}}, b''))", ("needle.tree", "metadata")))
    c.append(("open(os.path.join(TMP, 'short.safetensors'), 'wb').write(b'\\x01'); ndl.load(os.path.join(TMP, 'short.safetensors'))", ("header", "short", "truncated")))
    c.append(("ndl.load(raw(fp32([2], [0, 8]), bytes(8)), device=5.5)", "device"))
    return c


def _models() -> list[tuple[str, str | tuple[str, ...]]]:
    c: list[tuple[str, str | tuple[str, ...]]] = []
    c.append(("models.load_pretrained('/nonexistent/model')", ("path", "nonexistent")))
    c.append(("models.load_pretrained(TMP)", ("config.json", "config")))
    for key, bad in [("num_hidden_layers", -1), ("hidden_size", 0), ("vocab_size", "'x'"),
                     ("num_attention_heads", 0), ("num_key_value_heads", 3),
                     ("rms_norm_eps", -1), ("max_position_embeddings", 0),
                     ("intermediate_size", -5)]:
        c.append((f"models.load_pretrained(variant({key}={bad}), device=ndl.cpu_numpy())", key))
    c.append(("models.load_pretrained(variant(architectures=['FooForCausalLM']), device=ndl.cpu_numpy())", ("Foo", "architecture")))
    c.append(("models.load_pretrained(variant(dtype=None, torch_dtype='float7'), device=ndl.cpu_numpy())", ("dtype", "float7")))
    c.append(("models.load_pretrained(variant(dtype='float7'), device=ndl.cpu_numpy())", ("dtype", "float7")))
    c.append(("models.load_pretrained(variant(rope_parameters={'rope_type': 'default', 'rope_theta': 0}), device=ndl.cpu_numpy())", "rope_theta"))
    c.append(("models.load_pretrained(variant(rope_parameters={'rope_type': 'yarn2', 'rope_theta': 1e4}), device=ndl.cpu_numpy())", ("rope", "yarn2")))
    c.append(("models.load_pretrained(MODEL_DIR, device='tpu')", "device"))
    c.append(("models.load_pretrained(MODEL_DIR, dtype='int3', device=ndl.cpu_numpy())", "dtype"))
    c.append(("models.load_pretrained(MODEL_DIR, max_seq_len=0, device=ndl.cpu_numpy())", "max_seq_len"))
    for arg, bad in [("max_new_tokens", -1), ("max_new_tokens", "'a'"), ("temperature", -1),
                     ("temperature", "float('nan')"), ("top_p", 1.5), ("top_p", 0),
                     ("top_k", -1), ("top_k", 2.5), ("min_p", 2), ("repetition_penalty", 0),
                     ("seed", "'a'")]:
        c.append((f"M.generate([1, 2], {arg}={bad})", arg))
    c.append(("M.generate([], max_new_tokens=2)", ("prompt", "empty")))
    c.append(("M.generate([1, 999], max_new_tokens=2)", ("prompt", "token", "vocab")))
    c.append(("M.generate([1, -2], max_new_tokens=2)", ("prompt", "token")))
    c.append(("M.generate('hello', max_new_tokens=2)", ("prompt", "tokenizer")))
    c.append(("M.generate([1.5], max_new_tokens=2)", ("prompt", "token")))
    c.append(("M.generate([1] * 100, max_new_tokens=2)", ("max_seq_len", "length", "context", "position")))
    c.append(("M.generate([1], max_new_tokens=2, stop=5)", "stop"))
    c.append(("M.generate([1], max_new_tokens=2, callback=5)", "callback"))
    for arg, bad in [("temperature", -1), ("top_k", -1), ("top_p", 2.0), ("min_p", -0.5),
                     ("repetition_penalty", -1), ("seed", 1.5)]:
        c.append((f"models.SamplingParams({arg}={bad})", arg))
    c.append(("models.load_pretrained(with_file('generation_config.json', '{\"temperature\": \"hot\"}'), device=ndl.cpu_numpy())", "temperature"))
    c.append(("models.load_pretrained(with_file('generation_config.json', '[1, 2'), device=ndl.cpu_numpy())", "generation_config.json"))
    c.append(("models.load_pretrained(with_file('config.json', '{not json'), device=ndl.cpu_numpy())", "config.json"))
    c.append(("models.load_pretrained(with_file('model.safetensors', 'garbage'), device=ndl.cpu_numpy())", ("model.safetensors", "header")))
    c.append(("models.Tokenizer.from_file('/nonexistent/tokenizer.json')", ("tokenizer", "path", "nonexistent")))
    # the serving engine (needle.serve)
    for args, name in [("max_seqs=0", "max_seqs"), ("page_size=0", "page_size"),
                       ("kv_memory=-5", "kv_memory"), ("max_queue=0", "max_queue"),
                       ("max_seqs='4'", "max_seqs")]:
        c.append((f"serve.Engine(M, {args})", name))
    c.append(("serve.Engine(5)", ("model", "CausalLM")))
    c.append(("serve.RequestParams(max_tokens=-1)", "max_tokens"))
    c.append(("serve.RequestParams(stop=5)", "stop"))
    c.append(("serve.RequestParams(stop='</s>')", "stop"))
    c.append(("serve.RequestParams(stop_token_ids=['a'])", "stop_token_ids"))
    c.append(("serve.Engine(M).submit([], serve.RequestParams(max_tokens=2))", ("prompt", "empty")))
    c.append(("serve.Engine(M).submit([1, 999], serve.RequestParams(max_tokens=2))", ("prompt", "token", "vocab")))
    c.append(("M.generate([[1, 2], 'x'], max_new_tokens=2)", ("prompt", "tokenizer")))
    # GGUF and quantized checkpoints
    c.append(("models.load_pretrained(os.path.join(TMP, 'x.gguf'))", ("gguf", "path", "x.gguf")))
    c.append(("open(os.path.join(TMP, 'bad.gguf'), 'wb').write(b'GGUF' + bytes(8)); models.load_pretrained(os.path.join(TMP, 'bad.gguf'))", ("gguf", "bad.gguf")))
    c.append(("models.load_pretrained(variant(quantization_config={'quant_method': 'gptq', 'bits': 4}), device=ndl.cpu_numpy())", ("gptq", "quantization_config")))
    return c


def _cli() -> list[tuple[str, str | tuple[str, ...]]]:
    c: list[tuple[str, str | tuple[str, ...]]] = []
    c.append(("['foo']", "unknown command"))
    c.append(("['devices', '--bogus']", "--bogus"))
    c.append(("['generate', '/nonexistent/model', '--prompt', 'hi']", ("nonexistent", "model")))
    c.append(("['generate', EMPTY, '--prompt', 'hi']", ("config.json", "tokenizer.json")))
    c.append(("['chat', '/nonexistent/model']", ("nonexistent", "model")))
    c.append(("['generate', EMPTY, '--max-tokens', 'x']", "--max-tokens"))
    c.append(("['generate', EMPTY, '--top-p', 'x']", "--top-p"))
    c.append(("['generate', EMPTY, '--dtype', 'float7']", "--dtype"))
    c.append(("['generate', EMPTY, '--temperature', 'hot']", "--temperature"))
    c.append(("['demo', '--lr', 'nan']", "--lr"))
    c.append(("['demo', '--lr', '-1']", "--lr"))
    c.append(("['demo', '--epochs', '-1']", "--epochs"))
    c.append(("['demo', '--epochs', 'x']", "--epochs"))
    c.append(("['demo', '--device', 'tpu']", "device"))
    c.append(("['warmup', '--device', 'tpu']", "device"))
    c.append(("['demo', '--out', '/proc/nonexistent/dir']", ("out", "directory")))
    c.append(("['quantize', '/nonexistent/model', os.path.join(TMP, 'q'), '--bits', '4']", ("nonexistent", "model")))
    c.append(("['quantize', EMPTY, os.path.join(TMP, 'q'), '--bits', '3']", "--bits"))
    c.append(("['quantize', EMPTY, os.path.join(TMP, 'q'), '--bits', '4', '--group-size', '0']", ("group", "config.json")))
    c.append(("['serve', '/nonexistent/model']", ("nonexistent", "model")))
    c.append(("['serve', EMPTY, '--port', '70000']", "--port"))
    c.append(("['serve', EMPTY, '--max-seqs', '0']", "--max-seqs"))
    c.append(("['serve', EMPTY, '--kv-memory', 'lots']", "--kv-memory"))
    c.append(("['run', '-n', '0', SCRIPT]", ("-n", "ranks", "processes")))
    c.append(("['run', '-n', '2', '/nonexistent/job.py']", ("job.py", "script")))
    c.append(("['generate', EMPTY, '--tp', '0']", ("--tp", "tp")))
    c.append(("['serve', EMPTY, '--tp', '0']", ("--tp", "tp")))
    return c


CASES = {"arrays": _arrays(), "ops": _ops(), "nn": _nn(), "optim": _optim(), "data": _data(),
         "serialization": _serialization(), "models": _models(), "cli": _cli()}
