"""Kernel files compile once per process, lazily; binaries are cached on disk atomically."""

from __future__ import annotations

import threading

from needle.hal import DiskCache, Executable, ExecutableCache, Kernel


class TextExecutable(Executable):
    """An 'executable' whose kernels are the source file's lines (one name per line)."""

    def __init__(self, name: str, source: str):
        super().__init__(name)
        self.names = set(source.split())

    def _load_kernel(self, name: str) -> Kernel:
        assert name in self.names
        return Kernel(name, handle=name, max_threads=256, preferred_threads=128, simd_width=32)


class CountingCache(ExecutableCache):
    def __init__(self, source_dir):
        super().__init__(source_dir, ".txt", "test")
        self.compiles = []

    def _compile(self, family, source):
        self.compiles.append(family)
        return TextExecutable(family, source)


def test_each_file_compiles_once_lazily(tmp_path):
    (tmp_path / "elementwise.txt").write_text("ewise_add_f32 ewise_mul_f32")
    (tmp_path / "reduce.txt").write_text("reduce_rows_sum_f32")
    cache = CountingCache(tmp_path)
    assert cache.families() == ["elementwise", "reduce"]
    assert cache.compiles == []
    k = cache.kernel("elementwise", "ewise_add_f32")
    assert k.name == "ewise_add_f32" and k.max_threads == 256
    cache.kernel("elementwise", "ewise_mul_f32")
    assert cache.kernel("elementwise", "ewise_add_f32") is k
    assert cache.compiles == ["elementwise"]


def test_concurrent_first_use_compiles_once(tmp_path):
    (tmp_path / "nn.txt").write_text("softmax_f32")
    cache = CountingCache(tmp_path)
    threads = [threading.Thread(target=cache.get, args=("nn",)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.compiles == ["nn"]


def test_disk_cache_round_trip_and_key(tmp_path, monkeypatch):
    monkeypatch.setenv("NEEDLE_CACHE_DIR", str(tmp_path))
    disk = DiskCache("cuda")
    assert disk.directory == tmp_path / "cuda"
    key = DiskCache.key("source", "sm_90", "-O3")
    assert key != DiskCache.key("source", "sm_80", "-O3")
    assert key != DiskCache.key("sourcesm_90", "", "-O3")  # parts are length-prefixed
    assert disk.load(key, ".cubin") is None
    disk.store(key, ".cubin", b"\x7fELF binary")
    assert disk.load(key, ".cubin") == b"\x7fELF binary"
    assert [p.name for p in (tmp_path / "cuda").iterdir()] == [f"{key}.cubin"]


def test_unwritable_disk_cache_only_costs_recompiles(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("NEEDLE_CACHE_DIR", str(blocker))
    disk = DiskCache("cuda")
    disk.store("k", ".cubin", b"data")  # must not raise
    assert disk.load("k", ".cubin") is None
