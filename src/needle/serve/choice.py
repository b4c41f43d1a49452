"""How a serving step chooses each sequence's next token.

Every row of a step's logits is chosen by ``nd.sample`` with its request's settings, seed
and the position of the token being chosen, so a seeded request gets the tokens
``model.generate`` gives it. Where the device has capability ``sampling`` the choice is
made there, inside the recorded decode step, and only the tokens cross to the host: the
logits of 64 sequences are 4 MB, and drawing a 32,000-token row on the host takes
milliseconds. A captured sampled step can then be fed its successor on the device, as a
greedy one is. Elsewhere the logits come to the host and the same function runs there.
An all-greedy step needs none of this: its argmax is its choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import backend_ndarray as nd
from ..backend_ndarray.sampling import PARAMS
from ..backends.api import has
from .request import TokenLogprob


@dataclass
class SamplingRows:
    """What ``nd.sample`` needs for R rows of logits, on the host."""

    params: np.ndarray  # (R, 5) float32: temperature, top_k, top_p, min_p, penalty
    seeds: np.ndarray  # (R,) int32
    positions: np.ndarray  # (R,) int32: the position of the token each row chooses
    # (R, vocab) bool: the tokens each sequence holds, where a row has a repetition penalty;
    # None when none has (the mask is then not read)
    seen: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.seeds)


def sampling_rows(samplers, positions, vocab: int) -> SamplingRows:
    """The rows for requests' ``Sampler``s choosing tokens at ``positions``."""
    params = np.stack([s.params.row() for s in samplers]).astype(np.float32)  # (R, 5)
    penalized = bool((params[:, 4] != 1.0).any())
    seen = np.stack([s.seen_mask(vocab) for s in samplers]) if penalized else None
    return SamplingRows(params, np.array([s.seed for s in samplers], np.int32),
                        np.asarray(positions, np.int32).reshape(-1), seen)


def on_device(device) -> bool:
    """Whether steps on ``device`` sample there."""
    return has(device.backend, "sampling")


def choose_on_host(logits: np.ndarray, rows: SamplingRows) -> np.ndarray:
    """The tokens (R,) for logits rows brought to the host: ``nd.sample`` on cpu_numpy."""
    dev = nd.cpu_numpy()
    r, vocab = logits.shape
    seen = rows.seen if rows.seen is not None else np.zeros((r, vocab), bool)
    out = nd.sample(nd.array(np.ascontiguousarray(logits, np.float32), device=dev),
                    nd.array(rows.params, device=dev), nd.array(rows.seeds, device=dev),
                    nd.array(rows.positions, device=dev),
                    nd.array(seen, device=dev, dtype="bool"))
    return out.numpy()


class DeviceRows:
    """Sampling inputs for ``rows`` rows of logits on the device, rewritten before each
    step (so that a recorded step reading them stays valid), and the tokens chosen. Each
    its own allocation: ``nd.sample`` takes whole compact arrays."""

    def __init__(self, rows: int, vocab: int, device):
        self.rows, self.vocab = rows, vocab
        self.params = nd.zeros((rows, PARAMS), "float32", device)
        self.seeds = nd.zeros((rows,), "int32", device)
        self.positions = nd.zeros((rows,), "int32", device)
        self.seen = nd.zeros((rows, vocab), "bool", device)
        self.tokens = nd.zeros((rows,), "int32", device)

    def load(self, rows: SamplingRows, mask: bool = True) -> None:
        """Write ``rows`` (padding rows greedy); the seen mask only where a row has a
        penalty and ``mask`` (a step fed on the device keeps the mask the previous
        sample left, which holds that step's token)."""
        n, dev = len(rows), self.params.device
        params = np.zeros((self.rows, PARAMS), np.float32)
        params[:, 2] = params[:, 4] = 1.0  # padding: temperature 0, filters off
        params[:n] = rows.params
        self.params[...] = nd.array(params, device=dev)
        for array, values in ((self.seeds, rows.seeds), (self.positions, rows.positions)):
            host = np.zeros(self.rows, np.int32)
            host[:n] = values
            array[...] = nd.array(host, device=dev)
        if rows.seen is not None and mask:
            seen = np.zeros((self.rows, self.vocab), bool)
            seen[:n] = rows.seen
            self.seen[...] = nd.array(seen, device=dev, dtype="bool")

    def choose(self, logits) -> nd.NDArray:
        """``nd.sample`` of ``logits`` (rows, vocab) into ``tokens``."""
        return nd.sample(logits, self.params, self.seeds, self.positions, self.seen,
                         out=self.tokens)


def needs_host(request) -> bool:
    """Whether a request's token is chosen on the host from changed logits: a grammar
    (grammar.py), a logit bias or penalties (logit_rules.py)."""
    return request.constraint is not None or bool(request.params.logit_rules)


def chosen_on_host(read, logits, rows: list, sampling: SamplingRows | None):
    """``read`` with the tokens of some rows chosen again on the host: ``rows`` (sampling
    row j, its request); the rows' logits with each one's bias and penalties applied and
    the tokens its grammar forbids at -inf (every grammar's mask in one call), then their
    argmaxes (an all-greedy step, ``sampling`` None) or ``nd.sample`` of them with each
    row's own settings, as the device would have drawn."""
    picked = [j for j, _ in rows]

    def chosen() -> np.ndarray:
        tokens = np.array(read(), np.int64).reshape(-1)
        block = np.asarray(logits.numpy()[picked], np.float32)  # (n, vocab)
        for i, (_, request) in enumerate(rows):
            if request.params.logit_rules:
                block[i] = request.params.logit_rules.apply(block[i], request.output)
        grammars = [(i, r.constraint) for i, (_, r) in enumerate(rows)
                    if r.constraint is not None]
        if grammars:
            allowed = grammars[0][1].grammars.allowed_rows([c for _, c in grammars])
            at = [i for i, _ in grammars]
            block[at] = np.where(allowed, block[at], -np.inf)
        if sampling is None:
            tokens[picked] = block.argmax(axis=1)
        else:
            part = SamplingRows(sampling.params[picked], sampling.seeds[picked],
                                sampling.positions[picked],
                                None if sampling.seen is None else sampling.seen[picked])
            tokens[picked] = choose_on_host(block, part)
        return tokens

    return chosen


def log_softmax_rows(logits, rows: list[int]) -> dict[int, np.ndarray]:
    """float64 log-softmax of the given rows of device ``logits`` (rows, vocab), on the
    host: what a request asking for logprobs is told (the model's distribution, before
    temperature and filters, as OpenAI and vLLM report it)."""
    host = logits.numpy()
    out = {}
    for r in rows:
        z = host[r].astype(np.float64)
        z = z - z.max()
        out[r] = z - np.log(np.exp(z).sum())
    return out


def token_logprob(scores: np.ndarray, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability and the ``top`` likeliest tokens' in ``scores``."""
    best = np.argpartition(-scores, top)[:top] if 0 < top < scores.size else (
        np.arange(scores.size) if top else np.zeros(0, np.int64))
    best = best[np.argsort(-scores[best], kind="stable")]
    return TokenLogprob(int(token), float(scores[token]),
                        tuple((int(t), float(scores[t])) for t in best))
