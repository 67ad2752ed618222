"""Closed forms of LR schedules: small expressions of the epoch, written once per scheduler.

A scheduler's `formula(group, e)` (optim/lr_scheduler.py) builds the LR of a parameter group at
epoch `e` from `EPOCH` with Python's arithmetic and comparison operators and the functions below
(`where` for a choice). The one expression is

- evaluated in Python (`evaluate`): the scheduler's `closed_form`, hence `step(epoch)` and the
  LR of schedulers whose eager step is their closed form;
- written as plain data (`to_data`: nested lists such as ``["mul", 0.1, ["epoch"]]``) into a
  saved graph's state schedule (passes/optimizer.lr_schedule), and
- printed from that data as a C++ double expression (`to_cpp`) by the standalone program
  (codegen/aot.py).

Each operation is defined once, in `OPS`: its Python function and its C++ text. Python keeps
the operands' types (an integer epoch stays an integer), so a scheduler's closed form computes
what its hand-written formula did; C++ computes in double. `call_python(fn, x)` (a LambdaLR's
lambda, a CyclicLR scale_fn) evaluates but has no C++: a program cannot follow such a schedule
(`uses_python`).

The functions take numbers too and then compute at once (`cos(0.5)` is a float), so a helper
such as OneCycleLR's `anneal` serves both the LR formula and the eager momentum.
"""
from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Op:
    arity: int
    python: Callable | None   # None: evaluated by `evaluate` itself (where, lazily)
    cpp: str                  # str.format template over the operands' C++ text


def _restart_walk(epoch, first, ratio) -> tuple:
    """(position in the current period, its length, restarts before it) at `epoch` for periods
    of length first, first * ratio, first * ratio ** 2, ... (CosineAnnealingWarmRestarts)."""
    position, length, restarts = epoch, first, 0
    while position >= length:
        position -= length
        length *= ratio
        restarts += 1
    return position, length, restarts


def _restart_cpp(result: str) -> str:
    return ("[&] {{ double cur = {0}, period = {1}, r = 0.0; while (cur >= period) {{ cur -= period; "
            "period *= {2}; r += 1.0; }} return " + result + "; }}()")


OPS = {
    "add": Op(2, operator.add, "({0} + {1})"),
    "sub": Op(2, operator.sub, "({0} - {1})"),
    "mul": Op(2, operator.mul, "({0} * {1})"),
    "div": Op(2, operator.truediv, "({0} / {1})"),
    "floordiv": Op(2, operator.floordiv, "std::floor({0} / {1})"),
    "pow": Op(2, operator.pow, "std::pow({0}, {1})"),
    "neg": Op(1, operator.neg, "(-{0})"),
    # comparisons are numbers, 1 or 0, so that they can be counted (MultiStepLR's milestones); in
    # C++ a bool, which arithmetic turns into 1 or 0
    "lt": Op(2, lambda a, b: float(a < b), "({0} < {1})"),
    "le": Op(2, lambda a, b: float(a <= b), "({0} <= {1})"),
    "gt": Op(2, lambda a, b: float(a > b), "({0} > {1})"),
    "ge": Op(2, lambda a, b: float(a >= b), "({0} >= {1})"),
    "min": Op(2, min, "std::min({0}, {1})"),
    "max": Op(2, max, "std::max({0}, {1})"),
    "cos": Op(1, math.cos, "std::cos({0})"),
    "floor": Op(1, math.floor, "std::floor({0})"),
    "ceil": Op(1, math.ceil, "std::ceil({0})"),
    "where": Op(3, None, "({0} ? {1} : {2})"),
    "since_restart": Op(3, lambda e, first, ratio: _restart_walk(e, first, ratio)[0], _restart_cpp("cur")),
    "restart_period": Op(3, lambda e, first, ratio: _restart_walk(e, first, ratio)[1], _restart_cpp("period")),
    "restarts": Op(3, lambda e, first, ratio: _restart_walk(e, first, ratio)[2], _restart_cpp("r")),
}


def _operand(value):
    if isinstance(value, Expr):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"an LR formula takes numbers, not {type(value).__name__} ({value!r})")
    return int(value) if isinstance(value, numbers.Integral) else float(value)


@dataclass(frozen=True, eq=False)
class Expr:
    """A node of an LR formula: `op` (a key of OPS, "epoch" or "python") over `args` (Exprs or
    numbers); `fn` is the Python function of a "python" node."""
    op: str
    args: tuple = ()
    fn: Callable | None = None

    def __add__(self, other): return _node("add", self, other)
    def __radd__(self, other): return _node("add", other, self)
    def __sub__(self, other): return _node("sub", self, other)
    def __rsub__(self, other): return _node("sub", other, self)
    def __mul__(self, other): return _node("mul", self, other)
    def __rmul__(self, other): return _node("mul", other, self)
    def __truediv__(self, other): return _node("div", self, other)
    def __rtruediv__(self, other): return _node("div", other, self)
    def __floordiv__(self, other): return _node("floordiv", self, other)
    def __rfloordiv__(self, other): return _node("floordiv", other, self)
    def __pow__(self, other): return _node("pow", self, other)
    def __rpow__(self, other): return _node("pow", other, self)
    def __neg__(self): return _node("neg", self)
    def __lt__(self, other): return _node("lt", self, other)
    def __le__(self, other): return _node("le", self, other)
    def __gt__(self, other): return _node("gt", self, other)
    def __ge__(self, other): return _node("ge", self, other)

    def __bool__(self):
        raise TypeError("an LR formula has no truth value before it is evaluated: choose with where(cond, a, b)")


def _node(op: str, *args) -> Expr:
    return Expr(op, tuple(_operand(a) for a in args))


EPOCH = Expr("epoch")


def _function(op: str):
    """OPS[op] as a function of numbers or Exprs: numbers compute at once."""
    def apply(*args):
        if any(isinstance(a, Expr) for a in args):
            return _node(op, *args)
        return OPS[op].python(*args)
    apply.__name__ = op
    return apply


cos = _function("cos")
floor = _function("floor")
ceil = _function("ceil")
minimum = _function("min")
maximum = _function("max")
since_restart = _function("since_restart")
restart_period = _function("restart_period")
restarts = _function("restarts")


def where(condition, if_true, if_false):
    """`if_true` where `condition` holds, else `if_false` (only the chosen one is evaluated)."""
    if isinstance(condition, Expr):
        return _node("where", condition, if_true, if_false)
    return if_true if condition else if_false


def call_python(fn: Callable, argument):
    """`fn(argument)`: a user's function, which a standalone program cannot run."""
    if isinstance(argument, Expr):
        return Expr("python", (argument,), fn)
    return fn(argument)


def evaluate(formula, epoch):
    """The value of `formula` (an Expr or a number) at `epoch`."""
    if not isinstance(formula, Expr):
        return formula
    if formula.op == "epoch":
        return epoch
    if formula.op == "where":
        condition, if_true, if_false = formula.args
        return evaluate(if_true if evaluate(condition, epoch) else if_false, epoch)
    args = [evaluate(a, epoch) for a in formula.args]
    return formula.fn(*args) if formula.op == "python" else OPS[formula.op].python(*args)


def uses_python(formula) -> bool:
    if not isinstance(formula, Expr):
        return False
    return formula.op == "python" or any(uses_python(a) for a in formula.args)


def to_data(formula):
    """`formula` as JSON-ready plain data: ["epoch"], a number, or [op, operands...]."""
    if not isinstance(formula, Expr):
        return formula
    if formula.op == "python":
        raise ValueError(f"the LR formula calls Python ({getattr(formula.fn, '__name__', formula.fn)}), which has "
                         f"no plain-data form")
    return [formula.op, *(to_data(a) for a in formula.args)]


def _cpp_number(value) -> str:
    v = float(value)
    if math.isnan(v):
        return "NAN"
    if math.isinf(v):
        return "INFINITY" if v > 0 else "(-INFINITY)"
    return repr(v) if v >= 0 else f"({v!r})"


def to_cpp(data, epoch: str) -> str:
    """C++ (a double expression) for a formula's plain data (`to_data`), the epoch being the C++
    expression `epoch`; a malformed formula (a hostile or newer graph.json) raises ValueError."""
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        return _cpp_number(data)
    if not isinstance(data, list) or not data or not isinstance(data[0], str):
        raise ValueError(f"malformed LR formula {data!r}: expected a number or [operation, operands...]")
    op, operands = data[0], data[1:]
    if op == "epoch" and not operands:
        return epoch
    if op not in OPS:
        raise ValueError(f"unknown operation {op!r} in an LR formula (saved by another flowgen version?)")
    if len(operands) != OPS[op].arity:
        raise ValueError(f"LR formula operation {op!r} takes {OPS[op].arity} operands, got {len(operands)}")
    return OPS[op].cpp.format(*(to_cpp(a, epoch) for a in operands))
