"""Tensor-core kernel cases shared by the tests (tests/test_tensor_cores.py, test_wgmma.py,
test_wgmma_conv.py) and the first-contact GPU run (benchmarks/first_contact.py): each case renders
one IR node's kernels the way a program does (GEMM on mma.sync or warpgroup MMA, implicit-GEMM conv
and its gradients, split-k weight gradients, tiled attention) and runs them over host arrays, on a
GPU or on the CPU emulator, for comparison with the op's NumPy reference.

`make_launch(source, tag, target)` compiles a CUDA C++ source for `target` ("gpu": NVRTC for the
GPU's architecture, CUDA driver launches; "emulator": g++ against runtime_cpp/flowgen_emu.h) and
returns a `launch(name, grid, block, smem, arrays)` that runs one kernel over host arrays in place
(NumPy arrays are copied to the device and back; ctypes scalars are passed as they are).
"""
from __future__ import annotations

import ctypes
from unittest import mock

import ml_dtypes
import numpy as np

import flowgen  # noqa: F401  (registers the ops)
from flowgen import dtype as dt
from flowgen.codegen.kernel import RenderContext
from flowgen.codegen.kernels import render_node
from flowgen.codegen.kernels.gemm import gemm_kernel
from flowgen.codegen.kernel import BufferArg
from flowgen.codegen.target import TARGET_BLOCKS, rendering_for
from flowgen.ir.graph import Node, Value
from flowgen.ops.nn_ops import dropout_keep_mask
from flowgen.ops.registry import TensorMeta, get_op
from flowgen.runtime import cuda_driver, nvrtc
from flowgen.runtime.cpu_compiler import CpuModule, build_cpu_library, build_kernel_library

# Input element types of the tensor-core kinds (tf32: float32 operands rounded on the way in).
KINDS = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "tf32": np.float32}
# Unit roundoff of each format (round to nearest): 10, 7, 10 and 23 stored mantissa bits.
U_TF32, U_BF16, U_F16, U_FP32 = 2.0 ** -11, 2.0 ** -8, 2.0 ** -11, 2.0 ** -24
U_OUT = {"bf16": U_BF16, "f16": U_F16}
U_HALF = {"bfloat16": U_BF16, "float16": U_F16}


def tf32_round(x: np.ndarray) -> np.ndarray:
    """cvt.rna.tf32.f32: keep 10 mantissa bits, round to nearest, ties away from zero."""
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def small_ints(rng, shape, low=-4, high=5) -> np.ndarray:
    return rng.integers(low, high, size=shape).astype(np.float32)


def ptr(array: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(array.ctypes.data)


# ---------------------------------------------------------------------------------------
# Where kernels run

def gpu_arch() -> str | None:
    """The GPU's architecture ("sm_90", ...), or None without a usable GPU and driver."""
    return cuda_driver.CudaContext.get().arch if cuda_driver.available() else None


def tensor_core_family(arch: str | None) -> str:
    """The tensor-core instructions a 'cuda' program rendered for `arch` uses (codegen/target.py)."""
    return "wgmma" if arch in ("sm_90", "sm_90a") else "mma.sync"


class EmulatorLaunch:
    """Runs the kernels of `source` on the CPU emulator over host arrays, in place. A `generated`
    source (a kernels.cu of rendered kernels) is built kernel by kernel as a graph's is (chunks in
    parallel, each body cached); any other as one library."""

    target = "emulator"

    def __init__(self, source: str, tag: str, generated: bool = False):
        if generated:
            library, build = build_kernel_library(source)
            self.module = CpuModule(library, {name: symbol for name, (_, symbol) in build.symbols.items()})
        else:
            self.module = CpuModule(build_cpu_library(source, tag))

    def __call__(self, name, grid, block, smem, arrays):
        self.module.launch(name, grid, block, smem, [a if isinstance(a, ctypes._SimpleCData) else ptr(a)
                                                     for a in arrays])


class GpuLaunch:
    """Runs the kernels of `source` on the GPU (NVRTC for its architecture; sm_90a for sources
    with warpgroup MMA): each launch copies the arrays to the device, and back after the kernel.
    A `generated` source is compiled kernel by kernel as a graph's is (nvrtc.compile_kernels)."""

    target = "gpu"

    def __init__(self, source: str, tag: str, generated: bool = False):
        self.ctx = cuda_driver.CudaContext.get()
        if generated:
            build = nvrtc.compile_kernels(source, self.ctx.arch)
            modules = [cuda_driver.CudaModule(path.read_bytes()) for path in build.artifacts]
            self.functions = {name: (modules[index], symbol) for name, (index, symbol) in build.symbols.items()}
        else:
            self.module = cuda_driver.CudaModule(nvrtc.compile_cuda(source, arch=self.ctx.arch, tag=tag))
            self.functions = None

    def __call__(self, name, grid, block, smem, arrays):
        module, symbol = self.functions[name] if self.functions is not None else (self.module, name)
        buffers = {}
        try:
            for i, a in enumerate(arrays):
                if not isinstance(a, ctypes._SimpleCData):
                    buffers[i] = self.ctx.alloc(a.nbytes)
                    self.ctx.memcpy_htod(buffers[i], a)
            module.launch(symbol, grid, block, smem, [ctypes.c_void_p(buffers[i]) if i in buffers else a
                                                      for i, a in enumerate(arrays)], name_for_errors=name)
            self.ctx.synchronize()
            for i, device in buffers.items():
                self.ctx.memcpy_dtoh(arrays[i], device)
        finally:
            for device in buffers.values():
                self.ctx.free(device)


def make_launch(source: str, tag: str, target: str, generated: bool = False):
    """A launcher of `source`'s kernels on `target`: "gpu" or "emulator" (see EmulatorLaunch)."""
    if target not in ("gpu", "emulator"):
        raise ValueError(f"target {target!r}: expected 'gpu' or 'emulator'")
    return (GpuLaunch if target == "gpu" else EmulatorLaunch)(source, tag, generated)


def launch_kernels(kernels: list, target: str):
    """A launcher of rendered `kernels` on `target`, built as a graph's kernels.cu is (its preamble,
    then the kernels; compiled kernel by kernel, each distinct body cached)."""
    source = f'#include "{nvrtc.PRELUDE}"\n' + "\n".join(k.source for k in kernels)
    return make_launch(source, "kernels", target, generated=True)


def run_kernels(launch, node: Node, kernels: list, arrays: list) -> list:
    """`node`'s outputs computed by `kernels` (its rendering, or another one of the same node) on
    `arrays` (its inputs). Outputs start as a poison fill of 123, so an element the kernels skip
    shows; arguments that are neither inputs nor outputs (split-k partials, attention's D) get
    buffers of their own."""
    buffers = {v: np.ascontiguousarray(a) for v, a in zip(node.inputs, arrays)}
    for out in node.outputs:
        buffers[out] = np.full(out.shape, 123, out.dtype.np_dtype)
    for k in kernels:
        buffers.update({a.value: np.zeros(a.value.shape, a.value.dtype.np_dtype) for a in k.args
                        if a.value not in buffers})
        launch(k.name, k.grid, k.block, k.smem, [buffers[a.value] for a in k.args])
    return [buffers[out] for out in node.outputs]


def render_for(node: Node, name: str, kind: str, target: str = "cuda", arch: str | None = None,
               blocks: int | None = None) -> list:
    """`node`'s kernels rendered for `target` and, on "cuda", the GPU `arch` (None: any sm_80 or
    newer: mma.sync; "sm_90": warpgroup MMA); `blocks` overrides the target's block count (1: the
    tile choice follows the padded work alone)."""
    with mock.patch.dict(TARGET_BLOCKS, {target: blocks or TARGET_BLOCKS[target]}), \
            rendering_for(target, allow_tf32=kind == "tf32", arch=arch):
        return render_node(node, RenderContext(name=name))


# ---------------------------------------------------------------------------------------
# GEMM (templates/gemm_mma.cu.j2, gemm_wgmma.cu.j2): c = op(a) @ op(b), an operand "trans" when its
# buffer holds the transpose (read in place): A trans is M-major, B trans is K-major.

def stored(x: np.ndarray, trans: bool) -> np.ndarray:
    """The buffer holding operand x: x itself, or x^T laid out contiguously (read transposed)."""
    return np.ascontiguousarray(np.swapaxes(x, -1, -2)) if trans else x


class GemmCase:
    """One GEMM kernel for c (float32) = op(a) @ op(b) in `kind`'s precision, rendered as the
    fused GEMM path calls it, for `target` / `arch` / `blocks` (see `render_for`)."""

    def __init__(self, kind, M, N, K, a_trans=False, b_trans=False, a_batch=(), b_batch=(), *, target="cuda",
                 arch=None, blocks=None, prefix="tc", tile=None):
        self.kind, self.M, self.N, self.K, self.a_trans, self.b_trans = kind, M, N, K, a_trans, b_trans
        self.tile = tile   # the tile the case is meant to select (checked by the tests)
        self.a_shape = a_batch + ((K, M) if a_trans else (M, K))
        self.b_shape = b_batch + ((N, K) if b_trans else (K, N))
        self.out_shape = tuple(np.broadcast_shapes(a_batch, b_batch)) + (M, N)
        self.id = (f"{kind}_{M}x{N}x{K}{'_At' if a_trans else ''}{'_Bt' if b_trans else ''}"
                   f"{'_batch' if a_batch or b_batch else ''}")
        in_dtype = dt.from_numpy(np.dtype(KINDS[kind]))
        a, b = Value("a", self.a_shape, in_dtype), Value("b", self.b_shape, in_dtype)
        c = Value("c", self.out_shape, dt.float32)
        name = f"{prefix}_{self.id}"
        node = Node("matmul", [a, b], [c], {}, scope=f"test.{name}")
        args = [BufferArg(a, f"const {in_dtype.ctype}*"), BufferArg(b, f"const {in_dtype.ctype}*"),
                BufferArg(c, "float*")]
        with mock.patch.dict(TARGET_BLOCKS, {target: blocks or TARGET_BLOCKS[target]}), \
                rendering_for(target, allow_tf32=kind == "tf32", arch=arch):
            self.kernel = gemm_kernel(node, name, a, b, c, params=None, args=args,
                                      epilogue_lines=["c[c_base + (long long)m * GN + n] = val;"],
                                      a_trans=a_trans, b_trans=b_trans)
        self.kernels = [self.kernel]

    def operands(self, make):
        """Logical A (.., M, K) and B (.., K, N) from `make(shape)`, rounded to the input precision."""
        dtype = KINDS[self.kind]
        a = make(self.a_shape[:-2] + (self.M, self.K)).astype(dtype)
        b = make(self.b_shape[:-2] + (self.K, self.N)).astype(dtype)
        return a, b

    def run(self, launch, a, b) -> np.ndarray:
        out = np.full(self.out_shape, 123, np.float32)   # poison: an output the kernel skips shows up
        k = self.kernel
        launch(k.name, k.grid, k.block, k.smem, [stored(a, self.a_trans), stored(b, self.b_trans), out])
        return out

    def reference(self, a, b) -> tuple:
        """(float64 product of the operands as the tensor cores read them, the same product of
        their magnitudes) for error bounds."""
        a, b = (tf32_round(x) if self.kind == "tf32" else x for x in (a, b))
        a, b = a.astype(np.float64), b.astype(np.float64)
        return a @ b, np.abs(a) @ np.abs(b)


# ---------------------------------------------------------------------------------------
# Implicit-GEMM convolutions (templates/conv2d.cu.j2): forward, grad_input, grad_weight.

def conv_node(kind, op, geometry, case_id):
    """(input shapes, attrs, node) of one conv op (conv2d / conv2d_grad_input / conv2d_grad_weight)
    on the `geometry` (name, N, C, H, W, O, kernel, stride, padding, dilation, groups) in `kind`'s
    input dtype; the node's output is named "out"."""
    name, N, C, H, W, O, k, stride, padding, dilation, groups = geometry
    attrs = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    x_shape, w_shape = (N, C, H, W), (O, C // groups) + k
    in_dtype = dt.from_numpy(np.dtype(KINDS[kind]))
    y_shape = get_op("conv2d").infer(TensorMeta(x_shape, in_dtype), TensorMeta(w_shape, in_dtype), **attrs).shape
    if op == "conv2d":
        shapes = (x_shape, w_shape)
    elif op == "conv2d_grad_input":
        shapes, attrs = (y_shape, w_shape), dict(attrs, input_shape=x_shape)
    else:
        shapes, attrs = (y_shape, x_shape), dict(attrs, weight_shape=w_shape)
    inputs = [Value(f"in{i}", shape, in_dtype) for i, shape in enumerate(shapes)]
    meta = get_op(op).infer(*(TensorMeta(v.shape, v.dtype) for v in inputs), **attrs)
    out = Value("out", tuple(meta.shape), meta.dtype)
    return shapes, attrs, Node(op, inputs, [out], attrs, scope=f"test.{case_id}")


class ConvCase:
    """One conv op's kernels (a `_combine` kernel after the main one when split-k) rendered for
    `target` / `arch` / `blocks` (see `render_for`)."""

    def __init__(self, kind, op, geometry, *, target="cuda", arch=None, blocks=None, prefix="tc"):
        self.kind, self.op, self.geometry = kind, op, geometry
        self.id = f"{kind}_{op}_{geometry[0]}{'_b' + str(blocks) if blocks else ''}"
        self.shapes, self.attrs, self.node = conv_node(kind, op, geometry, self.id)
        self.out = self.node.outputs[0]
        self.kernels = render_for(self.node, f"{prefix}_{self.id}", kind, target, arch, blocks)
        self.kernel = self.kernels[0]

    @property
    def reduction_length(self) -> int:
        """Products summed into each output (the implicit GEMM's K): input channels per group x
        taps (forward), output channels per group x taps (grad_input), batch x output pixels
        (grad_weight)."""
        taps = int(np.prod(self.geometry[6]))
        if self.op == "conv2d":
            return self.geometry[2] // self.attrs["groups"] * taps
        if self.op == "conv2d_grad_input":
            return self.geometry[5] // self.attrs["groups"] * taps
        y_shape = self.shapes[0]
        return y_shape[0] * y_shape[2] * y_shape[3]

    def run(self, launch, arrays, kernels=None) -> np.ndarray:
        """The output of `kernels` (default: the case's own; or another rendering of its node)."""
        return run_kernels(launch, self.node, kernels or self.kernels, arrays)[0]

    def reference(self, arrays) -> tuple:
        """(float64 result of the inputs as the tensor cores read them, the same op on their
        magnitudes) for error bounds."""
        arrays = [tf32_round(a) if self.kind == "tf32" else a for a in arrays]
        ref = get_op(self.op).ref
        return (ref(*(a.astype(np.float64) for a in arrays), **self.attrs),
                ref(*(np.abs(a.astype(np.float64)) for a in arrays), **self.attrs))


# ---------------------------------------------------------------------------------------
# Tiled attention (templates/attention_tiled.cu.j2): forward, backward, with dropout.

class AttentionCase:
    """One attention-family node (attention, attention_backward, attention_dropout,
    attention_dropout_backward) over q [B, H, L, E], k [B, H, S, E], v [B, H, S, Ev] in `dtype`
    (a flowgen dtype) and a bool mask of shape `mask` (None: none), rendered for the GPU;
    `arrays(rng)` draws consistent inputs (o and lse of a backward from the forward reference)."""

    def __init__(self, op, dtype, B, H, L, S, E, Ev, *, causal=False, mask=None, dropout_p=0.0, seed=3, offset=0,
                 prefix="tc"):
        self.op, self.dtype, self.mask = op, dtype, mask
        self.dims = (B, H, L, S, E, Ev)
        self.attrs = dict(scale=E ** -0.5, causal=causal)
        if dropout_p:
            self.attrs.update(dropout_p=dropout_p, seed=seed, offset=offset)
        self.forward_op = "attention_dropout" if dropout_p else "attention"
        self.id = (f"{op}_{dtype.name}_{L}x{S}_e{E}{'_causal' if causal else ''}{'_mask' if mask else ''}"
                   f"{'_p' + format(dropout_p, 'g').replace('.', '_') if dropout_p else ''}")
        q, k, v = Value("q", (B, H, L, E), dtype), Value("k", (B, H, S, E), dtype), Value("v", (B, H, S, Ev), dtype)
        inputs = [q, k, v]
        if op.endswith("_backward"):
            o, lse = (Value(n, tuple(m.shape), m.dtype) for n, m in zip(("o", "lse"), get_op(self.forward_op).infer(
                *(TensorMeta(x.shape, x.dtype) for x in inputs), **self.attrs)))
            inputs += [o, Value("do", o.shape, dtype), lse]
        if mask is not None:
            inputs.append(Value("mask", tuple(mask), dt.bool_))
        metas = get_op(op).infer(*(TensorMeta(x.shape, x.dtype) for x in inputs), **self.attrs)
        outputs = [Value(f"out{i}", tuple(m.shape), m.dtype) for i, m in enumerate(metas)]
        self.node = Node(op, inputs, outputs, dict(self.attrs), scope=f"test.{self.id}")
        with rendering_for("cuda"):
            self.kernels = render_node(self.node, RenderContext(name=f"{prefix}_{self.id}"))

    def arrays(self, rng) -> list:
        B, H, L, S, E, Ev = self.dims
        np_dtype = self.dtype.np_dtype
        q, k, v = (rng.standard_normal(shape).astype(np_dtype) for shape in ((B, H, L, E), (B, H, S, E), (B, H, S, Ev)))
        masks = [] if self.mask is None else [rng.random(self.mask) < 0.7]
        if not self.op.endswith("_backward"):
            return [q, k, v, *masks]
        o, lse = get_op(self.forward_op).ref(*(x.astype(np.float64) for x in (q, k, v)), *masks, **self.attrs)
        return [q, k, v, o.astype(np_dtype), rng.standard_normal(o.shape).astype(np_dtype), lse.astype(np.float32),
                *masks]

    def run(self, launch, arrays) -> list:
        return run_kernels(launch, self.node, self.kernels, arrays)

    def expected(self, arrays) -> list:
        """(float64 reference, error bound) of each output (o and lse, or dq, dk, dv) on `arrays`.
        Half precision: inputs exact, P and dS rounded to the input type before their products (u
        each), the result rounded once more (u), fp32 sums: within 4u of each sum's magnitude;
        float32/float64: sums of S + E terms in the compute type. lse: the fp32 scores and
        statistics, within 1e-4 relative."""
        B, H, L, S, E, Ev = self.dims
        u = U_HALF.get(self.dtype.name, (S + E) * (2.0 ** -24 if self.dtype.name == "float32" else 2.0 ** -53))
        q, k, v = (a.astype(np.float64) for a in arrays[:3])
        mask = arrays[-1] if self.mask is not None else None
        p = self.attrs.get("dropout_p", 0.0)
        keep = (dropout_keep_mask((B, H, L, S), p, self.attrs["seed"], self.attrs["offset"]) if p
                else np.ones((B, H, L, S), bool))
        backward = self.op.endswith("_backward")
        do = arrays[4].astype(np.float64) if backward else np.zeros((B, H, L, Ev))
        o = arrays[3].astype(np.float64) if backward else None
        results, magnitudes = attention_reference(q, k, v, do, mask, self.attrs["causal"], self.attrs["scale"], keep,
                                                  float(np.float32(1 - np.float32(p))), o=o)
        bounds = [4 * u * m + 2.0 ** -20 for m in magnitudes]
        if backward:
            return list(zip(results[1:], bounds[1:]))
        lse = get_op(self.forward_op).ref(q, k, v, *([mask] if mask is not None else []), **self.attrs)[1]
        return [(results[0], bounds[0]), (lse, 1e-4 * (1 + np.abs(np.where(np.isfinite(lse), lse, 0))))]


def attention_reference(q, k, v, do, mask, causal, scale, keep, keep_scale, o=None):
    """float64 (o, dq, dk, dv) of attention (P, dP, dS built whole) with a bool or additive `mask`
    (None: none), `causal`, dropout's `keep` mask over [..., L, S] (all True: none) and its
    1 / (1 - p) as `keep_scale`, `do` the output gradient and `o` the output the backward reads
    (None: the exact one); plus the magnitude of each result's sum (the same sums over absolute
    values) for rounding bounds."""
    s = q @ np.swapaxes(k, -1, -2) * scale
    L, S = s.shape[-2:]
    allowed = np.tri(L, S, dtype=bool) if causal else np.ones((L, S), bool)
    if mask is not None:
        allowed = allowed & (mask if mask.dtype == np.bool_ else np.isfinite(mask))
        s = s + (0 if mask.dtype == np.bool_ else np.where(np.isfinite(mask), mask, 0))
    s = np.where(allowed, s, -np.inf)
    m = np.max(s, -1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0))
    l = e.sum(-1, keepdims=True)
    p = np.where(l > 0, e / np.where(l > 0, l, 1), 0)
    pd = np.where(keep, p / keep_scale, 0)
    out = pd @ v
    o = out if o is None else o
    dp = np.where(keep, do @ np.swapaxes(v, -1, -2) / keep_scale, 0)
    d = (do * o).sum(-1, keepdims=True)
    ds = p * (dp - d)
    grads = (ds @ k * scale, np.swapaxes(ds, -1, -2) @ q * scale, np.swapaxes(pd, -1, -2) @ do)
    ads = p * (np.abs(dp) + (np.abs(do) * np.abs(o)).sum(-1, keepdims=True))
    magnitudes = (np.abs(pd) @ np.abs(v), np.abs(ads) @ np.abs(k) * scale,
                  np.swapaxes(ads, -1, -2) @ np.abs(q) * scale, np.swapaxes(np.abs(pd), -1, -2) @ np.abs(do))
    return (out, *grads), magnitudes


# ---------------------------------------------------------------------------------------
# Comparison with a reference, for reports

def compare(got: np.ndarray, want: np.ndarray, bound) -> dict:
    """Whether |got - want| <= bound everywhere (NaN never passes), with what a report needs when
    not: the largest error, its ratio to the bound there, and the first element (in C order) over
    the bound with both values."""
    got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
    bound = np.broadcast_to(np.asarray(bound, np.float64), want64.shape)
    with np.errstate(invalid="ignore"):   # inf - inf: NaN, sorted out below
        error = np.abs(got64 - want64)
    same_inf = np.isinf(got64) & (got64 == want64)   # -inf logsumexp of a fully masked row
    error = np.where(same_inf, 0.0, np.where(np.isnan(error), np.inf, error))
    bad = error > bound
    result = {"ok": not bad.any(), "max_error": float(error.max(initial=0.0)),
              "max_error_over_bound": float((error / np.maximum(bound, 1e-300)).max(initial=0.0))}
    if bad.any():
        first = np.unravel_index(int(np.argmax(bad.ravel())), want64.shape)
        result.update(first_bad_index=[int(i) for i in first], got=float(got64[first]), want=float(want64[first]),
                      bad_elements=int(bad.sum()), elements=int(bad.size))
    return result
