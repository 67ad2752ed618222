"""Template kernel families (flowgen/codegen/kernels/ + templates/*.cu.j2) against the ops' NumPy refs.

Every case builds a one-node IR, renders it with `render_node`, runs the kernels on the
CPU emulator with NumPy buffers and compares the output with the op's `ref`. All cases
share two emulator builds (one per core) and one NVRTC compile per architecture, so the
module stays fast.
"""
from __future__ import annotations

import ctypes
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import flowgen  # noqa: F401  (registers the ops)
from flowgen import dtype as dt
from flowgen.codegen.kernel import BufferArg, RenderContext
from flowgen.codegen.kernels import render_node
from flowgen.codegen.target import rendering_for
from flowgen.ir.graph import Node, Value
from flowgen.ops import linalg, nn_ops, reduction, shape  # noqa: F401  (registered even if ops/__init__ lags)
from flowgen.ops.registry import TensorMeta, get_op
from flowgen.runtime import nvrtc
from flowgen.runtime.cpu_compiler import CpuModule, build_cpu_library

F16 = np.float16


def _rand(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def _index(rng, high, shape, dtype=np.int64):
    return rng.integers(0, high, shape).astype(dtype)


class Case:
    """One op application: `make(rng)` returns the input arrays; attrs go to the node."""

    def __init__(self, cid, op, make, rtol=1e-4, atol=1e-5, **attrs):
        self.id, self.op, self.make, self.rtol, self.atol, self.attrs = cid, op, make, rtol, atol, attrs


def _conv_cases():
    geoms = [  # (N, C, H, W, O, kernel, stride, padding, dilation, groups)
        ("3x3_s1_p1", 2, 4, 9, 7, 6, (3, 3), (1, 1), (1, 1), (1, 1), 1),
        ("3x3_s2_p0", 2, 4, 9, 7, 6, (3, 3), (2, 2), (0, 0), (1, 1), 1),
        ("3x2_s21_p10_d21_g2", 1, 4, 9, 8, 6, (3, 2), (2, 1), (1, 0), (2, 1), 2),
        ("depthwise_s1_p1", 2, 6, 7, 7, 6, (3, 3), (1, 1), (1, 1), (1, 1), 6),
        ("depthwise_mult2_s2", 2, 3, 8, 7, 6, (3, 3), (2, 2), (1, 1), (1, 1), 3),
        ("1x1_s1", 2, 5, 6, 7, 7, (1, 1), (1, 1), (0, 0), (1, 1), 1),
        ("1x1_s2", 2, 5, 6, 7, 7, (1, 1), (2, 2), (0, 0), (1, 1), 1),
        ("3x3_d2_p2_wide", 3, 16, 10, 10, 70, (3, 3), (1, 1), (2, 2), (2, 2), 1),   # 64-wide tiles, split-k dw
        ("5x3_s2_p21_g2", 2, 6, 11, 9, 4, (5, 3), (2, 2), (2, 1), (1, 1), 2),
    ]
    cases = []
    for name, N, C, H, W, O, k, s, p, d, g in geoms:
        attrs = dict(stride=s, padding=p, dilation=d, groups=g)
        x_shape, w_shape = (N, C, H, W), (O, C // g) + k
        y_shape = get_op("conv2d").infer(TensorMeta(x_shape, dt.float32), TensorMeta(w_shape, dt.float32),
                                         **attrs).shape
        cases.append(Case(f"conv2d_{name}", "conv2d", lambda r, a=x_shape, b=w_shape: [_rand(r, a), _rand(r, b)],
                          **attrs))
        cases.append(Case(f"conv2d_grad_input_{name}", "conv2d_grad_input",
                          lambda r, a=y_shape, b=w_shape: [_rand(r, a), _rand(r, b)], input_shape=x_shape, **attrs))
        cases.append(Case(f"conv2d_grad_weight_{name}", "conv2d_grad_weight",
                          lambda r, a=y_shape, b=x_shape: [_rand(r, a), _rand(r, b)], weight_shape=w_shape, **attrs))
    cases.append(Case("conv2d_f16", "conv2d", lambda r: [_rand(r, (2, 4, 9, 7), F16), _rand(r, (6, 4, 3, 3), F16)],
                      rtol=1e-2, atol=1e-2, stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=1))
    return cases


def _qkv(rng, q_shape, S, Ev, dtype=np.float32):
    *lead, _, E = q_shape
    return [_rand(rng, q_shape, dtype), _rand(rng, (*lead, S, E), dtype), _rand(rng, (*lead, S, Ev), dtype)]


def _masked_row(mask):
    """An additive mask with its row 1 all -inf (a fully masked query row)."""
    mask[..., 1, :] = -np.inf
    return mask


def _attention_backward_cases():
    """attention_backward on consistent inputs: o and lse from the forward ref, a random dO."""
    def make(q_shape, S, Ev, mask=None, dtype=np.float32, **attrs):
        def arrays(r):
            q, k, v = _qkv(r, q_shape, S, Ev, dtype)
            masks = [] if mask is None else [mask(r)]
            o, lse = get_op("attention_dropout" if "dropout_p" in attrs else "attention").ref(q, k, v, *masks,
                                                                                          **attrs)
            return [q, k, v, o, _rand(r, o.shape, dtype), lse, *masks]
        return arrays

    configs = [  # (id, q shape, S, Ev, mask, attrs)
        ("full", (2, 3, 5, 8), 7, 6, None, dict(scale=0.35, causal=False)),
        ("causal_L_gt_S", (3, 9, 5), 4, 3, None, dict(scale=0.5, causal=True)),
        ("causal_L_lt_S", (2, 4, 5), 7, 3, None, dict(scale=0.5, causal=True)),
        ("bool_mask", (2, 3, 5, 4), 6, 3, lambda r: r.random((3, 1, 6)) < 0.6, dict(scale=0.5, causal=False)),
        ("float_mask_masked_row", (2, 4, 4), 5, 4, lambda r: _masked_row(_rand(r, (2, 4, 5))),
         dict(scale=0.5, causal=False)),
    ]
    cases = [Case(f"attention_backward_{cid}", "attention_backward", make(qs, S, Ev, mask, **attrs), **attrs)
             for cid, qs, S, Ev, mask, attrs in configs]
    cases.append(Case("attention_backward_f64", "attention_backward", make((2, 4, 3), 6, 2, dtype=np.float64,
                                                                         scale=0.7, causal=True),
                      rtol=1e-12, atol=1e-12, scale=0.7, causal=True))
    cases.append(Case("attention_backward_f16", "attention_backward", make((2, 5, 8), 5, 8, dtype=F16, scale=0.25,
                                                                         causal=True),
                      rtol=1e-2, atol=1e-3, scale=0.25, causal=True))
    dropout = dict(scale=0.5, causal=False, dropout_p=0.3, seed=2 ** 63 + 5, offset=3)   # seed: a uint64
    cases.append(Case("attention_dropout_bool_mask", "attention_dropout",
                      lambda r: [*_qkv(r, (2, 3, 5, 4), 6, 3), r.random((3, 1, 6)) < 0.7], **dropout))
    cases.append(Case("attention_dropout_backward_bool_mask", "attention_dropout_backward",
                      make((2, 3, 5, 4), 6, 3, lambda r: r.random((3, 1, 6)) < 0.7, **dropout), **dropout))
    cases.append(Case("attention_dropout_backward_causal", "attention_dropout_backward",
                      make((2, 6, 4), 5, 3, **dict(dropout, causal=True)), **dict(dropout, causal=True)))
    return cases


def _layer_norm_cases():
    """The lanes-and-tree order of ops/norm_ops.py: every case equals the reference bit for bit
    (32 lanes with some empty, 64 and 128 lanes folded into a warp, rows longer than a block keeps
    in registers); layer_norm_backward on the statistics the forward reference gives."""
    def ln(shape, k, affine="wb", dtype=np.float32, op="layer_norm"):
        def arrays(r):
            x = (_rand(r, shape) * 3 + 1).astype(dtype)
            params = [_rand(r, shape[len(shape) - k:], dtype) for _ in affine]
            return [x, _rand(r, shape, dtype)] + params if op == "add_layer_norm" else [x] + params
        return arrays

    def backward(shape, k, weight=True, residual=False, dtype=np.float32):
        def arrays(r):
            x = (_rand(r, shape) * 3 + 1).astype(dtype)
            w = [_rand(r, shape[len(shape) - k:], dtype)] if weight else []
            _, mean, rstd = get_op("layer_norm").ref(x, normalized_ndim=k, eps=1e-5, has_weight=False, has_bias=False)
            return [_rand(r, shape, dtype), x, mean, rstd, *w] + ([_rand(r, shape, dtype)] if residual else [])
        return arrays

    def attrs(k, affine="wb"):
        return dict(normalized_ndim=k, eps=1e-5, has_weight="w" in affine, has_bias="b" in affine)

    exact = dict(rtol=0.0, atol=0.0)
    return [
        Case("layer_norm_affine", "layer_norm", ln((4, 6, 40), 1), **exact, **attrs(1)),
        Case("layer_norm_two_dims_no_affine", "layer_norm", ln((3, 5, 7), 2, ""), **exact, **attrs(2, "")),
        Case("layer_norm_wide_f64_weight", "layer_norm", ln((3, 700), 1, "w", np.float64), **exact, **attrs(1, "w")),
        Case("layer_norm_f16_bias", "layer_norm", ln((5, 24), 1, "b", F16), **exact, **attrs(1, "b")),
        Case("layer_norm_long_rows", "layer_norm", ln((2, 9000), 1), **exact, **attrs(1)),
        Case("add_layer_norm", "add_layer_norm", ln((5, 300), 1, op="add_layer_norm"), **exact, **attrs(1)),
        Case("layer_norm_backward_residual", "layer_norm_backward", backward((4, 6, 40), 1, residual=True), **exact,
             normalized_ndim=1, has_weight=True, has_residual=True),
        Case("layer_norm_backward_f64_no_weight", "layer_norm_backward", backward((3, 700), 1, False, False,
                                                                                np.float64),
             **exact, normalized_ndim=1, has_weight=False, has_residual=False),
        Case("layer_norm_backward_long_rows", "layer_norm_backward", backward((2, 3, 3000), 2), **exact,
             normalized_ndim=2, has_weight=True, has_residual=False),
    ]


def _pool_cases():
    x_shape = (2, 3, 11, 9)
    cases = []
    max_cfgs = [("3x3_s2_p1", dict(kernel_size=(3, 3), stride=(2, 2), padding=(1, 1))),
                ("2x3_d21_ceil", dict(kernel_size=(2, 3), stride=(2, 1), padding=(1, 0), dilation=(2, 1),
                                      ceil_mode=True)),
                ("3x3_s2_ceil", dict(kernel_size=(3, 3), stride=(2, 2), padding=(0, 0), ceil_mode=True)),
                ("2x2_s2", dict(kernel_size=(2, 2), stride=(2, 2)))]
    for name, kw in max_cfgs:
        out = get_op("max_pool2d").infer(TensorMeta(x_shape, dt.float32), **kw).shape
        # Values on a coarse grid make ties inside windows: the first maximum must win.
        ties = lambda r: [np.round(_rand(r, x_shape) * 2) / 2]
        cases.append(Case(f"max_pool2d_{name}", "max_pool2d", ties, **kw))
        cases.append(Case(f"max_pool2d_indices_{name}", "max_pool2d_indices", ties, **kw))
        cases.append(Case(f"max_pool2d_grad_{name}", "max_pool2d_grad",
                          lambda r, o=out: [_rand(r, o), np.round(_rand(r, x_shape) * 2) / 2], **kw))
    avg_cfgs = [("3x3_s2_p1", dict(kernel_size=(3, 3), stride=(2, 2), padding=(1, 1))),
                ("3x2_ceil_nopad", dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 1), ceil_mode=True,
                                        count_include_pad=False)),
                ("3x3_ceil_pad", dict(kernel_size=(3, 3), stride=(2, 2), padding=(1, 0), ceil_mode=True,
                                      count_include_pad=True))]
    for name, kw in avg_cfgs:
        out = get_op("avg_pool2d").infer(TensorMeta(x_shape, dt.float32), **kw).shape
        cases.append(Case(f"avg_pool2d_{name}", "avg_pool2d", lambda r: [_rand(r, x_shape)], **kw))
        cases.append(Case(f"avg_pool2d_grad_{name}", "avg_pool2d_grad", lambda r, o=out: [_rand(r, o)],
                          input_shape=x_shape, **kw))
    for size in [(4, 5), (13, 1)]:
        cases.append(Case(f"adaptive_avg_pool2d_{size[0]}x{size[1]}", "adaptive_avg_pool2d",
                          lambda r: [_rand(r, x_shape)], output_size=size))
        cases.append(Case(f"adaptive_avg_pool2d_grad_{size[0]}x{size[1]}", "adaptive_avg_pool2d_grad",
                          lambda r, s=size: [_rand(r, x_shape[:2] + s)], input_shape=x_shape, output_size=size))
    return cases


def _upsample_cases():
    x_shape = (2, 3, 5, 7)
    cases = []
    for size, scales in [((10, 14), None), ((13, 9), None), ((3, 4), None), ((11, 15), (2.2, 2.2)), ((1, 1), None)]:
        tag = f"{size[0]}x{size[1]}" + ("_scales" if scales else "")
        g = lambda r, s=size: [_rand(r, x_shape[:2] + s)]
        cases.append(Case(f"upsample_nearest2d_{tag}", "upsample_nearest2d", lambda r: [_rand(r, x_shape)],
                          size=size, scales=scales))
        cases.append(Case(f"upsample_nearest2d_grad_{tag}", "upsample_nearest2d_grad", g, input_shape=x_shape,
                          size=size, scales=scales))
        for ac in (False, True):
            cases.append(Case(f"upsample_bilinear2d_{tag}_ac{int(ac)}", "upsample_bilinear2d",
                              lambda r: [_rand(r, x_shape)], size=size, align_corners=ac, scales=scales))
            cases.append(Case(f"upsample_bilinear2d_grad_{tag}_ac{int(ac)}", "upsample_bilinear2d_grad", g,
                              input_shape=x_shape, size=size, align_corners=ac, scales=scales))
    for ac in (False, True):   # float64: source coordinates in double, as the reference and PyTorch
        cases.append(Case(f"upsample_bilinear2d_f64_13x9_ac{int(ac)}", "upsample_bilinear2d",
                          lambda r: [_rand(r, x_shape, np.float64)], size=(13, 9), align_corners=ac, scales=None))
        cases.append(Case(f"upsample_bilinear2d_grad_f64_13x9_ac{int(ac)}", "upsample_bilinear2d_grad",
                          lambda r: [_rand(r, x_shape[:2] + (13, 9), np.float64)], input_shape=x_shape, size=(13, 9),
                          align_corners=ac, scales=None))
    return cases


def _argreduce_input(r):
    a = _rand(r, (6, 50))
    a[1, 7] = a[1, 9] = 100.0      # tie: the first index wins
    a[2, 3] = a[2, 10] = np.nan    # NaN: the first NaN wins
    a[3, :] = 1.0                  # all equal
    return [a]


CASES = [
    # gemm
    Case("matmul_tails", "matmul", lambda r: [_rand(r, (37, 19)), _rand(r, (19, 45))]),
    Case("matmul_64_tiles", "matmul", lambda r: [_rand(r, (2, 70, 33)), _rand(r, (33, 130))]),
    Case("matmul_broadcast_batch", "matmul", lambda r: [_rand(r, (3, 1, 5, 7)), _rand(r, (4, 7, 6))]),
    Case("matmul_vector_rows", "matmul", lambda r: [_rand(r, (1, 40)), _rand(r, (40, 300))]),
    Case("matmul_f16", "matmul", lambda r: [_rand(r, (70, 33), F16), _rand(r, (33, 13), F16)], rtol=1e-2, atol=1e-2),
    Case("matmul_f64", "matmul", lambda r: [_rand(r, (9, 17), np.float64), _rand(r, (17, 5), np.float64)]),
    Case("matmul_int64", "matmul", lambda r: [_index(r, 9, (5, 6)), _index(r, 9, (6, 4))]),
    # copy
    Case("permute_tiled_021", "permute", lambda r: [_rand(r, (3, 40, 33))], dims=(0, 2, 1)),
    Case("permute_tiled_4d", "permute", lambda r: [_rand(r, (9, 3, 17, 10))], dims=(3, 1, 0, 2)),
    Case("permute_map_small", "permute", lambda r: [_rand(r, (2, 3, 4, 5))], dims=(3, 1, 0, 2)),
    Case("permute_inner_kept", "permute", lambda r: [_rand(r, (4, 6, 5))], dims=(1, 0, 2)),
    Case("permute_bool", "permute", lambda r: [_rand(r, (5, 9)) > 0], dims=(1, 0)),
    Case("slice_steps", "slice", lambda r: [_rand(r, (5, 9, 7))], starts=(1, 0, 2), stops=(5, 9, 7), steps=(2, 1, 3)),
    Case("slice_int64", "slice", lambda r: [_index(r, 100, (6, 8))], starts=(2, 1), stops=(6, 8), steps=(1, 1)),
    Case("slice_backward_steps", "slice_backward", lambda r: [_rand(r, (2, 9, 2))], shape=(5, 9, 7),
         starts=(1, 0, 2), stops=(5, 9, 7), steps=(2, 1, 3)),
    Case("slice_backward_full", "slice_backward", lambda r: [_rand(r, (4, 3))], shape=(4, 3),
         starts=(0, 0), stops=(4, 3), steps=(1, 1)),
    Case("cat_dim1_mixed_dtype", "cat", lambda r: [_rand(r, (2, 3, 4)), _rand(r, (2, 1, 4)),
                                                    _rand(r, (2, 5, 4), F16)], dim=1),
    Case("cat_last_dim", "cat", lambda r: [_rand(r, (2, 3, 4)), _rand(r, (2, 3, 1))], dim=2),
    Case("cat_dim0_int", "cat", lambda r: [_index(r, 50, (2, 3)), _index(r, 50, (1, 3))], dim=0),
    Case("cat_with_empty", "cat", lambda r: [_rand(r, (2, 0)), _rand(r, (2, 3)), _rand(r, (2, 2))], dim=1),
    # softmax
    Case("softmax_last", "softmax", lambda r: [_rand(r, (5, 37))], dim=1),
    Case("log_softmax_last", "log_softmax", lambda r: [_rand(r, (5, 37))], dim=-1),
    Case("softmax_middle_block", "softmax", lambda r: [_rand(r, (3, 300, 7))], dim=1),
    Case("log_softmax_long_row", "log_softmax", lambda r: [_rand(r, (2, 3000))], dim=1),
    Case("softmax_middle_columns", "softmax", lambda r: [_rand(r, (4, 9, 700))], dim=1),
    Case("log_softmax_middle_columns", "log_softmax", lambda r: [_rand(r, (4, 9, 700))], dim=1),
    # a row whose log-sum-exp is below the max's rounding unit: (x - max) - log(sum) keeps it
    Case("log_softmax_saturated_rows", "log_softmax", lambda r: [np.array([[8, -8.5], [20, 3.5]], np.float32)],
         rtol=1e-6, atol=0.0, dim=1),
    Case("log_softmax_saturated_columns", "log_softmax",
         lambda r: [np.array([[[8, 20, 0]], [[-8.5, 3.5, 0]]], np.float32).transpose(1, 0, 2).copy()],
         rtol=1e-6, atol=0.0, dim=1),
    Case("softmax_f16_dim0", "softmax", lambda r: [_rand(r, (4, 9), F16)], rtol=1e-2, atol=1e-3, dim=0),
    Case("softmax_scalar", "softmax", lambda r: [np.float32(3.0).reshape(())], dim=0),
    # one inf/NaN scan over several tensors (a GradScaler's skip test)
    Case("nonfinite_clean", "nonfinite_flag", lambda r: [_rand(r, (5, 7)), _rand(r, (300,)), _rand(r, (2,), F16)]),
    Case("nonfinite_inf_in_last", "nonfinite_flag",
         lambda r: [_rand(r, (5, 7)), np.where(np.arange(700) == 699, np.inf, _rand(r, (700,))).astype(np.float32)]),
    Case("nonfinite_nan_f16_f64", "nonfinite_flag",
         lambda r: [np.array([1.0, np.nan], F16), _rand(r, (3, 3)).astype(np.float64)]),
    # cross-entropy rows (ignore_index rows give 0) and their gradient
    Case("cross_entropy_rows", "cross_entropy_rows",
         lambda r: [_rand(r, (6, 10)) * 4, np.array([3, 0, -100, 9, 9, 1])], ignore_index=-100),
    Case("cross_entropy_rows_wide_i32", "cross_entropy_rows",
         lambda r: [_rand(r, (3, 1000)), np.array([999, 2, 5], np.int32)], ignore_index=2),
    Case("cross_entropy_rows_grad", "cross_entropy_rows_grad",
         lambda r: [_rand(r, (6,)), _rand(r, (6, 10)) * 4, np.array([3, 0, -100, 9, 9, 1])], ignore_index=-100),
    Case("cross_entropy_rows_grad_f16", "cross_entropy_rows_grad",
         lambda r: [_rand(r, (4,), F16), _rand(r, (4, 300), F16), np.array([1, 7, 299, 0])], rtol=1e-2,
         atol=1e-3, ignore_index=-100),
    # argreduce
    Case("argmax_ties_nan", "argmax", _argreduce_input, dim=1),
    Case("argmin_ties_nan", "argmin", _argreduce_input, dim=1),
    Case("argmax_middle_keepdim", "argmax", lambda r: [_rand(r, (4, 300, 5))], dim=1, keepdim=True),
    Case("argmin_middle_columns", "argmin", lambda r: [_rand(r, (4, 9, 700))], dim=1),
    Case("argmax_int", "argmax", lambda r: [np.arange(20).reshape(4, 5) % 3], dim=0),
    # gather
    Case("gather_dim1", "gather", lambda r: [_rand(r, (4, 7, 5)), _index(r, 7, (3, 9, 5))], dim=1),
    Case("gather_last_int32_index", "gather", lambda r: [_rand(r, (4, 7, 5)), _index(r, 5, (4, 2, 3), np.int32)],
         dim=-1),
    Case("index_select_dim1", "index_select", lambda r: [_rand(r, (4, 7, 5)), _index(r, 7, (9,))], dim=1),
    Case("index_select_dim0", "index_select", lambda r: [_rand(r, (4, 7, 5)), _index(r, 4, (3,))], dim=0),
    Case("index_select_last", "index_select", lambda r: [_rand(r, (4, 7, 5)), _index(r, 5, (3,))], dim=2),
    Case("index_select_wrap_negative", "index_select", lambda r: [_rand(r, (4, 7, 5)), _index(r, 14, (9,)) - 7],
         dim=1, wrap_negative=True),
    Case("embedding", "embedding", lambda r: [_rand(r, (11, 6)), _index(r, 11, (3, 5))], padding_idx=-1),
    Case("embedding_f16", "embedding", lambda r: [_rand(r, (11, 6), F16), _index(r, 11, (4,))], padding_idx=-1),
    # scatter
    Case("scatter_add_dim1", "scatter_add", lambda r: [_index(r, 7, (3, 9, 5)), _rand(r, (3, 9, 5))],
         shape=(4, 7, 5), dim=1),
    Case("scatter_add_int64", "scatter_add", lambda r: [_index(r, 3, (4, 6)), _index(r, 100, (4, 6))],
         shape=(4, 3), dim=1),
    Case("index_add_dim1", "index_add", lambda r: [_index(r, 7, (9,)), _rand(r, (4, 9, 5))], shape=(4, 7, 5), dim=1),
    Case("index_add_dim0", "index_add", lambda r: [_index(r, 4, (9,)), _rand(r, (9, 7, 5))], shape=(4, 7, 5), dim=0),
    Case("index_add_last", "index_add", lambda r: [_index(r, 5, (9,)), _rand(r, (4, 7, 9))], shape=(4, 7, 5), dim=2),
    Case("index_add_wrap_negative", "index_add", lambda r: [_index(r, 14, (9,)) - 7, _rand(r, (4, 9, 5))],
         shape=(4, 7, 5), dim=1, wrap_negative=True),
    Case("embedding_backward_pad", "embedding_backward", lambda r: [_rand(r, (3, 5, 6)), _index(r, 11, (3, 5))],
         num_weights=11, padding_idx=2),
    Case("embedding_backward", "embedding_backward", lambda r: [_rand(r, (40, 6)), _index(r, 5, (40,))],
         num_weights=5, padding_idx=-1),
    # attention (online softmax per query row)
    Case("attention", "attention", lambda r: [_rand(r, (2, 3, 5, 8)), _rand(r, (2, 3, 7, 8)), _rand(r, (2, 3, 7, 6))],
         scale=0.35, causal=False),
    Case("attention_causal_L_gt_S", "attention",
         lambda r: [_rand(r, (3, 9, 5)), _rand(r, (3, 4, 5)), _rand(r, (3, 4, 3))], scale=0.5, causal=True),
    Case("attention_causal_2d", "attention", lambda r: [_rand(r, (6, 4)), _rand(r, (11, 4)), _rand(r, (11, 7))],
         scale=1.0, causal=True),
    Case("attention_f64", "attention", lambda r: [_rand(r, (2, 4, 3), np.float64), _rand(r, (2, 6, 3), np.float64),
                                                  _rand(r, (2, 6, 2), np.float64)], rtol=1e-12, atol=1e-12,
         scale=0.7, causal=False),
    Case("attention_f16", "attention", lambda r: [_rand(r, (2, 5, 8), F16), _rand(r, (2, 5, 8), F16),
                                                  _rand(r, (2, 5, 8), F16)], rtol=1e-2, atol=1e-3,
         scale=0.25, causal=True),
    Case("attention_bool_mask_broadcast", "attention",
         lambda r: [*_qkv(r, (2, 3, 5, 4), 6, 3), r.random((2, 1, 5, 6)) < 0.6], scale=0.5, causal=False),
    Case("attention_float_mask_masked_row", "attention",
         lambda r: [*_qkv(r, (2, 4, 4), 5, 4), _masked_row(_rand(r, (4, 5)))], scale=0.5, causal=False),
    *_attention_backward_cases(),
    *_conv_cases(),
    *_pool_cases(),
    *_upsample_cases(),
    # scatter of nothing: a zero fill (appended, so the cases above keep their seeds)
    Case("index_add_no_entries", "index_add", lambda r: [_index(r, 7, (0,)), _rand(r, (4, 0, 5))], shape=(4, 7, 5),
         dim=1),
    *_layer_norm_cases(),
]

FAMILY_OPS = {
    "gemm": {"matmul"}, "copy": {"permute", "slice", "slice_backward", "cat"}, "softmax": {"softmax", "log_softmax"},
    "argreduce": {"argmax", "argmin"}, "gather": {"gather", "index_select", "embedding"},
    "scatter": {"scatter_add", "index_add", "embedding_backward"},
    "conv2d": {"conv2d", "conv2d_grad_input", "conv2d_grad_weight"},
    "pool2d": {"max_pool2d", "max_pool2d_indices", "max_pool2d_grad", "avg_pool2d", "avg_pool2d_grad", "adaptive_avg_pool2d",
               "adaptive_avg_pool2d_grad"},
    "upsample": {"upsample_nearest2d", "upsample_nearest2d_grad", "upsample_bilinear2d", "upsample_bilinear2d_grad"},
    "attention": {"attention", "attention_backward", "attention_dropout", "attention_dropout_backward"},
    "layer_norm": {"layer_norm", "add_layer_norm", "layer_norm_backward"},
}


def _node(case, arrays) -> Node:
    inputs = [Value(f"in{k}", tuple(a.shape), dt.from_numpy(a.dtype)) for k, a in enumerate(arrays)]
    metas = get_op(case.op).infer(*(TensorMeta(v.shape, v.dtype) for v in inputs), **case.attrs)
    metas = metas if isinstance(metas, tuple) else (metas,)
    outputs = [Value("out" if n == 0 else f"out{n}", tuple(m.shape), m.dtype) for n, m in enumerate(metas)]
    return Node(case.op, inputs, outputs, dict(case.attrs), scope=f"model.{case.id}")


class Rendered:
    def __init__(self, case, index):
        self.case = case
        self.arrays = case.make(np.random.default_rng(index))
        self.node = _node(case, self.arrays)
        self.kernels = render_node(self.node, RenderContext(name=f"k{index}_{case.id}"))


@pytest.fixture(scope="module")
def rendered():
    return {case.id: Rendered(case, i) for i, case in enumerate(CASES)}


@pytest.fixture(scope="module")
def emulator(rendered):
    """kernel name -> CpuModule; all kernels built as two libraries (g++ runs in parallel)."""
    items = list(rendered.values())
    chunks = [items[0::2], items[1::2]]
    sources = ["\n".join(k.source for r in chunk for k in r.kernels) for chunk in chunks]
    with ThreadPoolExecutor(len(sources)) as pool:
        paths = list(pool.map(lambda a: build_cpu_library(a[1], f"test_families_{a[0]}"), enumerate(sources)))
    modules = {}
    for chunk, path in zip(chunks, paths):
        module = CpuModule(path)
        for r in chunk:
            for k in r.kernels:
                modules[k.name] = module
    return modules


def _run(rendered_case, modules) -> list:
    """The node's outputs (all of them: attention's logsumexp and gradients too)."""
    buffers = {v: np.ascontiguousarray(a) for v, a in zip(rendered_case.node.inputs, rendered_case.arrays)}
    # A poison fill: an element the kernels forget to write shows up as a mismatch.
    for out in rendered_case.node.outputs:
        buffers[out] = np.full(out.shape, 123, out.dtype.np_dtype)
    for v in {a.value for k in rendered_case.kernels for a in k.args} - set(buffers):   # scratch (split-k partials)
        buffers[v] = np.full(v.shape, 123, v.dtype.np_dtype)
    for k in rendered_case.kernels:
        args = [ctypes.c_void_p(buffers[a.value].ctypes.data) for a in k.args]
        modules[k.name].launch(k.name, k.grid, k.block, k.smem, args)
    return [buffers[out] for out in rendered_case.node.outputs]


def _refs(case, arrays) -> list:
    want = get_op(case.op).ref(*arrays, **case.attrs)
    return list(want) if isinstance(want, tuple) else [want]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_kernel_matches_ref(case, rendered, emulator):
    r = rendered[case.id]
    for out, got, want in zip(r.node.outputs, _run(r, emulator), _refs(case, r.arrays)):
        _compare(case, out, got, np.asarray(want).astype(out.dtype.np_dtype))


def _compare(case, out, got, want):
    assert got.shape == want.shape
    if not out.dtype.is_floating:
        np.testing.assert_array_equal(got, want)
    else:
        # atol scales with the output's magnitude: a sum of products loses bits where it cancels
        wide = want.astype(np.float64)
        scale = max(1.0, float(np.abs(wide[np.isfinite(wide)]).max(initial=0.0)))
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=case.rtol,
                                   atol=case.atol * scale)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvrtc_compiles_every_kernel(arch, rendered):
    """Through the GPU backend's own path (nvrtc.compile_kernels: distinct bodies in parallel chunks)."""
    kernels = [k for r in rendered.values() for k in r.kernels]
    build = nvrtc.compile_kernels("\n".join(k.source for k in kernels), arch)
    assert set(build.symbols) == {k.name for k in kernels}
    assert all(path.read_bytes()[:4] == b"\x7fELF" for path in build.artifacts)


def test_every_family_op_is_covered(rendered):
    from flowgen.ops.registry import REGISTRY

    covered = {r.case.op for r in rendered.values()}
    for family, ops in FAMILY_OPS.items():
        assert ops <= covered, f"{family}: untested ops {ops - covered}"
    # Every registered op of these families has a case (catches ops added later).
    for name, op in REGISTRY.items():
        if getattr(op.lowering, "family", None) in FAMILY_OPS:
            assert name in covered, f"op {name} ({op.lowering.family}) has no kernel test"


def test_kernel_contract(rendered):
    """Argument order (inputs, then output), comments, flags and the emulator registration line."""
    for r in rendered.values():
        node, kernels = r.node, r.kernels
        if node.op in FAMILY_OPS["scatter"]:
            _check_scatter_kernels(node, kernels)
        elif len(node.outputs) > 1:   # attention: the kernels read inputs (+ scratch), write the outputs
            _check_multi_output_args(node, kernels)
        else:
            _check_kernel_args(node, kernels)
        for k in kernels:
            assert all(isinstance(a, BufferArg) for a in k.args)
            assert k.ops == [node.op]
            assert k.comment.startswith(node.scope + ": " + node.op)
            assert k.source.startswith(f"// {k.comment}") or f"\n// {k.comment}\n" in k.source
            assert re.search(rf'extern "C" __global__ void (__launch_bounds__\([0-9, ]+\) )?{k.name}\(', k.source)
            uses_sync = "__syncthreads" in k.source or "_sync(" in k.source
            assert f"FLOWGEN_EMU_KERNEL({k.name}, {'true' if uses_sync else 'false'})" in k.source
            assert k.needs_fibers == uses_sync
            assert all(g >= 1 for g in k.grid) and k.block[0] * k.block[1] * k.block[2] <= 1024


def _check_kernel_args(node, kernels):
    """The main kernel takes the inputs, then the output (split-k: a scratch buffer of partial sums
    that `_combine` reads); helper kernels before it zero-fill the output."""
    main, written = kernels[-1], node.output
    if main.name.endswith("_combine"):   # split-k: partial sums into a scratch buffer, then combined
        main, combine = kernels
        written = combine.args[0].value
        assert combine.name == main.name + "_combine"
        assert [a.value for a in combine.args] == [written, node.output]
        assert [a.ctype.startswith("const") for a in combine.args] == [True, False]
        kernels = [main, combine]
    assert [a.value for a in main.args] == [*node.inputs, written]
    assert [a.ctype.startswith("const") for a in main.args] == [True] * len(node.inputs) + [False]
    for k in kernels[:kernels.index(main)]:              # helper kernels zero-fill the output
        assert k.name == main.name + "_zero"
        assert [a.value for a in k.args] == [node.output]


def _check_scatter_kernels(node, kernels):
    """A scatter: `_rows`, `_fill`, `_sort` (integer work on the index and int32 scratch; `_rows`
    checks the indices), then the segmented sum reading the source and the scratch; with no
    entries, only a zero fill of the output."""
    if len(kernels) == 1:
        assert kernels[0].name.endswith("_zero") and [a.value for a in kernels[0].args] == [node.output]
        assert (node.inputs[1] if node.op == "embedding_backward" else node.inputs[0]).numel == 0
        return
    rows, fill, sort, main = kernels           # segments longer than 256 would add a `_sort_long`
    assert [k.name for k in (rows, fill, sort)] == [main.name + s for s in ("_rows", "_fill", "_sort")]
    index, src = (node.inputs[1], node.inputs[0]) if node.op == "embedding_backward" else node.inputs
    counts, offsets = rows.args[1].value, rows.args[2].value
    positions = fill.args[3].value
    assert [a.value for a in rows.args] == [index, counts, offsets]
    assert [a.value for a in fill.args] == [index, offsets, counts, positions]
    assert [a.value for a in sort.args] == [offsets, positions]
    assert [a.value for a in main.args] == [src, offsets, positions, node.output]
    assert [a.ctype.startswith("const") for a in main.args] == [True, True, True, False]
    assert all(v.dtype == dt.int32 for v in (counts, offsets, positions))
    assert offsets.numel == counts.numel + 1 and rows.grid == (1, 1, 1)
    assert rows.index_check is not None and all(k.index_check is None for k in (fill, sort, main))
    assert "atomicAdd(&counts" in fill.source and "atomicAdd" not in main.source


def _check_multi_output_args(node, kernels):
    """Every output is written by exactly one kernel; a kernel reads only inputs and what an earlier
    kernel wrote (scratch), and lists its reads (const) before its writes."""
    written = []
    for k in kernels:
        assert all(isinstance(a, BufferArg) for a in k.args)
        consts = [a.ctype.startswith("const") for a in k.args]
        assert consts == sorted(consts, reverse=True), k.name
        assert all(a.value in node.inputs or a.value in written for a in k.args if a.ctype.startswith("const"))
        written += [a.value for a in k.args if not a.ctype.startswith("const")]
    assert sorted(v.name for v in written if v in node.outputs) == sorted(v.name for v in node.outputs)


def test_rendering_is_deterministic(rendered):
    for i, case in enumerate(CASES[:12]):
        again = Rendered(case, i)
        assert [k.source for k in again.kernels] == [k.source for k in rendered[case.id].kernels]


def test_template_lookup():
    from flowgen.codegen.templates import get_template, templates_dir

    assert (templates_dir() / "gemm.cu.j2").is_file()
    assert get_template("gemm") is get_template("gemm.cu.j2")
    import jinja2

    with pytest.raises(jinja2.UndefinedError):
        get_template("softmax").render()        # StrictUndefined: missing variables are errors


@pytest.mark.gpu
def test_kernels_on_gpu(rendered):
    """The same cases on a real GPU (NVRTC for the device's architecture, CUDA driver launches)."""
    from flowgen.runtime import cuda_driver
    from flowgen.runtime.nvrtc import compile_cuda

    ctx = cuda_driver.CudaContext.get()
    source = "\n".join(k.source for r in rendered.values() for k in r.kernels)
    module = ctx.load_module(compile_cuda(source, ctx.arch, tag="test_families_gpu"))
    failures = []
    for r in rendered.values():
        node, case = r.node, r.case
        pointers = {}
        for v, a in zip(node.inputs, r.arrays):
            pointers[v] = ctx.alloc(max(a.nbytes, 1))
            ctx.memcpy_htod(pointers[v], a)
        for v in {a.value for k in r.kernels for a in k.args} - set(pointers):   # outputs and scratch
            pointers[v] = ctx.alloc(max(v.nbytes, 1))
            ctx.memset(pointers[v], 0xFF, v.nbytes)         # NaN / -1 poison
        for k in r.kernels:
            module.launch(k.name, k.grid, k.block, k.smem, [ctypes.c_void_p(pointers[a.value]) for a in k.args])
        ctx.synchronize()
        for out, want in zip(node.outputs, _refs(case, r.arrays)):
            got = np.empty(out.shape, out.dtype.np_dtype)
            ctx.memcpy_dtoh(got, pointers[out])
            want = np.asarray(want).astype(out.dtype.np_dtype)
            try:   # the emulator's criterion (atol scaled by the output's magnitude), on both targets
                _compare(case, out, got, want)
            except AssertionError as exc:
                failures.append(f"{case.id} ({', '.join(k.name for k in r.kernels)}): {_mismatch(got, want)}; "
                                f"{str(exc).strip().splitlines()[0]}")
        for p in pointers.values():
            ctx.free(p)
    module.close()
    assert not failures, "kernels that disagree with the reference on the GPU:\n" + "\n".join(failures)


def _mismatch(got, want) -> str:
    """The largest error and the first differing index of an output."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    error = np.abs(got - want)
    error[np.isnan(got) & np.isnan(want)] = 0.0
    error[np.isnan(error)] = np.inf
    if not error.any():
        return "no element differs"
    worst = np.unravel_index(int(np.argmax(error)), error.shape)
    first = np.unravel_index(int(np.flatnonzero(error)[0]), error.shape)
    return (f"largest error {error[worst]:.3g} at {tuple(map(int, worst))} (got {got[worst]!r}, want "
            f"{want[worst]!r}), first differing index {tuple(map(int, first))}")


def test_every_gemm_tile_configuration(monkeypatch):
    """Each tile shape of the GEMM core (picked by problem size in practice) on one matmul and
    one split-k conv2d_grad_weight with M, N, K tails."""
    from flowgen.codegen.kernels import gemm

    rng = np.random.default_rng(7)
    a, b = _rand(rng, (2, 130, 37)), _rand(rng, (37, 135))
    g, x = _rand(rng, (2, 5, 33, 33)), _rand(rng, (2, 3, 35, 35))
    conv = Case("wgrad", "conv2d_grad_weight", None, weight_shape=(5, 3, 3, 3), stride=(1, 1), padding=(0, 0),
                dilation=(1, 1), groups=1)
    rendered = []
    for i, tile in enumerate(gemm._TILES):
        monkeypatch.setattr(gemm, "_TILES", (tile,))
        mm = _node(Case("mm", "matmul", None), [a, b])
        wg = _node(conv, [g, x])
        rendered.append((mm, [a, b], render_node(mm, RenderContext(name=f"tile{i}_mm"))))
        rendered.append((wg, [g, x], render_node(wg, RenderContext(name=f"tile{i}_wgrad"))))
    monkeypatch.undo()
    assert any(len(k) == 2 for _, _, k in rendered), "the conv case should exercise split-k"
    source = "\n".join(k.source for _, _, ks in rendered for k in ks)
    module = CpuModule(build_cpu_library(source, "test_families_tiles"))
    for node, arrays, kernels in rendered:
        r = type("R", (), {})()
        r.node, r.arrays, r.kernels = node, arrays, kernels
        (got,) = _run(r, {k.name: module for k in kernels})
        want = get_op(node.op).ref(*arrays, **node.attrs)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=kernels[-1].comment)


@pytest.mark.parametrize("op", ["matmul", "conv2d", "conv2d_grad_input", "conv2d_grad_weight"])
def test_cpu_gemm_tiles_match_the_gpu_tiles_bit_for_bit(monkeypatch, op):
    """Rendered for "cpu", a SIMT GEMM tile is one thread per block with no shared memory
    (_gemm_tile_cpu.j2); for each tile shape, the cpu target's wider ones included, it gives
    exactly the numbers of the GPU's shared-memory tile (the same fmaf chain over k per output;
    the same split-k, whose partial sums are combined in split order)."""
    from flowgen.codegen.kernels import gemm

    rng = np.random.default_rng(11)
    if op == "matmul":
        case, arrays = Case("mm", "matmul", None), [_rand(rng, (2, 130, 37)), _rand(rng, (37, 135))]
    elif op == "conv2d":
        case = Case("fwd", "conv2d", None, stride=(2, 1), padding=(1, 0), dilation=(1, 1), groups=2)
        arrays = [_rand(rng, (2, 6, 11, 9)), _rand(rng, (10, 3, 3, 2))]
    elif op == "conv2d_grad_input":
        case = Case("dgrad", "conv2d_grad_input", None, input_shape=(2, 6, 11, 9), stride=(2, 1), padding=(1, 0),
                    dilation=(1, 2), groups=2)
        arrays = [_rand(rng, (2, 10, 6, 7)), _rand(rng, (10, 3, 3, 2))]
    else:
        case = Case("wgrad", "conv2d_grad_weight", None, weight_shape=(5, 3, 3, 3), stride=(1, 1),
                    padding=(0, 0), dilation=(1, 1), groups=1)
        arrays = [_rand(rng, (2, 5, 33, 33)), _rand(rng, (2, 3, 35, 35))]
    rendered = []
    tiles = gemm._CPU_TILES + gemm._TILES
    monkeypatch.setattr(gemm, "_CPU_TILES", ())   # one shape at a time, the same on both sides
    for i, tile in enumerate(tiles):
        monkeypatch.setattr(gemm, "_TILES", (tile,))
        node = _node(case, arrays)
        pair = []
        for serial in (False, True):
            with rendering_for("cpu", serial_blocks=serial):
                pair.append(render_node(node, RenderContext(name=f"cpu_tile{i}_{op}_{'serial' if serial else 'fibers'}")))
        rendered.append((node, pair))
    monkeypatch.undo()
    assert all("one thread per tile" in s[0].comment and s[0].block == (1, 1, 1) and not s[0].needs_fibers
               and "__shared__" not in s[0].source and "__syncthreads" not in s[0].source
               for _, (_, s) in rendered)
    if op == "conv2d_grad_weight":
        assert any("split-k" in s[0].comment for _, (_, s) in rendered)
    source = "\n".join(k.source for _, pair in rendered for ks in pair for k in ks)
    module = CpuModule(build_cpu_library(source, f"test_families_cpu_tiles_{op}"))
    for node, (fibers, serial) in rendered:
        r = type("R", (), {"node": node, "arrays": arrays})()
        r.kernels = fibers
        want = _run(r, {k.name: module for k in fibers})[0].copy()
        r.kernels = serial
        (got,) = _run(r, {k.name: module for k in serial})
        assert [k.grid for k in fibers] == [k.grid for k in serial], serial[0].comment
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), serial[0].comment

