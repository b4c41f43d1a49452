"""needle's benchmarks: one runner that times needle against numpy and PyTorch (design §8).

Run ``python -m benchmarks --help`` (or ``needle bench --help`` from a checkout). Cases live in
``benchmarks/cases_*.py``; ``benchmarks/README.md`` says how to add one.
"""
