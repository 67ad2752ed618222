"""One Program for every size of the dynamic dimensions (flowgen/dims.py): fitted from renderings.

The compiler renders a step with every Dim at its maximum (the base Program: its memory plan is
the one used at every size) and again at other sizes (flowgen/dims.py sample_sizes, one Dim at a
time, and all Dims at their minimum when there are several). The renderings must be the same
program but for integer literals: the same kernels, names, arguments and launch shapes, the same
source text token by token. Each integer literal that changes is fitted as a polynomial of the
Dims (batch * seq, an attention's batch * seq * seq), with integer coefficients that every
rendering satisfies exactly; it becomes that
expression of the sizes, which the kernel reads once from one more parameter, `flowgen_dims`
(the executor, program or library writes the sizes there before each step); so is a float
literal holding a whole number (a mean's count), its reciprocal (the mean's gradient) or
n / (n - 1) (BatchNorm's unbiased running variance), cast back to the literal's type. A launch
grid that changes is fitted the same way: an axis the lowering computed as blocks over an extent
(codegen.kernel.Blocks: grid_1d, a GEMM's row tiles) becomes a GridSize, ceil(extent / per_block)
with the extent (and a multiple) fitted, which the executor, program or library computes from the
sizes before launching; another axis must follow a polynomial. The renderings below the maximum
are made with the maximum's kernel forms (codegen/target.py forms_chosen_at), so that they are one
program. Anything else that changes with a size is refused, naming the kernel, its module path
and the Dim: another float literal (two thirds of the batch), a token (a form chosen by size), a
block shape, a buffer that shrinks as a size grows (the plan is made for the maximum). Comments
keep the base's text, whose sizes are the maximum's.
"""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field, replace

import numpy as np

from flowgen import dtype as dt
from flowgen.codegen.kernel import Blocks, BufferArg
from flowgen.codegen.program import IN_PLACE_NOTE
from flowgen.dims import dim_axes
from flowgen.ir.graph import Value

# Code split into what a rendering may change: comments and literals (strings, characters,
# numbers: decimal with an optional fraction, exponent and suffix; hex ones are plain text).
_TOKEN = re.compile(r'//[^\n]*|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\''
                    r'|(?<![\w.])(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?[fFlLuU]*(?![\w.])')
_INT = re.compile(r"(\d+)([lLuU]*)\Z")
DIMS_PARAM = "flowgen_dims"
# An integer literal's suffix -> the cast that keeps a fitted expression (long long) of its type.
_LITERAL_TYPES = {"": "int", "U": "unsigned", "L": "long", "UL": "unsigned long", "LU": "unsigned long",
                  "LL": "", "ULL": "unsigned long long", "LLU": "unsigned long long"}


class DynamicShapeError(NotImplementedError):
    """A step that cannot take its dynamic dimensions at run time (the message says where)."""


@dataclass(frozen=True)
class SizeExpr:
    """b + sum(a * the product of the sizes of the Dims in `dims`) over `terms` ((dims, a), ...):
    a size such as 32 * batch * seq + 1 (`dims` a tuple of Dim places, one repeated for a square)."""

    b: int
    terms: tuple = ()

    def at(self, sizes) -> int:
        """The value for `sizes` (a sequence: the size of Dim k at k)."""
        return self.b + sum(a * math.prod(sizes[k] for k in dims) for dims, a in self.terms)

    @property
    def dims(self) -> set:
        return {k for dims, _ in self.terms for k in dims}

    @property
    def grows(self) -> bool:
        """No size gets smaller as a Dim grows (every coefficient positive)."""
        return all(a > 0 for _, a in self.terms)

    def c_expr(self, names) -> str:
        terms = [" * ".join(([] if a == 1 else [f"{a}LL"]) + [names[k] for k in dims]) for dims, a in self.terms]
        if self.b:
            terms.append(f"{self.b}LL")
        if len(terms) == 1 and " " not in terms[0]:
            return terms[0]
        return "(" + " + ".join(terms).replace("+ -", "- ") + ")"


@dataclass(frozen=True)
class GridSize:
    """A launch grid's axis at run time: `times` * ceil(`extent` / `per_block`) clamped to [1, `cap`]
    before the product (codegen.kernel.Blocks fitted), each of `extent` and `times` an int or a
    SizeExpr."""

    extent: int | SizeExpr
    per_block: int = 1
    cap: int | None = None
    times: int | SizeExpr = 1

    def at(self, sizes) -> int:
        def value(n):
            return n if isinstance(n, int) else n.at(sizes)
        blocks = max(1, -(-value(self.extent) // self.per_block))
        return int(value(self.times) * (blocks if self.cap is None else min(blocks, self.cap)))

    @property
    def dims(self) -> set:
        return {k for n in (self.extent, self.times) if isinstance(n, SizeExpr) for k in n.dims}

    def c_expr(self, names) -> str:
        """The host's C expression (an unsigned) of this axis, the sizes named `names`."""
        def text(n):
            return f"{n}LL" if isinstance(n, int) else n.c_expr(names)
        blocks = f"flowgen_blocks({text(self.extent)}, {self.per_block}LL, {self.cap or 0}LL)"
        return blocks if self.times == 1 else f"{text(self.times)} * {blocks}"


@dataclass
class DynamicDims:
    """What a Program with dynamic dimensions needs at run time."""

    dims: list                # flowgen.dims.Dim, in the order of the sizes in `value`
    uses: dict                # Dim -> [DimUse]: where each size is read from the inputs
    value: Value              # the int64 buffer of the sizes, one per Dim (the kernels' flowgen_dims)
    output_shapes: list       # per graph output, per axis: an int or a SizeExpr
    base: object = None       # the Program at the maximum sizes, before fitting
    renderings: list = field(default_factory=list)   # [(sizes, Program)]: the others fitted (flow.save keeps their IRs)
    # A build's programs for sizes of 1 its kernels do not fit: [(places in `dims` of the Dims at
    # 1, the Program for them, fitted to the other Dims)]; these sizes never reach this Program.
    variants: list = field(default_factory=list)

    def sizes(self, sizes_by_dim: dict) -> np.ndarray:
        return np.array([sizes_by_dim[d] for d in self.dims], np.int64)

    def output_shape(self, k: int, sizes) -> tuple:
        return tuple(s if isinstance(s, int) else s.at(sizes) for s in self.output_shapes[k])


def host_shapes(dynamic, ir) -> tuple:
    """How the host code of the program and library (templates/program_host.cpp.j2) sees a
    Program's shapes: per input, (its shape text, "[batch,20]"; its Dim per axis: 1 + the Dim's
    place, 0 for a fixed size) or None; per output, its shape text ("[batch,5]") or None; all None
    for fixed shapes."""
    if dynamic is None:
        return [None] * len(ir.inputs), [None] * len(ir.outputs)
    place = dim_axes(dynamic.uses)
    names = [d.name for d in dynamic.dims]
    inputs = []
    for i, v in enumerate(ir.inputs):
        axes = [place.get((i, axis)) for axis in range(len(v.shape))]
        inputs.append(("[" + ",".join(str(n) if d is None else d.name for d, n in zip(axes, v.shape)) + "]",
                       [0 if d is None else dynamic.dims.index(d) + 1 for d in axes]))
    outputs = ["[" + ",".join(str(n) if isinstance(n, int) else n.c_expr(names).strip("()").replace(" ", "")
                              for n in shape) + "]" for shape in dynamic.output_shapes]
    return inputs, outputs


def c_name(dim) -> str:
    """The kernels' local holding `dim`'s size."""
    return f"dim_{dim.name}"


def fit_programs(base, renderings: list, dims: list, uses: dict, source_of):
    """The Program computing every rendering: `base` (all Dims at their maximum) with its kernels
    reading the sizes at run time. `renderings`: [(sizes: a list, one per Dim, Program)], other
    sizes than the base's; `source_of(graph, prepare, kernels)` gives a Program's kernels.cu."""
    base_sizes = [d.max for d in dims]
    points = [base_sizes] + [sizes for sizes, _ in renderings]
    programs = [base] + [program for _, program in renderings]
    value = Value("flowgen_dims", (len(dims),), dt.int64)
    # Prepare kernels run once, not every call (codegen/program.py split_prepare): they compute
    # their persistent outputs (a position embedding's rows, a mask) at the maximum sizes.
    max_value = Value("flowgen_dims_max", (len(dims),), dt.int64)
    names = [c_name(d) for d in dims]

    def fit(values, where) -> int | SizeExpr:
        return _fit(values, points, base_sizes, dims, where)

    all_kernels = [p.prepare + p.kernels for p in programs]
    for kernels, sizes in zip(all_kernels[1:], points[1:]):
        if [k.name for k in kernels] != [k.name for k in all_kernels[0]]:
            raise DynamicShapeError(f"dynamic_shapes: {_dims_text(dims)}: the step's kernels at "
                                    f"{_sizes_text(dims, sizes)} are not those at the maximum sizes "
                                    f"({_first_name_difference(all_kernels[0], kernels)}): flowgen compiles it "
                                    f"differently by size")
    fitted = [_fit_kernel(list(column), dims, names, max_value if k < len(base.prepare) else value, fit, points)
              for k, column in enumerate(zip(*all_kernels))]
    _check_values(programs, dims, points)
    _check_constants(programs, dims, points)
    outputs = [[fit([p.graph.outputs[k].shape[axis] for p in programs], f"output {k}, axis {axis}")
                for axis in range(len(out.shape))] for k, out in enumerate(base.graph.outputs)]
    for k, shape in enumerate(outputs):
        for axis, size in enumerate(shape):
            if isinstance(size, SizeExpr) and not size.grows:
                raise DynamicShapeError(f"dynamic_shapes: output {k}'s axis {axis} shrinks as {_dims_text(dims)} grows")
    # Prepare kernels compute at the maximum sizes: their grid is the maximum's.
    prepare = [replace(k, dynamic_grid=None) for k in fitted[:len(base.prepare)]]
    kernels = fitted[len(base.prepare):]
    constants = dict(base.constants)
    if any(a.value is max_value for k in prepare for a in k.args if isinstance(a, BufferArg)):
        constants[max_value] = np.array(base_sizes, np.int64)
    return replace(base, prepare=prepare, kernels=kernels, source=source_of(base.graph, prepare, kernels),
                   constants=constants, dynamic=DynamicDims(list(dims), uses, value, outputs, base, list(renderings)))


def fit_variant(base, renderings: list, dims: list, uses: dict, ones: tuple, source_of):
    """The Program of a size-1 variant: `base` and `renderings` ([(sizes over every Dim, Program)])
    rendered with the Dims at places `ones` at 1 (flowgen/dims.py variant_points), fitted to the
    other Dims; `base` itself when every Dim is at 1."""
    rest = [k for k in range(len(dims)) if k not in ones]
    if not rest:
        return base
    return fit_programs(base, [([sizes[k] for k in rest], program) for sizes, program in renderings],
                        [dims[k] for k in rest], {dims[k]: uses[dims[k]] for k in rest}, source_of)


def with_variants(program, variants: list, source_of):
    """`program` (fitted for every size) holding the size-1 programs `variants` ([(places of the
    Dims at 1, Program)]) for a build: their kernels renamed after the sizes they serve
    (`k0_model_0_matmul_batch1`), so that one kernels.cu, its `source`, holds every program's."""
    dims = program.dynamic.dims
    renamed = [(ones, _renamed(p, "_" + "_".join(f"{dims[k].name}1" for k in ones), source_of))
               for ones, p in variants]
    prepare = program.prepare + [k for _, p in renamed for k in p.prepare]
    kernels = program.kernels + [k for _, p in renamed for k in p.kernels]
    return replace(program, source=source_of(program.graph, prepare, kernels),
                   dynamic=replace(program.dynamic, variants=renamed))


def _renamed(program, suffix: str, source_of):
    def renamed(k):
        return replace(k, name=k.name + suffix, source=re.sub(rf"\b{re.escape(k.name)}\b", k.name + suffix, k.source))

    prepare, kernels = [renamed(k) for k in program.prepare], [renamed(k) for k in program.kernels]
    return replace(program, prepare=prepare, kernels=kernels, source=source_of(program.graph, prepare, kernels))


def _fit(values, points, base_sizes, dims, where):
    """`values` (one per point) as an int or a SizeExpr of the sizes, or DynamicShapeError: a
    polynomial with integer coefficients, each Dim to the power 1 or, where the points hold four
    or more of its sizes and there are at most two Dims, 2 (batch * seq * seq); its terms fixed by
    the points (the least-squares system of full rank) and exact at every one of them."""
    if all(v == values[0] for v in values):
        return values[0]
    top = [2 if len(dims) <= 2 and len({p[k] for p in points}) >= 4 else 1 for k in range(len(dims))]
    powers = [e for e in itertools.product(*(range(t + 1) for t in top)) if any(e)]
    basis = np.array([[1.0] + [math.prod(p[k] ** n for k, n in enumerate(e)) for e in powers] for p in points])
    solution, _, rank, _ = np.linalg.lstsq(basis, np.array(values, float), rcond=None)
    coeffs = [int(round(x)) for x in solution]
    form = SizeExpr(coeffs[0], tuple((tuple(k for k, n in enumerate(e) for _ in range(n)), a)
                                     for e, a in zip(powers, coeffs[1:]) if a))
    if rank < basis.shape[1] or any(form.at(sizes) != v for sizes, v in zip(points, values)):
        bad = next((f"{v} at {_sizes_text(dims, sizes)}" for sizes, v in zip(points, values) if form.at(sizes) != v),
                   "too few sizes rendered to tell")
        raise DynamicShapeError(f"{where}: {values[0]} at the maximum sizes is not a polynomial of "
                                f"{_dims_text(dims)} that flowgen can fit ({bad})")
    return form


def _fit_kernel(kernels, dims, names, value, fit, points):
    """The base kernel (kernels[0]) with its changing literals as expressions of the sizes."""
    base = kernels[0]
    where = f"dynamic_shapes: kernel {base.name} ({base.comment or base.name})"
    for k, p in zip(kernels[1:], points[1:]):
        at = _sizes_text(dims, p)
        if k.name != base.name or len(k.args) != len(base.args):
            raise DynamicShapeError(f"{where}: rendered as {k.name} with {len(k.args)} arguments at {at}: flowgen "
                                    f"compiles this node differently by size")
        if (k.block, k.smem) != (base.block, base.smem):
            raise DynamicShapeError(f"{where}: its launch (block {base.block}, {base.smem} shared bytes) changes "
                                    f"with {_dims_text(dims)} (block {k.block}, {k.smem} shared bytes at {at}); "
                                    f"flowgen cannot launch it for a size given at run time")
        for a, b in zip(base.args, k.args):
            if isinstance(a, BufferArg) != isinstance(b, BufferArg) or \
                    (isinstance(a, BufferArg) and a.value.name != b.value.name) or \
                    (not isinstance(a, BufferArg) and a != b):
                raise DynamicShapeError(f"{where}: an argument changes with {_dims_text(dims)} ({a} at the maximum "
                                        f"sizes, {b} at {at})")
    normalized = [_planless(k.source) for k in kernels]
    pieces = [_TOKEN.split(text) for text in normalized]
    tokens = [_TOKEN.findall(text) for text in normalized]
    for k, p in zip(range(1, len(kernels)), points[1:]):
        if pieces[k] != pieces[0] or len(tokens[k]) != len(tokens[0]):
            raise DynamicShapeError(f"{where}: its code changes with {_dims_text(dims)} beyond sizes (at "
                                    f"{_sizes_text(dims, p)}: {_first_difference(pieces[0], pieces[k])}); "
                                    f"flowgen chooses this kernel's form by size")
    grid = _fit_grid(kernels, dims, points, fit, where)
    fitted, used = [], set()
    for position, token in enumerate(tokens[0]):
        column = [t[position] for t in tokens]
        if token.startswith("//"):
            continue
        if all(t == token for t in column):
            fitted.append(token)
            continue
        ints = [_INT.match(t) for t in column]
        floats = next(((kind, parsed) for kind, parse in _FLOAT_SIZES.items()
                       for parsed in [[parse(t) for t in column]] if all(parsed) and len({p[1] for p in parsed}) == 1),
                      None)
        if all(ints) and len({m.group(2) for m in ints}) == 1:
            values, kind = [int(m.group(1)) for m in ints], "integer"
            cast = _LITERAL_TYPES[ints[0].group(2).upper()]   # the literal's own type (std::min(int, int) stays so)
        elif floats is not None:
            (kind, parsed), values = floats, [p[0] for p in floats[1]]
            cast = "float" if parsed[0][1] == "float" else "" if kind != "count" else "double"
        else:
            other = next(k for k, t in enumerate(column) if t != token)
            what = ("a text" if token[0] in "\"'" else
                    "only sizes can follow a Dim: integers, whole numbers in a float (a mean's count), their "
                    "reciprocals (1/n) or n/(n - 1) (BatchNorm's unbiased variance), computed as flowgen computes "
                    "them; another float cannot")
            raise DynamicShapeError(f"{where}: {token} at the maximum sizes is {column[other]} at "
                                    f"{_sizes_text(dims, points[other])}: {what}")
        form = fit(values, f"{where}: the literal {token}")
        used |= form.dims
        n = form.c_expr(names)
        expr = {"reciprocal": f"(1.0 / (double){n})", "ratio": f"((double){n} / (double)({n} - 1))"}.get(kind, n)
        fitted.append(f"({cast}){expr}" if cast else expr)
    if grid is not None:
        base = replace(base, dynamic_grid=grid)
    if not used:
        return base
    # The base's own text (its memory plan's __restrict__ and in-place note), its literals fitted.
    base_pieces, base_tokens = _TOKEN.split(base.source), _TOKEN.findall(base.source)
    code = iter(fitted)
    out = [token if token.startswith("//") else next(code) for token in base_tokens]
    source = "".join(piece + token for piece, token in zip(base_pieces, out + [""]))
    source = _add_dims_parameter(source, base.name, [(k, names[k], dims[k]) for k in sorted(used)])
    return replace(base, source=source, args=list(base.args) + [BufferArg(value, "const long long*")])


def _fit_grid(kernels, dims, points, fit, where):
    """The launch grid of `kernels` (one per point) as a tuple of ints and GridSizes, or None where
    it is the same at every point: an axis the lowering computed as a codegen.kernel.Blocks has its
    extent and multiple fitted, any other follows a polynomial of the sizes."""
    grids = [k.grid for k in kernels]
    if all(g == grids[0] for g in grids):
        return None
    axes = []
    for axis, column in enumerate(zip(*grids)):
        column = list(column)
        blocks = all(isinstance(b, Blocks) for b in column) and \
            len({(b.per_block, b.cap) for b in column}) == 1
        what = f"{where}: its launch grid's axis {'xyz'[axis]} ({column[0]} blocks at the maximum sizes)"
        if all(b == column[0] for b in column):
            axes.append(int(column[0]))
            continue
        if blocks:
            size = GridSize(fit([b.extent for b in column], what + ", the extent it covers"), column[0].per_block,
                            column[0].cap, fit([b.times for b in column], what + ", its multiple"))
        else:
            size = GridSize(fit([int(b) for b in column], what))
        bad = next((p for p, b in zip(points, column) if size.at(p) != b), None)
        if bad is not None:
            raise DynamicShapeError(f"{what} is not computed as flowgen fitted it at {_sizes_text(dims, bad)}")
        axes.append(size)
    return tuple(axes)


_FLOAT = re.compile(r"(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?([fF]?)\Z")


def _float_literal(token: str):
    """(value, its C type: "float" for an "f" literal, else "double") of a float literal (a dot or an
    exponent), else None."""
    match = _FLOAT.match(token)
    if match is None or not (match.group(2) or "." in match.group(1)):
        return None
    return float(match.group(1) + (match.group(2) or "")), "float" if match.group(3) else "double"


def _count(token: str):
    """(the whole number, the C type to cast a fitted one to) of a float literal holding one that
    float32 and float64 both hold exactly (below 2^24: a mean's count, "96.0f"), else None."""
    literal = _float_literal(token)
    if literal is None or not literal[0].is_integer() or not 0 <= literal[0] < 2 ** 24:
        return None
    return int(literal[0]), literal[1]


def _reciprocal(token: str):
    """(n, the C type) of a float literal that is 1/n for a whole n, rounded as flowgen writes it
    (1.0 / n in double, then to float for an "f" literal), else None."""
    literal = _float_literal(token)
    if literal is None or not 0 < literal[0] <= 1:
        return None
    value, ctype = literal
    n = round(1.0 / value)
    if not 1 <= n < 2 ** 24:
        return None
    if ctype == "float":
        return (n, ctype) if np.float32(1.0 / n) == np.float32(value) else None
    return (n, ctype) if 1.0 / n == value else None


def _ratio(token: str):
    """(n, the C type) of a float literal that is n / (n - 1) for a whole n >= 2 (BatchNorm's
    unbiased variance factor), rounded as flowgen writes it (in double, then to float for an "f"
    literal), else None."""
    literal = _float_literal(token)
    if literal is None or not 1 < literal[0] <= 2:
        return None
    value, ctype = literal
    n = round(value / (value - 1.0))
    if not 2 <= n < 2 ** 24:
        return None
    if ctype == "float":
        return (n, ctype) if np.float32(n / (n - 1)) == np.float32(value) else None
    return (n, ctype) if n / (n - 1) == value else None


# The float literals a size can make, by kind: each parses a literal to (n, its C type) or None.
_FLOAT_SIZES = {"count": _count, "reciprocal": _reciprocal, "ratio": _ratio}


def _planless(source: str) -> str:
    """A kernel's source without what its program's memory plan decided (codegen/program.py
    declare_shared_memory: parameters in place lose __restrict__, a comment names them): the plan
    of the maximum sizes is the one every size runs with."""
    lines = [line for line in source.split("\n") if not line.startswith(IN_PLACE_NOTE)]
    return "\n".join(lines).replace(" __restrict__", "")


def _add_dims_parameter(source: str, name: str, locals_: list) -> str:
    """`source` with the kernel taking `flowgen_dims` last and reading the sizes it uses first
    (`locals_`: (the Dim's place in flowgen_dims, the local's name, the Dim))."""
    start = source.index(f" {name}(", source.index("__global__")) + len(name) + 2
    depth, end = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(source[end], 0)
        end += 1
    body = source.index("{", end) + 1
    reads = "".join(f"\n  const long long {n} = {DIMS_PARAM}[{k}];   // {d}" for k, n, d in locals_)
    return (source[:end - 1] + f", const long long* __restrict__ {DIMS_PARAM}" + source[end - 1:body] + reads
            + source[body:])


def _check_values(programs, dims, points):
    """Every buffer at a smaller size fits in its place in the plan made for the maximum."""
    bases = {a.value.name: a.value for k in programs[0].prepare + programs[0].kernels for a in k.args
             if isinstance(a, BufferArg)}
    for program, sizes in zip(programs[1:], points[1:]):
        for k in program.prepare + program.kernels:
            for a in k.args:
                if isinstance(a, BufferArg) and a.value.nbytes > bases[a.value.name].nbytes:
                    raise DynamicShapeError(f"dynamic_shapes: {a.value.type_str} (%{a.value.name}, kernel {k.name}) is "
                                            f"larger at {_sizes_text(dims, sizes)} than at the maximum sizes; the "
                                            f"memory plan is made for the maximum")


def _check_constants(programs, dims, points):
    """Every constant buffer at a smaller size holds the first elements of the maximum's, the
    only ones its kernels read there (an arange of positions does; the indices of a flip along a
    dynamic axis count from its end and do not)."""
    for program, sizes in zip(programs[1:], points[1:]):
        theirs = {v.name: (v, array) for v, array in program.constants.items()}
        for v, array in programs[0].constants.items():
            other, values = theirs.get(v.name, (None, None))
            base = np.asarray(array).reshape(-1)
            if other is None or not np.array_equal(base[:other.numel], np.asarray(values).reshape(-1)):
                reader = next((k for k in programs[0].prepare + programs[0].kernels
                               if any(isinstance(a, BufferArg) and a.value is v for a in k.args)), None)
                read = "" if reader is None else f", read by kernel {reader.name} ({reader.comment or reader.name}),"
                raise DynamicShapeError(f"dynamic_shapes: the constant %{v.name} ({v.type_str}){read} holds other "
                                        f"values at {_sizes_text(dims, sizes)} than the first of the maximum's (values "
                                        f"computed from a size: positions arange(n, n + 1), a flip's indices that "
                                        f"count from the end of a dynamic axis); flowgen cannot compute it for a size "
                                        f"given at run time")


def _dims_text(dims) -> str:
    return ", ".join(map(repr, dims))


def _sizes_text(dims, sizes) -> str:
    return ", ".join(f"{d.name}={s}" for d, s in zip(dims, sizes))


def _values_text(dims, points, values, k) -> str:
    return ", ".join(f"{v} at {dims[k].name}={p[k]}" for p, v in zip(points, values))


def _first_name_difference(a: list, b: list) -> str:
    for k, (x, y) in enumerate(zip(a, b)):
        if x.name != y.name:
            return f"launch {k} is {y.name}, not {x.name}"
    return f"{len(b)} launches, not {len(a)}"


def _first_difference(a: list, b: list) -> str:
    """The first of the code pieces (between literals and comments) that differs."""
    for piece_a, piece_b in zip(a, b):
        if piece_a != piece_b:
            at = next((k for k, (x, y) in enumerate(zip(piece_a, piece_b)) if x != y), min(len(piece_a), len(piece_b)))
            start = max(0, at - 30)
            return f"{piece_a[start:at + 40].strip()!r} became {piece_b[start:at + 40].strip()!r}"
    return "a literal more or less"
