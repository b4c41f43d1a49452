"""The needle course's names (#16 item 1), exercised the way the course's homework tests use
them: gradient checks through ``NDArray.flat``, hw3-style NDArray tests built on
``process_slice``, and the course's helper names as aliases of needle's own."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import needle as ndl
import needle.backend_ndarray as nd
from needle import autograd, ops
from needle.errors import ArgumentTypeError, IndexOutOfRangeError

from .conftest import supports

# --- gradient checks through .flat (hw1/hw2/hw4's gradient_check, written afresh) ----------


def gradient_check(f, *args, tol=1e-6, **kwargs):
    """Central differences by nudging each input element through ``.flat``, against
    backward(); what the course's helper does (with backward=True)."""
    eps = 1e-4
    numerical = [np.zeros(a.shape) for a in args]
    for i, a in enumerate(args):
        data = a.realize_cached_data()
        for j in range(data.size):
            data.flat[j] += eps
            f1 = float(f(*args, **kwargs).numpy().sum())
            data.flat[j] -= 2 * eps
            f2 = float(f(*args, **kwargs).numpy().sum())
            data.flat[j] += eps
            numerical[i].flat[j] = (f1 - f2) / (2 * eps)
    for a in args:
        a.grad = None
    f(*args, **kwargs).sum().backward()
    grads = [a.grad for a in args]
    error = sum(np.linalg.norm(g.numpy() - n) for g, n in zip(grads, numerical))
    assert error < tol, f"gradient error {error}"
    return grads


def _float64_device(device):
    if not supports(device, "float64"):
        pytest.skip(f"{device.name} has no float64 for a finite-difference check")
    return device


CASES = [
    ("divide_scalar", lambda a: ops.divide_scalar(a, 1.7), [(5, 4)]),
    ("mul_scalar", lambda a: ops.mul_scalar(a, -3.1), [(5, 4)]),
    ("power_scalar", lambda a: ops.power_scalar(a, 3), [(5, 4)]),
    ("divide", lambda a, b: ops.divide(a, ops.add_scalar(b * b, 1.0)), [(5, 4), (5, 4)]),
    ("matmul", ops.matmul, [(5, 4), (4, 3)]),
    ("batched_matmul", ops.matmul, [(2, 5, 4), (2, 4, 3)]),
    ("summation", lambda a: ops.summation(a, axes=(1,)), [(5, 4)]),
    ("broadcast_to", lambda a: ops.broadcast_to(a, (3, 4, 5)), [(4, 1)]),
    ("reshape", lambda a: ops.reshape(a, (4, 5)), [(5, 4)]),
    ("transpose", lambda a: ops.transpose(a, axes=(0, 2)), [(3, 4, 5)]),
    ("negate", ops.negate, [(5, 4)]),
    ("log", lambda a: ops.log(ops.add_scalar(a * a, 1.0)), [(5, 4)]),
    ("exp", ops.exp, [(5, 4)]),
    ("tanh", ops.tanh, [(5, 4)]),
    ("logsoftmax", ops.logsoftmax, [(5, 4)]),
    ("logsumexp", lambda a: ops.logsumexp(a, axes=(1,)), [(5, 4)]),
    ("stack", lambda a, b: ops.stack([a, b], axis=1), [(3, 4), (3, 4)]),
    ("flip", lambda a: ops.flip(a, (0,)), [(3, 4)]),
]


@pytest.mark.parametrize("name,f,shapes", CASES, ids=[c[0] for c in CASES])
def test_course_gradient_check_through_flat(device, name, f, shapes):
    device = _float64_device(device)
    rng = np.random.default_rng(0)
    args = [ndl.Tensor(rng.standard_normal(s), device=device) for s in shapes]
    assert all(a.dtype == "float64" for a in args)  # numpy float64 stays float64
    gradient_check(f, *args)


def test_flat_reads_and_writes_in_row_major_order(device):
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    a = nd.array(x, device=device)
    view = a.permute((2, 0, 1))[1:3]  # not compact: flat follows the view's shape
    expected = x.transpose(2, 0, 1)[1:3]
    assert len(view.flat) == expected.size
    assert [view.flat[j] for j in range(expected.size)] == list(expected.flat)
    assert list(view.flat) == list(expected.flat)
    np.testing.assert_array_equal(np.asarray(view.flat), expected.ravel())
    view.flat[5] = -1.0  # writes reach the base array, like a numpy view's
    expected.flat[5] = -1.0
    np.testing.assert_array_equal(a.numpy(), x)
    a.flat[-1] += 100.0
    assert a.numpy().flat[-1] == 123.0
    assert isinstance(a.flat[0], np.float32)
    with pytest.raises(IndexOutOfRangeError):
        a.flat[24]
    with pytest.raises(ArgumentTypeError):
        a.flat[1.5]


# --- hw3-style NDArray tests built on process_slice ------------------------------------------


class _ShapeAndSlices(nd.NDArray):
    """The course's test helper: indexing gives back the shape and the explicit slices."""

    def __getitem__(self, idxs):
        idxs = tuple(self.process_slice(s, i) if isinstance(s, slice) else slice(s, s + 1, 1)
                     for i, s in enumerate(idxs))
        return self.shape, idxs


def ShapeAndSlices(*shape):  # noqa: N802 (the course's name)
    return _ShapeAndSlices(np.ones(shape))


SETITEM_PARAMS = [
    (ShapeAndSlices(4, 5, 6)[1:2, 0, 0], ShapeAndSlices(7, 7, 7)[1:2, 0, 0]),
    (ShapeAndSlices(4, 5, 6)[1:4:2, 0, 0], ShapeAndSlices(7, 7, 7)[1:3, 0, 0]),
    (ShapeAndSlices(4, 5, 6)[1:3, 2:5, 2:6], ShapeAndSlices(7, 7, 7)[:2, :3, :4]),
    (ShapeAndSlices(4, 5, 6)[-3:, ::2, -4:-1], ShapeAndSlices(6, 6, 6)[1:4, 1:4, 2:5]),
    (ShapeAndSlices(4, 5, 6)[::-1, 0, 1:], ShapeAndSlices(4, 5, 6)[:, 1, 1:]),
]


@pytest.mark.parametrize("lhs,rhs", SETITEM_PARAMS)
def test_setitem_ewise(device, lhs, rhs):
    lhs_shape, lhs_slices = lhs
    rhs_shape, rhs_slices = rhs
    rng = np.random.default_rng(0)
    _a, _b = rng.standard_normal(lhs_shape), rng.standard_normal(rhs_shape)
    a = nd.array(_a.astype(np.float32), device=device)
    b = nd.array(_b.astype(np.float32), device=device)
    start_ptr = a._handle
    a[lhs_slices] = b[rhs_slices]
    _a[lhs_slices] = _b[rhs_slices]
    assert a._handle is start_ptr  # in place
    np.testing.assert_allclose(a.numpy(), _a, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("params", [
    ShapeAndSlices(4, 5, 6)[1:2, 0, 0], ShapeAndSlices(4, 5, 6)[1:3, 2:5, 2:6],
    ShapeAndSlices(4, 5, 6)[::2, -2:, ::-3],
])
def test_setitem_scalar(device, params):
    shape, slices = params
    _a = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    a = nd.array(_a, device=device)
    a[slices] = 4.0
    _a[slices] = 4.0
    np.testing.assert_array_equal(a.numpy(), _a)


def test_process_slice_resolves_bounds():
    a = nd.array(np.zeros((4, 5)))
    assert a.process_slice(slice(None, None, None), 1) == slice(0, 5, 1)
    assert a.process_slice(slice(-3, None, 2), 0) == slice(1, 4, 2)
    assert a.process_slice(slice(1, -1, None), 1) == slice(1, 4, 1)
    x = np.arange(5)
    for sl in (slice(None, None, -1), slice(3, None, -2), slice(-1, 0, -1)):
        assert list(x[a.process_slice(sl, 1)]) == list(x[sl])
    with pytest.raises(ArgumentTypeError):
        a.process_slice(2, 0)
    with pytest.raises(IndexOutOfRangeError):
        a.process_slice(slice(None), 2)


# --- autograd names ------------------------------------------------------------------------


def _recursive_topo(nodes):
    order, seen = [], set()

    def visit(n):
        if id(n) in seen:
            return
        for x in n.inputs:
            visit(x)
        seen.add(id(n))
        order.append(n)

    for n in nodes:
        visit(n)
    return order


def test_find_topo_sort_is_the_courses_post_order():
    rng = np.random.default_rng(0)
    a1, b1 = (ndl.Tensor(rng.standard_normal((3, 3))) for _ in range(2))
    c1 = 3 * a1 * a1 + 4 * b1 * a1 - a1
    a2, b2 = ndl.Tensor(rng.standard_normal((2, 3))), ndl.Tensor(rng.standard_normal((3, 2)))
    c2 = ops.matmul(a2, b2).sum() + (a2 @ b2).sum() * a2.sum()
    for roots in ([c1], [c2], [c1, c2]):
        got = autograd.find_topo_sort(roots)
        assert [id(n) for n in got] == [id(n) for n in _recursive_topo(roots)]
        position = {id(n): k for k, n in enumerate(got)}
        assert all(position[id(x)] < position[id(n)] for n in got for x in n.inputs)
    assert autograd.find_topo_sort([a1]) == [a1]


def test_tensor_counter_counts_live_tensors():
    gc.collect()
    before = autograd.TENSOR_COUNTER
    xs = [ndl.Tensor(np.ones(3)) for _ in range(10)]
    y = xs[0] * 2.0 + xs[1]
    assert autograd.TENSOR_COUNTER >= before + 12
    del xs, y
    gc.collect()
    assert autograd.TENSOR_COUNTER == before


def test_tensor_counter_exact_under_threads():
    import threading

    gc.collect()
    before = autograd.TENSOR_COUNTER

    def churn():
        for _ in range(300):
            x = ndl.Tensor(np.ones(2))
            (x * 2.0 + x).sum()

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    assert autograd.TENSOR_COUNTER == before


def test_tensor_counter_flat_over_training_steps():
    """What the course's hw2 checks: training does not leak graph nodes."""
    model = ndl.nn.Sequential(ndl.nn.Linear(4, 8), ndl.nn.ReLU(), ndl.nn.Linear(8, 2))
    opt = ndl.optim.SGD(model.parameters(), lr=0.1)
    x = ndl.Tensor(np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32))
    y = ndl.Tensor(np.arange(16) % 2)
    counts = []
    for _ in range(6):
        opt.reset_grad()
        loss = ndl.nn.SoftmaxLoss()(model(x), y)
        loss.backward()
        opt.step()
        del loss
        gc.collect()
        counts.append(autograd.TENSOR_COUNTER)
    assert counts[-1] == counts[1]


def test_reset_grad_is_zero_grad():
    p = ndl.nn.Parameter(np.ones(3, np.float32))
    (p * 2.0).sum().backward()
    opt = ndl.optim.SGD([p], lr=0.1)
    opt.reset_grad()
    assert p.grad is None


def test_logsoftmax_alias():
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    got = ops.logsoftmax(ndl.Tensor(x)).numpy()
    ref = x - x.max(1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(1, keepdims=True))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert ndl.logsoftmax is ops.log_softmax


# --- data names ----------------------------------------------------------------------------


def test_ndarray_dataset_and_slices():
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    y = np.arange(10)
    ds = ndl.data.NDArrayDataset(x, y)
    xb, yb = ds[2:5]
    np.testing.assert_array_equal(xb, x[2:5])
    np.testing.assert_array_equal(yb, y[2:5])
    xb, yb = ds[::-3]
    np.testing.assert_array_equal(xb, x[::-3])
    xb, _ = ds[[0, 9]]
    np.testing.assert_array_equal(xb, x[[0, 9]])
    xi, yi = ds[4]
    np.testing.assert_array_equal(xi, x[4])
    assert yi == 4
    flipped = ndl.data.ArrayDataset(np.arange(24.).reshape(2, 1, 3, 4), y[:2],
                                    transforms=[ndl.data.RandomFlipHorizontal(p=1.0)])
    np.testing.assert_array_equal(flipped[0:2][0], np.arange(24.).reshape(2, 1, 3, 4)[..., ::-1])


def test_transforms_take_one_hwc_image():
    img = np.random.default_rng(0).standard_normal((5, 6, 3)).astype(np.float32)
    np.testing.assert_array_equal(ndl.data.RandomFlipHorizontal(p=1.0)(img), img[:, ::-1, :])
    np.testing.assert_array_equal(ndl.data.RandomFlipHorizontal(p=0.0)(img), img)
    crop = ndl.data.RandomCrop(padding=2, seed=0)(img)
    assert crop.shape == img.shape
    # the crop is a shifted window of the zero-padded image
    padded = np.pad(img, ((2, 2), (2, 2), (0, 0)))
    assert any(np.array_equal(crop, padded[2 + dy:7 + dy, 2 + dx:8 + dx])
               for dy in range(-2, 3) for dx in range(-2, 3))
    norm = ndl.data.Normalize(mean=[0.0, 1.0, 2.0], std=[1.0, 2.0, 4.0])(img)
    np.testing.assert_allclose(norm, (img - [0.0, 1.0, 2.0]) / [1.0, 2.0, 4.0], rtol=1e-6)
    batch = img.transpose(2, 0, 1)[None]
    np.testing.assert_array_equal(ndl.data.RandomFlipHorizontal(p=1.0)(batch)[0],
                                  batch[0][..., ::-1])


def test_corpus_batchify_get_batch(tmp_path):
    (tmp_path / "train.txt").write_text("the cat sat\non the mat\nthe end\n")
    (tmp_path / "test.txt").write_text("the cat\nnew words\n")
    corpus = ndl.data.Corpus(tmp_path)
    words = corpus.dictionary.idx2word
    assert [words[i] for i in corpus.train[:4]] == ["the", "cat", "sat", "<eos>"]
    assert [words[i] for i in corpus.test] == ["the", "cat", "<eos>", "new", "words", "<eos>"]
    assert len(ndl.data.Corpus(tmp_path, max_lines=1).train) == 4
    batches = ndl.data.batchify(corpus.train, batch_size=2, device=ndl.cpu(), dtype="float32")
    assert batches.shape == (len(corpus.train) // 2, 2) and batches.dtype == np.float32
    np.testing.assert_array_equal(batches[:, 0], corpus.train[:len(batches)])
    data, target = ndl.data.get_batch(batches, 0, bptt=3, device=ndl.cpu_numpy(),
                                      dtype="float32")
    assert (data.shape, target.shape, data.dtype) == ((3, 2), (6,), "float32")
    np.testing.assert_array_equal(target.numpy(), batches[1:4].reshape(-1))
    data, _ = ndl.data.get_batch(ndl.data.batchify(corpus.train, 2), 0, bptt=3)
    assert data.dtype == "int64"


def test_embedding_takes_the_courses_float_ids():
    emb = ndl.nn.Embedding(10, 4)
    ids = np.array([[1, 2], [9, 0]])
    np.testing.assert_array_equal(emb(ndl.Tensor(ids.astype(np.float32))).numpy(),
                                  emb(ndl.Tensor(ids)).numpy())
    with pytest.raises(TypeError, match="whole numbers"):
        emb(ndl.Tensor(np.array([1.5], np.float32)))
