"""Tests of needle.data: datasets, transforms and the DataLoader."""
