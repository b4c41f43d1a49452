"""Check and time needle's Hopper GEMMs against torch (cuBLAS) on one GPU.

    python scripts/check_gemm.py                   # everything (about 2-4 minutes)
    python scripts/check_gemm.py --sizes 4096 --reps 10

1. Smoke test of the TMA kernel (gemm_tma.cu) in a child process with a time limit: a hang
   (an mbarrier waiting forever) kills the child, not this run; the TMA rows are then
   skipped and the child's output printed.
2. Resources: ptxas registers/spills (NVRTC --ptxas-options=-v) and, where cuobjdump is on
   PATH, the SASS counts of HGMMA and UTMALDG in gemm_tma's sm_90a cubin.
3. Correctness of needle-TMA and needle-wgmma (the tuning's gemm="wgmma") against
   torch in float32 on the same bf16/f16 inputs: 4096^3, 8192^3, ragged and batched shapes,
   outputs poisoned with NaN first (every element must be written).
4. Timing: C = A @ B^T (A (m, k), B (n, k): a Linear layer's layout, both kernels' native
   one), square sizes, CUDA graphs of `--inner` products replayed `--reps` times, median
   per product, for needle-TMA, needle-wgmma and torch.matmul; TFLOP/s and ratio to torch.
The last lines are a short table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

TOL = {"bfloat16": 1e-2, "float16": 2e-3}


def _torch_dtype(torch, dtype: str):
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


NO_TMA = False  # set when the smoke test failed: needle never launches the TMA kernel then


def _use(kernel: str) -> None:
    """Route needle's half-precision matmuls: 'tma' / 'tma_nn' (default) or 'wgmma'
    (cp.async kernel)."""
    import dataclasses

    import needle.backend_ndarray as nd

    be = nd.cuda(0).backend
    be.tuning = dataclasses.replace(be.tuning,
                                    gemm="wgmma" if kernel == "wgmma" or NO_TMA else "tma")


def needle_product(nd, dev, a_t, b_t, dtype: str, kernel: str, out=None):
    """C[z] = A[z] @ B[z]^T for torch tensors a (batch, m, k), b (batch, n, k) on the GPU,
    through GpuBackend.matmul into a NaN-poisoned needle array; returns (out, kernels run).
    kernel 'tma_nn' passes B as a (batch, k, n) row-major copy, untransposed (A @ B)."""
    batch, m, k = a_t.shape
    n = b_t.shape[1]
    nn = kernel == "tma_nn"
    A = nd.from_dlpack(a_t, device=dev)
    B = nd.from_dlpack(b_t.transpose(-1, -2).contiguous() if nn else b_t, device=dev)
    if out is None:
        out = nd.NDArray.make((batch, m, n), device=dev, dtype=dtype)
    out.fill(float("nan"))
    _use(kernel)
    try:
        with dev.backend.profile() as prof:
            dev.backend.matmul(A.handle, B.handle, out.handle, m, k, n, batch=batch,
                               stride_a=m * k, stride_b=n * k, transpose_b=not nn)
            dev.backend.synchronize()
    finally:
        _use("tma")
    return out, set(prof.totals)


def relerr(torch, got, want) -> float:
    got, want = got.float(), want.float()
    return float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))


# --- 1. smoke test (child process) ------------------------------------------------------------
def smoke() -> int:
    """A few small and one large TMA product; exit 0 when all are right."""
    import torch

    import needle.backend_ndarray as nd

    dev = nd.cuda(0)
    if not dev.enabled():
        print("cuda disabled:", dev.reason)
        return 3
    tuning = dev.backend.tuning
    print("device:", dev.backend.device.describe(), "tuning:", tuning)
    if not tuning.tma:
        print("no TMA GEMM on this device (tuning.tma is off): the kernel is not used here")
        return 4
    from needle.backends.cuda import tensor_map

    probe = torch.empty(300, 136, dtype=torch.bfloat16, device="cuda")
    try:  # the host half alone: does the driver encode the operand maps?
        raw = tensor_map.matrix_map("bfloat16", probe.data_ptr(), 300, 136, 1, 0, 256)
        print(f"tensor map encoded: {len(raw)} bytes, first words {raw[:16].hex()}")
    except Exception as e:
        print(f"tensor map encoding FAILED: {type(e).__name__}: {e}")
        return 5
    ok = True
    for dtype, kern in (("bfloat16", "tma"), ("float16", "tma"), ("bfloat16", "tma_nn"),
                        ("float16", "tma_nn")):
        for batch, m, k, n in ((1, 128, 64, 256), (1, 200, 72, 264), (2, 300, 136, 520),
                               (1, 4096, 4096, 4096)):
            t0 = time.time()
            g = torch.Generator(device="cuda").manual_seed(m + k + n)
            a = torch.randn(batch, m, k, device="cuda", generator=g).to(_torch_dtype(torch, dtype))
            b = torch.randn(batch, n, k, device="cuda", generator=g).to(_torch_dtype(torch, dtype))
            out, kernels = needle_product(nd, dev, a, b, dtype, kern)
            got = torch.from_dlpack(out)
            want = a.float() @ b.float().transpose(1, 2)
            nans = int(torch.isnan(got.float()).sum())
            err = relerr(torch, torch.nan_to_num(got.float()), want)
            used = f"matmul_{kern}_{'bf16' if dtype == 'bfloat16' else 'f16'}" in kernels
            good = nans == 0 and err < TOL[dtype] and used
            ok &= good
            print(f"smoke {kern} {dtype} batch={batch} {m}x{k}x{n}: relerr {err:.2e}, "
                  f"unwritten {nans}, kernels {sorted(kernels)} ({time.time() - t0:.1f}s) "
                  f"{'ok' if good else 'FAIL'}",
                  flush=True)
    return 0 if ok else 1


def run_smoke(timeout: float) -> bool:
    print(f"== 1. smoke test of the TMA kernel in a child process (limit {timeout:.0f}s)",
          flush=True)
    t0 = time.time()
    try:
        r = subprocess.run([sys.executable, __file__, "--smoke"], capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) \
            else (e.stdout or "")
        print(out)
        print(f"TMA smoke test HUNG (killed after {timeout:.0f}s): a deadlock in the kernel's "
              "mbarrier pipeline, or a TMA fault; TMA rows are skipped")
        return False
    print(r.stdout.rstrip())
    if r.returncode != 0:
        print(r.stderr[-6000:])
        print(f"TMA smoke test FAILED (exit {r.returncode}, {time.time() - t0:.1f}s); "
              "TMA rows are skipped")
        return False
    print(f"smoke ok ({time.time() - t0:.1f}s)")
    return True


# --- 2. resources ------------------------------------------------------------------------------
def resources() -> None:
    print("== 2. resources of gemm_tma.cu for sm_90a", flush=True)
    try:
        from cuda.bindings import nvrtc

        from needle.backends.cuda.compiler import KERNEL_DIR, OPTIONS, compile_source, headers

        source = (KERNEL_DIR / "gemm_tma.cu").read_text()
        h = headers()
        prog = nvrtc.nvrtcCreateProgram(source.encode(), b"gemm_tma.cu", len(h),
                                        [v.encode() for v in h.values()],
                                        [k.encode() for k in h])[1]
        opts = [b"--gpu-architecture=sm_90a", b"--ptxas-options=-v",
                *[o.encode() for o in OPTIONS]]
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        size = nvrtc.nvrtcGetProgramLogSize(prog)[1]
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        nvrtc.nvrtcDestroyProgram(prog)
        print(f"nvrtc {nvrtc.nvrtcVersion()[1:]} result {res}")
        for line in log.decode(errors="replace").splitlines():
            if any(w in line for w in ("Used", "spill", "warning", "error", "entry")):
                print("  " + line.strip())
        cubin = compile_source(source, "gemm_tma", "sm_90a")
        tool = shutil.which("cuobjdump")
        if tool is None:
            print("cuobjdump not on PATH: no SASS counts")
            return
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(cubin)
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
        os.unlink(f.name)
        for word in ("HGMMA", "UTMALDG", "SYNCS", "USETMAXREG", "LDL", "STL"):
            print(f"  SASS {word}: {sum(word in line for line in sass.splitlines())}")
    except Exception as e:  # reporting only: never stop the run here
        print(f"resources: {type(e).__name__}: {e}")


# --- 3. correctness ----------------------------------------------------------------------------
def correctness(torch, nd, dev, with_tma: bool) -> list[str]:
    print("== 3. correctness vs torch float32 (relerr = ||got - ref|| / ||ref||)", flush=True)
    failures = []
    shapes = [(1, 4096, 4096, 4096), (1, 8192, 8192, 8192), (1, 3001, 1032, 2056),
              (3, 1000, 520, 776)]
    kernels = (["tma", "tma_nn"] if with_tma else []) + ["wgmma"]
    for dtype in ("bfloat16", "float16"):
        tdt = _torch_dtype(torch, dtype)
        for batch, m, k, n in shapes:
            a = torch.randn(batch, m, k, device="cuda").to(tdt)
            b = torch.randn(batch, n, k, device="cuda").to(tdt)
            want = a.float() @ b.float().transpose(1, 2)
            ref_torch = relerr(torch, a @ b.transpose(1, 2), want)
            line = f"{dtype:8s} batch={batch} {m}x{k}x{n}: torch {ref_torch:.2e}"
            for kern in kernels:
                try:
                    out, ran = needle_product(nd, dev, a, b, dtype, kern)
                    got = torch.from_dlpack(out).float()
                    nans = int(torch.isnan(got).sum())
                    err = relerr(torch, torch.nan_to_num(got), want)
                    used = ",".join(sorted(x for x in ran if x.startswith("matmul")))
                    good = nans == 0 and err < TOL[dtype] and f"matmul_{kern}" in used
                    line += f" | {kern} {err:.2e} ({used}{'' if nans == 0 else f', {nans} NaN'})"
                    if not good:
                        failures.append(f"{kern} {dtype} {batch}x{m}x{k}x{n}")
                        line += " FAIL"
                    del out, got
                except Exception as e:
                    failures.append(f"{kern} {dtype} {batch}x{m}x{k}x{n}: {e}")
                    line += f" | {kern} ERROR {type(e).__name__}: {e}"
            print(line, flush=True)
            del a, b, want
            torch.cuda.empty_cache()
    return failures


# --- 4. timing ---------------------------------------------------------------------------------
def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) if samples else float("nan")


def time_needle(nd, dev, a, b, dtype: str, kern: str, inner: int, reps: int) -> tuple[float, str]:
    """Median ms per product: a CUDA graph of `inner` products replayed `reps` times (eager,
    event-timed loops if capture fails)."""
    be = dev.backend
    m, k = a.shape
    n = b.shape[0]
    nn = kern == "tma_nn"  # B as a (k, n) row-major copy, untransposed: A @ B
    A = nd.from_dlpack(a, device=dev)
    B = nd.from_dlpack(b.t().contiguous() if nn else b, device=dev)
    out = nd.NDArray.make((m, n), device=dev, dtype=dtype)

    def call():
        be.matmul(A.handle, B.handle, out.handle, m, k, n, batch=1, stride_a=m * k,
                  stride_b=n * k, transpose_b=not nn)

    _use(kern)
    try:
        with be.profile() as prof:
            call()
            be.synchronize()
        used = ",".join(sorted(x for x in prof.totals if x.startswith("matmul")))
        for _ in range(3):
            call()
        be.synchronize()
        samples = []
        try:
            with be.capture() as graph:
                for _ in range(inner):
                    call()
            graph.replay()
            be.synchronize()
            for _ in range(reps):
                e0, e1 = be.queue.event(), be.queue.event()
                e0.record()
                graph.replay()
                e1.record()
                e1.synchronize()
                samples.append(e0.elapsed_ms(e1) / inner)
            graph.close()
        except Exception as e:
            print(f"  (needle {kern}: graph capture failed, timing eager: {e})")
            for _ in range(reps):
                e0, e1 = be.queue.event(), be.queue.event()
                e0.record()
                for _ in range(inner):
                    call()
                e1.record()
                e1.synchronize()
                samples.append(e0.elapsed_ms(e1) / inner)
        return _median_ms(samples), used
    finally:
        _use("tma")


def time_torch(torch, a, b, inner: int, reps: int) -> float:
    c = torch.empty(a.shape[0], b.shape[0], dtype=a.dtype, device="cuda")
    bt = b.t()
    for _ in range(3):
        torch.matmul(a, bt, out=c)
    torch.cuda.synchronize()
    samples = []
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            torch.matmul(a, bt, out=c)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(inner):
                torch.matmul(a, bt, out=c)
        g.replay()
        torch.cuda.synchronize()
        run = g.replay
        per = inner
    except Exception as e:
        print(f"  (torch: graph capture failed, timing eager: {e})")

        def run():
            for _ in range(inner):
                torch.matmul(a, bt, out=c)
        per = inner
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        run()
        e1.record()
        e1.synchronize()
        samples.append(e0.elapsed_time(e1) / per)
    return _median_ms(samples)


def timing(torch, nd, dev, sizes, with_tma: bool, inner: int, reps: int, dtype: str) -> list:
    print(f"== 4. timing {dtype} C = A @ B^T (graphs of {inner} products, median of {reps})",
          flush=True)
    rows = []
    tdt = _torch_dtype(torch, dtype)
    for s in sizes:
        a = torch.randn(s, s, device="cuda").to(tdt)
        b = torch.randn(s, s, device="cuda").to(tdt)
        flop = 2.0 * s * s * s
        n_inner = max(1, min(inner, int(inner * (4096 / s) ** 3)))  # keep 8192 short
        row = {"size": s, "torch": time_torch(torch, a, b, n_inner, reps)}
        for kern in (["tma", "tma_nn"] if with_tma else []) + ["wgmma"]:
            try:
                row[kern], row[kern + "_used"] = time_needle(nd, dev, a, b, dtype, kern,
                                                             n_inner, reps)
            except Exception as e:
                print(f"  needle {kern} at {s}: {type(e).__name__}: {e}")
                row[kern] = float("nan")
        line = f"{s}: torch {row['torch'] * 1e3:8.1f} us {flop / row['torch'] / 1e9:6.0f} TFLOP/s"
        for kern in ("tma", "tma_nn", "wgmma"):
            if kern in row:
                t = row[kern]
                line += (f" | {kern} {t * 1e3:8.1f} us {flop / t / 1e9:6.0f} TFLOP/s "
                         f"({row['torch'] / t:.2f}x torch) [{row.get(kern + '_used', '?')}]")
        print(line, flush=True)
        rows.append(row)
        del a, b
        torch.cuda.empty_cache()
    return rows


def _cell(row: dict, key: str) -> str:
    t = row.get(key)
    if t is None or t != t:
        return f"{'-':>13}"
    return f"{2.0 * row['size'] ** 3 / t / 1e9:6.0f} {row['torch'] / t:5.2f}x"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="(internal) the child's smoke test")
    ap.add_argument("--sizes", default="1024,2048,4096,8192")
    ap.add_argument("--inner", type=int, default=20, help="products per graph at 4096")
    ap.add_argument("--reps", type=int, default=25, help="timed replays (median)")
    ap.add_argument("--timeout", type=float, default=240.0, help="smoke test limit, seconds")
    ap.add_argument("--skip-check", action="store_true", help="timing only")
    args = ap.parse_args()
    if args.smoke:
        try:
            return smoke()
        except Exception:
            traceback.print_exc()  # a KernelCompileError carries NVRTC's log
            return 2

    import torch

    import needle.backend_ndarray as nd

    print("torch", torch.__version__, "| device", torch.cuda.get_device_name(0))
    global NO_TMA
    with_tma = run_smoke(args.timeout)
    NO_TMA = not with_tma
    _use("tma")
    resources()
    dev = nd.cuda(0)
    if not dev.enabled():
        print("needle cuda disabled:", dev.reason)
        return 1
    print("needle:", dev.backend.device.describe(), dev.backend.tuning)
    failures = [] if args.skip_check else correctness(torch, nd, dev, with_tma)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    rows = timing(torch, nd, dev, sizes, with_tma, args.inner, args.reps, "bfloat16")
    f16 = timing(torch, nd, dev, [4096], with_tma, args.inner, args.reps, "float16")

    print("\n== summary (bf16 unless noted; TFLOP/s, ratio to torch)")
    print(f"{'size':>6} {'torch':>7} {'tma (A.Bt)':>13} {'tma_nn (A.B)':>13} {'wgmma':>13}")
    for r, note in [(r, "") for r in rows] + [(r, " f16") for r in f16]:
        print(f"{r['size']:>6} {2.0 * r['size'] ** 3 / r['torch'] / 1e9:7.0f} "
              f"{_cell(r, 'tma')} {_cell(r, 'tma_nn')} {_cell(r, 'wgmma')}{note}")
    print("TMA smoke:", "ok" if with_tma else "FAILED/HUNG (see above)")
    print("correctness:", "all ok" if not failures else f"{len(failures)} FAILED: {failures}")
    return 0 if with_tma and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
