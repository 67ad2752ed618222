"""Attention of the cpu target as native kernels (templates/cpu_attention.cpp.j2): the emulated
kernels' thread-per-row loops (templates/attention.cu.j2: an online softmax per query row; the
backward's D and dQ per query row, dK and dV per key row), each row's arithmetic in the same
order, so the same numbers, but with the rows spread over the pool, the scores' dot products
computed 16 keys at a time in vector lanes from the operands transposed once per slice, and the
dropout's Philox words drawn four at a time (one Philox4x32 block serves four consecutive keys;
the emulated kernels draw a block per key and keep one word). The backward is one kernel: its
query-row pass keeps D and each (query, key) pair's keep flag in scratch, so the key-row pass
draws no Philox at all.

float32 only: other dtypes keep the emulated kernels.
"""
from __future__ import annotations

from flowgen import dtype as dt
from flowgen.codegen.kernel import BufferArg, Kernel, RenderContext
from flowgen.codegen.kernels.attention import _attention_dropout, _attention_mask_context
from flowgen.codegen.kernels.common import (f32_literal, loader, neg_inf, node_comment, numel_of, shape_text,
                                            storer)
from flowgen.codegen.templates import get_template


def render(node, ctx: RenderContext):
    """An attention / attention_backward node (or a `_dropout` one, which reads its rng state) as
    one native kernel, or None where it is not float32."""
    name, rng = ctx.kernel_name(node, [node.op]), ctx.rng_state(node)
    q, k, v = node.inputs[:3]
    backward = node.op.endswith("_backward")
    plain = 6 if backward else 3   # inputs before the optional mask
    mask = node.inputs[plain] if len(node.inputs) > plain else None
    if any(x.dtype != dt.float32 for x in (*node.inputs[:plain], *node.outputs)):
        return None
    L, E, S, Ev = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
    if S == 0:
        return None   # the emulated renderer says why
    causal = bool(node.attrs["causal"])
    dropout = _attention_dropout(node.attrs, rng is not None)
    shapes = f"{shape_text(q.shape)} x {shape_text(k.shape)}" + (" causal" if causal else "") + \
        (f" mask {shape_text(mask.shape)}" if mask is not None else "") + \
        (f" dropout {node.attrs['dropout_p']}" if dropout else "")
    reads = list(zip(node.inputs[:plain], ("q", "k", "v", "o", "dout", "lse")))
    reads += [(mask, "mask")] if mask is not None else []
    reads += [(rng, "rng")] if rng is not None else []
    writes = list(zip(node.outputs, ("dq_out", "dk_out", "dv_out") if backward else ("y", "lse")))
    if backward:
        what = f"{shapes} -> dQ, dK, dV (query rows then key rows, spread over the pool)"
    else:
        what = f"{shapes} -> {shape_text(node.outputs[0].shape)} + logsumexp (query rows spread over the pool)"
    comment = node_comment(node, what)
    source = get_template("cpu_attention.cpp.j2").render(
        kind="backward" if backward else "forward", name=name, comment=comment,
        params=[f"const {x.dtype.ctype}* __restrict__ {n}" for x, n in reads] +
               [f"{x.dtype.ctype}* __restrict__ {n}" for x, n in writes],
        slices=numel_of(q.shape[:-2]), L=L, S=S, E=E, Ev=Ev, causal=causal,
        causal_text=", causal (keys j <= i)" if causal else "", q_t="float", acc="float", out_t="float",
        load=loader(q.dtype, "float"), store=storer(q.dtype, "float"), exp="expf", log="logf", one="1.0f",
        neg_inf=neg_inf("float"), scale=f32_literal(node.attrs["scale"]),
        keys_of_row=f"(i + 1 < {S} ? i + 1 : {S})" if causal else str(S), first_query="j" if causal else "0",
        dropout=dropout, **_attention_mask_context(mask, q.shape[:-2], L, S, "float"))
    args = [BufferArg(x, f"const {x.dtype.ctype}*") for x, _ in reads] + \
        [BufferArg(x, f"{x.dtype.ctype}*") for x, _ in writes]
    return [Kernel(name, source, args, (1, 1, 1), (1, 1, 1), native=True, comment=comment, ops=[node.op])]
