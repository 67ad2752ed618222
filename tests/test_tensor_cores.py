"""Tensor cores: the warp-level primitives (mma.sync, ldmatrix, cp.async), the GEMM and
implicit-GEMM conv kernels built on them, the precision switches that select them
(`enable_amp(True, dtype=flow.bfloat16)`, `allow_tf32`), and their sm_90 machine code.

The primitive kernels below are plain CUDA C++ that call the named device functions of
runtime_cpp/flowgen_cuda_prelude.h; the emulator runs them with the PTX ISA's per-lane
fragment layouts and NVRTC compiles the same source for sm_80 and sm_90. Every kernel test runs
on the emulator and, marked `gpu` (pytest -m gpu), on the GPU when one is present (the
`kernel_target` fixture; the cases come from benchmarks/first_contact_cases.py, which the
first-contact GPU run shares); the public-API graph tests run on the cpu target and on a GPU
(`graph_device`). Values are small integers wherever a test compares exactly, so every sum is
exact in fp32 and only a layout mistake (a transposed or shifted fragment) can change a result;
those comparisons hold on the hardware too.
"""

import copy
import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path
from unittest import mock

import ml_dtypes
import numpy as np
import nvidia
import pytest
from cuda.bindings import nvrtc as nvrtc_api

import flowgen as flow
import flowgen.nn as nn
from flowgen import dtype as dt
from flowgen.codegen.kernel import RenderContext
from flowgen.codegen.kernels import render_node
from flowgen.codegen.target import TARGET_BLOCKS, rendering_for
from flowgen.ops.registry import get_op
from flowgen.runtime import nvrtc
from flowgen.runtime.toolchain import cuda_include_dirs, runtime_cpp_dir
from first_contact_cases import (KINDS, U_BF16, U_FP32, U_OUT, U_TF32, ConvCase, GemmCase, conv_node, gpu_arch,
                                 make_launch, small_ints, tensor_core_family, tf32_round)
from graphs import InferGraph, TrainGraph

PRIMITIVES = r"""
// One warp multiplies a 16x16 A (row-major) by a 16x8 B (stored k-major, B[k][n]) and adds C,
// building each lane's fragments straight from global memory by the PTX ISA's formulas.
template <int Kind>
__device__ void mma16_from_global(const unsigned short* A, const unsigned short* B, const float* C, float* D) {
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  auto pair = [](const unsigned short* p, int first, int stride) {
    return unsigned(p[first]) | unsigned(p[first + stride]) << 16;
  };
  unsigned a[4] = {pair(A, g * 16 + 2 * t, 1), pair(A, (g + 8) * 16 + 2 * t, 1),
                   pair(A, g * 16 + 2 * t + 8, 1), pair(A, (g + 8) * 16 + 2 * t + 8, 1)};
  unsigned b[2] = {pair(B, (2 * t) * 8 + g, 8), pair(B, (2 * t + 8) * 8 + g, 8)};
  float acc[4] = {C[g * 8 + 2 * t], C[g * 8 + 2 * t + 1], C[(g + 8) * 8 + 2 * t], C[(g + 8) * 8 + 2 * t + 1]};
  if (Kind == 0) mma_m16n8k16_bf16(acc, a, b); else mma_m16n8k16_f16(acc, a, b);
  D[g * 8 + 2 * t] = acc[0];
  D[g * 8 + 2 * t + 1] = acc[1];
  D[(g + 8) * 8 + 2 * t] = acc[2];
  D[(g + 8) * 8 + 2 * t + 1] = acc[3];
}
extern "C" __global__ void mma_bf16(const unsigned short* A, const unsigned short* B, const float* C, float* D) {
  mma16_from_global<0>(A, B, C, D);
}
FLOWGEN_EMU_KERNEL(mma_bf16, true)
extern "C" __global__ void mma_f16(const unsigned short* A, const unsigned short* B, const float* C, float* D) {
  mma16_from_global<1>(A, B, C, D);
}
FLOWGEN_EMU_KERNEL(mma_f16, true)

// 16x8 A (row-major fp32) times 8x8 B (B[k][n]) plus C on the tf32 path; inputs are rounded
// by float_to_tf32 (cvt.rna.tf32.f32).
extern "C" __global__ void mma_tf32(const float* A, const float* B, const float* C, float* D) {
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  unsigned a[4] = {float_to_tf32(A[g * 8 + t]), float_to_tf32(A[(g + 8) * 8 + t]),
                   float_to_tf32(A[g * 8 + t + 4]), float_to_tf32(A[(g + 8) * 8 + t + 4])};
  unsigned b[2] = {float_to_tf32(B[t * 8 + g]), float_to_tf32(B[(t + 4) * 8 + g])};
  float acc[4] = {C[g * 8 + 2 * t], C[g * 8 + 2 * t + 1], C[(g + 8) * 8 + 2 * t], C[(g + 8) * 8 + 2 * t + 1]};
  mma_m16n8k8_tf32(acc, a, b);
  D[g * 8 + 2 * t] = acc[0];
  D[g * 8 + 2 * t + 1] = acc[1];
  D[(g + 8) * 8 + 2 * t] = acc[2];
  D[(g + 8) * 8 + 2 * t + 1] = acc[3];
}
FLOWGEN_EMU_KERNEL(mma_tf32, true)

// Stages 32 rows of 8 16-bit values in shared memory (rows padded to 24 elements); lane l
// passes the address of row order[l]; out[l][j] receives register j of every ldmatrix variant:
// columns 0 (x1), 1-2 (x2), 3-6 (x4), then the same three with .trans (columns 7-13).
extern "C" __global__ void ldmatrix_all(const unsigned short* rows, const int* order, unsigned* out) {
  __shared__ __align__(16) unsigned short tile[32][24];
  const int lane = threadIdx.x;
  for (int c = 0; c < 8; ++c) tile[lane][c] = rows[lane * 8 + c];
  __syncwarp();
  const void* row = &tile[order[lane]][0];
  unsigned* mine = out + lane * 14;
  unsigned r1[1], r2[2], r4[4];
  ldmatrix_x1(r1, row);
  mine[0] = r1[0];
  ldmatrix_x2(r2, row);
  mine[1] = r2[0]; mine[2] = r2[1];
  ldmatrix_x4(r4, row);
  for (int j = 0; j < 4; ++j) mine[3 + j] = r4[j];
  ldmatrix_x1_trans(r1, row);
  mine[7] = r1[0];
  ldmatrix_x2_trans(r2, row);
  mine[8] = r2[0]; mine[9] = r2[1];
  ldmatrix_x4_trans(r4, row);
  for (int j = 0; j < 4; ++j) mine[10 + j] = r4[j];
}
FLOWGEN_EMU_KERNEL(ldmatrix_all, true)

// The usual pairing: A (16x16 row-major) through ldmatrix.x4, B stored k-major (B[k][n],
// 16x8) through ldmatrix.x2.trans, then one bf16 mma; D = A @ B.
extern "C" __global__ void ldmatrix_mma(const __nv_bfloat16* A, const __nv_bfloat16* B, float* D) {
  __shared__ __align__(16) __nv_bfloat16 As[16][16 + 8];
  __shared__ __align__(16) __nv_bfloat16 Bs[16][8 + 8];
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  for (int e = lane; e < 256; e += 32) As[e / 16][e % 16] = A[e];
  for (int e = lane; e < 128; e += 32) Bs[e / 8][e % 8] = B[e];
  __syncwarp();
  unsigned a[4], b[2];
  ldmatrix_x4(a, &As[lane % 16][(lane / 16) * 8]);      // matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15)
  ldmatrix_x2_trans(b, &Bs[lane % 16][0]);               // lanes 0-15: rows k = 0..15
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  mma_m16n8k16_bf16(acc, a, b);
  D[g * 8 + 2 * t] = acc[0];
  D[g * 8 + 2 * t + 1] = acc[1];
  D[(g + 8) * 8 + 2 * t] = acc[2];
  D[(g + 8) * 8 + 2 * t + 1] = acc[3];
}
FLOWGEN_EMU_KERNEL(ldmatrix_mma, true)

// cp.async: each of 32 threads copies 16 + 8 + 4 bytes with .ca and 16 with .cg from its
// 48-byte row of src into its 48-byte row of a shared buffer first filled with 0xAB (every copy
// aligned to its size, as the hardware requires: a 44-byte row faulted on an H200). Group 0 (.ca
// 16 at byte 0 with src-size `partial`, .ca 8 at byte 32) is committed before group 1 (.cg 16 at
// byte 16 with src-size 0 for odd threads, .ca 4 at byte 40). snapshot[0] holds group 0's bytes
// after wait_group 1 (group 1's may still be in flight: not read), snapshot[1] the row after
// wait_group 0.
extern "C" __global__ void async_copies(const unsigned char* src, int partial, unsigned char* snapshot) {
  __shared__ __align__(16) unsigned char buf[32 * 48];
  const int tid = threadIdx.x;
  for (int i = tid; i < 32 * 48; i += 32) buf[i] = 0xAB;
  __syncthreads();
  unsigned char* mine = buf + tid * 48;
  const unsigned char* from = src + tid * 48;
  cp_async_ca<16>(mine, from, partial);
  cp_async_ca<8>(mine + 32, from + 32, 8);
  cp_async_commit();
  cp_async_cg(mine + 16, from + 16, tid % 2 ? 0 : 16);
  cp_async_ca<4>(mine + 40, from + 40, 4);
  cp_async_commit();
  cp_async_wait_group<1>();
  for (int i = 0; i < 16; ++i) snapshot[tid * 48 + i] = mine[i];
  for (int i = 32; i < 40; ++i) snapshot[tid * 48 + i] = mine[i];
  cp_async_wait_group<0>();
  for (int i = 0; i < 48; ++i) snapshot[32 * 48 + tid * 48 + i] = mine[i];
}
FLOWGEN_EMU_KERNEL(async_copies, true)
"""


@pytest.fixture(scope="module")
def primitives(kernel_target):
    return make_launch(PRIMITIVES, "test_tensor_cores", kernel_target)


def launch_warp(launch, name, *args):
    launch(name, (1, 1, 1), (32, 1, 1), 0, list(args))


@pytest.mark.parametrize("kernel, np_dtype", [("mma_bf16", ml_dtypes.bfloat16), ("mma_f16", np.float16)])
def test_mma_m16n8k16_fragments_follow_the_ptx_layout(primitives, kernel, np_dtype):
    rng = np.random.default_rng(1)
    a, b, c = small_ints(rng, (16, 16)), small_ints(rng, (16, 8)), small_ints(rng, (16, 8), -50, 50)
    d = np.zeros((16, 8), np.float32)
    launch_warp(primitives, kernel, a.astype(np_dtype).view(np.uint16), b.astype(np_dtype).view(np.uint16), c, d)
    np.testing.assert_array_equal(d, a @ b + c)


def test_mma_m16n8k16_accumulates_in_fp32_from_bf16_inputs(primitives):
    rng = np.random.default_rng(2)
    a = rng.standard_normal((16, 16)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16)
    c = np.zeros((16, 8), np.float32)
    d = np.zeros((16, 8), np.float32)
    launch_warp(primitives, "mma_bf16", a.view(np.uint16), b.view(np.uint16), c, d)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    # 16 fp32 additions of exact products: far closer than one bf16 rounding of the result
    np.testing.assert_allclose(d, exact, rtol=0, atol=16 * 2.0 ** -24 * np.abs(exact).max() + 1e-30)
    assert np.abs(d - exact).max() < np.abs(exact.astype(ml_dtypes.bfloat16).astype(np.float64) - exact).max()


def test_mma_m16n8k8_tf32_fragments_follow_the_ptx_layout(primitives):
    rng = np.random.default_rng(3)
    a, b, c = small_ints(rng, (16, 8)), small_ints(rng, (8, 8)), small_ints(rng, (16, 8), -50, 50)
    d = np.zeros((16, 8), np.float32)
    launch_warp(primitives, "mma_tf32", a, b, c, d)
    np.testing.assert_array_equal(d, a @ b + c)


def test_mma_tf32_rounds_inputs_to_nearest_ties_away(primitives):
    rng = np.random.default_rng(4)
    a = rng.standard_normal((16, 8)).astype(np.float32)
    a[0, :4] = np.array([1 + 2.0 ** -11, -(1 + 2.0 ** -11), 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -12], np.float32)
    eye, zero = np.eye(8, dtype=np.float32), np.zeros((16, 8), np.float32)
    d = np.zeros((16, 8), np.float32)
    launch_warp(primitives, "mma_tf32", a, eye, zero, d)
    np.testing.assert_array_equal(d, tf32_round(a))
    np.testing.assert_array_equal(d[0, :4], [1 + 2.0 ** -10, -(1 + 2.0 ** -10), 1 + 2 * 2.0 ** -10, 1.0])


def ldmatrix_expected(rows: np.ndarray, order: np.ndarray, matrices: int, trans: bool) -> np.ndarray:
    """What each lane's registers hold per the PTX ISA: matrix j's rows come from the
    addresses of lanes 8j..8j+7; lane l gets row l/4, columns 2(l%4), 2(l%4)+1 (or, with
    .trans, column l/4 of rows 2(l%4), 2(l%4)+1); the lower column/row in the low half."""
    out = np.zeros((32, matrices), np.uint32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for j in range(matrices):
            m = rows[order[8 * j: 8 * j + 8]].astype(np.uint32)   # 8 x 8 matrix j
            lo, hi = (m[2 * t, g], m[2 * t + 1, g]) if trans else (m[g, 2 * t], m[g, 2 * t + 1])
            out[lane, j] = lo | hi << 16
    return out


def test_ldmatrix_distributes_rows_like_the_ptx_isa(primitives):
    rng = np.random.default_rng(5)
    rows = rng.integers(0, 2 ** 16, size=(32, 8)).astype(np.uint16)
    order = rng.permutation(32).astype(np.int32)
    out = np.zeros((32, 14), np.uint32)
    launch_warp(primitives, "ldmatrix_all", rows, order, out)
    columns = {(1, False): [0], (2, False): [1, 2], (4, False): [3, 4, 5, 6],
               (1, True): [7], (2, True): [8, 9], (4, True): [10, 11, 12, 13]}
    for (matrices, trans), cols in columns.items():
        np.testing.assert_array_equal(out[:, cols], ldmatrix_expected(rows, order, matrices, trans),
                                      err_msg=f"ldmatrix x{matrices}{' trans' if trans else ''}")


def test_ldmatrix_fragments_feed_mma(primitives):
    rng = np.random.default_rng(6)
    a, b = small_ints(rng, (16, 16)), small_ints(rng, (16, 8))
    d = np.zeros((16, 8), np.float32)
    launch_warp(primitives, "ldmatrix_mma", a.astype(ml_dtypes.bfloat16), b.astype(ml_dtypes.bfloat16), d)
    np.testing.assert_array_equal(d, a @ b)


def test_cp_async_lands_groups_on_wait_and_zero_fills_past_src_size(primitives):
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, size=32 * 48).astype(np.uint8)
    snapshot = np.zeros(2 * 32 * 48, np.uint8)
    launch_warp(primitives, "async_copies", src, ctypes.c_int(10), snapshot)
    after_one, final = snapshot.reshape(2, 32, 48)
    expected = src.reshape(32, 48).copy()
    expected[:, 10:16] = 0                  # src-size 10 of a 16-byte copy: the rest is zero
    expected[1::2, 16:32] = 0               # src-size 0: all zeros
    expected[:, 44:48] = 0xAB               # never copied
    np.testing.assert_array_equal(final, expected)
    group0 = np.r_[0:16, 32:40]             # complete after wait_group 1
    np.testing.assert_array_equal(after_one[:, group0], expected[:, group0])


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_primitives_compile_with_nvrtc(arch):
    cubin = nvrtc.compile_cuda(PRIMITIVES, arch=arch, tag="test_tensor_cores")
    assert cubin[:4] == b"\x7fELF"


# ---------------------------------------------------------------------------------------
# The GEMM family on tensor cores (templates/gemm_mma.cu.j2), one kernel per case, rendered
# the way the fused GEMM path calls it: operands possibly transposed (read in place), an
# fp32 output written by the epilogue lines.

# Tails in every dim (K = 70: 4-byte copies for 16-bit A, plain loads for B's rows of 45),
# 16-byte cp.async.cg copies, several blocks and a K shorter than one k tile, a broadcast batch.
# Rendered for the cpu target (its tile choice), as a CPU graph under AMP or allow_tf32 runs them.
GEMM_CASES = [GemmCase(kind, 37, 45, 70, a_trans, b_trans, target="cpu") for kind in ("bf16", "f16", "tf32")
              for a_trans, b_trans in ((False, False), (True, True), (False, True))] + [
    GemmCase("bf16", 72, 136, 24, target="cpu"), GemmCase("bf16", 72, 136, 24, True, True, target="cpu"),
    GemmCase("tf32", 16, 64, 48, True, False, target="cpu"),
    GemmCase("bf16", 20, 24, 40, False, True, a_batch=(3, 1), b_batch=(2,), target="cpu"),
]


@pytest.fixture(scope="module")
def gemm_launch(kernel_target):
    return make_launch("\n".join(case.kernel.source for case in GEMM_CASES), "test_tensor_cores_gemm", kernel_target)


def test_gemm_cases_run_on_tensor_cores():
    for case in GEMM_CASES:
        assert "tensor-core GEMM" in case.kernel.comment and f"{case.kind} mma.sync" in case.kernel.comment
        assert case.kernel.smem > 0 and case.kernel.block[0] % 128 == 0


@pytest.mark.parametrize("case", GEMM_CASES, ids=[c.id for c in GEMM_CASES])
def test_tensor_core_gemm_is_exact_on_integers(case, gemm_launch):
    a, b = case.operands(lambda shape: small_ints(np.random.default_rng(case.M * case.K), shape))
    got = case.run(gemm_launch, a, b)
    np.testing.assert_array_equal(got, (a.astype(np.float32) @ b.astype(np.float32)))


@pytest.mark.parametrize("case", [c for c in GEMM_CASES if not c.a_trans], ids=lambda c: c.id)
def test_tensor_core_gemm_matches_the_reference_in_its_precision(case, gemm_launch):
    """Random values: inputs rounded to bf16/fp16 (tf32 by the kernel itself), products summed
    in fp32. The bound is fp32 summation error over K terms; a wrong precision (fp32 inputs on
    the tf32 path, or bf16 rounding of the accumulator) misses it by orders of magnitude."""
    rng = np.random.default_rng(case.N)
    a, b = case.operands(lambda shape: rng.standard_normal(shape))
    want = case.reference(a, b)[0]
    got = case.run(gemm_launch, a, b)
    magnitude = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    np.testing.assert_array_less(np.abs(got - want), case.K * 2.0 ** -23 * magnitude + 1e-30)




# ---------------------------------------------------------------------------------------
# Implicit-GEMM convolutions on the same core: weights and gathered input windows (or output
# gradient taps) staged in shared memory by the conv template's load statements.

CONV_GEOMETRIES = [   # (name, N, C, H, W, O, kernel, stride, padding, dilation, groups)
    ("3x3_s1_p1", 2, 8, 7, 7, 20, (3, 3), (1, 1), (1, 1), (1, 1), 1),
    ("3x2_s2_p10_g2", 2, 8, 9, 8, 12, (3, 2), (2, 2), (1, 0), (1, 1), 2),
    ("1x1", 2, 24, 5, 6, 18, (1, 1), (1, 1), (0, 0), (1, 1), 1),
]


# bf16: forward and both gradients for each geometry; tf32 on the first; weight gradients
# rendered for the GPU whose deep reductions (2 x 24 x 24 in bf16 and fp16, 2 x 14 x 14 in tf32)
# are split across blocks (split-k: each split writes its float32 partial sums from the
# tensor-core epilogue, a second kernel adds them in order and rounds once to the output dtype).
SPLIT_GEOMETRY = ("3x3_24x24", 2, 4, 24, 24, 8, (3, 3), (1, 1), (1, 1), (1, 1), 1)
SPLIT_K_16BIT = [ConvCase(kind, "conv2d_grad_weight", SPLIT_GEOMETRY) for kind in ("bf16", "f16")]
CONV_CASES = [ConvCase("bf16", op, g, target="cpu") for g in CONV_GEOMETRIES
              for op in ("conv2d", "conv2d_grad_input", "conv2d_grad_weight")] + [
    ConvCase("tf32", op, CONV_GEOMETRIES[0], target="cpu")
    for op in ("conv2d", "conv2d_grad_input", "conv2d_grad_weight")] + \
    SPLIT_K_16BIT + [
    ConvCase("tf32", "conv2d_grad_weight", ("3x3_14x14", 2, 4, 14, 14, 8, (3, 3), (1, 1), (1, 1), (1, 1), 1))]


def test_deep_weight_gradient_splits_k_on_tensor_cores():
    case = CONV_CASES[-1]
    assert "split-k" in case.kernel.comment and [k.name for k in case.kernels] == [case.kernel.name,
                                                                                    f"{case.kernel.name}_combine"]


@pytest.fixture(scope="module")
def conv_launch(kernel_target):
    source = "\n".join(k.source for case in CONV_CASES for k in case.kernels)
    return make_launch(source, "test_tensor_cores_conv", kernel_target)


@pytest.mark.parametrize("case", CONV_CASES, ids=[c.id for c in CONV_CASES])
def test_implicit_gemm_conv_on_tensor_cores_is_exact_on_integers(case, conv_launch):
    """Values in {-1, 0, 1}: every sum (at most 1152 terms, far below 256 in magnitude) is exact
    in fp32 and in the 16-bit output."""
    assert f"on tensor cores, {case.kind} mma.sync" in case.kernel.comment
    rng = np.random.default_rng(len(case.id))
    arrays = [rng.integers(-1, 2, size=shape).astype(KINDS[case.kind]) for shape in case.shapes]
    want = get_op(case.op).ref(*(a.astype(np.float64) for a in arrays), **case.attrs)
    np.testing.assert_array_equal(case.run(conv_launch, arrays).astype(np.float64), want)


# ---------------------------------------------------------------------------------------
# Precision switches through the public API: graph against eager float32, with bounds from
# the unit roundoff u of the input format (inputs rounded once each, fp32 accumulation).

def gemm_error_bound(u: float, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """|x @ w^T| error when both operands are rounded with unit roundoff u and K products are
    summed in fp32: (2u + K u_fp32) (|x| @ |w|^T), first order."""
    return (2 * u + x.shape[-1] * U_FP32) * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T)


def tensor_core_kernels(graph) -> list:
    return [k for k in graph.compiled.program.kernels if "tensor-core GEMM" in k.comment]


def family_on(device: str) -> str:
    """The tensor-core instructions a graph on `device` runs: mma.sync on the cpu target; on a GPU
    its architecture's (warpgroup MMA on sm_90)."""
    return tensor_core_family(gpu_arch() if device == "cuda" else None)


@pytest.mark.parametrize("tf32", [True, False])
def test_allow_tf32_runs_float32_linear_on_tensor_cores(tf32, graph_device):
    flow.manual_seed(0)
    model = nn.Linear(96, 40)
    x = flow.randn(24, 96)
    want = model(x).numpy().astype(np.float64)
    graph = InferGraph(model.to(graph_device))
    graph.config.allow_tf32(tf32)
    got = graph(x.to(graph_device)).numpy().astype(np.float64)
    error = np.abs(got - want)
    w = model.weight.numpy()
    fp32_bound = gemm_error_bound(0.0, x.numpy(), w) + 2 * U_FP32 * np.abs(want)
    if tf32:
        assert [k.comment.count(f"tf32 {family_on(graph_device)}") for k in tensor_core_kernels(graph)] == [1]
        assert "k8_tf32" in graph.compiled.sources["kernels.cu"]    # mma_m16n8k8_tf32 or wgmma_m64nNk8_tf32
        np.testing.assert_array_less(error, gemm_error_bound(U_TF32, x.numpy(), w) + 2 * U_FP32 * np.abs(want))
        assert (error > fp32_bound).any()      # TF32 rounding shows: the inputs were not used in fp32
    else:
        assert tensor_core_kernels(graph) == []
        np.testing.assert_array_less(error, fp32_bound + 1e-30)


def test_bf16_amp_trains_with_fp32_master_weights_on_tensor_cores(graph_device):
    flow.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 24))
    reference = copy.deepcopy(model)
    loss_fn = nn.MSELoss()
    model.to(graph_device)
    amp = TrainGraph(model, loss_fn, flow.optim.SGD(model.parameters(), lr=0.05))
    amp.config.enable_amp(True, dtype=flow.bfloat16)
    eager_opt = flow.optim.SGD(reference.parameters(), lr=0.05)
    x, y = flow.randn(64, 32), flow.randn(64, 24)
    for _ in range(3):
        loss = float(amp(x.to(graph_device), y.to(graph_device)))
        eager_opt.zero_grad()
        eager_loss = loss_fn(reference(x), y)
        eager_loss.backward()
        eager_opt.step()
        # two bf16 GEMMs in a row, each off by at most ~3u relative, through a squared error
        assert abs(loss - float(eager_loss)) <= 12 * U_BF16 * abs(float(eager_loss))
    ir = str(amp.compiled.ir)
    assert "bf16[" in ir
    # Forward and both gradients of the second layer, forward and weight gradient of the first.
    assert len(tensor_core_kernels(amp)) == 5
    assert all(f"bf16 {family_on(graph_device)}" in k.comment for k in tensor_core_kernels(amp))
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.dtype == flow.float32     # master weights stay float32
        np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=0, atol=3 * 0.05 * 12 * U_BF16)


def test_bf16_amp_conv_runs_on_tensor_cores_with_its_fused_epilogue(graph_device):
    flow.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(6, 16, 3, padding=1), nn.ReLU())
    x = flow.randn(2, 6, 9, 7)
    want = model(x).numpy().astype(np.float64)
    graph = InferGraph(model.to(graph_device))
    graph.config.enable_amp(True, dtype=flow.bfloat16)
    got = graph(x.to(graph_device)).numpy().astype(np.float64)
    (conv,) = [k for k in graph.compiled.program.kernels if "conv2d" in k.ops]
    assert f"on tensor cores, bf16 {family_on(graph_device)}" in conv.comment and "relu" in conv.ops
    # |conv(x, w)| summed term by term bounds the rounding: inputs (2u), the bf16 result (u), fp32 sums
    magnitude = nn.functional.conv2d(flow.tensor(np.abs(x.numpy())), flow.tensor(np.abs(model[0].weight.numpy())),
                                     padding=1).numpy().astype(np.float64)
    bound = (3 * U_BF16 + 6 * 9 * U_FP32) * magnitude + 2 * U_FP32 * np.abs(want)
    np.testing.assert_array_less(np.abs(got - want), bound + 1e-30)


def test_enable_amp_names_the_dtypes_it_accepts():
    graph = InferGraph(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="float16 or flow.bfloat16"):
        graph.config.enable_amp(True, dtype=flow.float64)


# ---------------------------------------------------------------------------------------
# Split-k 16-bit weight gradients (AMP): float32 partials per split, combined in split order in
# float32 and rounded once to bf16/fp16. Against the unsplit kernel only the grouping of the sum
# changes, so the result is within fp32 summation error (chunk + splits terms deep) of the float64
# sum, plus the one final rounding; exact wherever every partial sum is exact (integers).

def split_k_layout(kernels) -> tuple:
    """(splits, chunk) of a split-k grad_weight rendering: its split count and its chunk of
    batch x pixels per split."""
    main, combine = kernels
    assert combine.name == f"{main.name}_combine"
    return (int(re.search(r"split-k (\d+)", main.comment).group(1)),
            int(re.search(r"chunks of (\d+)", main.source).group(1)))


def split_k_bound(case, arrays, want, kernels) -> np.ndarray:
    """|dw - exact| bound of a split-k 16-bit weight gradient: fp32 sums of chunk-long runs, then of
    `splits` partials (first order, (chunk + splits) u_fp32 x the sum of |products|), then one
    rounding to the output (u_out |dw|)."""
    splits, chunk = split_k_layout(kernels)
    magnitude = get_op(case.op).ref(*(np.abs(a.astype(np.float64)) for a in arrays), **case.attrs)
    return (1 + U_OUT[case.kind]) * (chunk + splits) * U_FP32 * magnitude + U_OUT[case.kind] * np.abs(want)


def test_16bit_weight_gradients_split_k_into_float32_partials():
    for case in SPLIT_K_16BIT:
        assert f"on tensor cores, {case.kind} mma.sync" in case.kernel.comment
        splits, chunk = split_k_layout(case.kernels)
        GK = 2 * 24 * 24
        assert splits > 1 and chunk % 32 == 0 and (splits - 1) * chunk < GK <= splits * chunk   # whole k tiles
        assert case.kernel.grid[2] == splits   # one group
        (scratch,) = {a.value for a in case.kernels[1].args} - {case.out}
        assert scratch.dtype == dt.float32 and scratch.shape == (splits * case.out.numel,)
        combine = case.kernels[1].source
        assert "float sum = partials[i];" in combine and combine.count("__float2") == 1   # rounded once, at the store


@pytest.mark.parametrize("case", SPLIT_K_16BIT, ids=[c.id for c in SPLIT_K_16BIT])
def test_split_k_16bit_weight_gradient_rounds_once(case, conv_launch):
    """Integers in [0, 4): partial sums reach thousands, exact in fp32 but not in bf16 (fp16 holds
    them): rounding each split's partial, or the running sum, to 16 bits would show; rounding
    the exact fp32 total once gives the exact sum rounded to the output dtype."""
    rng = np.random.default_rng(3)
    arrays = [rng.integers(0, 4, size=shape).astype(KINDS[case.kind]) for shape in case.shapes]
    want = get_op(case.op).ref(*(a.astype(np.float64) for a in arrays), **case.attrs)
    assert np.abs(want).max() > 1024
    got = case.run(conv_launch, arrays)
    np.testing.assert_array_equal(got, want.astype(KINDS[case.kind]))


@pytest.mark.parametrize("case", SPLIT_K_16BIT, ids=[c.id for c in SPLIT_K_16BIT])
def test_split_k_16bit_weight_gradient_is_within_its_rounding_bound(case, conv_launch):
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(shape).astype(KINDS[case.kind]) for shape in case.shapes]
    want = get_op(case.op).ref(*(a.astype(np.float64) for a in arrays), **case.attrs)
    got = case.run(conv_launch, arrays).astype(np.float64)
    np.testing.assert_array_less(np.abs(got - want), split_k_bound(case, arrays, want, case.kernels) + 1e-30)


# ResNet-50's first bottleneck under AMP (64 -> 64 channels, 56 x 56, batch 32): its weight
# gradients alone make 9 (3x3) and 1 to 4 (1x1) tiles; split-k fills the H100's target of
# 264 blocks. A ResNeXt-style grouped 3x3 (32 groups of 4 channels): a grid of G x splits in z.
# Rendered only.
RESNET_WGRAD = [("resnet_3x3", 32, 64, 56, 56, 64, (3, 3), (1, 1), (1, 1), (1, 1), 1),
                ("resnet_1x1", 32, 64, 56, 56, 64, (1, 1), (1, 1), (0, 0), (1, 1), 1),
                ("resnet_1x1_256", 32, 64, 56, 56, 256, (1, 1), (1, 1), (0, 0), (1, 1), 1),
                ("resnext_3x3_g32", 32, 128, 56, 56, 128, (3, 3), (1, 1), (1, 1), (1, 1), 32)]


def split_k_grid_checks(kernels, geometry, BK: int):
    """A ResNet-sized 16-bit weight gradient's split-k grid: (GN tiles, GM tiles, G x splits)
    blocks, the target's 264 (less at most one split's worth: chunks are rounded up to whole k
    tiles) or as many as 16 k tiles per split allow."""
    name, N, C, H, W, O, k = geometry[:7]
    G = geometry[-1]
    GM, GN, GK = O // G, C // G * k[0] * k[1], N * H * W
    BM, BN = map(int, re.search(r"GEMM (\d+)x(\d+)", kernels[0].comment).groups())
    splits, chunk = split_k_layout(kernels)
    assert kernels[0].grid == (-(-GN // BN), -(-GM // BM), G * splits)
    tiles = -(-GN // BN) * -(-GM // BM) * G
    assert (splits + 1) * tiles >= 264 or chunk == 16 * BK, (tiles, splits, chunk)
    assert chunk % BK == 0 and (splits - 1) * chunk < GK <= splits * chunk
    return splits


@pytest.mark.parametrize("geometry", RESNET_WGRAD, ids=[g[0] for g in RESNET_WGRAD])
@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_resnet_sized_16bit_weight_gradient_fills_the_gpu_with_split_k(kind, geometry):
    _, _, node = conv_node(kind, "conv2d_grad_weight", geometry, geometry[0])
    with rendering_for("cuda"):
        kernels = render_node(node, RenderContext(name=f"rn_{kind}_{geometry[0]}"))
    assert f"{kind} mma.sync" in kernels[0].comment
    assert split_k_grid_checks(kernels, geometry, 32) > 1


def test_bf16_amp_conv_training_step_with_split_k_weight_gradients_matches_eager(graph_device):
    """A public-API AMP training step whose conv weight gradients (4 x 16 x 16 = 1024 positions,
    two chunks of 16 k tiles) run split-k on tensor cores; the block target is the GPU's (the cpu
    target's follows the machine's cores). Graph (bf16 convs) against eager float32."""
    flow.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.Flatten(),
                          nn.Linear(8 * 16 * 16, 5))
    reference = copy.deepcopy(model)
    initial = [p.numpy().copy() for p in model.parameters()]
    loss_fn = nn.MSELoss()
    model.to(graph_device)
    amp = TrainGraph(model, loss_fn, flow.optim.SGD(model.parameters(), lr=0.01))
    amp.config.enable_amp(True, dtype=flow.bfloat16)
    eager_opt = flow.optim.SGD(reference.parameters(), lr=0.01)
    x, y = flow.randn(4, 4, 16, 16), flow.randn(4, 5)
    with mock.patch.dict(TARGET_BLOCKS, cpu=TARGET_BLOCKS["cuda"]):
        for _ in range(2):
            loss = float(amp(x.to(graph_device), y.to(graph_device)))
            eager_opt.zero_grad()
            eager_loss = loss_fn(reference(x), y)
            eager_loss.backward()
            eager_opt.step()
            # three bf16 GEMMs in a row, each off by a few u relative, through a squared error
            assert abs(loss - float(eager_loss)) <= 16 * U_BF16 * abs(float(eager_loss))
    wgrads = [k for k in amp.compiled.program.kernels if "conv2d_grad_weight" in k.ops]
    if family_on(graph_device) == "mma.sync":
        assert [k.name.endswith("_combine") for k in wgrads] == [False, True] * 2   # each: partials, then combine
        assert all("bf16 mma.sync" in k.comment and "split-k 2" in k.comment for k in wgrads[::2])
    else:   # wgmma's k tiles are 64 wide: 1024 positions make one chunk of 16 (tests/test_wgmma_conv.py splits)
        assert all("bf16 wgmma" in k.comment for k in wgrads)
    # the two steps' updates (gradients through three bf16 layers): within 16 u of their largest (seen: 8 u)
    for p, q, p0 in zip(model.parameters(), reference.parameters(), initial):
        update, want = p.numpy() - p0, q.numpy() - p0
        np.testing.assert_allclose(update, want, rtol=0, atol=16 * U_BF16 * np.abs(want).max())


# ---------------------------------------------------------------------------------------
# Machine code for sm_90: tensor-core instructions, asynchronous copies, no spills. Full-size
# GEMM tiles (M, N, K = 4096) beside the test cases, which use the small tiles.

def test_kernels_compile_with_nvrtc_for_sm_80():   # sm_90: see sm_90_build below
    source = "\n".join(k.source for case in GEMM_CASES + CONV_CASES for k in case.kernels)
    assert nvrtc.compile_cuda(source, arch="sm_80", tag="test_tensor_cores")[:4] == b"\x7fELF"


SASS_CASES = GEMM_CASES + CONV_CASES + [
    GemmCase("bf16", 4096, 4096, 4096, False, True), GemmCase("f16", 4096, 4096, 4096, True),
    GemmCase("tf32", 4096, 4096, 4096)]


@pytest.fixture(scope="module")
def sm_90_build():
    """(cubin, NVRTC log with ptxas --verbose: registers, stack and spills per kernel) for SASS_CASES."""
    return build_with_ptxas_report("\n".join(c.kernel.source for c in SASS_CASES), "sm_90")


def build_with_ptxas_report(kernels: str, arch: str) -> tuple:
    """(cubin, NVRTC log with ptxas --verbose) of generated kernels compiled for `arch`."""
    source = '#include "flowgen_cuda_prelude.h"\n' + kernels
    options = [f"--gpu-architecture={arch}", "-std=c++17", "--ptxas-options=--verbose",
               *(f"-I{d}" for d in (runtime_cpp_dir(), *cuda_include_dirs()))]
    _, program = nvrtc_api.nvrtcCreateProgram(source.encode(), b"kernels.cu", 0, [], [])
    try:
        (status,) = nvrtc_api.nvrtcCompileProgram(program, len(options), [o.encode() for o in options])
        _, size = nvrtc_api.nvrtcGetProgramLogSize(program)
        log = b" " * size
        nvrtc_api.nvrtcGetProgramLog(program, log)
        assert status == nvrtc_api.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")
        _, size = nvrtc_api.nvrtcGetCUBINSize(program)
        cubin = b" " * size
        nvrtc_api.nvrtcGetCUBIN(program, cubin)
    finally:
        nvrtc_api.nvrtcDestroyProgram(program)
    return cubin, log.decode(errors="replace").replace("\0", "")


def test_ptxas_reports_no_spills_for_sm_90(sm_90_build):
    assert_no_spills(sm_90_build[1], {c.kernel.name for c in SASS_CASES})


def assert_no_spills(report: str, names: set):
    """ptxas --verbose says every kernel in `names` (and no other) has no stack frame and no spills."""
    per_kernel = dict(re.findall(r"Function properties for (\w+)\s*ptxas\s+\.\s+([^\n]*)", report))
    assert set(per_kernel) == names
    for name, frame in per_kernel.items():
        assert frame == "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", (name, frame)


def cuda_binary_tool(name: str):
    """A CUDA binary utility from PATH or the pip wheels (nvidia/*/bin), else None."""
    wheels = [str(c) for root in nvidia.__path__ for c in sorted(Path(root).glob(f"*/bin/{name}"))]
    candidates = [shutil.which(name)] + wheels
    return next((c for c in candidates if c), None)


CUOBJDUMP, NVDISASM = cuda_binary_tool("cuobjdump"), cuda_binary_tool("nvdisasm")


def disassemble(cubin: bytes, tmp_path) -> tuple:
    """({kernel: SASS}, {kernel: cuobjdump -res-usage line}) of a cubin."""
    path = tmp_path / "kernels.cubin"
    path.write_bytes(cubin)
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(NVDISASM).parent), os.environ.get("PATH", "")]))

    def dump(flag):
        return subprocess.run([CUOBJDUMP, flag, str(path)], env=env, capture_output=True, text=True, check=True).stdout

    sass = {chunk.split("\n", 1)[0].strip(): chunk for chunk in re.split(r"\n\s*Function : ", dump("-sass"))[1:]}
    usage = dict(re.findall(r"Function (\w+):\s*\n\s*(REG:[^\n]*)", dump("-res-usage")))
    return sass, usage


MMA_SASS = {"bf16": "HMMA.16816.F32.BF16", "f16": "HMMA.16816.F32 ", "tf32": "HMMA.1688.F32.TF32"}


@pytest.mark.skipif(CUOBJDUMP is None or NVDISASM is None,
                    reason="needs cuobjdump and nvdisasm (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
def test_sm_90_sass_has_tensor_core_and_async_copy_instructions_and_no_local_memory(sm_90_build, tmp_path):
    sass, usage = disassemble(sm_90_build[0], tmp_path)
    for case in SASS_CASES:
        name, code = case.kernel.name, sass[case.kernel.name]
        assert MMA_SASS[case.kind] in code, name
        assert ("LDSM.16.M" in code) == (case.kind != "tf32"), name        # ldmatrix for 16-bit fragments
        if re.search(r"cp_async_c[ag]\b", case.kernel.source):     # a copied (not gathered) operand
            assert "LDGSTS" in code and "DEPBAR" in code, name             # cp.async and wait_group
        assert "LDL" not in code and "STL" not in code, name               # no local memory (spills)
        assert re.search(r"\bSTACK:0 .*\bLOCAL:0\b", usage[name]), (name, usage[name])
