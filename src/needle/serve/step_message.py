"""A serving step as int64 words: what rank 0 of a tensor-parallel server sends the other
ranks before each step (``tp_engine.py``), so that they run the same step.

A message is a fixed header (``HEADER`` words: its kind, then the sizes of a step's
arrays and how to run it) and, for a step, one payload holding the ``StepBatch``'s arrays
end to end, and for a step that samples its rows' settings, seeds and positions (the
float32 settings as their bits). Not the seen-token masks of a repetition penalty: the other
ranks' draws are not read, and a step whose rows have a penalty is never fed the previous
step's tokens on the device (where rank 0's draws would have to be theirs). Two broadcasts
carry it: the header first, since the payload's length depends on it.
"""

from __future__ import annotations

import numpy as np

from ..backend_ndarray.sampling import PARAMS
from ..errors import DistributedError
from .batch import StepBatch
from .choice import SamplingRows

STEP, IDLE, STOP = 1, 2, 3  # a step follows; wait on the host for the next; leave
HEADER = 11
# header words: kind, tokens T, sequences S, block-table width P, logit rows R,
# prompt chunks C, their slots in all, captured (0/1), greedy (0/1), fed (0/1: the tokens
# are the previous step's choices, on the device), scored prompt rows N


def header(kind: int) -> np.ndarray:
    """A header of ``kind`` IDLE or STOP (no payload)."""
    out = np.zeros(HEADER, np.int64)
    out[0] = kind
    return out


def pack(batch: StepBatch, captured: bool, greedy: bool,
         fed: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The header and the payload of a step."""
    t, (s, p), r = len(batch.tokens), batch.block_tables.shape, len(batch.logit_rows)
    chunk_slots = [np.asarray(slots) for _, _, slots in batch.chunks]
    head = np.array([STEP, t, s, p, r, len(batch.chunks), sum(c.size for c in chunk_slots),
                     int(captured), int(greedy), int(fed), len(batch.score_rows)], np.int64)
    chunks = np.array([(first, count, slots.size) for (first, count, _), slots
                       in zip(batch.chunks, chunk_slots)], np.int64).reshape(-1)
    parts = [batch.tokens, batch.positions, batch.seq_of, batch.slots,
             batch.block_tables.reshape(-1), batch.logit_rows, chunks, *chunk_slots,
             batch.score_rows]
    if not greedy:
        rows = batch.sampling
        parts += [rows.params.astype(np.float32).view(np.int32), rows.seeds, rows.positions]
    return head, np.concatenate([np.asarray(a, np.int64).reshape(-1) for a in parts])


def payload_size(head: np.ndarray) -> int:
    """Words of the payload that follows a STEP header."""
    _, t, s, p, r, c, slots = (int(v) for v in head[:7])
    sampling = 0 if head[8] else (PARAMS + 2) * r
    return 4 * t + s * p + r + 3 * c + slots + int(head[10]) + sampling


def unpack(head: np.ndarray, payload: np.ndarray) -> tuple[StepBatch, bool, bool, bool]:
    """The step a header and payload describe: (batch, captured, greedy, fed)."""
    if int(head[0]) != STEP or payload.size != payload_size(head):
        raise DistributedError(f"a malformed step message (header {head.tolist()}, payload of "
                               f"{payload.size} words): the ranks run different needle code")
    _, t, s, p, r, c = (int(v) for v in head[:6])
    at = 0

    def take(n: int) -> np.ndarray:
        nonlocal at
        at += n
        return payload[at - n:at]

    tokens, positions, seq_of, slots = (take(t) for _ in range(4))
    tables = take(s * p).reshape(s, p).astype(np.int32)
    rows = take(r)
    meta = take(3 * c).reshape(c, 3)
    chunks = [(int(first), int(count), take(int(n))) for first, count, n in meta]
    batch = StepBatch(tokens, positions, seq_of, slots, tables, rows, chunks,
                      score_rows=take(int(head[10])))
    if not head[8]:
        params = take(PARAMS * r).astype(np.int32).view(np.float32).reshape(r, PARAMS)
        batch.sampling = SamplingRows(params, take(r).astype(np.int32),
                                      take(r).astype(np.int32))
    return batch, bool(head[7]), bool(head[8]), bool(head[9])
