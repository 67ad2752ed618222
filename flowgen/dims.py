"""Dynamic dimensions: `flow.Dim(name, min=, max=)` and the per-input specs that use them.

A compiled step declared with dynamic dimensions (`graph.config.dynamic_shapes([...])`, one entry
per input: `{axis: Dim}` or None, as `torch.export`'s `dynamic_shapes`) takes any size of each Dim
in [min, max] without recompiling: codegen/dynamic.py renders the step at several sizes and turns
every size that changes into an expression of the Dim read at run time. One Dim in several places
ties those sizes. This module holds what the user writes and the checks of a call's inputs
against it; it imports nothing of the compiler.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class Dim:
    """A dimension whose size is given at run time, from `min` to `max` (both included). The
    memory plan is made for `max`."""

    name: str
    min: int = 1
    max: int | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"flow.Dim({self.name!r}): the name must be an identifier (letters, digits, _)")
        if self.max is None:
            raise ValueError(f"flow.Dim({self.name!r}): max is required: the compiled step's memory is planned for "
                             f"the largest size")
        for what in ("min", "max"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"flow.Dim({self.name!r}): {what} must be an int, got {value!r}")
        if not 1 <= self.min < self.max:
            raise ValueError(f"flow.Dim({self.name!r}): needs 1 <= min < max, got min={self.min}, max={self.max}")
        if len(sample_sizes(self)) < 2:
            raise ValueError(f"flow.Dim({self.name!r}, min={self.min}, max={self.max}): too few sizes for flowgen to "
                             f"check how the step's sizes follow it (it compiles at the max and at two or more sizes "
                             f"from max(min, 2) below it): give it a max of at least {max(self.min, 2) + 2}")

    def __repr__(self) -> str:
        return f"Dim({self.name!r}, min={self.min}, max={self.max})"


@dataclass(frozen=True)
class DimUse:
    """Where a Dim's size is read from: axis `axis` of flat input `input`."""

    input: int
    axis: int


def normalize_spec(spec, num_inputs: int, ranks: list, where: str) -> dict:
    """{Dim: [DimUse, ...]} of a dynamic_shapes spec for inputs of the given ranks, checked: one
    entry per input (a dict {axis: Dim} or None), axes in range, Dims of one name the same Dim."""
    if not isinstance(spec, (list, tuple)):
        raise TypeError(f"{where}: dynamic_shapes must be a list with one entry per input (a dict {{axis: Dim}} "
                        f"or None), got {type(spec).__name__}")
    if len(spec) != num_inputs:
        raise ValueError(f"{where}: dynamic_shapes has {len(spec)} entries for {num_inputs} inputs")
    uses: dict = {}
    by_name: dict = {}
    for k, (entry, rank) in enumerate(zip(spec, ranks)):
        if entry is None:
            continue
        if not isinstance(entry, dict):
            raise TypeError(f"{where}: dynamic_shapes[{k}] must be a dict {{axis: Dim}} or None, got {entry!r}")
        for axis, dim in entry.items():
            if not isinstance(dim, Dim):
                raise TypeError(f"{where}: dynamic_shapes[{k}][{axis!r}] must be a flow.Dim, got {dim!r}")
            if isinstance(axis, bool) or not isinstance(axis, int) or not -rank <= axis < rank:
                raise ValueError(f"{where}: dynamic_shapes[{k}]: axis {axis!r} of input {k} (rank {rank}) is out of range")
            if by_name.setdefault(dim.name, dim) != dim:
                raise ValueError(f"{where}: two different Dims named {dim.name!r}: {by_name[dim.name]} and {dim}")
            uses.setdefault(dim, []).append(DimUse(k, axis % rank))
    if not uses:
        raise ValueError(f"{where}: dynamic_shapes names no Dim; pass None to compile for fixed shapes")
    return uses


def sizes_of(uses: dict, shapes: list, where: str, names: list | None = None) -> dict:
    """{Dim: size} read from the inputs' `shapes`, checked against each Dim's range and ties.
    A mismatch raises ValueError naming the input, the axis, the Dim and what is allowed."""
    sizes = {}
    for dim, places in uses.items():
        for use in places:
            size = int(shapes[use.input][use.axis])
            label = names[use.input] if names else f"input {use.input}"
            if not dim.min <= size <= dim.max:
                raise ValueError(f"{where}: {label} has size {size} at axis {use.axis}, which is {dim}: "
                                 f"allowed {dim.min} to {dim.max}")
            if sizes.setdefault(dim, size) != size:
                first = places[0]
                first_label = names[first.input] if names else f"input {first.input}"
                raise ValueError(f"{where}: {dim} is {sizes[dim]} at axis {first.axis} of {first_label} but {size} "
                                 f"at axis {use.axis} of {label}: one Dim is one size")
    return sizes


def dim_axes(uses: dict) -> dict:
    """{(input, axis): Dim} of {Dim: [DimUse]}: the Dim each dynamic axis gives."""
    return {(use.input, use.axis): dim for dim, places in uses.items() for use in places}


def shapes_at(shapes: list, uses: dict, sizes_by_dim: dict) -> list:
    """The inputs' `shapes` with each axis that gives a Dim at its size in `sizes_by_dim`."""
    place = dim_axes(uses)
    return [tuple(sizes_by_dim[place[k, axis]] if (k, axis) in place else n for axis, n in enumerate(shape))
            for k, shape in enumerate(shapes)]


def sample_sizes(dim: Dim) -> list:
    """The sizes codegen/dynamic.py renders a step at, besides the maximum: the minimum, the one
    above it, and two between, so a size rule that is not one affine function over the whole
    range (a choice made by size) shows as a difference between renderings. Never 1: a size of 1
    is compiled as a variant of its own (nn/graph/graph.py), the compiler having special cases for
    it (a broadcast that reads in place, a transpose that moves nothing, a slice that empties)."""
    lo, hi = max(dim.min, 2), dim.max
    picks = [lo, lo + 1, (lo + hi) // 2, lo + (hi - lo) // 3]
    return sorted({p for p in picks if lo <= p < hi})


def sample_points(dims: list) -> list:
    """The sizes (one per Dim, in order) to render a step at besides every Dim's max. One or two
    Dims: every combination of their sample sizes and maxima (a grid, so that codegen/dynamic.py
    can fit sizes such as batch * seq * seq, an attention's scores); more: each Dim at its sample
    sizes with the others at their max, and three points where all of them move."""
    samples = [sample_sizes(d) + [d.max] for d in dims]
    if len(dims) <= 2:
        grid = [list(p) for p in itertools.product(*samples)]
        return [p for p in grid if p != [d.max for d in dims]]
    points = []
    for k, dim in enumerate(dims):
        for size in samples[k][:-1]:
            points.append([size if j == k else d.max for j, d in enumerate(dims)])
    points.append([s[0] for s in samples])
    points.append([s[len(s) // 2 - 1] for s in samples])
    points.append([s[0] if j % 2 else s[-2] for j, s in enumerate(samples)])
    return points


def unit_points(dims: list) -> list:
    """The sizes with Dims whose minimum is 1 at 1, for a program that serves a size of 1 with
    the kernels it fits for the others (a saved graph's: the standalone program and the library
    have one program; the Python graph compiles variants of its own instead): each such Dim at 1
    with the others at their max, then at their smallest sample size, and all of them at 1."""
    ones = [k for k, d in enumerate(dims) if d.min == 1]
    points = []
    for others in ([d.max for d in dims], [max(d.min, 2) for d in dims]):
        for k in ones:
            points.append([1 if j == k else size for j, size in enumerate(others)])
    if len(ones) > 1:
        points.append([1 if d.min == 1 else d.max for d in dims])
    return [p for k, p in enumerate(points) if p not in points[:k]]


def unit_subsets(dims: list) -> list:
    """The sets (tuples of places in `dims`) of Dims whose minimum is 1 that a saved graph may
    have at 1 together, when its kernels do not fit a size of 1: one program each (codegen/aot.py),
    as the Python graph compiles a variant for each (nn/graph/graph.py)."""
    ones = [k for k, d in enumerate(dims) if d.min == 1]
    return [s for n in range(1, len(ones) + 1) for s in itertools.combinations(ones, n)]


def variant_points(dims: list, ones: tuple) -> tuple:
    """(the sizes of the variant with the Dims at places `ones` at 1 and the others at their max,
    the sizes to render it at besides: sample_points of the others), each a list over all `dims`."""
    rest = [k for k in range(len(dims)) if k not in ones]

    def full(sizes):
        values = dict(zip(rest, sizes))
        return [1 if k in ones else values[k] for k in range(len(dims))]

    return full([dims[k].max for k in rest]), ([full(p) for p in sample_points([dims[k] for k in rest])]
                                               if rest else [])
