# Temporary GPU benchmark for the template families (deleted after use).
import ctypes, time, sys
import numpy as np
import flowgen
from flowgen.ops import linalg, shape, reduction, nn_ops
from flowgen import dtype as dt
from flowgen.ir.graph import Node, Value
from flowgen.ops.registry import get_op, TensorMeta
from flowgen.codegen.families import render_node
from flowgen.runtime import cuda_driver
from flowgen.runtime.nvrtc import compile_cuda

ctx = cuda_driver.CudaContext.get()
rng = np.random.default_rng(0)

def bench(label, op, shapes, dtypes=None, flops=None, check=True, **attrs):
    dtypes = dtypes or [np.float32] * len(shapes)
    arrays = []
    for s, d in zip(shapes, dtypes):
        arrays.append(rng.standard_normal(s).astype(d) if np.dtype(d).kind == "f" else rng.integers(0, attrs.pop("_hi", 10), s).astype(d))
    vals = [Value(f"in{i}", a.shape, dt.from_numpy(a.dtype)) for i, a in enumerate(arrays)]
    meta = get_op(op).infer(*[TensorMeta(v.shape, v.dtype) for v in vals], **attrs)
    out = Value("out", tuple(meta.shape), meta.dtype)
    node = Node(op, vals, [out], attrs, scope="bench")
    ks = render_node(node, "kb")
    t0 = time.time()
    mod = ctx.load_module(compile_cuda("\n".join(k.source for k in ks), ctx.arch, tag="bench"))
    ptr = {}
    for v, a in zip(vals, arrays):
        ptr[v] = ctx.alloc(a.nbytes); ctx.memcpy_htod(ptr[v], a)
    ptr[out] = ctx.alloc(out.nbytes)
    def go():
        for k in ks:
            mod.launch(k.name, k.grid, k.block, k.smem, [ctypes.c_void_p(ptr[a.value]) for a in k.args])
    go(); ctx.synchronize()
    n = 10
    t = time.perf_counter()
    for _ in range(n): go()
    ctx.synchronize()
    ms = (time.perf_counter() - t) / n * 1e3
    msg = f"{label:40s} {ms:8.3f} ms"
    if flops: msg += f"  {flops / ms / 1e9:7.2f} TFLOP/s"
    nbytes = sum(a.nbytes for a in arrays) + out.nbytes
    msg += f"  {nbytes / ms / 1e6:7.1f} GB/s(min traffic)"
    if check:
        got = np.empty(out.shape, out.dtype.np_dtype); ctx.memcpy_dtoh(got, ptr[out])
        want = get_op(op).ref(*arrays, **attrs)
        err = np.max(np.abs(got.astype(np.float64) - want)) / (np.max(np.abs(want)) + 1e-30)
        msg += f"  relerr {err:.1e}"
    print(msg, [k.comment.split(": ", 1)[1] for k in ks], flush=True)
    for p in ptr.values(): ctx.free(p)
    mod.close()

M = 2048
bench("matmul 2048^3 f32", "matmul", [(M, M), (M, M)], flops=2 * M**3)
bench("matmul 4096x4096x4096 f32", "matmul", [(4096, 4096), (4096, 4096)], flops=2 * 4096**3, check=False)
bench("matmul bf16-free f16 2048^3", "matmul", [(M, M), (M, M)], [np.float16, np.float16], flops=2 * M**3)
bench("bmm 64x(128x64 @ 64x128)", "matmul", [(64, 128, 64), (64, 64, 128)], flops=2 * 64 * 128 * 64 * 128)
bench("linear 256x1024 @ 1024x4096", "matmul", [(256, 1024), (1024, 4096)], flops=2 * 256 * 1024 * 4096)
N, C, H = 32, 64, 56
f = 2 * N * C * C * 9 * H * H
a = dict(stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=1)
bench("conv 3x3 64->64 56x56 N32 fwd", "conv2d", [(N, C, H, H), (C, C, 3, 3)], flops=f, **a)
bench("conv 3x3 dgrad", "conv2d_grad_input", [(N, C, H, H), (C, C, 3, 3)], flops=f, input_shape=(N, C, H, H), **a)
bench("conv 3x3 wgrad", "conv2d_grad_weight", [(N, C, H, H), (N, C, H, H)], flops=f, weight_shape=(C, C, 3, 3), **a)
a1 = dict(stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1)
f1 = 2 * N * 256 * 64 * H * H
bench("conv 1x1 256->64 56x56 fwd", "conv2d", [(N, 256, H, H), (64, 256, 1, 1)], flops=f1, **a1)
a2 = dict(stride=(2, 2), padding=(1, 1), dilation=(1, 1), groups=1)
bench("conv 3x3 s2 128->256 28x28 fwd", "conv2d", [(N, 128, 28, 28), (256, 128, 3, 3)], flops=2*N*256*128*9*14*14, **a2)
ad = dict(stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=128)
bench("depthwise 3x3 128ch 56x56 fwd", "conv2d", [(N, 128, H, H), (128, 1, 3, 3)], **ad)
bench("depthwise dgrad", "conv2d_grad_input", [(N, 128, H, H), (128, 1, 3, 3)], input_shape=(N, 128, H, H), **ad)
bench("depthwise wgrad", "conv2d_grad_weight", [(N, 128, H, H), (N, 128, H, H)], weight_shape=(128, 1, 3, 3), **ad)
bench("softmax 4096x1024", "softmax", [(4096, 1024)], dim=1)
bench("log_softmax 64x32000", "log_softmax", [(64, 32000)], dim=1)
bench("softmax dim1 of 32x1000x64", "softmax", [(32, 1000, 64)], dim=1)
bench("permute 4096x4096 transpose", "permute", [(4096, 4096)], dims=(1, 0))
bench("permute 32x64x56x56 -> NHWC", "permute", [(32, 64, 56, 56)], dims=(0, 2, 3, 1))
bench("maxpool 3x3 s2 N32 64x112", "max_pool2d", [(N, 64, 112, 112)], kernel_size=(3, 3), stride=(2, 2), padding=(1, 1))
bench("maxpool grad", "max_pool2d_grad", [(N, 64, 56, 56), (N, 64, 112, 112)], kernel_size=(3, 3), stride=(2, 2), padding=(1, 1))
bench("upsample bilinear x2 grad", "upsample_bilinear2d_grad", [(N, 64, 112, 112)], input_shape=(N, 64, 56, 56), size=(112, 112), align_corners=False)
bench("embedding 32000x1024, 8192 idx", "embedding", [(32000, 1024), (8192,)], [np.float32, np.int64], _hi=32000, padding_idx=-1)
bench("embedding_backward", "embedding_backward", [(8192, 1024), (8192,)], [np.float32, np.int64], _hi=32000, num_weights=32000, padding_idx=-1)
bench("argmax 4096x1024", "argmax", [(4096, 1024)], dim=1)
