"""Run by test_tensor_parallel.py under `needle run -n 2 --backend mpi tp_logits.py OUT
DIR...`: load each model directory tensor-parallel and have rank 0 write, per model, the
logits of a prompt (the prompt pass), 6 greedy tokens (prefill + decode steps), the decode
step's logits for the first 3 of them, which layers decode as five fused operations and
how many vocabulary rows of the output head the rank holds to OUT/<i>.npz; rank 1 checks
that its logits are rank 0's."""

import sys
from pathlib import Path

import numpy as np

from needle import backend_ndarray as nd
from needle import distributed as dist

PROMPT = [1, 17, 92, 5, 201, 33, 8]

out, directories = Path(sys.argv[1]), sys.argv[2:]
dist.init_process_group()
for i, directory in enumerate(directories):
    model = dist.load_tensor_parallel(directory, max_seq_len=32)
    logits = model.forward([PROMPT]).numpy()
    tokens = model.generate(PROMPT, max_new_tokens=6, temperature=0)
    decoder = model.decoder()  # the decode step's logits for the first three tokens
    decoder.prefill(PROMPT)
    steps = np.stack([decoder.step(t).numpy().reshape(-1) for t in tokens[:3]])
    both = dist.all_gather(nd.array(logits, device=model.device)).numpy()
    np.testing.assert_array_equal(both[0], both[1])  # every rank computes the same logits
    if dist.get_rank() == 0:
        np.savez(out / f"{i}.npz", logits=logits, tokens=np.array(tokens), steps=steps,
                 fused=np.array(model.transformer.five_ops),
                 head_rows=model.weights.lm_head.weight.shape[0])
dist.destroy_process_group()
