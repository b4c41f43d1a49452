"""Tests of the array layer: NDArray and every backend against the numpy reference."""
