"""Tests of needle.nn: modules against numpy formulas and against PyTorch."""
