"""Row kernels: a reduction along one dim that writes a row's worth of results.

* softmax    — softmax / log_softmax over any dim, and cross-entropy rows and their gradient
               over (N, C) logits (templates/softmax.cu.j2): one block per row (block reductions
               for max and sum) or, when the dim is not innermost, one thread per row walking the
               dim (coalesced across neighbouring rows).
* argreduce  — argmax / argmin (argreduce.cu.j2): the same layouts; first index wins ties, NaN wins.
* layer_norm — layer_norm / add_layer_norm (forward: y, the row's mean and rstd; add_layer_norm
               also writes the residual sum it normalizes) and layer_norm_backward (dx, plus a
               residual gradient) (layer_norm.cu.j2): a block of L threads per row
               (L = layer_norm_lanes(D)), each thread a lane of the op's fixed order, its elements
               kept in registers up to LAYER_NORM_CACHED_STEPS; Welford states (forward) or two sums
               (backward) merged in the op's tree through shared memory and warp shuffles. On the cpu
               target one thread per row with the L lanes' accumulators in arrays, merged the same way.
"""
from __future__ import annotations

from flowgen import dtype as dt
from flowgen.codegen.kernel import Kernel, RenderContext
from flowgen.codegen.kernels.common import (BLOCK, acc_type, declared_in_place, grid_1d, index_type,
                                            loader, make_index_check, node_args, node_comment, node_kernel, node_params,
                                            numel_of, render_template, row_blocks, row_element, row_layout,
                                            serial_rows_launch, shape_text, storer)
from flowgen.codegen.target import chosen_shape, reduce_block, serial_blocks, target_blocks
from flowgen.ops.lowering import cpp_literal
from flowgen.ops.norm_ops import layer_norm_lanes


def render_softmax(node, ctx: RenderContext) -> list:
    return _softmax(node, ctx.kernel_name(node, [node.op]), ctx.check_id)


def render_argreduce(node, ctx: RenderContext) -> list:
    return _argreduce(node, ctx.kernel_name(node, [node.op]))


def render_layer_norm(node, ctx: RenderContext) -> list:
    return _layer_norm(node, ctx.kernel_name(node, [node.op]))


# --------------------------------------------------------------------------
# softmax / log_softmax and argmax / argmin: rows along one dim

def _use_columns(D: int, inner: int, rows: int) -> bool:
    """One thread per row when the dim is strided and there are rows enough to fill the GPU."""
    return inner > 1 and rows >= 32 * target_blocks() // 4


def _row_kernels(node, kernel_name, template, ctx, x, index_check=None) -> list:
    """One kernel that reduces `x` along a dim: a thread per row when the dim is strided and rows
    are many (coalesced), else a block per row with block reductions."""
    rows = ctx["rows"]
    # the rows its form is chosen for (codegen/target.py chosen_shape: a dynamic step's maximum)
    chosen_outer, chosen_D, chosen_inner = row_layout(chosen_shape(x), ctx["dim"])
    chosen_rows = chosen_outer * chosen_inner
    where = f"over dim {ctx['dim']} of {ctx['shape']}"
    # the cpu target (serial_blocks) runs softmax rows a thread each: no barriers, no fibers
    serial_rows = serial_blocks() and template == "softmax.cu.j2" and ctx["mode"] in ("softmax", "log_softmax")
    if _use_columns(chosen_D, chosen_inner, chosen_rows) or serial_rows:
        what = f"{where} (thread per row)"
        source = render_template(template, kind="column", comment=node_comment(node, what), **ctx)
        grid, block = serial_rows_launch(rows, chosen_rows) if serial_blocks() else (grid_1d(rows), (BLOCK, 1, 1))
        return [node_kernel(node, kernel_name, source, grid, block, False, what, index_check=index_check)]
    block = reduce_block(chosen_D)
    what = f"{where} (block per row)"
    source = render_template(template, kind="block", comment=node_comment(node, what), block=block, **ctx)
    return [node_kernel(node, kernel_name, source, row_blocks(rows), (block, 1, 1), True, what,
                        index_check=index_check)]


# per op: (kernel parameter names, what the last pass over the row computes)
_ROW_SOFTMAX_MODES = {
    "softmax": (("x",), ("y",)),
    "log_softmax": (("x",), ("y",)),
    "cross_entropy_rows": (("x", "target"), ("loss",)),
    "cross_entropy_rows_grad": (("g", "x", "target"), ("dx",)),
}


def _softmax(node, kernel_name, check_id):
    """softmax / log_softmax along any dim, and the cross-entropy rows (forward: the row's loss
    from its max and sum of exp; backward: g * (softmax - onehot)) on (N, C) logits."""
    in_names, out_names = _ROW_SOFTMAX_MODES[node.op]
    x, y = node.inputs[in_names.index("x")], node.output
    dim = node.attrs["dim"] % max(len(x.shape), 1) if "dim" in node.attrs else 1
    outer, D, inner = row_layout(x.shape, dim)
    rows = outer * inner
    acc = acc_type(x.dtype, y.dtype)
    f = "" if acc == "double" else "f"
    ctx = dict(name=kernel_name, op=node.op, dim=dim, shape=shape_text(x.shape), rows=rows, D=D, inner=inner,
               stride_text=f" (stride {inner})" if inner > 1 else "", in_t=x.dtype.ctype, out_t=y.dtype.ctype,
               acc=acc, mode=node.op, load=loader(x.dtype, acc), store=storer(y.dtype, acc), elem=row_element(inner),
               fmax=f"fmax{f}", exp=f"exp{f}", logf=f"log{f}", one="1.0" if acc == "double" else "1.0f",
               idx_t=index_type(rows), params=node_params(node, in_names, out_names),
               # C++ telling an ignored row by its label t (ignore_index None: no row is ignored)
               ignored="false" if node.attrs.get("ignore_index") is None else
               f"t == {cpp_literal(int(node.attrs['ignore_index']))}")
    if node.op.startswith("cross_entropy"):
        ctx.update(load_g=loader(node.inputs[0].dtype, acc), check_id=check_id)
        kernels = _row_kernels(node, kernel_name, "softmax.cu.j2", ctx, x,
                               index_check=make_index_check(node, check_id, "label", D))
    else:
        kernels = _row_kernels(node, kernel_name, "softmax.cu.j2", ctx, x)
    for k in kernels:
        k.in_place = declared_in_place(node, in_names, out_names)
    return kernels


# --------------------------------------------------------------------------
# layer_norm / add_layer_norm / layer_norm_backward: rows over the trailing dims

# per op: (kernel parameter names of the inputs that are always there, of the outputs)
_LAYER_NORM_OPERANDS = {
    "layer_norm": (("x",), ("y", "mean_out", "rstd_out")),
    "add_layer_norm": (("a", "b"), ("sum", "y", "mean_out", "rstd_out")),
    "layer_norm_backward": (("g", "x", "mean", "rstd"), ("dx",)),
}

# Elements per thread a block kernel keeps in registers: longer rows are read (or recomputed) again.
LAYER_NORM_CACHED_STEPS = 32


def _layer_norm_names(node) -> tuple:
    """(input names, output names) of a layer_norm-family node's kernel parameters."""
    fixed, out_names = _LAYER_NORM_OPERANDS[node.op]
    attrs = node.attrs
    optional = ("weight", "residual") if node.op == "layer_norm_backward" else ("weight", "bias")
    flags = (attrs["has_weight"], attrs.get("has_residual", False) or attrs.get("has_bias", False))
    return list(fixed) + [n for n, on in zip(optional, flags) if on], out_names


def _layer_norm(node, kernel_name, native: bool = False):
    """One row kernel: the forward (statistics by Welford per lane, merged in the op's fixed tree;
    add_layer_norm also writes the residual sum) or the backward's dx (two row sums, same tree).
    A block of L threads per row, or on the cpu target one thread per row with L accumulators
    (`native`: the rows in a loop over the thread pool, codegen/cpu/rows.py): the same arithmetic
    in the same order every way (ops/norm_ops.py)."""
    attrs = node.attrs
    backward = node.op == "layer_norm_backward"
    in_names, out_names = _layer_norm_names(node)
    operand = dict(zip(in_names, node.inputs))
    x = operand["x"] if "x" in operand else operand["a"]
    k = attrs["normalized_ndim"]
    D = numel_of(x.shape[len(x.shape) - k:])
    rows = numel_of(x.shape[:len(x.shape) - k])
    stat = node.inputs[2] if backward else node.outputs[-1]
    ct = stat.dtype.ctype
    L = layer_norm_lanes(D)
    S = -(-D // L)
    ctx = dict(name=kernel_name, op=node.op, shape=shape_text(x.shape), normalized_ndim=k, rows=rows, D=D, L=L,
               S=S, ct=ct, idx_t=index_type(rows), params=node_params(node, in_names, out_names),
               mode="backward" if backward else "forward", residual=node.op == "add_layer_norm",
               has_weight=attrs["has_weight"], has_bias=attrs.get("has_bias", False),
               has_residual=attrs.get("has_residual", False), cache=S <= LAYER_NORM_CACHED_STEPS,
               eps=None if backward else cpp_literal(attrs["eps"], double=True), store_x=storer(x.dtype, ct),
               store_y=None if backward else storer(node.outputs[-3].dtype, ct),
               store_dx=storer(node.outputs[0].dtype, ct))
    # load_x, load_weight, ...: an operand's element in the compute type (add_layer_norm's sum reads as x)
    ctx.update({f"load_{n}": loader(v.dtype, ct) for n, v in operand.items()}, load_x=loader(x.dtype, ct))
    serial = serial_blocks() or native
    what = (f"over the last {k} dims of {shape_text(x.shape)} "
            f"({'row per iteration' if native else 'thread per row' if serial else 'block per row'})")
    source = render_template("layer_norm.cu.j2", kind="serial" if serial else "block", native=native,
                             comment=node_comment(node, what), **ctx)
    if native:
        kernel = Kernel(kernel_name, source, node_args(node), (1, 1, 1), (1, 1, 1), native=True,
                        comment=node_comment(node, what), ops=[node.op])
    elif serial:
        chosen = chosen_shape(x)   # the rows its block is chosen for (a dynamic step's maximum)
        kernel = node_kernel(node, kernel_name, source,
                             *serial_rows_launch(rows, numel_of(chosen[:len(chosen) - k])), False, what)
    else:
        kernel = node_kernel(node, kernel_name, source, row_blocks(rows), (L, 1, 1), True, what)
    kernel.in_place = declared_in_place(node, in_names, out_names, optional=("residual",))
    return [kernel]


def _argreduce(node, kernel_name):
    x = node.inputs[0]
    if x.dtype == dt.bool_:
        raise NotImplementedError(f"{node.op}: boolean input has no kernel")
    dim = node.attrs["dim"] % max(len(x.shape), 1)
    outer, D, inner = row_layout(x.shape, dim)
    rows = outer * inner
    acc = acc_type(x.dtype)
    ctx = dict(name=kernel_name, op=node.op, dim=dim, shape=shape_text(x.shape), rows=rows, D=D, inner=inner,
               stride_text=f" (stride {inner})" if inner > 1 else "", in_t=x.dtype.ctype, acc=acc,
               load=loader(x.dtype, acc), elem=row_element(inner), cmp=">" if node.op == "argmax" else "<",
               idx_t=index_type(rows))
    return _row_kernels(node, kernel_name, "argreduce.cu.j2", ctx, x)
