"""Fusion: group primitive nodes into kernels.

* Chains of elementwise nodes with the same output shape become one
  ``fused`` node of kind ``elementwise`` (inputs may broadcast).
* A reduction absorbs the elementwise group that only feeds it (prologue) and
  the elementwise nodes of its output shape that follow it (epilogue): kind
  ``reduction``.
* A matmul reads transposed operands in place (absorbing the permute) and takes
  the elementwise nodes of its output shape that follow it (bias add,
  activation) as an epilogue: kind ``gemm``.
* A forward conv takes the same kind of epilogue (bias, folded BatchNorm shift,
  activation, residual add): kind ``conv``.
* A reshape inside such a chain is free (elements keep their flat index), so
  nodes after it join too when their other inputs are flat or scalar.
* Independent reductions over the same elements share one pass (one group with
  several reduction nodes: BatchNorm's backward sums).
* Independent one-element groups share a kernel; optimizer update groups that
  joined no anchor (conv weights) become one kind ``multi`` node whose
  ``segments`` run side by side (a multi-tensor update).
* Every other elementwise or reduction node becomes a one-node fused group, so
  codegen sees kernels only as ``fused`` nodes or template-family nodes.
* Then a residual add left as a kernel of its own runs inside a LayerNorm row kernel: feeding a
  layer_norm it becomes ``add_layer_norm`` (which also writes the sum); adding a gradient to
  layer_norm_backward's dx it becomes that op's ``residual`` operand.

What an op is to this pass is a property declared with its defop (flowgen/ops/registry.py
PROPERTIES): its ``fusion`` role (elementwise, reduction, view, gemm, conv, transpose, or None:
a kernel of its own), whether it is a ``residual_add`` and its ``cast_scale`` part; only the
LayerNorm rewrite above names the ops it rewrites.

Four families can be switched off (``graph.config.allow_fuse_*`` and
``enable_multi_tensor_update``, all on by default):

* ``model_update=False``: optimizer update nodes (scope ``optim...``/``grad_scaler``) form
  kernels of their own: they join no gradient kernel (reduction, GEMM epilogue); the update
  of one parameter stays one kernel.
* ``multi_tensor_update=False``: updates that joined no gradient kernel are not merged into
  ``multi`` kernels: each keeps a kernel of its own.
* ``add_to_output=False``: an ``add`` of two full-size tensors (a residual) does not join
  a conv or GEMM epilogue (a bias add, which broadcasts, still does).
* ``cast_scale=False``: a ``cast`` and a multiply/divide by a one-element tensor (a scale)
  each run as their own kernel: they join no neighbour and no neighbour joins them (those
  of the optimizer update belong to the model-update family, as in OneFlow).

A group is emitted at the position of its last member; a node may only join
a group if no node outside the group, positioned before it, reads a value the
group produces (so the order stays valid).
"""
from __future__ import annotations

from flowgen import dtype as dt
from flowgen.ir.graph import Node
from flowgen.ops.registry import get_op


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _swaps_last_two(dims) -> bool:
    n = len(dims)
    return n >= 2 and tuple(dims) == tuple(range(n - 2)) + (n - 1, n - 2)


def _kind(node) -> str:
    """The node's op's fusion role, "other" for an op that is a kernel of its own."""
    return get_op(node.op).extra["fusion"] or "other"


def _transposes_gemm_result(node, group, producer_index, users, live_out) -> bool:
    """`node` transposes the bare result of a GEMM group (no epilogue yet, no other reader)."""
    v = node.inputs[0]
    return (group is not None and group.kind == "gemm" and producer_index[v] == group.reduction
            and max(group.members) == group.reduction and v not in live_out and len(users.get(v, [])) == 1)


# Elementwise groups this small are launch-bound: independent ones of one shape share a kernel.
HORIZONTAL_MAX_NUMEL = 1
# Buffers one multi-tensor update kernel may take (8-byte pointers within CUDA's 4 KB of parameters).
MULTI_MAX_POINTERS = 400
# Sibling reductions one kernel computes: on a GPU each keeps a block-wide array of accumulators in
# static shared memory (up to 256 threads x 8 bytes: 2 KB), and a kernel may declare 48 KB. A GPT's
# LayerNorm weight and bias gradients (2 per LayerNorm, 25 LayerNorms in GPT-2) are such siblings.
SIBLING_MAX_REDUCTIONS = 16


class _Group:
    def __init__(self, kind: str, shape: tuple, first: int):
        self.kind = kind
        self.shape = shape        # iteration shape (elementwise) / output shape (reduction epilogue)
        self.members: list = []   # node indices
        self.produced: set = set()
        self.first = first
        self.reduction = None     # index of the reduction node, for kind "reduction"
        self.segments = None      # kind "multi": the member indices of each independent segment
        self.loop_values: set = set()   # kind "reduction": values computed inside the reduction loop
        self.sealed = False       # a cast/scale kept alone (cast_scale=False): nothing joins it


def _is_update(node) -> bool:
    return node.scope.startswith(("optim", "grad_scaler"))


def _is_add_to_output(node) -> bool:
    """A residual add: both operands have the result's full size (a bias broadcasts)."""
    return get_op(node.op).extra["residual_add"] and all(v.numel == node.output.numel for v in node.inputs)


def _is_cast_or_scale(node) -> bool:
    """Outside the optimizer: its casts and scales belong to the model-update family."""
    if _is_update(node):
        return False
    part = get_op(node.op).extra["cast_scale"]
    if part == "scale":
        return sorted(v.numel == 1 for v in node.inputs) == [False, True]
    return part == "cast"


def fuse(graph, enabled: bool = True, model_update: bool = True, add_to_output: bool = True,
         cast_scale: bool = True, multi_tensor_update: bool = True):
    nodes = graph.nodes
    users = graph.users()
    group_of: dict = {}       # node index -> _Group
    producer_index = {v: i for i, n in enumerate(nodes) for v in n.outputs}
    index_of = {id(n): i for i, n in enumerate(nodes)}
    live_out = graph.live_out()
    groups: list = []
    small: dict = {}          # shape -> the latest elementwise group of at most HORIZONTAL_MAX_NUMEL elements

    def only_feeds(prologue: _Group, reduction_node) -> bool:
        for v in prologue.produced:
            if v in live_out:
                return False
            for u in users.get(v, []):
                if u is not reduction_node and group_of.get(index_of[id(u)]) is not prologue:
                    return False
        return True

    def can_join(group: _Group, index: int) -> bool:
        for between in range(group.first, index):
            if group_of.get(between) is group:
                continue
            if any(v in group.produced for v in nodes[between].inputs):
                return False
        return True

    def family_allows(group: _Group, node) -> bool:
        """The switched-off families (see the module docstring) keep `node` out of `group`."""
        if group.sealed or (not cast_scale and _is_cast_or_scale(node)):
            return False
        if not model_update and any(_is_update(nodes[m]) != _is_update(node) for m in group.members):
            return False
        return add_to_output or group.kind not in ("conv", "gemm") or not _is_add_to_output(node)

    def add(group: _Group, index: int):
        group.members.append(index)
        group.produced.update(nodes[index].outputs)
        group_of[index] = group

    def fits(g: _Group, node) -> bool:
        """Can `node` be evaluated at the group's iteration index? Same shape (its inputs may
        broadcast), or same element count with every outside input read at the same flat
        index or a scalar (a reshape in between does not move elements)."""
        if tuple(node.output.shape) == g.shape:
            return True
        n = _numel(g.shape)
        return _numel(node.output.shape) == n and all(
            v in g.produced or v.numel in (1, n) for v in node.inputs)

    def sibling_reduction(g: _Group, i: int):
        """An earlier reduction group over the same elements that node i's group is independent of."""
        node = nodes[i]
        for h in reversed(groups):
            if h.kind != "reduction":
                continue
            first = nodes[h.reduction]
            if (first.op != node.op or first.attrs != node.attrs
                    or tuple(first.inputs[0].shape) != tuple(node.inputs[0].shape)):
                continue
            if any(v in h.produced for m in g.members for v in nodes[m].inputs):
                continue   # depends on it (a variance reading its mean)
            if sum(_kind(nodes[m]) == "reduction" for m in h.members) >= SIBLING_MAX_REDUCTIONS:
                continue   # full
            # nothing outside the two groups may read h's results before the merged kernel runs
            if not any(group_of.get(b) not in (g, h) and any(v in h.produced for v in nodes[b].inputs)
                       for b in range(h.first, i)):
                return h
        return None

    def merge_feeders(g: _Group, node):
        """Pull in elementwise groups that exist only to feed `node` (e.g. the two masks of a
        ReLU6 gradient): one kernel instead of several."""
        for v in node.inputs:
            h = group_of.get(producer_index.get(v))
            if h is None or h is g or h.kind != "elementwise" or _numel(h.shape) != _numel(g.shape):
                continue
            if h.sealed or not all(family_allows(g, nodes[m]) for m in h.members):
                continue
            members = set(h.members) | set(g.members)
            if any(w in live_out or any(index_of[id(u)] not in members for u in users.get(w, []))
                   for w in h.produced):
                continue
            if not all(fits(g, nodes[m]) for m in h.members):
                continue
            if g.kind != "elementwise" and min(h.members) < g.reduction:
                continue   # anchored kernels split their body at the anchor: feeders must come after it
            groups.remove(h)
            g.first = min(g.first, h.first)
            for m in h.members:
                add(g, m)

    for i, node in enumerate(nodes):
        kind = _kind(node)
        if kind == "elementwise" or (kind == "view" and enabled):
            shape = tuple(node.output.shape)
            joined = False
            if enabled:
                candidates = []
                for v in node.inputs:
                    p = producer_index.get(v)
                    g = group_of.get(p)
                    # A reduction group takes epilogue nodes that read its result (not its prologue).
                    if g is not None and g not in candidates and fits(g, node) and can_join(g, i) \
                            and family_allows(g, node) \
                            and (g.kind == "elementwise" or (p >= g.reduction and v not in g.loop_values)):
                        candidates.append(g)
                if candidates:
                    # An anchored kernel (reduction, GEMM, conv) first: the elementwise groups
                    # feeding the node can then merge into its epilogue, the other way round they can't.
                    g = min(candidates, key=lambda c: c.kind == "elementwise")
                    add(g, i)
                    joined = True
                    merge_feeders(g, node)
            if not joined and kind == "view":
                continue   # stays a view of its input: no kernel
            if not joined and enabled and _numel(shape) <= HORIZONTAL_MAX_NUMEL:
                # Tiny independent work (each BatchNorm's num_batches_tracked += 1) shares one
                # kernel with the previous tiny group of its shape when nothing in between reads it.
                h = small.get(shape)
                if h is not None and h in groups and can_join(h, i) and family_allows(h, node):
                    add(h, i)
                    joined = True
            if not joined:
                g = _Group("elementwise", shape, i)
                g.sealed = not cast_scale and _is_cast_or_scale(node)
                groups.append(g)
                add(g, i)
                if _numel(shape) <= HORIZONTAL_MAX_NUMEL:
                    small[shape] = g
        elif kind == "reduction":
            g = _Group("reduction", tuple(node.output.shape), i)
            g.reduction = i
            src = node.inputs[0]
            prologue = group_of.get(producer_index.get(src))
            if (enabled and prologue is not None and prologue.kind == "elementwise"
                    and prologue.shape == tuple(src.shape) and only_feeds(prologue, node)
                    and family_allows(prologue, node)):
                # Absorb the prologue group: its values are only read by this reduction.
                groups.remove(prologue)
                g.first = prologue.first
                for m in prologue.members:
                    add(g, m)
                g.loop_values |= prologue.produced
            add(g, i)
            h = sibling_reduction(g, i) if enabled else None
            if h is None:
                groups.append(g)
            else:
                # One pass over the same elements computes both (BatchNorm's sum(g), sum(g * xhat)).
                h.first = min(h.first, g.first)
                h.loop_values |= g.loop_values
                for m in g.members:
                    add(h, m)
        elif kind == "conv" and enabled:
            # Conv anchor: elementwise consumers of its output run in its epilogue.
            g = _Group("conv", tuple(node.output.shape), i)
            g.reduction = i
            groups.append(g)
            add(g, i)
        elif kind == "gemm" and enabled:
            # GEMM anchor: transposes that only feed it are read in place (prologue), and
            # elementwise consumers of its output (bias, activation) join as the epilogue.
            g = _Group("gemm", tuple(node.output.shape), i)
            g.reduction = i
            for v in node.inputs:
                p = producer_index.get(v)
                if (p is not None and _kind(nodes[p]) == "transpose" and _swaps_last_two(nodes[p].attrs["dims"])
                        and group_of.get(p) is None and v not in live_out
                        and all(u is node for u in users.get(v, []))):
                    add(g, p)
                    g.first = min(g.first, p)
            groups.append(g)
            add(g, i)
        elif (kind == "transpose" and enabled and _swaps_last_two(node.attrs["dims"])
              and _transposes_gemm_result(node, group_of.get(producer_index.get(node.inputs[0])),
                                          producer_index, users, live_out)
              and can_join(group_of[producer_index[node.inputs[0]]], i)):
            # (A @ B)^T: the GEMM stores its tile transposed instead of a separate transpose kernel.
            g = group_of[producer_index[node.inputs[0]]]
            g.shape = tuple(node.output.shape)
            add(g, i)
        # template families, views, constants and transposes no GEMM reads stay as they are

    if enabled and multi_tensor_update:
        _merge_update_groups(groups, nodes, users, live_out, group_of)
    # Rebuild the node list: each group at the position of its last member.
    last_of = {max(g.members): g for g in groups}
    new_nodes = []
    for i, node in enumerate(nodes):
        g = group_of.get(i)
        if g is None:
            new_nodes.append(node)
        elif i in last_of:
            new_nodes.append(_fused_node(graph, g, nodes, users))
    fused = graph.copy_with(nodes=new_nodes)
    return _residual_adds_into_layer_norms(fused) if enabled else fused


def _is_update_group(g: _Group, nodes, users, live_out) -> bool:
    """An elementwise group of the optimizer (or GradScaler) whose results are only state updates."""
    if g.kind != "elementwise" or _numel(g.shape) <= HORIZONTAL_MAX_NUMEL:
        return False
    members = {id(nodes[m]) for m in g.members}
    if not all(nodes[m].scope.startswith(("optim", "grad_scaler")) for m in g.members):
        return False
    return all(all(id(u) in members for u in users.get(v, [])) for v in g.produced) and \
        any(v in live_out for v in g.produced)


def _merge_update_groups(groups: list, nodes, users, live_out, group_of: dict):
    """Parameter updates that did not join the kernel making their gradient (a conv weight's)
    run as segments of one kernel after the last of them, like a multi-tensor optimizer step."""
    updates = [g for g in groups if _is_update_group(g, nodes, users, live_out)]
    chunks, pointers = [[]], 0
    for g in updates:   # kernel parameters stay within CUDA's 4 KB: several kernels for big models
        inside = {v for m in g.members for v in nodes[m].outputs}
        n = len({v for m in g.members for v in nodes[m].inputs if v not in inside}) + \
            sum(v in live_out for v in inside)
        if pointers + n > MULTI_MAX_POINTERS and chunks[-1]:
            chunks.append([])
            pointers = 0
        chunks[-1].append(g)
        pointers += n
    for chunk in chunks:
        if len(chunk) < 2:
            continue
        merged = _Group("multi", (), min(g.first for g in chunk))
        merged.segments = [sorted(g.members) for g in chunk]
        for g in chunk:
            groups.remove(g)
            for m in g.members:
                merged.members.append(m)
                merged.produced.update(nodes[m].outputs)
                group_of[m] = merged
        groups.append(merged)


def _fused_node(graph, group: _Group, nodes, users) -> Node:
    members = sorted(group.members)
    body = [nodes[i] for i in members]
    inside = set()
    for n in body:
        inside.update(n.outputs)
    inputs, seen = [], set()
    for n in body:
        for v in n.inputs:
            if v not in inside and v not in seen:
                seen.add(v)
                inputs.append(v)
    member_set = set(id(n) for n in body)
    live_out = graph.live_out()
    outputs = [v for v in inside
               if v in live_out or any(id(u) not in member_set for u in users.get(v, []))]
    outputs.sort(key=lambda v: [o for n in body for o in n.outputs].index(v))
    scopes = []
    for n in body:
        if n.scope and n.scope not in scopes:
            scopes.append(n.scope)
    attrs = {"kind": group.kind, "body": body}
    if group.kind == "multi":   # independent elementwise bodies: positions in `body` per segment
        position = {m: k for k, m in enumerate(members)}
        attrs["segments"] = [[position[m] for m in seg] for seg in group.segments]
    return Node("fused", inputs, outputs, attrs, scope=scopes[0] if scopes else "", loc=body[-1].loc)


def _lone_residual_add(node):
    """(add, views) of a kernel that is one residual add of two float32/float64 operands of the
    result's shape and dtype (a residual stream's sum, or its gradient's), then only views
    (reshapes) of its result; else None."""
    if node.op != "fused" or node.attrs["kind"] != "elementwise":
        return None
    add, *views = node.attrs["body"]
    out = add.output
    if not get_op(add.op).extra["residual_add"] or out.dtype not in (dt.float32, dt.float64):
        return None
    if any(tuple(v.shape) != tuple(out.shape) or v.dtype != out.dtype for v in add.inputs):
        return None
    made = {out}
    for view in views:
        if _kind(view) != "view" or view.inputs[0] not in made:
            return None
        made.add(view.output)
    return add, views


def _residual_adds_into_layer_norms(graph):
    """A residual add that stayed a kernel of its own (it joined no GEMM/conv epilogue or
    elementwise chain) runs inside the layer_norm row kernel next to it:

    * forward, `s = a + b` feeding layer_norm(s): `add_layer_norm(a, b)` reads both addends and
      writes s (still read later: the next residual add, the backward) and the normalized rows;
    * backward, `dx + r` adding the residual stream's gradient r to layer_norm_backward's dx (its
      only reader): `layer_norm_backward(..., residual=r)` writes the sum.

    Where the add joined a GEMM epilogue (nanoGPT's `x + c_proj(y)`) it stays there: the GEMM
    then writes s with one read of x less than add_layer_norm would need."""
    nodes = graph.nodes
    users = graph.users()
    live_out = graph.live_out()
    index = {id(n): i for i, n in enumerate(nodes)}
    producer = {v: i for i, n in enumerate(nodes) for v in n.outputs}
    rewritten: dict = {}   # node index -> the nodes in its place ([] where a node is absorbed)
    for i, node in enumerate(nodes):
        if node.op == "layer_norm":
            total = node.inputs[0]
            p = producer.get(total)
            found = _lone_residual_add(nodes[p]) if p is not None and p not in rewritten else None
            # the sum is written later now: nothing between the add and the layer_norm may read it
            if found is None or found[1] or nodes[p].outputs != [total] or \
                    any(total in nodes[b].inputs for b in range(p + 1, i)):
                continue
            rewritten[p] = []
            rewritten[i] = [Node("add_layer_norm", [*found[0].inputs, *node.inputs[1:]], [total, *node.outputs],
                                 dict(node.attrs), scope=node.scope, loc=node.loc)]
        elif node.op == "layer_norm_backward" and not node.attrs["has_residual"]:
            dx = node.output
            readers = users.get(dx, [])
            if dx in live_out or len(readers) != 1 or index[id(readers[0])] in rewritten:
                continue
            found = _lone_residual_add(readers[0])
            if found is None or found[0].inputs[0] is found[0].inputs[1]:
                continue
            add, views = found
            residual = add.inputs[1] if add.inputs[0] is dx else add.inputs[0]
            rewritten[i] = []
            # the reshapes of the sum stay views of it (no kernel)
            rewritten[index[id(readers[0])]] = [
                Node("layer_norm_backward", [*node.inputs, residual], [add.output],
                     {**node.attrs, "has_residual": True}, scope=node.scope, loc=node.loc), *views]
    return graph.copy_with(nodes=[m for i, n in enumerate(nodes) for m in rewritten.get(i, [n])])
