"""The CUDA backend's tuning: every choice of kernel and tile it makes, read once per device.

Environment overrides (docs/cuda.md lists them):

- ``NEEDLE_WGMMA=0``: no Hopper warpgroup-MMA GEMMs (wgmma, TMA) even on sm_90a.
- ``NEEDLE_GEMM=wgmma``: half-precision GEMMs take the cp.async wgmma kernel, not TMA.
- ``NEEDLE_WGMMA_TILE=128|256``: the wgmma kernel's N tile (default: by problem size).
- ``NEEDLE_TMA_TILE=64|80|128|160|176|256``: the TMA GEMM's N tile (default: by problem size,
  ``tma_width``; 80, 160 and 176 only where B is K-major fp16 / bf16, else the default's).
- ``NEEDLE_TC_TILE=256``: the sm_80 tensor-core GEMM's 128x256 tile (default 128x128).
- ``NEEDLE_PDL=0``: no programmatic dependent launch inside graph captures.
- ``NEEDLE_PAGED_ATTENTION=simple``: paged attention by the group-per-query-head kernel
  instead of flash decoding (paged.cu).
- ``NEEDLE_DECODE_ATTENTION=flash|split``: one token's attention by the scalar
  flash-decoding kernel (decode.cu) or nn.cu's split kernel instead of the tensor-core one
  (decode_tc.cu); ``NEEDLE_DECODE_SPLITS=N``: most ranges per KV head (default 32);
  ``NEEDLE_DECODE_CLUSTER=0``: on sm_90, a short cache's ranges merged through memory rather
  than within a thread-block cluster.
- ``NEEDLE_QUANT_SKINNY=0``: products of 2..16 rows with int8 / int4 weights per row
  (quant.cu's qmv) or dequantized first, instead of one pass over the weights on tensor
  cores (quant_skinny.cu, sm_80+).
- ``NEEDLE_QUANT_GEMM=auto|always|off``: products of more than 16 rows with int8 / int4
  weights (prefill) dequantize W in registers as the warpgroup MMA's operand
  (quant_gemm.cu, sm_90a) instead of into a workspace for the GEMM: by default ("auto")
  up to 256 rows, and up to 768 where each multiprocessor's share of the k steps is at
  least a 2,048-wide tile's (faster there on the H100; docs/cuda_notes.md v32), "always"
  wherever it applies, "off" never.
- ``NEEDLE_QUANT_STREAM=auto|always|off``: one row's int8 / int4 decode projections with
  bf16 / fp16 x by bulk copies of each multiprocessor's rows into shared memory
  (quant_stream.cu, sm_90) instead of quant_decode.cu's register rounds: by default
  ("auto") where each warp of a multiprocessor's group has one step of rows, or the rows
  are at least 160 16-byte chunks (5,120 int4 or 2,560 int8 values; faster there:
  docs/cuda_notes.md v49), "always" wherever they fit, "off" never.
- ``NEEDLE_SKINNY_TC=N``: products X @ W^T of 2..N rows (default 127 with the TMA GEMM,
  whose 128-row tile 128 rows fill, else 128; 0: none) take the skinny tensor-core kernel
  (skinny.cu) instead of the tiled GEMMs.
- ``NEEDLE_FOLDED_NORM=0``: the decode step keeps its RMSNorms as launches of their own
  (by default a model folds each norm's scale into the next projection's weights at load,
  and one-row products take the norm in the same pass: gemv.py).
- ``NEEDLE_F32_ON_F64=0|1``: float32 products of whole 128 x 128 tiles on FP64 tensor
  cores (``sgemm_dmma.cuh``: exact products, float64 sums, one rounding). Default: on for
  sm_90 devices whose FP64 tensor cores run at full rate (H100, H200, GH200: model names
  ``F64_FULL_RATE``), off elsewhere (export parts such as the H800 and H20 have ~1 TFLOP/s
  of FP64); 1 forces it on any sm_90 device.
- ``NEEDLE_CUDA_OPTIONS``: extra NVRTC options; its ``-DTC_STAGES=``, ``-DWG_STAGES=``,
  ``-DGEMM_TMA_STAGES=`` (every TMA tile width: as many stages as that many of the 256-wide
  tile take) and ``-DGEMM_TMA_STAGES_<W>=`` (one width) defines set pipeline depths that
  the launches must size shared memory for, so they are read here too.

Tests and scripts change a setting for a block with ``backend.tuned(gemm="wgmma")``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ...errors import DeviceError
from ..gpu import GpuTuning

F64_FULL_RATE = ("H100", "H200", "GH200")  # sm_90 models with full-rate FP64 tensor cores
TMA_WIDTHS = (256, 128, 64)  # gemm_tma.cu's N tiles (all 128 rows high)
# and with K-major fp16 / bf16 B (X @ W^T) also 176, 160 and 80: 2,560 columns (a 1.1B
# layer's fused q/k/v) are 16 tiles of 160, 2 waves at 2,048 rows where 256-wide tiles take
# 1.2; at 512 rows 128 tiles of 80, one full wave where 128-wide fill 0.6 (cuda_notes v34);
# 11,264 (its gate/up) 64 of 176, 2 waves at 512 rows where 128-wide take 2.7 (cuda_notes v33)
K_MAJOR_WIDTHS = (256, 176, 160, 128, 80, 64)
# the TMA GEMM's pipeline stages a tile width (gemm_tma.cu's stages<BN>(), the same numbers):
# 160, 128 and 80 measured faster below what fills shared memory (cuda_notes v34)
TMA_STAGES = ((256, 4), (176, 5), (160, 4), (128, 4), (80, 6), (64, 8))
TMA_TILE_COST = 64  # a tile's fixed cost in columns of work: its A rows are loaded whatever
# its width (calibrated on the H100: docs/cuda_notes.md, "TMA GEMM tile widths")


def _tma_tile(value: str | None) -> int | None:
    if not value:
        return None
    if value not in {str(w) for w in K_MAJOR_WIDTHS}:
        raise DeviceError(f"NEEDLE_TMA_TILE={value!r} is not a TMA GEMM tile width; use one "
                          f"of {', '.join(map(str, K_MAJOR_WIDTHS))} or leave it unset "
                          "(automatic)")
    return int(value)


def _positive(env, name: str) -> int | None:
    """An optional positive integer from the environment (unset or empty: None)."""
    value = env.get(name, "")
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise DeviceError(f"{name}={value!r}: use a positive integer or leave it unset")
    return int(value)


def _stages(options: list[str], define: str, default: int) -> int:
    for opt in options:
        if opt.startswith(f"-D{define}="):
            return int(opt.split("=", 1)[1])
    return default


@dataclass(frozen=True)
class CudaTuning(GpuTuning):
    """``capability``/``arch`` decide what the device can run; the rest is choice."""

    split_k: bool = True  # float32 products with few output tiles split K over more groups
    f32_on_f64: bool = False  # float32 products on FP64 tensor cores (sgemm_dmma.cuh): sm_90
    narrow_f32: bool = True  # float32 products of <= 64 columns on 128 x 64 tiles
    attention_simt: bool = True  # float32 attention (head_dim 64, >= 64 query rows) as
    # tiled products (attention_simt.cu) rather than nn.cu's attention_f32
    attention_backward: bool = True  # attention gradients fused (float32 head_dim 64:
    # attention_simt_bwd.cu; half types head_dim 64/128: attention_tc_bwd.cu) rather than
    # composed of products and a softmax
    attention_backward_parts: bool = True  # attention_tc_bwd.cu's dK/dV walk split by query
    # heads where there are few key blocks (float32 sums added after)
    transpose: bool = True  # compact() of transposed matrices by a tiled transpose kernel
    skinny: bool = True  # products of <= 8 rows read B once (matmul_skinny)
    skinny_tc: int = 128  # X @ W^T of 2..this many rows on tensor cores, W read once
    # (skinny.cu: a batched decode step's projections); 0 turns it off; 127 with the TMA GEMM
    half_scatter: bool = True  # small fp16/bf16 scatter_adds in place (a decode step's K/V)
    mma: bool = False  # tensor-core (mma.sync) GEMMs and prefill attention: sm_80+
    wgmma: bool = False  # Hopper warpgroup MMA GEMMs: sm_90a
    tma: bool = False  # the TMA-fed warp-specialized GEMM (gemm_tma.cu): sm_90a
    gemm: str = "tma"  # "tma", or "wgmma" for the cp.async kernel
    wgmma_tile: str | None = None
    tc_tile: int = 128
    pdl: bool = False  # programmatic dependent launch in captured graphs: sm_90+
    tc_stages: int = 4
    wg_stages: int = 4
    tma_stages: tuple[tuple[int, int], ...] = TMA_STAGES  # (tile width, stages) pairs
    tma_tile: int | None = None  # the TMA GEMM's N tile; None: tma_width's choice
    tma_groups: int | None = None  # the TMA GEMM's persistent grid: None, one group an SM;
    # fewer make each group walk more tiles (tests), more than the tiles one tile a group
    quant_skinny: bool = False  # 2..16 rows times int8 / int4 weights on tensor cores: sm_80+
    quant_gemm: str = "off"  # more rows times int8 / int4 weights, W dequantized in registers
    # as the wgmma's A operand (quant_gemm.cu, sm_90a): "auto" (cuda/quant_gemm.py's
    # takes()), "always", "off"
    quant_stream: str = "off"  # one row times int8 / int4 weights (16-bit x) by bulk copies
    # of each multiprocessor's rows into shared memory (quant_stream.cu, sm_90), not
    # quant_decode.cu's register rounds: "auto" (cuda/quant_stream.py's rule), "always", "off"
    fused_matvec: bool = False  # the decode step's norm/SwiGLU/residual fused into its gemvs
    # (off by default: on the H100 the fused kernels are still slower than gemv + add_rmsnorm,
    # docs/cuda_notes.md v9)
    folded_norm: bool = True  # the decode step's norms folded into its projections' weights
    # (capability folded_norm_matvec: gemv_t_norm / gemv_glu_norm, cuda/gemv.py)
    l2_prefetch: bool = False  # fused gemvs prefetch their groups' weight rows into L2: sm_90+
    decode_attention: str = "tc"  # "tc" (kernels/decode_tc.cu: fp16/bf16 on tensor cores,
    # sm_80+; other dtypes take flash), "flash" (kernels/decode.cu) or "split" (nn.cu's)
    paged_flash: bool = True  # paged_attention by flash decoding (paged.cu), not the
    # group-per-query-head kernel
    decode_splits: int = 32  # flash decoding: most ranges per KV head (at most 64)
    decode_cluster: bool = False  # sm_90: a cache of 2-8 tensor-core ranges a KV head merges
    # them within one thread-block cluster (decode_tc.cu's ...c kernels), not through memory
    decode_bands: bool = True  # attention_decode_bands names the cluster kernels' bound, so
    # the decoder records a step for the positions below it and one for those above

    @classmethod
    def for_device(cls, capability: int, arch: str, env=os.environ,
                   model: str = "") -> CudaTuning:
        """The tuning for a device of compute ``capability`` (named ``model``) whose kernels
        NVRTC builds for ``arch`` (the executable cache's target), with the environment's
        overrides."""
        options = env.get("NEEDLE_CUDA_OPTIONS", "").split()
        target = int("".join(c for c in arch if c.isdigit()))  # sm_90a, compute_89 -> 90, 89
        hopper = arch == "sm_90a" and env.get("NEEDLE_WGMMA", "1") != "0"
        f64 = env.get("NEEDLE_F32_ON_F64", "")
        if f64 not in ("", "0", "1"):
            raise DeviceError(f"NEEDLE_F32_ON_F64={f64!r}: use 1 (float32 products on FP64 "
                              "tensor cores on any sm_90 device), 0 (never) or leave it unset")
        return cls(mma=capability >= 80, wgmma=hopper, tma=hopper,
                   f32_on_f64=target >= 90 and (f64 == "1" if f64 else
                                                any(m in model for m in F64_FULL_RATE)),
                   gemm="wgmma" if env.get("NEEDLE_GEMM") == "wgmma" else "tma",
                   wgmma_tile=env.get("NEEDLE_WGMMA_TILE"),
                   tc_tile=256 if env.get("NEEDLE_TC_TILE", "128") == "256" else 128,
                   attention_backward=env.get("NEEDLE_ATTENTION_BACKWARD", "1") != "0",
                   # 128 rows: the TMA GEMM 1.3-2.3x faster on the H100 (cuda_notes v32)
                   skinny_tc=int(env.get("NEEDLE_SKINNY_TC", "127" if hopper else "128"))
                   if capability >= 80 else 0,
                   pdl=target >= 90 and env.get("NEEDLE_PDL", "1") != "0",
                   tc_stages=_stages(options, "TC_STAGES", 4),
                   wg_stages=_stages(options, "WG_STAGES", 4),
                   tma_stages=_tma_stages(options),
                   tma_tile=_tma_tile(env.get("NEEDLE_TMA_TILE")),
                   tma_groups=_positive(env, "NEEDLE_TMA_GROUPS"),
                   quant_skinny=capability >= 80 and env.get("NEEDLE_QUANT_SKINNY", "1") != "0",
                   quant_gemm=_choice("NEEDLE_QUANT_GEMM", env.get("NEEDLE_QUANT_GEMM"))
                   if hopper else "off",
                   quant_stream=_choice("NEEDLE_QUANT_STREAM", env.get("NEEDLE_QUANT_STREAM"))
                   if target >= 90 else "off",
                   fused_matvec=env.get("NEEDLE_FUSED_MATVEC", "0") == "1",
                   folded_norm=env.get("NEEDLE_FOLDED_NORM", "1") != "0",
                   l2_prefetch=target >= 90 and env.get("NEEDLE_L2_PREFETCH", "0") == "1",
                   paged_flash=env.get("NEEDLE_PAGED_ATTENTION", "flash") == "flash",
                   decode_attention=env.get("NEEDLE_DECODE_ATTENTION", "tc"),
                   decode_splits=max(1, min(64, int(env.get("NEEDLE_DECODE_SPLITS", "32")))),
                   decode_cluster=target >= 90 and env.get("NEEDLE_DECODE_CLUSTER", "1") != "0",
                   decode_bands=env.get("NEEDLE_DECODE_BANDS", "1") != "0")


def _choice(name: str, value: str | None) -> str:
    """NEEDLE_QUANT_GEMM, NEEDLE_QUANT_STREAM: "auto" (unset), "always" (or 1), "off" (or 0)."""
    choice = {None: "auto", "": "auto", "auto": "auto", "always": "always", "1": "always",
              "off": "off", "0": "off"}.get(value)
    if choice is None:
        raise DeviceError(f"{name}={value!r}: use auto, always or off")
    return choice


def tma_width(m: int, p: int, batch: int, sms: int,
              widths: tuple[int, ...] = TMA_WIDTHS) -> int:
    """The TMA GEMM's tile width (of ``widths``: K_MAJOR_WIDTHS where B is K-major fp16 /
    bf16) for an (m, p) output, ``batch`` times, on ``sms`` SMs: the one whose tiles finish
    soonest, counting whole waves of one tile per SM (a 1024 x 1024 output is 32 tiles of
    128 x 256 for 132 SMs, but 128 tiles of 128 x 64)."""
    def finish(width: int) -> int:
        tiles = -(-m // 128) * -(-p // width) * batch
        return -(-tiles // sms) * (width + TMA_TILE_COST)
    fits = [w for w in widths if p >= w] or [widths[-1]]
    return min(fits, key=finish)  # ties: the wider tile (listed first)


def tma_stages(width: int, table: tuple[tuple[int, int], ...] = TMA_STAGES) -> int:
    """Pipeline stages of the TMA GEMM's tile ``width`` wide (a CudaTuning's ``tma_stages``
    table; gemm_tma.cu's stages<BN>())."""
    return dict(table)[width]


def _tma_stages(options: list[str]) -> tuple[tuple[int, int], ...]:
    """The stage table with NEEDLE_CUDA_OPTIONS' defines: -DGEMM_TMA_STAGES=S gives each
    width what S stages of the 256-wide tile take in shared memory, -DGEMM_TMA_STAGES_<W>=s
    sets one width (as gemm_tma.cu reads them)."""
    base = _stages(options, "GEMM_TMA_STAGES", 0)
    return tuple((w, _stages(options, f"GEMM_TMA_STAGES_{w}",
                             base * (128 + 256) // (128 + w) if base else s))
                 for w, s in TMA_STAGES)
