"""Graph inputs and outputs as OneFlow takes them: tensors nested in tuples, lists and dicts,
keyword arguments, and non-tensor leaves (None, bool, int, float, str) passed through.

`flatten(obj)` gives the tensors in order and a function rebuilding the same structure from
replacement tensors (lazy ones while tracing, results after a call). `signature(obj)` is the
cache key of a call: tensor metadata and the non-tensor values, since `build()` may branch
on them.
"""
from __future__ import annotations

from flowgen.dims import dim_axes
from flowgen.tensor import Tensor

PASSED_THROUGH = (type(None), bool, int, float, str)


def _rebuild_sequence(obj, parts):
    if type(obj) in (tuple, list):
        return lambda ts: type(obj)(p(ts) for p in parts)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):   # a namedtuple
        return lambda ts: type(obj)(*(p(ts) for p in parts))
    kind = tuple if isinstance(obj, tuple) else list
    return lambda ts: kind(p(ts) for p in parts)


def _walk(item, where: str, flat: list):
    """Append `item`'s tensors to `flat`; return a function rebuilding `item` from replacements."""
    if isinstance(item, Tensor):
        flat.append(item)
        index = len(flat) - 1
        return lambda ts: ts[index]
    if isinstance(item, (tuple, list)):
        return _rebuild_sequence(item, [_walk(v, f"{where}[{k}]", flat) for k, v in enumerate(item)])
    if isinstance(item, dict):
        kind = type(item) if type(item).__init__ is dict.__init__ else dict
        parts = {k: _walk(v, f"{where}[{k!r}]", flat) for k, v in item.items()}
        return lambda ts: kind((k, p(ts)) for k, p in parts.items())
    if isinstance(item, PASSED_THROUGH):
        return lambda ts: item
    raise TypeError(f"{where} is a {type(item).__name__}; graph inputs and outputs may hold tensors in tuples, "
                    f"lists and dicts, and None, bool, int, float or str values (wrap data with flow.tensor(...))")


def flatten(obj, what: str):
    """(tensors, rebuild): `rebuild(replacements)` is `obj` with its k-th tensor replaced."""
    flat = []
    rebuild = _walk(obj, what, flat)
    return flat, rebuild


def flatten_call(args: tuple, kwargs: dict, owner: str):
    """`flatten` for a call: errors name the argument (`G_0: argument 1[0]`); `rebuild` gives (args, kwargs)."""
    flat = []
    positional = [_walk(v, f"{owner}: argument {k}", flat) for k, v in enumerate(args)]
    keywords = {k: _walk(v, f"{owner}: argument {k!r}", flat) for k, v in kwargs.items()}
    return flat, lambda ts: (tuple(p(ts) for p in positional), {k: p(ts) for k, p in keywords.items()})


def signature(obj):
    """Hashable description of a call's arguments: tensor metadata, structure, non-tensor values."""
    if isinstance(obj, Tensor):
        return ("tensor", tuple(obj.shape), obj.dtype, obj.device)
    if isinstance(obj, (tuple, list)):
        return (type(obj).__name__,) + tuple(signature(v) for v in obj)
    if isinstance(obj, dict):
        return ("dict",) + tuple((k, signature(v)) for k, v in obj.items())
    return (type(obj).__name__, obj)


def abstract_inputs(inputs, uses: dict) -> list:
    """The flat input tensors as what a dynamic-shapes variant is keyed by: dtype, device and
    shape with each dynamic axis the Dim (flowgen/dims.py) instead of its size."""
    dynamic = dim_axes(uses)
    return [("tensor", tuple(dynamic.get((k, axis), size) for axis, size in enumerate(t.shape)), t.dtype, t.device)
            for k, t in enumerate(inputs)]


def leaf_names(args, kwargs: dict, prefix: str) -> list:
    """(name, leaf) for every leaf in order, named as OneFlow's debug lines name them:
    `prefix_0`, `prefix_1.0` inside a sequence, `prefix_1.key` inside a dict, `prefix_kw` for a keyword."""
    out = []

    def walk(item, name):
        if isinstance(item, (tuple, list)):
            for k, v in enumerate(item):
                walk(v, f"{name}.{k}")
        elif isinstance(item, dict):
            for k, v in item.items():
                walk(v, f"{name}.{k}")
        else:
            out.append((name, item))

    for k, v in enumerate(args):
        walk(v, f"{prefix}_{k}")
    for k, v in kwargs.items():
        walk(v, f"{prefix}_{k}")
    return out


def non_tensor_arguments(args, kwargs: dict) -> list:
    """`argument 0 is a list`, `argument 'scale' is a float`: the call's arguments holding Python
    values other than None (for errors raised when build() uses one as if it were a tensor)."""
    named = [(str(k), v) for k, v in enumerate(args)] + [(repr(k), v) for k, v in kwargs.items()]
    return [f"argument {k} is a {type(v).__name__}" for k, v in named
            if any(not isinstance(leaf, (Tensor, type(None))) for _, leaf in leaf_names((v,), {}, ""))]
