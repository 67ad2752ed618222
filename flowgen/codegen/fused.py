"""Render ``fused`` nodes: elementwise chains, multi-tensor updates, reductions with
prologue/epilogue; and the epilogue lines of the fused nodes anchored on a GEMM or a conv
(kernels/gemm.py, kernels/conv.py render those).

Each body node becomes one line ``const <type> vK = <expr>;`` where `<expr>`
is the op's `Elementwise` expression with its inputs substituted. Values are
held in their compute type (float for float32/float16/bfloat16 storage) and
converted once at load and store.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from flowgen import dtype as dt
from flowgen.codegen.kernel import Blocks, BufferArg, Kernel, RenderContext, every_output_over
from flowgen.codegen.target import block_segments, chosen_shape, reduce_block, serial_blocks, target_blocks
from flowgen.codegen.templates import get_template
from flowgen.ir.graph import Value
from flowgen.ops.lowering import Reduction, View, cpp_literal
from flowgen.ops.registry import get_op

COMPUTE_TYPE = {dt.float32: "float", dt.float16: "float", dt.bfloat16: "float", dt.float64: "double",
                dt.int64: "long long", dt.int32: "int", dt.int16: "int", dt.int8: "int", dt.uint8: "int",
                dt.bool_: "bool"}

IDENTITY = {"sum": "0", "max": "-INFINITY", "min": "INFINITY"}


def sum_accumulator(dtype) -> str:
    """The C++ type a sum of `dtype` accumulates in: float32 sums in double, as the eager `sum`
    (ops/reduction.py) does, so that any summation order rounds to the same float32 (almost
    always: bit for bit) and a mean over nearly-constant values is as exact as eager's. LayerNorm
    of a constant row amplifies a one-ulp error of its mean by 1/sqrt(eps)."""
    return "double" if dtype == dt.float32 else COMPUTE_TYPE[dtype]


def _store(value_dtype, expr: str) -> str:
    if value_dtype == dt.float16:
        return f"__float2half({expr})"
    if value_dtype == dt.bfloat16:
        return f"__float2bfloat16({expr})"
    return expr


def _load(value_dtype, expr: str) -> str:
    if value_dtype == dt.float16:
        return f"__half2float({expr})"
    if value_dtype == dt.bfloat16:
        return f"__bfloat162float({expr})"
    return expr


def scalar_constant(value, producers):
    """The literal of a one-element constant value, or None if `value` is not one."""
    node = producers.get(value)
    if node is None or node.op != "constant" or value.numel != 1:
        return None
    return cpp_literal(np.asarray(node.attrs["value"]).reshape(()).item(), double=value.dtype == dt.float64)


def strides(shape) -> list:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return list(reversed(out))


def broadcast_offset(in_shape, out_shape, coord_names) -> str:
    """Offset into a tensor of `in_shape` broadcast to `out_shape`, from per-dim coordinates."""
    in_shape = tuple(in_shape)
    lead = len(out_shape) - len(in_shape)
    terms = []
    for d, (size, stride) in enumerate(zip(in_shape, strides(in_shape))):
        if size == 1:
            continue
        c = coord_names[lead + d]
        terms.append(c if stride == 1 else f"{c} * {stride}LL")
    return " + ".join(terms) if terms else "0"


@dataclass(frozen=True)
class Coordinate:
    """Coordinate `name` of a flat index into a row-major shape: `(index / stride) % size`, with
    no modulo for the outermost dim."""
    name: str
    stride: int
    size: int
    outermost: bool

    def expr(self, index: str) -> str:
        expr = index if self.stride == 1 else f"{index} / {self.stride}LL"
        return expr if self.outermost else f"({expr}) % {self.size}LL"

    def line(self, index: str) -> str:
        return f"const long long {self.name} = {self.expr(index)};"


def coordinates(shape, prefix: str) -> list:
    """The Coordinate of each dim of `shape`, named prefix0, prefix1, ..."""
    return [Coordinate(f"{prefix}{d}", stride, size, d == 0)
            for d, (size, stride) in enumerate(zip(shape, strides(shape)))]


def coordinate_lines(shape, index: str, prefix: str) -> list:
    """`const long long c0 = (i / 12) % 4;` ... for each dim of `shape`."""
    return [c.line(index) for c in coordinates(shape, prefix)]


# Kernel parameters named after a graph input or state (names the user chose) start with this, and
# no other identifier in generated code does (tests/test_deploy.py checks the templates, the
# runtime headers and codegen's code strings): a state `b.base` may not become a template's local
# (`b_base`), a keyword or a macro.
GRAPH_VALUE_PREFIX = "g_"


def value_param_name(v, producers) -> str:
    """A C identifier for the kernel parameter carrying `v`: a graph input's or state's own name
    behind GRAPH_VALUE_PREFIX (module path, `model.0.weight` -> `g_model_0_weight`; optimizer
    state, `g_optim0_group0_lr`), a view's or a converted or transposed copy's source
    (`g_model_0_weight_bfloat16`), else the op that produced it (`relu_out`). Every name holds an
    underscore, so it shadows neither a math function (`exp`) nor a kernel's one-word locals (`i`,
    `n`, `val`), and a name from the graph can equal no identifier the templates declare."""
    node = producers.get(v)
    if node is None:
        return GRAPH_VALUE_PREFIX + (re.sub(r"_+", "_", re.sub(r"\W", "_", v.name)).strip("_") or "value")
    body = getattr(node, "body", None) or []
    made_by = next((b for b in body if v in b.outputs), node)
    view = isinstance(get_op(made_by.op).lowering, View)
    while view and any(made_by.inputs[0] in b.outputs for b in body):   # a view of a value computed here
        made_by = next(b for b in body if made_by.inputs[0] in b.outputs)
        view = isinstance(get_op(made_by.op).lowering, View)
    made_as = get_op(made_by.op).extra
    converted, transposed = made_as["cast_scale"] == "cast", made_as["fusion"] == "transpose"
    source = made_by.inputs[0] if view or converted or transposed else None
    if source is not None and not any(source in b.outputs for b in body):
        # a view of another buffer is that buffer; a copy, converted or transposed, is named after
        # it: model_0_weight_bfloat16
        name = value_param_name(source, producers)
        return name if view else f"{name}_{v.dtype.name if converted else 'permuted'}"
    return f"{made_by.op}_out"


def unique_name(name: str, taken: set) -> str:
    """`name`, or `name_2`, `name_3`, ... the first not in `taken` (which it joins)."""
    k, unique = 2, name
    while unique in taken:
        unique, k = f"{name}_{k}", k + 1
    taken.add(unique)
    return unique


DECLARED_NAME = re.compile(r"const [\w ]+ (\w+) = ")


def declared_if_read(declarations, code) -> list:
    """The `const long long <name> = ...;` lines of `declarations` whose name `code` (lines)
    reads: a coordinate no load uses is not computed (and leaves no unused variable)."""
    read = names_read(code)
    return [d for d in declarations if DECLARED_NAME.match(d)[1] in read]


def names_read(code) -> set:
    """Every word of `code` (lines): the names it may read."""
    return set(re.findall(r"\w+", "\n".join(code)))


def _unwrapped(text: str) -> str:
    """`text` without parentheses around the whole of it: `(a + b)` -> `a + b`; `(a) + (b)` and
    `(a, b)` (a comma would end the declaration it initialises) stay."""
    while text.startswith("(") and text.endswith(")"):
        depth = 0
        for pos, ch in enumerate(text):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if (depth == 0 and pos < len(text) - 1) or (depth == 1 and ch == ","):
                return text
        text = text[1:-1]
    return text


class Emitter:
    """Turns body nodes into C++ lines; tracks params and value -> C variable names."""

    def __init__(self, node, producers, stream_values=None, names=None, buffered=()):
        self.node = node
        self.producers = producers
        names = names or {}   # input Value -> parameter name, where a template expects one (x, w)
        # `buffered`: inputs the kernel reads through a pointer even if they are one-element
        # constants (a GEMM's operands); program.py uploads such a constant.
        self.stream_values = stream_values or {}   # rng state name -> its Value
        self.streams: set = set()
        self.params: list = []
        self.args: list = []
        self.var: dict = {}
        self.counter = 0
        self.param_name: dict = {}   # input Value -> the name of the parameter it arrives in
        self.out_name: dict = {}     # output Value -> the name of the parameter it is stored through
        taken = set(names.values())
        for v in node.inputs:   # scalar constants are inlined, except where a template reads a buffer
            if scalar_constant(v, producers) is not None and v not in buffered:
                continue
            self.param_name[v] = names.get(v) or unique_name(value_param_name(v, producers), taken)
            self.params.append(f"const {v.dtype.ctype}* __restrict__ {self.param_name[v]}")
            self.args.append(BufferArg(v, f"const {v.dtype.ctype}*"))
        for v in node.outputs:   # named as the kernels reading it name it
            self.out_name[v] = unique_name(value_param_name(v, producers), taken)
            self.params.append(f"{v.dtype.ctype}* __restrict__ {self.out_name[v]}")
            self.args.append(BufferArg(v, f"{v.dtype.ctype}*"))

    def fresh(self) -> str:
        self.counter += 1
        return f"v{self.counter - 1}"

    def load_inputs(self, values, offset_of) -> list:
        """Load each external input once (inline scalar constants)."""
        lines = []
        for v in self.node.inputs:
            if v not in values or v in self.var:
                continue
            const = scalar_constant(v, self.producers)
            if const is not None:
                self.var[v] = const
                continue
            name = self.fresh()
            lines.append(f"const {COMPUTE_TYPE[v.dtype]} {name} = "
                         f"{_load(v.dtype, f'{self.param_name[v]}[{offset_of(v)}]')};")
            self.var[v] = name
        return lines

    def random_stream(self, attrs: dict) -> dict:
        """Seed and offset of a random op, as C++ reading the graph's rng state (see passes/random_streams)."""
        stream = attrs["stream"]
        if stream not in self.streams:
            self.streams.add(stream)
            self.params.append(f"const long long* __restrict__ {stream}")
            self.args.append(BufferArg(self.stream_values[stream], "const long long*"))
        return {"seed": f"(unsigned long long){stream}[0]",
                "offset": f"(unsigned long long)({stream}[1] + {cpp_literal(attrs['offset'])})"}

    def compute(self, body_node, index_var: str = "i") -> str:
        op = get_op(body_node.op)
        if isinstance(op.lowering, View):   # a reshape moves no element: same variable
            self.var[body_node.output] = self.var[body_node.inputs[0]]
            return f"// {body_node.op}: {body_node.inputs[0].type_str} -> {body_node.output.type_str}"
        expanded = self.random_stream(body_node.attrs) if "stream" in body_node.attrs else None
        text = op.lowering.render([self.var[v] for v in body_node.inputs], body_node.attrs, idx=index_var,
                                  double=body_node.output.dtype == dt.float64, expanded=expanded)
        out = body_node.output
        name = self.fresh()
        self.var[out] = name
        ctype = COMPUTE_TYPE[out.dtype]
        if body_node.inputs and all(COMPUTE_TYPE[v.dtype] == ctype for v in body_node.inputs):
            return f"const {ctype} {name} = {_unwrapped(text)};"   # operands of the result's type: no cast
        return f"const {ctype} {name} = ({ctype})({text});"

    def stores(self, values, index: str) -> list:
        lines = []
        for v in self.node.outputs:
            if v in values:
                lines.append(f"{self.out_name[v]}[{index}] = {_store(v.dtype, self.var[v])};")
        return lines


def _flat_index_coordinates(body, inputs, numel: int, producers, index: str = "i", prefix: str = "c") -> tuple:
    """(Coordinates, offset function) for reading `inputs` in a fused body whose nodes all have
    `numel` elements and run at the same flat index `index`: full-size inputs are read at the flat
    index; a broadcast input at the coordinates of the index in the shape of the node that reads
    it (a reshape may sit between the nodes)."""
    reader_shape = {}
    for b in body:
        for v in b.inputs:
            reader_shape.setdefault(v, tuple(b.output.shape))
    broadcast = [v for v in inputs if v.numel != numel and scalar_constant(v, producers) is None]
    index_coords, coords = [], {}
    for k, shape in enumerate(dict.fromkeys(reader_shape[v] for v in broadcast)):
        name = prefix if k == 0 else f"{prefix}{k}_"
        index_coords += coordinates(shape, name)
        coords[shape] = [f"{name}{d}" for d in range(len(shape))]

    def offset(v):
        return index if v.numel == numel else broadcast_offset(v.shape, reader_shape[v], coords[reader_shape[v]])

    return index_coords, offset


def _flat_index_reads(body, inputs, numel: int, producers, index: str = "i", prefix: str = "c") -> tuple:
    """_flat_index_coordinates with the coordinates as lines declaring them."""
    index_coords, offset = _flat_index_coordinates(body, inputs, numel, producers, index, prefix)
    return [c.line(index) for c in index_coords], offset


def elementwise_coordinates(em, body, inputs, outputs, producers) -> tuple:
    """(shape, the Coordinates the lines read, body lines) of an elementwise body evaluated at
    flat index `i`."""
    shape = tuple(body[-1].output.shape)
    index_coords, offset = _flat_index_coordinates(body, inputs, int(np.prod(shape, dtype=np.int64)), producers)
    lines = em.load_inputs(set(inputs), offset)
    for b in body:
        lines.append(em.compute(b))
    lines += em.stores(set(outputs), "i")
    read = names_read(lines)
    return shape, [c for c in index_coords if c.name in read], lines


def _elementwise_lines(em, body, inputs, outputs, producers) -> tuple:
    """(shape, coordinate lines, body lines) of an elementwise body evaluated at flat index `i`."""
    shape, index_coords, lines = elementwise_coordinates(em, body, inputs, outputs, producers)
    return shape, [c.line("i") for c in index_coords], lines


def render_elementwise(node, ctx: RenderContext) -> list:
    body = node.body
    producers = ctx.producers
    em = Emitter(node, producers, ctx.stream_values)
    shape, index_lines, lines = _elementwise_lines(em, body, node.inputs, node.outputs, producers)
    numel = int(np.prod(shape, dtype=np.int64))
    ops = [b.op for b in body]
    name = ctx.kernel_name(node, ops)
    source = get_template("elementwise").render(
        name=name, comment=f"{node.scope or 'graph'}: elementwise", ops=ops,
        shape_text=f"[{', '.join(map(str, shape))}]", params=em.params, numel=numel,
        index_lines=index_lines, body_lines=lines)
    block = 256
    return [Kernel(name, source, em.args, (Blocks(numel, block, 4096), 1, 1), (block, 1, 1), 0, False,
                   f"{node.scope or 'graph'}: {', '.join(ops)}", ops,
                   in_place=every_output_over(node.outputs, [v for v in node.inputs if v.numel == numel]))]


REDUCE_SPLIT_MIN_PER_THREAD = 32   # a split reduction's blocks still reduce this many elements per thread


def render_segments(node, ctx: RenderContext) -> list:
    """Independent elementwise bodies (parameter updates) in one launch: segment s owns a range
    of blocks and strides over its own elements."""
    producers = ctx.producers
    em = Emitter(node, producers, ctx.stream_values)
    segments, ops, in_place = [], [], set()
    for positions in node.attrs["segments"]:
        body = [node.body[p] for p in positions]
        inside = {v for b in body for v in b.outputs}
        inputs = [v for v in node.inputs if any(v in b.inputs for b in body)]
        em.var = {v: n for v, n in em.var.items() if scalar_constant(v, producers) is not None}
        outputs = [v for v in node.outputs if v in inside]
        shape, index_lines, lines = _elementwise_lines(em, body, inputs, outputs, producers)
        numel = int(np.prod(shape, dtype=np.int64))
        in_place |= every_output_over(outputs, [v for v in inputs if v.numel == numel])   # within the segment
        segments.append({"numel": numel, "index_lines": index_lines, "body_lines": lines,
                         "what": f"{body[-1].scope}: {', '.join(b.op for b in body)} over [{', '.join(map(str, shape))}]"})
        ops += [b.op for b in body]
    block = 1 if serial_blocks() else 256
    blocks = block_segments(segments, block)
    name = ctx.kernel_name(node, ["multi_tensor"] + sorted(set(ops)))
    source = get_template("elementwise").render(name=name, comment=f"{node.scope or 'graph'}: multi-tensor",
                                                ops=sorted(set(ops)), params=em.params, segments=segments)
    return [Kernel(name, source, em.args, (blocks, 1, 1), (block, 1, 1), 0, False,
                   f"{node.scope or 'graph'}: {len(segments)} segments of {', '.join(sorted(set(ops)))}", ops,
                   in_place=frozenset(in_place), horizontal=True)]


def _reduce_geometry(red):
    """(input shape, keepdim output shape, reduced dims) of a reduction node."""
    in_shape = tuple(red.inputs[0].shape)
    if red.op == "sum_to":
        target = tuple(red.attrs["shape"])
        target = (1,) * (len(in_shape) - len(target)) + target
        dims = tuple(d for d in range(len(in_shape)) if target[d] == 1 and in_shape[d] != 1)
    else:
        dims = red.attrs.get("dims")
        dims = tuple(range(len(in_shape))) if dims is None else tuple(sorted(d % max(len(in_shape), 1) for d in (dims if isinstance(dims, (tuple, list)) else (dims,))))
    out_keep = tuple(1 if d in dims else s for d, s in enumerate(in_shape))
    return in_shape, out_keep, dims


def _combine_fn(combine: str, acc_type: str) -> str:
    """How two partial results combine in the kernel (_common.j2's `combine`): "+" or a function;
    floating max/min propagate NaN (flowgen_max/flowgen_min, runtime_cpp/flowgen_cuda_prelude.h)."""
    if combine == "sum":
        return "+"
    return f"flowgen_{combine}" if acc_type in ("float", "double") else combine


def _split_reduction_body(body):
    """(loop nodes computing the reductions' inputs, reduction nodes, epilogue nodes). The loop
    nodes whose values the epilogue reads come first in the epilogue again: loop variables are
    out of scope after the loop."""
    reds = [b for b in body if isinstance(get_op(b.op).lowering, Reduction)]
    produced_by = {o: b for b in body for o in b.outputs}
    in_loop, todo = set(), [r.inputs[0] for r in reds]
    while todo:
        b = produced_by.get(todo.pop())
        if b is None or id(b) in in_loop or any(b is r for r in reds):
            continue
        in_loop.add(id(b))
        todo.extend(b.inputs)
    loop = [b for b in body if id(b) in in_loop]
    epilogue = [b for b in body if id(b) not in in_loop and not any(b is r for r in reds)]
    return loop, reds, _loop_values_read_after(loop, epilogue, reds[0].output.numel) + epilogue


def _loop_values_read_after(loop, epilogue, numel: int) -> list:
    """The loop nodes computing what the epilogue reads (and what they read), to compute again
    per output element. Fusion joins such a read only for a value with one element per output,
    e.g. a reduction over dims of size 1 (amax's tie mask beside log_softmax's sum, fuzz seed
    701619); a value with one element per reduced element cannot be read there."""
    produced_by = {o: b for b in loop for o in b.outputs}
    needed, todo = set(), [v for b in epilogue for v in b.inputs if v in produced_by]
    while todo:
        v = todo.pop()
        b = produced_by.get(v)
        if b is None or id(b) in needed:
            continue
        if v.numel != numel:
            raise AssertionError(f"a reduction's epilogue reads %{v.name} {list(v.shape)} ({b.op}), one value per "
                                 f"reduced element, not per output ({numel})")
        needed.add(id(b))
        todo.extend(b.inputs)
    return [b for b in loop if id(b) in needed]


def reduce_splits(outputs: int, reduce_size: int, block: int) -> int:
    """Blocks per output: 1 when there are outputs enough to fill the GPU; else enough to reach
    the target's block count, each still reducing at least REDUCE_SPLIT_MIN_PER_THREAD elements per
    thread."""
    blocks = target_blocks()
    if 2 * outputs >= blocks:
        return 1
    return max(1, min(-(-blocks // outputs), reduce_size // (block * REDUCE_SPLIT_MIN_PER_THREAD), 1024))


class _Part:
    """The inputs and outputs one kernel of a split reduction takes (an `Emitter` node)."""

    def __init__(self, inputs, outputs):
        self.inputs, self.outputs = list(inputs), list(outputs)


def _prologue_offset(prologue, in_shape, full_coords, producers):
    """Where a reduction's loop reads each input: at the loop's coordinates of the reduced
    tensor (broadcast where smaller), except a full-size input of another shape, read before a
    reshape (a [2, 12] gradient reshaped to the reduced [2, 3, 4]): at the element's flat index
    `flat`. Fusion lets only full-size or one-element inputs join behind a reshape."""
    numel = int(np.prod(in_shape, dtype=np.int64))
    for b in prologue:
        if tuple(b.output.shape) != tuple(in_shape):
            for v in b.inputs:
                if v.numel not in (1, numel) and scalar_constant(v, producers) is None:
                    raise AssertionError(f"{b.op} in a reduction prologue reads %{v.name} {list(v.shape)} "
                                         f"broadcast behind a reshape of the reduced {list(in_shape)}")

    def offset(v):
        if v.numel == numel and tuple(v.shape) != tuple(in_shape):
            return "flat"
        return broadcast_offset(v.shape, in_shape, full_coords)

    return offset


def render_reduction(node, ctx: RenderContext) -> list:
    """One or more reductions over the same elements (BatchNorm's sum(g) and sum(g * xhat)) in one
    pass: the loop computes their inputs (prologue), each keeps an accumulator, the epilogue
    runs per output element on the reduced values. With few outputs and many elements each
    (a whole-tensor sum, BatchNorm over few channels) the pass is split over several blocks per
    output writing partial results, and a second kernel combines them and runs the epilogue."""
    body = node.body
    producers, stream_values = ctx.producers, ctx.stream_values
    prologue, reds, epilogue = _split_reduction_body(body)
    red = reds[0]
    in_shape, out_keep, dims = _reduce_geometry(red)
    if any(_reduce_geometry(r) != (in_shape, out_keep, dims) for r in reds[1:]):
        raise AssertionError(f"fused reductions over different elements in {node.scope or 'graph'}")
    reduce_shape = [in_shape[d] for d in dims]
    reduce_size = int(np.prod(reduce_shape, dtype=np.int64))
    out_shape = tuple(red.output.shape)
    numel_out = max(int(np.prod(out_shape, dtype=np.int64)), 1)
    # On the cpu target (target.serial_blocks) one thread per block reduces its elements in order.
    # The block and the splits are chosen for the sizes of target.chosen_shape (a dynamic step's
    # maximum: the kernels at smaller sizes must be the same program but for sizes).
    chosen_in, chosen_out = chosen_shape(red.inputs[0]), chosen_shape(red.output)
    chosen_size = (int(np.prod([chosen_in[d] for d in dims], dtype=np.int64))
                   if len(chosen_in) == len(in_shape) else reduce_size)
    serial = serial_blocks()
    block = 1 if serial else reduce_block(chosen_size)
    splits = reduce_splits(max(int(np.prod(chosen_out, dtype=np.int64)), 1), chosen_size, block)

    prologue_values = {v for b in prologue for v in b.inputs} | {r.inputs[0] for r in reds}
    prologue_values -= {o for b in prologue for o in b.outputs}
    inside = {o for b in body for o in b.outputs}
    epilogue_inputs = {v for b in epilogue for v in b.inputs} - inside
    if splits == 1:
        em_loop = em_epi = Emitter(node, producers, stream_values)
    else:
        em_loop = Emitter(_Part([v for v in node.inputs if v in prologue_values], []), producers, stream_values)
        em_epi = Emitter(_Part([v for v in node.inputs if v in epilogue_inputs], node.outputs), producers,
                         stream_values)

    kept = [d for d in range(len(in_shape)) if d not in dims]
    kept_shape = [in_shape[d] for d in kept]
    out_coordinates = coordinate_lines(kept_shape, "o", "k") if kept else []
    in_coordinates = coordinate_lines(reduce_shape, "j", "r") if dims else []
    coord = {}
    for pos, d in enumerate(kept):
        coord[d] = f"k{pos}"
    for pos, d in enumerate(dims):
        coord[d] = f"r{pos}"
    full_coords = [coord[d] for d in range(len(in_shape))]

    prologue_lines = em_loop.load_inputs(prologue_values, _prologue_offset(prologue, in_shape, full_coords, producers))
    for b in prologue:
        prologue_lines.append(em_loop.compute(b, index_var="flat"))
    sources = [em_loop.var[r.inputs[0]] for r in reds]
    # Variables declared inside the loop are out of scope in the epilogue (literals stay usable).
    em_epi.var = {v: n for v, n in em_loop.var.items() if scalar_constant(v, producers) is not None}
    em_epi.counter = em_loop.counter

    red_ctx = []
    for k, (r, source_var) in enumerate(zip(reds, sources)):
        lowering = get_op(r.op).lowering
        combine = lowering.combine
        value_type = COMPUTE_TYPE[r.output.dtype]
        acc_type = sum_accumulator(r.output.dtype) if combine == "sum" else value_type
        reduced_var = em_epi.fresh()
        em_epi.var[r.output] = reduced_var
        identity = IDENTITY[combine] if acc_type in ("float", "double") else \
            {"sum": "0", "max": "LLONG_MIN", "min": "LLONG_MAX"}[combine]
        red_ctx.append({"combine": combine, "acc_type": acc_type, "value_type": value_type, "identity": identity,
                        "source_var": source_var,
                        # a mean divides the accumulated sum by the count before rounding it once
                        "divisor": f"{float(reduce_size)!r}" if lowering.average else None,
                        "reduced_var": reduced_var, "fn": _combine_fn(combine, acc_type), "scratch": f"partials{k}",
                        "block_item": (f"acc{k}", f"partial{k}", _combine_fn(combine, acc_type))})
    epi_numel = int(np.prod(out_shape, dtype=np.int64))
    epilogue_index_lines, epi_offset = _flat_index_reads(reds + epilogue, epilogue_inputs, epi_numel, producers,
                                                         prefix="e")
    epilogue_lines = em_epi.load_inputs(epilogue_inputs, epi_offset)
    for b in epilogue:
        epilogue_lines.append(em_epi.compute(b, index_var="i"))
    epilogue_lines += em_epi.stores(set(node.outputs), "i")

    ops = [b.op for b in body]
    name = ctx.kernel_name(node, ops)
    # `flat` is the input element's linear index, for prologue ops that use {idx} (dropout).
    flat_line = declared_if_read([f"const long long flat = {broadcast_offset(in_shape, in_shape, full_coords)};"],
                                 prologue_lines)
    in_index_lines = declared_if_read(in_coordinates, prologue_lines + flat_line) + flat_line
    out_index_lines = declared_if_read(out_coordinates, prologue_lines + flat_line)
    if out_index_lines:
        out_index_lines.insert(0, f"// output element o -> coordinates of the kept dims {tuple(kept)}")
    epilogue_index_lines = declared_if_read(epilogue_index_lines, epilogue_lines)
    common = dict(comment=f"{node.scope or 'graph'}: reduction", ops=ops, reds=red_ctx,
                  in_shape_text=str(list(in_shape)), out_shape_text=str(list(out_shape)), reduce_size=reduce_size,
                  out_index_lines=out_index_lines, in_index_lines=in_index_lines,
                  prologue_lines=prologue_lines, epilogue_index_lines=epilogue_index_lines,
                  epilogue_lines=epilogue_lines, splits=splits)
    in_place = every_output_over(node.outputs, [v for v in epilogue_inputs
                                                if v.numel == epi_numel and v not in prologue_values])
    what = f"{node.scope or 'graph'}: {', '.join(ops)}"
    if splits == 1:
        source = get_template("reduction").render(name=name, stage="full", params=em_loop.params, block=block,
                                                  **common)
        return [Kernel(name, source, em_loop.args, (numel_out, 1, 1), (block, 1, 1), 0, block > 1, what, ops,
                       in_place=in_place)]
    scratch = [Value(f"{r.output.name}_partials", (numel_out * splits,),
                     dt.float64 if c["acc_type"] == "double" else dt.int64 if c["acc_type"] == "long long"
                     else dt.float32) for r, c in zip(reds, red_ctx)]
    for v, c in zip(scratch, red_ctx):
        em_loop.params.append(f"{v.dtype.ctype}* __restrict__ {c['scratch']}")
        em_loop.args.append(BufferArg(v, f"{v.dtype.ctype}*"))
        em_epi.params.insert(0, f"const {v.dtype.ctype}* __restrict__ {c['scratch']}")
        em_epi.args.insert(0, BufferArg(v, f"const {v.dtype.ctype}*"))
    partial = get_template("reduction").render(name=f"{name}_partial", stage="partial", params=em_loop.params,
                                               block=block, **common)
    final_block = 1 if serial else reduce_block(splits)
    final = get_template("reduction").render(name=name, stage="final", params=em_epi.params, block=final_block,
                                             **common)
    return [Kernel(f"{name}_partial", partial, em_loop.args, (numel_out, splits, 1), (block, 1, 1), 0, block > 1,
                   f"{what} (partial sums, {splits} blocks per output)", ops),
            Kernel(name, final, em_epi.args, (numel_out, 1, 1), (final_block, 1, 1), 0, final_block > 1,
                   f"{what} (combine {splits} partials)", ops, in_place=in_place)]


def anchor_epilogue(em, body_after, out_value, out_shape, producers, index_line):
    """Lines that finish one output element of an anchor kernel (GEMM, conv): load the
    epilogue's other inputs at (broadcast) index `i`, evaluate its ops, store the outputs."""
    externals = {v for b in body_after for v in b.inputs} - {o for b in em.node.body for o in b.outputs}
    lines = [index_line] if index_line else []
    numel = int(np.prod(out_shape, dtype=np.int64))
    index_lines, offset = _flat_index_reads(body_after, externals, numel, producers, prefix="e")
    em.var[out_value] = "val"
    body_lines = em.load_inputs(externals, offset)
    for b in body_after:
        body_lines.append(em.compute(b))
    body_lines += em.stores(set(em.node.outputs), "i")
    lines += declared_if_read(index_lines, body_lines) + body_lines
    pointwise = frozenset(v for v in externals if v.numel == numel)
    return lines, pointwise
