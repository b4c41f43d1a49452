"""Data parallel training on 2 MPI processes equals one process on the whole batch; the
checkpoint rank 0 writes loads in a single process; the sampler's shares."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import needle as ndl
from needle import nn
from needle.data import ArrayDataset, DataLoader
from needle.distributed import DistributedSampler
from needle.errors import ArgumentError, DistributedError

from .jobs import SCRIPTS, run_job

sys.path.insert(0, str(SCRIPTS))
import ddp_train  # noqa: E402


def test_two_ranks_train_as_one_process_on_the_whole_batch(tmp_path):
    path = tmp_path / "ddp.safetensors"
    job = run_job("ddp_train.py", str(path))
    assert job.returncode == 0, job.stdout + job.stderr
    assert sorted(job.stdout.split()) == ["0", "1", "trained", "trained"]
    reference = ddp_train.reference().state_dict()
    state = ndl.load(path)  # written once, by rank 0; read here by a world of 1
    model = ddp_train.build_model(seed=5)
    model.load_state_dict(state["model"])
    for name, array in model.state_dict().items():
        np.testing.assert_allclose(array.numpy(), reference[name].numpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=name)
    assert state["optimizer"]["step"] == ddp_train.STEPS


def test_wrapper_needs_a_group_and_a_module():
    with pytest.raises(DistributedError, match="init_process_group"):
        ndl.distributed.DistributedDataParallel(nn.Linear(2, 2))


def test_sampler_shares_are_disjoint_equal_and_cover_the_data():
    shares = [DistributedSampler(range(10), num_replicas=3, rank=r, seed=1) for r in range(3)]
    first = [s.indices(0) for s in shares]
    assert [len(s) for s in shares] == [4, 4, 4] and all(len(f) == 4 for f in first)
    assert set(np.concatenate(first)) == set(range(10))  # padded with repeats: 12 slots
    assert not np.array_equal(shares[0].indices(0), shares[0].indices(1))  # new epoch order
    dropped = [DistributedSampler(range(10), 3, r, shuffle=False, drop_last=True).indices()
               for r in range(3)]
    assert [d.tolist() for d in dropped] == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    tiny = DistributedSampler(range(1), num_replicas=2, rank=1, shuffle=False)
    assert list(tiny) == [0]
    with pytest.raises(ArgumentError, match="rank 2 is outside"):
        DistributedSampler(range(4), num_replicas=2, rank=2)


def test_dataloader_follows_the_sampler_epoch_by_epoch():
    data = ArrayDataset(np.arange(8, dtype=np.float32)[:, None])
    sampler = DistributedSampler(data, num_replicas=2, rank=1, seed=4)
    loader = DataLoader(data, batch_size=3, sampler=sampler, device=ndl.cpu_numpy())
    assert len(loader) == 2
    for epoch in range(2):
        seen = np.concatenate([x.numpy()[:, 0] for (x,) in loader]).astype(int)
        np.testing.assert_array_equal(seen, sampler.indices(epoch))
    with pytest.raises(ArgumentError, match="shuffle to the sampler"):
        DataLoader(data, sampler=sampler, shuffle=True)


def test_bad_arguments_are_named():
    from needle.errors import ArgumentTypeError

    with pytest.raises(ArgumentTypeError, match="sampler must have indices"):
        DataLoader(ArrayDataset(np.zeros((4, 1))), sampler=[0, 1])
    with pytest.raises(ArgumentTypeError, match="dataset must be sized"):
        DistributedSampler(iter([1, 2]), num_replicas=1, rank=0)
    with pytest.raises(ArgumentTypeError, match="seed"):
        DistributedSampler(range(3), num_replicas=1, rank=0, seed="a")
    with pytest.raises(ArgumentTypeError, match="timeout"):
        ndl.distributed.init_process_group(backend="mpi", timeout="soon")
