"""OpenAI's per-request changes to the logits before a token is chosen: ``logit_bias`` and
the presence and frequency penalties.

They are applied on the host, to the row of the step's logits that chooses the request's
token, as a grammar's mask is (``choice.constrained``): such a row is chosen again there,
with the request's own settings, and the step is not queued ahead on the device. Both
follow OpenAI's definitions (and vLLM's): a bias is added to its token's logit (-100 bans
it in practice); the penalties count the tokens the answer has produced so far, not the
prompt's, logit[t] -= presence * (count[t] > 0) + frequency * count[t]. Logprobs stay the
model's, before these, as they are before temperature and filters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LogitRules:
    """A request's changes to its logits: ``bias`` (token id, added value) pairs and the
    two penalties (0: none)."""

    bias: tuple[tuple[int, float], ...] = ()
    presence: float = 0.0
    frequency: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.bias) or self.presence != 0.0 or self.frequency != 0.0

    def apply(self, logits: np.ndarray, output: list[int]) -> np.ndarray:
        """float32 logits (vocab,) with the bias added and the penalties taken for the
        tokens in ``output`` (the answer so far)."""
        out = np.asarray(logits, np.float32).copy()
        if self.bias:
            ids, values = zip(*self.bias)
            out[list(ids)] += np.asarray(values, np.float32)
        if output and (self.presence or self.frequency):
            tokens, counts = np.unique(np.asarray(output, np.int64), return_counts=True)
            out[tokens] -= (self.presence + self.frequency * counts).astype(np.float32)
        return out
