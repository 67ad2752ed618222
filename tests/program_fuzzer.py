"""Differential program fuzzer: random small models, graph on the CPU emulator vs eager vs PyTorch.

A seeded generator writes a random model as Python source over the public API (`lib` is
`flowgen` or `torch`, `F` their functional modules, `nn` their module namespaces): elementwise
unary/binary ops with broadcasting, reductions (sum/mean/amax/amin/var/std/norm/logsumexp/max/
min), Linear/matmul/einsum, conv1d/conv2d (grouped, dilated, 'same', transposed), BatchNorm/
LayerNorm/GroupNorm/InstanceNorm, softmax/log_softmax/normalize/cosine_similarity,
scaled_dot_product_attention, MultiheadAttention, TransformerEncoderLayer, LSTM/GRU/RNN,
pooling (max/avg with padding and ceil_mode, adaptive), interpolate (nearest/bilinear), pad
(constant/reflect/replicate), reshape/transpose/permute/flatten/slicing/stack/expand/repeat/
flip/roll/tril/triu, where/masked_fill, cumsum/cumprod, sort/topk values, index_select/gather/
Embedding with repeated indices, in-place writes as PyTorch defines them (a tensor read, then
written by an in-place method or operator, by `x[key] = value` with constant keys or a mask the
forward computes, or through a view -- slice, select, t/transpose/permute, view(-1), unsqueeze,
narrow, detach -- and read again with its views: `_inplace`), residual adds and a loss
(regression, BCE, KL, cross-entropy with label smoothing, class weights, ignored labels or one
class; some computed in float64), sometimes with an auxiliary loss on an intermediate value that
has its own backward() before the optimizer step. Each program runs

* as an inference graph (eval mode) and
* as 3 training steps (SGD with momentum or Nesterov, Adam, AdamW, AMSGrad, RMSprop, Adagrad)
  in an `nn.Graph` (float32; float64 for some programs),

compared with the same model in eager float32 and eager float64. The tolerance is stated in
float32 rounding units against the float64 eager result: the graph's error may be at most
`ERROR_FACTOR` times the largest error of three eager float32 runs (on the exact inputs and
state, on copies moved by up to one ulp, and with every op's result moved by up to one ulp --
an exact zero by one ulp of the largest magnitude the op read or wrote, as a cancellation
summed in another valid order leaves: how far float32 rounding alone moves this result, which
is large where the program is chaotic, e.g. Adam on a gradient that cancels to zero, or `abs`
and `relu` on a value that is exactly zero only because its terms cancelled)
plus `ROUNDING_UNITS` units of 2**-24 of the tensor's largest magnitude (different but equally
valid summation orders); a value that overflows in eager float32 too is not compared. With
torch installed, eager float64 is also checked against torch float64 (forward, loss and
first-step gradients), which must agree to 1e-6 relative (formulas may round differently;
semantics may not; the allowance grows with how far perturbed flowgen float64 runs move): that
checks the op semantics the fuzzer's reference relies on. The perturbed eager runs are made only
for a comparison that fails without them (they can only widen its allowance).

Several programs share one pair of graphs (their inputs, outputs and losses side by side; the
training loss is their sum, and their parameters are disjoint, so each trains as if alone) to
pay the g++ start-up once. A mismatch is re-run program by program, minimised statement by
statement, and reported as the program's source and seed:

    python tests/program_fuzzer.py --long 500 [--seed 0] [--batch 10]

Long runs spend most of their time in g++: `FLOWGEN_EMULATOR_OPT=0` compiles the kernels about
3x faster and gives the same numbers (README, "Environment").
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import random
import re
import sys
import traceback
from dataclasses import dataclass, replace

import numpy as np

import flowgen as flow
import flowgen.nn as flow_nn
import flowgen.nn.functional as flow_F
from flowgen.ops.registry import REGISTRY

ERROR_FACTOR = 8.0
ROUNDING_UNITS = 256
EPS32 = 2.0 ** -24
TORCH_RTOL = 1e-6
PERTURBED_RUNS = (None, 1, 2)   # eager float32 runs: exact inputs, and two ulp-perturbed ones
NOISY_RUNS = (11, 12)           # and two with every op's result moved by up to an ulp (`rounding_noise`)
STEPS = 3
# A training step whose loss float32 rounding alone moves by more than this (relative to its
# magnitude) leaves a state that rounding decided: later steps are not compared (`_Eager.chaotic_after`).
CHAOS_RELATIVE = 1e-4


# ----------------------------------------------------------------------------------------------
# Programs

@dataclass
class Program:
    """A random model as source text: `init` lines run in `__init__` (modules, parameters),
    `body` lines in `forward(self, x)` (the last one assigns `out`), `loss` is an expression of
    `out` and `target`."""

    seed: int
    input_shape: tuple
    init: list
    body: list
    loss: str
    target: str            # "float", "unit" (in [0, 1]), "labels:<classes>" or "labels:<classes>:<ignored label>"
    target_shape: tuple
    optimizer: str         # a key of OPTIMIZERS
    aux: str = ""          # an auxiliary loss (an expression of body values) with its own backward()
    dtype: str = "float32"   # of the graphs: "float64" runs them in float64

    def source(self) -> str:
        lines = [f"# fuzz program, seed {self.seed}: x {list(self.input_shape)}, target {self.target} "
                 f"{list(self.target_shape)}, optimizer {self.optimizer}"
                 + (", graphs in float64" if self.dtype == "float64" else ""),
                 "def __init__(self):", "    super().__init__()"]
        lines += [f"    {line}" for line in self.init]
        lines += ["def forward(self, x):"] + [f"    {line}" for line in self.body] + _returns(self)
        lines += [f"loss = {self.loss}"]
        if self.aux:
            lines += ["# training step: loss.backward(retain_graph=True); aux.backward(); optimizer.step()"]
        return "\n".join(lines)


def _returns(program: Program) -> list:
    """The end of `forward`: `out`, and the auxiliary loss beside it when the program has one."""
    if program.aux:
        return [f"    aux = {program.aux}", "    return out, aux"]
    return ["    return out"]


class _Gen:
    """Builds a `Program`: a pool of (variable, shape) values the next statement may read."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.seed = seed
        self.init, self.body = [], []
        self.count = 0
        self.trainable = set()   # variables that depend on a parameter
        self.also = []           # (variable, shape) a statement made beside its result, for the pool

    def name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def module(self, ctor: str) -> str:
        name = self.name("m")
        self.init.append(f"self.{name} = {ctor}")
        return f"self.{name}"

    def param(self, shape) -> str:
        name = self.name("p")
        self.init.append(f"self.{name} = nn.Parameter(lib.randn({', '.join(map(str, shape))}) * 0.5)")
        return f"self.{name}"

    def emit(self, expr: str, shape) -> tuple:
        var = self.name("h")
        self.body.append(f"{var} = {expr}")
        if "self." in expr or any(_reads(expr, v) for v in self.trainable):
            self.trainable.add(var)
        return var, tuple(shape)

    def mutate(self, statement: str, target: str) -> None:
        """An in-place write to `target` (a statement binding no new variable; through a
        detach() it carries no gradient)."""
        self.body.append(statement)
        if ".detach()" not in statement and ("self." in statement or any(_reads(statement, v) for v in self.trainable)):
            self.trainable.add(target)


UNARY = ["F.relu({})", "lib.sigmoid({})", "lib.tanh({})", "F.gelu({})", "F.silu({})", "F.leaky_relu({}, 0.1)",
         "F.elu({})", "F.softplus({})", "F.hardtanh({})", "F.relu6({} * 3.0)", "-{}", "lib.abs({})", "{} * {}",
         "lib.exp(-lib.abs({}))", "lib.log(lib.abs({}) + 1.0)", "lib.sqrt(lib.abs({}) + 0.1)", "lib.sin({})",
         "lib.cos({})", "lib.square({})", "lib.pow({}, 3)", "lib.clamp({}, min=-0.5, max=0.8)", "F.mish({})",
         "F.hardswish({})", "lib.rsqrt(lib.abs({}) + 0.5)", "F.gelu({}, approximate='tanh')", "lib.erf({})",
         "lib.expm1(-lib.abs({}))", "lib.log1p(lib.abs({}))", "lib.atan2({}, lib.abs({}) + 0.5)", "F.hardsigmoid({})",
         "lib.reciprocal(lib.abs({}) + 0.5)", "lib.pow(lib.abs({}) + 0.5, {})", "F.softplus({}, beta=2.0, threshold=1.0)",
         "F.elu({}, alpha=0.5)", "lib.sign({}) * {}", "lib.floor({}) + {}", "lib.remainder({}, 0.7)"]
BINARY = ["{a} + {b}", "{a} - {b}", "{a} * {b}", "{a} / (lib.abs({b}) + 1.0)", "lib.maximum({a}, {b})",
          "lib.minimum({a}, {b})"]
SCALAR_BINARY = ["{a} + {c}", "{a} - {c}", "{c} - {a}", "{a} * {c}", "{a} / {c}", "lib.clamp({a}, min={c})"]


def _broadcast_shape(rng, shape) -> tuple:
    """A shape that broadcasts to `shape`: some dims set to 1, maybe leading dims dropped."""
    out = [d if rng.random() < 0.5 else 1 for d in shape]
    while len(out) > 1 and out[0] == 1 and rng.random() < 0.5:
        out = out[1:]
    return tuple(out)


def _statement(g: _Gen, pool: list) -> tuple:
    """One random statement reading values of `pool`; returns the new (variable, shape)."""
    rng = g.rng
    var, shape = pool[-1] if rng.random() < 0.6 else rng.choice(pool)
    rank = len(shape)
    same = [v for v, s in pool if s == shape and v != var]
    choices = ["unary", "unary", "binary", "binary", "reduce_back", "reduce", "where", "masked_fill", "reshape",
               "cat", "chunk", "cumsum", "sort", "index_select"] + MORE_ANY
    if rank >= 2:
        choices += ["softmax", "transpose", "topk"] + MORE_2_UP
    if rank <= 3:
        choices += ["stack"]
    if rank >= 3:
        choices += ["permute"]
    if rank == 2:
        choices += ["linear", "linear", "matmul", "layernorm"] + (["batchnorm1d"] if shape[0] > 1 else [])
    if rank == 3:
        choices += ["linear", "layernorm", "attention", "sdpa", "flatten"] + MORE_3
    if rank == 4:
        choices += ["conv", "conv", "conv_residual", "conv_where", "groupnorm", "pool", "flatten",
                    "reduce_spatial"] + (["batchnorm2d"] if shape[0] * shape[2] * shape[3] > 1 else []) + MORE_4
    kind = rng.choice(choices)
    if kind in MORE_KINDS:
        return MORE_KINDS[kind](g, var, shape, same)
    if kind == "unary":
        return g.emit(rng.choice(UNARY).format(var, var), shape)
    if kind == "binary":
        pick = rng.random()
        if same and pick < 0.4:
            other = rng.choice(same)
        elif pick < 0.7:
            other = g.param(_broadcast_shape(rng, shape))
        elif pick < 0.85:
            # a reduction of the operand itself, broadcast back (x - mean(x), as in a norm)
            dim = rng.randrange(rank)
            other, _ = g.emit(f"lib.{rng.choice(['sum', 'mean', 'amax'])}({var}, dim={dim}, keepdim=True)",
                              shape[:dim] + (1,) + shape[dim + 1:])
        else:
            constant = rng.choice([-1.5, -0.5, 0.25, 2.0])
            return g.emit(rng.choice(SCALAR_BINARY).format(a=var, c=constant), shape)
        a, b = (var, other) if rng.random() < 0.7 else (other, var)
        return g.emit(rng.choice(BINARY).format(a=a, b=b), shape)
    if kind in ("reduce", "reduce_back"):
        dim = rng.randrange(rank) if kind == "reduce" else rank - 1
        keep = rank <= 2 or rng.random() < 0.5
        op = rng.choice(["sum", "mean", "amax", "amin", "var"])
        extra = ", unbiased=False" if op == "var" else ""
        out_shape = shape[:dim] + ((1,) if keep else ()) + shape[dim + 1:]
        return g.emit(f"lib.{op}({var}, dim={dim}, keepdim={keep}{extra})", out_shape)
    if kind == "reduce_spatial":
        keep = rng.random() < 0.5
        out_shape = shape[:2] + ((1, 1) if keep else ())
        return g.emit(f"lib.{rng.choice(['sum', 'mean'])}({var}, dim=(2, 3), keepdim={keep})", out_shape)
    if kind == "cat":
        dim = rng.randrange(rank)
        other = rng.choice(same) if same else f"lib.tanh({var})"
        return g.emit(f"lib.cat([{var}, {other}], dim={dim})", shape[:dim] + (2 * shape[dim],) + shape[dim + 1:])
    if kind == "chunk":
        dim = rng.randrange(rank)
        if shape[dim] < 2:
            return g.emit(f"lib.sigmoid({var})", shape)
        part = rng.choice([0, 1])
        size = -(-shape[dim] // 2) if part == 0 else shape[dim] // 2
        return g.emit(f"lib.chunk({var}, 2, dim={dim})[{part}]", shape[:dim] + (size,) + shape[dim + 1:])
    if kind == "cumsum":
        dim = rng.randrange(rank)
        return g.emit(f"lib.cumsum({var}, dim={dim})", shape)
    if kind == "sort":     # the sorted values: continuous in the input, the gradient follows the order
        dim = rng.randrange(rank)
        return g.emit(f"lib.sort({var}, dim={dim}, descending={rng.random() < 0.5})[0]", shape)
    if kind == "topk":
        dim = rng.randrange(rank)
        k = rng.randint(1, shape[dim])
        return g.emit(f"lib.topk({var}, {k}, dim={dim}, largest={rng.random() < 0.7})[0]",
                      shape[:dim] + (k,) + shape[dim + 1:])
    if kind == "index_select":     # constant indices with repeats: the gradient is a scatter-add
        dim = rng.randrange(rank)
        index = [rng.randrange(shape[dim]) for _ in range(rng.randint(1, 2 * shape[dim]))]
        return g.emit(f"lib.index_select({var}, {dim}, lib.tensor({index}))",
                      shape[:dim] + (len(index),) + shape[dim + 1:])
    if kind == "sdpa":
        causal = rng.random() < 0.5
        return g.emit(f"F.scaled_dot_product_attention({var}, lib.tanh({var}), {var}, is_causal={causal})", shape)
    if kind == "permute":
        order = list(range(rank))
        rng.shuffle(order)
        return g.emit(f"lib.permute({var}, {tuple(order)})", tuple(shape[d] for d in order))
    if kind == "groupnorm":
        groups = rng.choice([d for d in (1, 2, shape[1]) if shape[1] % d == 0])
        if shape[0] * (shape[1] // groups) * shape[2] * shape[3] < 2:   # GroupNorm raises (torch too)
            return g.emit(f"lib.tanh({var})", shape)
        m = g.module(f"nn.GroupNorm({groups}, {shape[1]})")
        return g.emit(f"{m}({var})", shape)
    if kind == "where":
        other = rng.choice(same) if same else g.param(_broadcast_shape(rng, shape))
        # Thresholds off zero: a value that is zero in exact arithmetic (BatchNorm's output on
        # a padded border) comes out as 0 or +-1e-17 depending on summation order, and either
        # branch is then right.
        threshold = rng.choice([-0.137, 0.0731, 0.291])
        cond = rng.choice([f"{var} > {threshold}", f"{var} < {other}", f"lib.abs({var}) > 0.5"])
        return g.emit(f"lib.where({cond}, {var}, {other})", shape)
    if kind == "masked_fill":
        return g.emit(f"lib.masked_fill({var}, {var} < {rng.choice([-0.61, -0.137, 0.0731, 0.43])}, "
                      f"{round(rng.uniform(-1, 1), 2)})", shape)
    if kind == "reshape":
        total = int(np.prod(shape))
        if rank >= 2 and rng.random() < 0.5:
            return g.emit(f"lib.reshape({var}, ({shape[0]}, {total // shape[0]}))", (shape[0], total // shape[0]))
        new = (shape[0], shape[1], 1) + tuple(shape[2:]) if rank >= 2 else (shape[0], 1)
        return g.emit(f"lib.unsqueeze({var}, {1 if rank < 2 else 2})", new)
    if kind == "softmax":
        dim = rng.randrange(rank)
        return g.emit(f"lib.{rng.choice(['softmax', 'log_softmax'])}({var}, dim={dim})", shape)
    if kind == "transpose":
        d0, d1 = rng.sample(range(rank), 2)
        new = list(shape)
        new[d0], new[d1] = new[d1], new[d0]
        return g.emit(f"lib.transpose({var}, {d0}, {d1})", new)
    if kind == "flatten":
        return g.emit(f"lib.flatten({var}, 1)", (shape[0], int(np.prod(shape[1:]))))
    if kind == "linear":
        width = rng.choice([3, 4, 6])
        m = g.module(f"nn.Linear({shape[-1]}, {width}, bias={rng.random() < 0.7})")
        return g.emit(f"{m}({var})", shape[:-1] + (width,))
    if kind == "matmul":
        width = rng.choice([3, 5])
        p = g.param((shape[-1], width))
        return g.emit(f"lib.matmul({var}, {p})", shape[:-1] + (width,))
    if kind == "layernorm":
        m = g.module(f"nn.LayerNorm({shape[-1]})")
        return g.emit(f"{m}({var})", shape)
    if kind == "batchnorm1d":
        m = g.module(f"nn.BatchNorm1d({shape[1]})")
        return g.emit(f"{m}({var})", shape)
    if kind == "attention":
        scores, s_shape = g.emit(f"lib.matmul({var}, lib.transpose({var}, 1, 2)) * {1 / shape[2]:.4f}",
                                 (shape[0], shape[1], shape[1]))
        probs, _ = g.emit(f"lib.softmax({scores}, dim=-1)", s_shape)
        return g.emit(f"lib.matmul({probs}, {var})", shape)
    if kind in ("conv", "conv_residual", "conv_where"):
        n, c, h, w = shape
        if kind == "conv":
            out_c = rng.choice([2, 3, 4])
            k, stride, pad = rng.choice([1, 3]), rng.choice([1, 1, 2]), rng.choice([0, 1])
            groups = rng.choice([g_ for g_ in (1, 2) if c % g_ == 0 and out_c % g_ == 0])
        else:
            out_c, k, stride, pad, groups = c, 3, 1, 1, rng.choice([1, c])
        oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
        if oh < 1 or ow < 1:
            return g.emit(f"F.relu({var})", shape)
        m = g.module(f"nn.Conv2d({c}, {out_c}, {k}, stride={stride}, padding={pad}, groups={groups}, "
                     f"bias={rng.random() < 0.7})")
        if kind == "conv_residual":
            return g.emit(f"{var} + {m}({var})", shape)
        if kind == "conv_where":
            conv, _ = g.emit(f"{m}({var})", shape)
            return g.emit(f"lib.where({conv} > 0.0731, {conv}, {var})", shape)
        return g.emit(f"{m}({var})", (n, out_c, oh, ow))
    if kind == "batchnorm2d":
        m = g.module(f"nn.BatchNorm2d({shape[1]})")
        return g.emit(f"{m}({var})", shape)
    if kind == "pool":
        n, c, h, w = shape
        if rng.random() < 0.3:
            return g.emit(f"F.adaptive_avg_pool2d({var}, 1)", (n, c, 1, 1))
        if h < 2 or w < 2:
            return g.emit(f"lib.tanh({var})", shape)
        op = rng.choice(["avg_pool2d", "max_pool2d"])
        return g.emit(f"F.{op}({var}, 2)", (n, c, h // 2, w // 2))
    raise AssertionError(kind)


# Statements of the wider op set (indexing, padding, resampling, recurrent and transformer
# modules, ...): each reads `var` of `shape` (`same`: other values of that shape) and returns the
# new (variable, shape). `_statement` picks them by rank through MORE_ANY ... MORE_4.

def _index_list(rng, shape, high) -> str:
    """A nested list of `shape` of random indices below `high` (constant index tensors)."""
    if not shape:
        return str(rng.randrange(high))
    return "[" + ", ".join(_index_list(rng, shape[1:], high) for _ in range(shape[0])) + "]"


def _other(g, var, shape, same) -> str:
    return g.rng.choice(same) if same else f"lib.tanh({var})"


def _slice(g, var, shape, same):
    rng, rank = g.rng, len(shape)
    dims = [d for d in range(rank) if shape[d] >= 2]
    if not dims:
        return g.emit(f"lib.sin({var})", shape)
    d = rng.choice(dims)
    n = shape[d]
    if rank >= 2 and rng.random() < 0.25:      # an integer index drops the dim
        k = rng.randrange(-n, n)
        return g.emit(f"{var}[{', '.join([':'] * d + [str(k)])}]", shape[:d] + shape[d + 1:])
    start = rng.randrange(n)
    stop = rng.randint(start + 1, n)
    step = rng.choice([1, 1, 2])
    text = f"{start - n if rng.random() < 0.3 else start}:{stop}" + (f":{step}" if step > 1 else "")
    prefix = "..., " if d == rank - 1 and rank > 1 and rng.random() < 0.5 else ", ".join([":"] * d + [""])
    return g.emit(f"{var}[{prefix}{text}]", shape[:d] + (len(range(start, stop, step)),) + shape[d + 1:])


def _stack(g, var, shape, same):
    d = g.rng.randrange(len(shape) + 1)
    return g.emit(f"lib.stack([{var}, {_other(g, var, shape, same)}], dim={d})", shape[:d] + (2,) + shape[d:])


def _expand(g, var, shape, same):
    d = g.rng.randrange(len(shape))
    k = g.rng.randrange(shape[d])
    return g.emit(f"lib.narrow({var}, {d}, {k}, 1).expand({', '.join(map(str, shape))})", shape)


def _repeat(g, var, shape, same):
    reps = [g.rng.choice([1, 1, 2]) for _ in shape]
    if int(np.prod(shape)) * int(np.prod(reps)) > 400:
        reps = [1] * len(shape)
    return g.emit(f"{var}.repeat({', '.join(map(str, reps))})", tuple(s * r for s, r in zip(shape, reps)))


def _flip_roll(g, var, shape, same):
    rng, rank = g.rng, len(shape)
    dims = rng.sample(range(rank), rng.randint(1, min(2, rank)))
    if rng.random() < 0.5:
        return g.emit(f"lib.flip({var}, {dims})", shape)
    shifts = tuple(rng.randint(-3, 3) for _ in dims)
    return g.emit(f"lib.roll({var}, {shifts}, {tuple(dims)})", shape)


def _pad(g, var, shape, same):
    rng, rank = g.rng, len(shape)
    last = shape[-1]
    if rank in (3, 4) and rng.random() < 0.5:     # torch pads the last dim of 3-D, the last two of 4-D
        mode = rng.choice(["reflect", "replicate"])
        dims = 2 if rank == 4 else 1
        limit = [s - 1 if mode == "reflect" else 2 for s in shape[-dims:]]
        pads = [rng.randint(0, min(2, lim)) for lim in limit for _ in (0, 1)]   # (dim, left/right) pairs
        flat = []
        for k in reversed(range(dims)):   # F.pad lists the last dim first
            flat += pads[2 * k:2 * k + 2]
        new = list(shape)
        for k in range(dims):
            new[rank - dims + k] += pads[2 * k] + pads[2 * k + 1]
        return g.emit(f"F.pad({var}, {tuple(flat)}, mode='{mode}')", tuple(new))
    left, right = rng.randint(0, 2), rng.randint(-1 if last > 1 else 0, 2)
    # Dyadic values: a padded column is constant, and its mean must be exact in any summation order;
    # with -1.2, BatchNorm over it divided a one-ulp x - mean by sqrt(eps), whose sign differed
    # between flowgen's and torch's orders, and abs() turned that into a gradient of 0.01 (seed 346770).
    value = rng.choice([0.0, 0.25, -1.25])
    return g.emit(f"F.pad({var}, ({left}, {right}), value={value})", shape[:-1] + (last + left + right,))


def _gather(g, var, shape, same):
    d = g.rng.randrange(len(shape))
    index_shape = shape[:d] + (g.rng.randint(1, shape[d] + 1),) + shape[d + 1:]
    return g.emit(f"lib.gather({var}, {d}, lib.tensor({_index_list(g.rng, index_shape, shape[d])}))", index_shape)


def _embedding(g, var, shape, same):
    rows = g.rng.randint(2, 7)
    m = g.module(f"nn.Embedding({rows}, {shape[-1]})")
    return g.emit(f"{var} + {m}(lib.tensor({_index_list(g.rng, shape[:-1], rows)}))", shape)


def _extra_reduce(g, var, shape, same):
    rng, rank = g.rng, len(shape)
    d = rng.randrange(rank)
    keep = rank == 1 or rng.random() < 0.5   # no 0-d values
    out = shape[:d] + ((1,) if keep else ()) + shape[d + 1:]
    op = rng.choice(["logsumexp", "std", "norm", "max", "min", "normalize", "cumprod"]
                    + (["cos_sim"] if rank >= 2 else []))
    if op == "std":
        return g.emit(f"lib.std({var}, dim={d}, unbiased=False, keepdim={keep})", out)
    if op in ("max", "min"):
        return g.emit(f"lib.{op}({var}, dim={d}, keepdim={keep})[0]", out)
    if op == "normalize":
        return g.emit(f"F.normalize({var}, dim={d})", shape)
    if op == "cumprod":
        return g.emit(f"lib.cumprod({var}, dim={d})", shape)
    if op == "cos_sim":
        return g.emit(f"F.cosine_similarity({var}, {_other(g, var, shape, same)}, dim={d})", shape[:d] + shape[d + 1:])
    return g.emit(f"lib.{op}({var}, dim={d}, keepdim={keep})", out)


def _triangle(g, var, shape, same):
    return g.emit(f"lib.{g.rng.choice(['tril', 'triu'])}({var}, {g.rng.randint(-1, 1)})", shape)


def _recurrent(g, var, shape, same):
    rng = g.rng
    cell = rng.choice(["LSTM", "GRU", "RNN"])
    hidden, directions = rng.choice([2, 3, 4]), rng.choice([1, 2])
    layers = rng.choice([1, 1, 2])
    m = g.module(f"nn.{cell}({shape[-1]}, {hidden}, num_layers={layers}, batch_first=True, "
                 f"bidirectional={directions == 2})")
    return g.emit(f"{m}({var})[0]", shape[:-1] + (hidden * directions,))


def _transformer(g, var, shape, same):
    rng = g.rng
    width = shape[-1]
    heads = rng.choice([h for h in (1, 2) if width % h == 0])
    if rng.random() < 0.5:
        m = g.module(f"nn.MultiheadAttention({width}, {heads}, batch_first=True, bias={rng.random() < 0.7})")
        return g.emit(f"{m}({var}, {var}, {var})[0]", shape)
    m = g.module(f"nn.TransformerEncoderLayer({width}, {heads}, dim_feedforward=8, dropout=0.0, batch_first=True, "
                 f"norm_first={rng.random() < 0.5}, activation='{rng.choice(['relu', 'gelu'])}')")
    return g.emit(f"{m}({var})", shape)


def _conv1d(g, var, shape, same):
    n, c, length = shape
    k = g.rng.choice([1, 2, 3])
    pad = g.rng.randint(max(0, -(-(k - length) // 2)), k - 1) if k > 1 else 0   # at least one output
    out_c = g.rng.choice([2, 3])
    m = g.module(f"nn.Conv1d({c}, {out_c}, {k}, padding={pad})")
    return g.emit(f"{m}({var})", (n, out_c, length + 2 * pad - k + 1))


def _einsum(g, var, shape, same):
    return g.emit(f"lib.einsum('bij,bkj->bik', {var}, {_other(g, var, shape, same)})", shape[:2] + (shape[1],))


def _upsample(g, var, shape, same):
    rng = g.rng
    n, c, h, w = shape
    mode = rng.choice(["nearest", "bilinear"])
    corners = f", align_corners={rng.random() < 0.5}" if mode == "bilinear" else ""
    if rng.random() < 0.5:
        return g.emit(f"F.interpolate({var}, scale_factor=2, mode='{mode}'{corners})", (n, c, 2 * h, 2 * w))
    size = (rng.randint(1, 8), rng.randint(1, 8))
    return g.emit(f"F.interpolate({var}, size={size}, mode='{mode}'{corners})", (n, c) + size)


def _pool_more(g, var, shape, same):
    rng = g.rng
    n, c, h, w = shape
    kind = rng.choice(["max3", "avg3", "ceil", "adaptive"])
    if kind == "max3":
        return g.emit(f"F.max_pool2d({var}, 3, stride=2, padding=1)", (n, c, (h - 1) // 2 + 1, (w - 1) // 2 + 1))
    if kind == "avg3":
        return g.emit(f"F.avg_pool2d({var}, 3, stride=1, padding=1, count_include_pad={rng.random() < 0.5})", shape)
    if kind == "ceil" and h >= 2 and w >= 2:
        op = rng.choice(["max_pool2d", "avg_pool2d"])
        return g.emit(f"F.{op}({var}, 2, ceil_mode=True)", (n, c, -(-h // 2), -(-w // 2)))
    size = (rng.randint(1, 3), rng.randint(1, 3))
    return g.emit(f"F.adaptive_avg_pool2d({var}, {size})", (n, c) + size)


def _conv_more(g, var, shape, same):
    rng = g.rng
    n, c, h, w = shape
    out_c = rng.choice([2, 3])
    bias = rng.random() < 0.7
    if rng.random() < 0.5:
        k, stride = rng.choice([2, 3]), rng.choice([1, 2])
        pad, extra = rng.randint(0, k - 1), rng.randint(0, stride - 1)
        oh, ow = (h - 1) * stride - 2 * pad + k + extra, (w - 1) * stride - 2 * pad + k + extra
        if oh < 1 or ow < 1:
            return g.emit(f"lib.cos({var})", shape)
        m = g.module(f"nn.ConvTranspose2d({c}, {out_c}, {k}, stride={stride}, padding={pad}, output_padding={extra}, "
                     f"bias={bias})")
        return g.emit(f"{m}({var})", (n, out_c, oh, ow))
    padding = rng.choice(["2, dilation=2", "'same'"])
    m = g.module(f"nn.Conv2d({c}, {out_c}, 3, padding={padding}, bias={bias})")
    return g.emit(f"{m}({var})", (n, out_c, h, w))


def _instance_norm(g, var, shape, same):
    if shape[2] * shape[3] < 2:   # one value per channel: torch raises in training
        return g.emit(f"lib.tanh({var})", shape)
    m = g.module(f"nn.InstanceNorm2d({shape[1]}, affine=True)")   # (a parameter: `emit` counts it trainable)
    return g.emit(f"{m}({var})", shape)


# In-place writes, as PyTorch defines them: a tensor to write (a copy of `var`, or a constant the
# forward makes, as DCGAN's `label`), maybe read first (a value, or a view that later reads must
# see written), then one write: an in-place method, operator or `x[key] = value` on it or on a
# view of it (slice, select, t/transpose/permute, view(-1), unsqueeze, narrow, detach). Later
# statements read the written tensor and the earlier read. Reads before the write are ops whose
# backward does not read their input (torch raises "modified by an inplace operation" otherwise).

READS_BEFORE_WRITE = ["{t} * 2.0", "{t} - 0.5", "lib.tanh({t})", "lib.sigmoid({t})", "F.relu({t})", "lib.exp(-{t})",
                      "lib.cumsum({t}, dim=0)", "lib.where({t} > 0.0731, {t}, 0.5)"]


def _constant(rng) -> float:
    return rng.choice([-1.5, -0.5, 0.25, 0.75, 2.0])


def _place(g, t, shape, contiguous: bool = True) -> tuple:
    """Something to write in place: (expression, shape, whether it is all of `t`, whether it is a
    subscript (so `+=` and `=` may assign to it)); `view(-1)` only of a `contiguous` t."""
    rng, rank = g.rng, len(shape)
    kinds = ["whole", "index", "slice", "narrow", "detach"] + (["flat"] if contiguous else []) + \
        (["t"] if rank == 2 else []) + \
        (["transpose", "permute", "unsqueeze"] if rank >= 2 else [])
    kind = rng.choice(kinds)
    if kind == "whole":
        return t, shape, True, False
    if kind == "index" and rank >= 2:
        k = rng.randrange(-shape[0], shape[0])
        return f"{t}[{k}]", shape[1:], shape[0] == 1, True
    if kind == "flat":
        n = int(np.prod(shape))
        a = rng.randrange(n)
        b = rng.randint(a + 1, n)
        if b - a == n:   # all of it: PyTorch's `view[0:n] += p` reuses the view for its setitem, which
            return f"{t}.view(-1)", (n,), True, False   # raises once t needs a gradient (a torch quirk)
        return f"{t}.view(-1)[{a}:{b}]", (b - a,), False, True
    if kind == "narrow":
        d = rng.randrange(rank)
        start = rng.randrange(shape[d])
        length = rng.randint(1, shape[d] - start)
        return (f"{t}.narrow({d}, {start}, {length})", shape[:d] + (length,) + shape[d + 1:], length == shape[d],
                False)
    if kind == "detach":   # the write changes t's values, not its gradient
        expr, sub_shape, whole, subscript = _place(g, f"{t}.detach()", shape, contiguous)
        return expr, sub_shape, False, subscript
    if kind in ("t", "transpose", "permute", "unsqueeze"):
        if kind == "t":
            base, base_shape = f"{t}.t()", (shape[1], shape[0])
        elif kind == "transpose":
            d0, d1 = rng.sample(range(rank), 2)
            dims = list(range(rank))
            dims[d0], dims[d1] = d1, d0
            base, base_shape = f"{t}.transpose({d0}, {d1})", tuple(shape[d] for d in dims)
        elif kind == "permute":
            dims = list(range(rank))
            rng.shuffle(dims)
            base, base_shape = f"{t}.permute{tuple(dims)}", tuple(shape[d] for d in dims)
        else:
            base, base_shape = f"{t}.unsqueeze(0)[0]", shape
        k = rng.randrange(base_shape[0])
        return f"{base}[{k}]", base_shape[1:], base_shape[0] == 1, True
    dims = [d for d in range(rank) if shape[d] >= 2]   # "slice" (and "index" of a 1-D t)
    if not dims:
        return t, shape, True, False
    d = rng.choice(dims)
    start = rng.randrange(shape[d])
    stop = rng.randint(start + 1, shape[d])
    step = rng.choice([1, 1, 2])
    size = len(range(start, stop, step))
    text = f"{start}:{stop}" + (f":{step}" if step > 1 else "")
    return (f"{t}[{', '.join([':'] * d + [text])}]", shape[:d] + (size,) + shape[d + 1:], size == shape[d],
            True)


def _operand(g, shape, tensor: bool = False) -> str:
    """A value to combine with a place of `shape`: a constant (unless `tensor`), or a parameter
    broadcast to it."""
    if not tensor and (not shape or g.rng.random() < 0.4):
        return str(_constant(g.rng))
    return g.param(_broadcast_shape(g.rng, shape)) if shape else f"lib.tensor({_constant(g.rng)})"


def _write(g, t, shape, contiguous: bool = True) -> tuple:
    """One in-place write to `t` or a view of it: (statement, whether it overwrites all of t with
    constants)."""
    rng = g.rng
    pick = rng.random()
    if pick < 0.25:
        return _setitem(g, t, shape), False
    place, p_shape, whole, subscript = _place(g, t, shape, contiguous)
    if (subscript or place == t) and pick < 0.4:
        op = rng.choice(["+=", "-=", "*=", "/="])
        value = _operand(g, p_shape) if op in ("+=", "-=") else str(rng.choice([0.5, 2.0, -1.5]))
        return f"{place} {op} {value}", False
    if pick < 0.45:
        return rng.choice([f"F.relu({place}, inplace=True)", f"F.leaky_relu({place}, 0.2, inplace=True)"]), False
    method = rng.choice(["mul_", "add_", "sub_", "div_", "clamp_", "clamp_min_", "relu_", "sigmoid_", "tanh_", "abs_",
                         "neg_", "fill_", "zero_", "masked_fill_", "copy_", "lerp_", "addcmul_", "exp_", "square_"])
    if method in ("copy_", "mul_", "add_"):
        return f"{place}.{method}({_operand(g, p_shape, tensor=method == 'copy_')})", False
    if method == "lerp_":
        return f"{place}.lerp_({_operand(g, p_shape, tensor=True)}, 0.3)", False
    if method == "sub_":
        return f"{place}.sub_({_operand(g, p_shape)}, alpha=0.5)", False
    if method == "addcmul_":
        return (f"{place}.addcmul_({_operand(g, p_shape, tensor=True)}, {_operand(g, p_shape, tensor=True)}, "
                f"value=0.5)", False)
    if method == "div_":
        return f"{place}.div_({rng.choice([2.0, -4.0, 0.5])})", False
    if method == "clamp_":
        return f"{place}.clamp_(min=-0.3, max=0.6)", False
    if method == "clamp_min_":
        return f"{place}.clamp_min_(0.1)", False
    if method == "fill_":
        return f"{place}.fill_({_constant(rng)})", whole
    if method == "masked_fill_":
        return f"{place}.masked_fill_({place} < {rng.choice([-0.137, 0.0731, 0.43])}, {_constant(rng)})", False
    return f"{place}.{method}()", whole and method == "zero_"


def _setitem(g, t, shape) -> str:
    """`t[key] = value`: constant keys (ints, slices, lists, a boolean mask) and masks the forward
    computes (over all of t, or over its leading dims)."""
    rng, rank = g.rng, len(shape)
    kind = rng.choice(["index", "slice", "list", "mask", "mask", "leading_mask", "constant_mask"])
    if kind == "mask":
        return f"{t}[{t} > {rng.choice([-0.137, 0.0731, 0.43])}] = {_constant(rng)}"
    if kind == "leading_mask" and rank >= 2:
        return f"{t}[lib.sum({t}, dim=-1) > 0.0731] = {_constant(rng)}"
    if kind == "constant_mask":
        mask_shape = shape[:rng.randint(1, rank)]
        mask = _index_list(rng, mask_shape, 2).replace("0", "False").replace("1", "True")
        return f"{t}[lib.tensor({mask})] = {_constant(rng)}"
    if kind == "list" and shape[0] >= 2:
        rows = sorted(rng.sample(range(shape[0]), rng.randint(1, shape[0])))
        return f"{t}[{rows}] = {_operand(g, (len(rows),) + shape[1:])}"
    if kind == "index" and rank >= 2:
        return f"{t}[{rng.randrange(shape[0])}] = {_operand(g, shape[1:])}"
    d = rng.randrange(rank)
    start = rng.randrange(shape[d])
    stop = rng.randint(start + 1, shape[d])
    key = ", ".join([":"] * d + [f"{start}:{stop}"])
    return f"{t}[{key}] = {_operand(g, shape[:d] + (stop - start,) + shape[d + 1:])}"


def _inplace(g, var, shape, same):
    rng = g.rng
    read, r_shape, view, row_major = None, None, False, True
    if rng.random() < 0.2:   # a constant the forward makes, read, then written (DCGAN's label.fill_)
        t, _ = g.emit(f"lib.{rng.choice(['ones', 'zeros'])}({', '.join(map(str, shape))}, dtype={var}.dtype)", shape)
        g.trainable.discard(t)   # (it reads only var's dtype)
        read, r_shape = g.emit(f"{var} * 2.0 + {t}", shape)
    else:
        # torch's `var * 1.0` keeps the layout of a permuted var, where view(-1) raises and
        # reshape(-1) copies (flowgen's results are row-major): view(-1) only of a contiguous() copy
        row_major = rng.random() < 0.5
        t, _ = g.emit(f"{var}.contiguous() * 1.0" if row_major else f"{var} * 1.0", shape)
        if rng.random() < 0.35:
            read, r_shape = g.emit(rng.choice(READS_BEFORE_WRITE).format(t=t), shape)
        elif rng.random() < 0.55 and max(shape) >= 2:     # a view of t: reading it after the write sees the write
            view = True
            read, r_shape = _slice(g, t, shape, same) if len(shape) < 2 or rng.random() < 0.6 else \
                g.emit(f"lib.transpose({t}, 0, 1)", (shape[1], shape[0]) + shape[2:])
    if view and rng.random() < 0.3:   # written through the view read before
        statement, overwrites = _write(g, read, r_shape, contiguous=False)
        g.mutate(statement, t)
        if overwrites:
            g.trainable.discard(read)
    else:
        statement, overwrites = _write(g, t, shape, row_major)
        g.mutate(statement, t)
        if overwrites:   # constants all over t (and a view of it): no gradient
            g.trainable.discard(t)
            if view:
                g.trainable.discard(read)
    if view and t in g.trainable and not overwrites:   # (it reads t's new value)
        g.trainable.add(read)
    if read is None:
        return t, shape
    if tuple(r_shape) == tuple(shape):
        return g.emit(f"{t} + {read}", shape)
    g.also.append((read, tuple(r_shape)))
    if rng.random() < 0.5:
        return g.emit(f"{t} + lib.mean({read})", shape)
    return t, shape


MORE_KINDS = {"slice": _slice, "stack": _stack, "expand": _expand, "repeat": _repeat, "flip_roll": _flip_roll,
              "pad": _pad, "gather": _gather, "embedding": _embedding, "extra_reduce": _extra_reduce,
              "triangle": _triangle, "recurrent": _recurrent, "transformer": _transformer, "conv1d": _conv1d,
              "einsum": _einsum, "upsample": _upsample, "pool_more": _pool_more, "conv_more": _conv_more,
              "instance_norm": _instance_norm, "inplace": _inplace}
MORE_ANY = ["slice", "expand", "repeat", "flip_roll", "pad", "gather", "extra_reduce", "inplace", "inplace"]
MORE_2_UP = ["embedding", "triangle"]
MORE_3 = ["recurrent", "transformer", "conv1d", "einsum"]
MORE_4 = ["upsample", "pool_more", "conv_more", "instance_norm"]


INPUT_SHAPES = [(2, 3, 5, 5), (2, 2, 4, 6), (4, 6), (3, 5), (5, 8), (2, 3, 4), (2, 4, 5)]
LOSSES = ["F.mse_loss(out, target)", "F.l1_loss(out, target)", "F.smooth_l1_loss(out, target)",
          "F.binary_cross_entropy_with_logits(out, target)", "lib.mean(out * out)", "lib.sum(out * target)",
          "F.mse_loss(out, target, reduction='sum')", "F.huber_loss(out, target, delta=0.5)",
          "F.smooth_l1_loss(out, target, beta=0.5)", "F.binary_cross_entropy(lib.sigmoid(out), target)",
          "F.kl_div(lib.log_softmax(out, dim=-1), lib.softmax(target, dim=-1), reduction='batchmean')"]
LABEL_LOSSES = ["F.cross_entropy(out, target)", "F.nll_loss(lib.log_softmax(out, dim=1), target)",
                "F.cross_entropy(out, target, label_smoothing=0.1)", "F.cross_entropy(out, target, reduction='sum')",
                "F.cross_entropy(out, target, weight=lib.linspace(0.5, 2.0, out.shape[1], dtype=out.dtype))",
                "F.cross_entropy(out.double(), target)"]
FLOAT64_LOSSES = ["F.mse_loss(out.double(), target.double())", "lib.sum(out.double() * target)",
                  "F.smooth_l1_loss(out.double(), target.double(), beta=0.5)"]
AUX_LOSSES = ["lib.mean({v} * {v}) * 0.1", "lib.sum(lib.abs({v})) * 0.01", "lib.mean(lib.tanh({v}).double())",
              "F.mse_loss({v}, lib.zeros_like({v}))", "lib.amax({v}) * 0.5"]


def _label_loss(rng, classes: int) -> tuple:
    """(loss, target) of a cross-entropy or NLL loss of `classes` classes; some labels may be an
    ignored one (-100, the default ignore_index, or a class)."""
    loss = rng.choice(LABEL_LOSSES)
    ignore = rng.choice([None, None, -100, "class"])
    if ignore is None:
        return loss, f"labels:{classes}"
    if ignore == "class":
        ignore = rng.randrange(classes) if classes > 1 else -100
    if ignore != -100 or rng.random() < 0.5:
        loss = f"{loss[:-1]}, ignore_index={ignore})"
    return loss, f"labels:{classes}:{ignore}"


def _aux_loss(g, out: str) -> str:
    """An auxiliary loss on a value the parameters reach (its own backward() in training): an
    intermediate one if there is one, else `out`."""
    candidates = sorted(v for v in g.trainable if v.startswith("h") and v != out) or [out]
    return g.rng.choice(AUX_LOSSES).format(v=g.rng.choice(candidates))


def generate(seed: int) -> Program:
    """A random program of 3 to 9 statements (seeded: the same seed gives the same program)."""
    g = _Gen(seed)
    rng = g.rng
    input_shape = rng.choice(INPUT_SHAPES)
    pool = [("x", input_shape)]
    for _ in range(rng.randint(3, 9)):
        result = _statement(g, pool)
        pool += g.also
        g.also = []
        pool.append(result)
    var, shape = pool[-1]
    if len(shape) == 2 and rng.random() < 0.08:   # one logit per row (one-class cross-entropy)
        m = g.module(f"nn.Linear({shape[1]}, 1)")
        var, shape = g.emit(f"{m}({var})", (shape[0], 1))
    if var not in g.trainable:   # something to train
        var, shape = g.emit(f"{var} * {g.param(_broadcast_shape(rng, shape))}", shape)
    g.body.append(f"out = {var}")
    if len(shape) == 2 and rng.random() < (0.5 if shape[1] == 1 else 0.3):
        loss, target = _label_loss(rng, shape[1])
        target_shape = (shape[0],)
    else:
        loss = rng.choice(LOSSES + FLOAT64_LOSSES)
        target = "unit" if "binary_cross" in loss else "float"
        target_shape = shape
    optimizer = rng.choice(sorted(OPTIMIZERS))
    aux = _aux_loss(g, var) if rng.random() < 0.25 else ""
    dtype = "float64" if rng.random() < 0.15 else "float32"
    return Program(seed, input_shape, g.init, g.body, loss, target, target_shape, optimizer, aux, dtype)


# ----------------------------------------------------------------------------------------------
# Running a program: flowgen eager (float32, float64), graphs, torch

def _namespaces(library: str) -> dict:
    if library == "torch":
        import torch   # the optional oracle: imported only when a torch comparison is asked for

        return {"lib": _StableTorch(torch), "nn": torch.nn, "F": torch.nn.functional}
    return {"lib": flow, "nn": flow_nn, "F": flow_F}


class _StableTorch:
    """`torch`, but sort and topk keep tied values in index order, as flowgen documents (which
    tied elements torch picks is unspecified: its CPU topk took the last of tied values where
    flowgen takes the first, and the gradient then reaches other elements; fuzz seed 702616)."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def sort(self, x, dim=-1, descending=False):
        return self._torch.sort(x, dim=dim, descending=descending, stable=True)

    def topk(self, x, k, dim=-1, largest=True):
        values, indices = self._torch.sort(x, dim=dim, descending=largest, stable=True)
        return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)


def model_class(program: Program, library: str = "flowgen"):
    """An `nn.Module` subclass (of flowgen or torch) running `program`."""
    code = "\n".join(["def __init__(self):", "    super(type(self), self).__init__()"]
                     + [f"    {line}" for line in program.init] + ["def forward(self, x):"]
                     + [f"    {line}" for line in program.body] + _returns(program))
    return _compiled_class(code, program.seed, library)


@functools.lru_cache(maxsize=256)
def _compiled_class(code: str, seed: int, library: str):
    """The class of `model_class`, compiled once per source (each program runs several times)."""
    names = _namespaces(library)
    scope = dict(names)
    exec(compile(code, f"<fuzz program {seed}>", "exec"), scope)
    return type(f"Fuzz{seed}", (names["nn"].Module,), {"__init__": scope["__init__"], "forward": scope["forward"]})


def loss_fn(program: Program, library: str = "flowgen"):
    return _compiled_loss(program.loss, program.seed, library)


@functools.lru_cache(maxsize=256)
def _compiled_loss(expression: str, seed: int, library: str):
    scope = dict(_namespaces(library))
    return eval(compile(f"lambda out, target: {expression}", f"<fuzz loss {seed}>", "eval"), scope)


def make_data(program: Program) -> tuple:
    """(x, target) as NumPy arrays, seeded by the program."""
    rng = np.random.default_rng(program.seed)
    x = rng.standard_normal(program.input_shape).astype(np.float32)
    if program.target.startswith("labels:"):
        classes, *ignored = map(int, program.target.split(":")[1:])
        target = rng.integers(0, classes, program.target_shape).astype(np.int64)
        if ignored:   # about a third of the labels ignored, never all (a mean over none is NaN)
            target[rng.random(target.shape) < 0.35] = ignored[0]
            if np.all(target == ignored[0]):
                target[0] = (ignored[0] + 1) % classes if 0 <= ignored[0] else 0
    elif program.target == "unit":
        target = rng.uniform(0, 1, program.target_shape).astype(np.float32)
    else:
        target = rng.standard_normal(program.target_shape).astype(np.float32)
    return x, target


def _tensor(a, dtype):
    a = np.asarray(a)
    return flow.tensor(a, dtype=dtype) if a.dtype.kind == "f" else flow.tensor(a)


OPTIMIZERS = {   # the program's optimizer: its name -> the constructor
    "sgd": lambda params: flow.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: flow.optim.Adam(params, lr=0.01),
    "adamw": lambda params: flow.optim.AdamW(params, lr=0.01, betas=(0.8, 0.95), weight_decay=0.1),
    "amsgrad": lambda params: flow.optim.Adam(params, lr=0.01, amsgrad=True, weight_decay=0.01),
    "nesterov": lambda params: flow.optim.SGD(params, lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.01),
    "rmsprop": lambda params: flow.optim.RMSprop(params, lr=0.01, momentum=0.5, centered=True),
    "adagrad": lambda params: flow.optim.Adagrad(params, lr=0.05),
}


def _optimizer(program: Program, params):
    return OPTIMIZERS[program.optimizer](params)


def _dtype(program: Program):
    """The dtype of the program's graphs."""
    return flow.float64 if program.dtype == "float64" else flow.float32


def _out_and_aux(result) -> tuple:
    """A model's (out, auxiliary loss or None)."""
    return result if isinstance(result, tuple) else (result, None)


def _backward(loss, aux) -> None:
    """The training step's backward calls: the loss's, then the auxiliary loss's."""
    if aux is None:
        loss.backward()
    else:
        loss.backward(retain_graph=True)
        aux.backward()


class _Batch(flow_nn.Module):
    """Several programs' models side by side (disjoint parameters)."""

    def __init__(self, models):
        super().__init__()
        for k, m in enumerate(models):
            setattr(self, f"prog{k}", m)

    def forward(self, *xs):
        return tuple(getattr(self, f"prog{k}")(x) for k, x in enumerate(xs))


class _Infer(flow_nn.Graph):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def build(self, *xs):
        return tuple(_out_and_aux(result)[0] for result in self.batch(*xs))


class _Train(flow_nn.Graph):
    def __init__(self, batch, losses, optimizers):
        super().__init__()
        self.batch = batch
        self.losses = losses
        for opt in optimizers:
            self.add_optimizer(opt)

    def build(self, *args):
        """The programs' losses, then their auxiliary losses: each sum has its own backward()."""
        half = len(args) // 2
        results = [_out_and_aux(result) for result in self.batch(*args[:half])]
        losses = [fn(out, t) for fn, (out, _), t in zip(self.losses, results, args[half:])]
        auxes = [aux for _, aux in results if aux is not None]
        _backward(_sum(losses), _sum(auxes) if auxes else None)
        return tuple(losses) + tuple(auxes)


def _sum(values):
    total = values[0]
    for extra in values[1:]:
        total = total + extra
    return total


def initial_states(programs) -> list:
    """Each program's initial state dict (float32, seeded by the program) as NumPy arrays. A
    normalization's affine parameters start away from their defaults (weight 1, bias 0), as a
    trained model's are: with the defaults a mean over a normalized group is 0 in exact arithmetic,
    and its sign in floating point, which abs() or a threshold turns into a gradient of 1 or 0,
    depends on the summation order (seed 412317: GroupNorm, a mean, log(abs(.) + 1))."""
    states = []
    for p in programs:
        flow.manual_seed(p.seed)
        rng = np.random.default_rng(p.seed)
        state = {k: v.numpy().copy() for k, v in model_class(p)().state_dict().items()}
        for k, v in state.items():
            if k.rsplit(".", 1)[-1] in ("weight", "bias") and v.dtype.kind == "f" and v.size and \
                    (np.all(v == 0) or np.all(v == 1)):
                state[k] = (v + rng.uniform(-0.3, 0.3, v.shape)).astype(v.dtype)
        states.append(state)
    return states


def _fresh(program, state, dtype):
    model = model_class(program)()
    model.load_state_dict({k: flow.tensor(v) for k, v in state.items()})
    return model.to(dtype) if dtype == flow.float64 else model


def _state_arrays(model) -> dict:
    return {k: v.numpy().astype(np.float64) for k, v in model.state_dict().items()
            if v.dtype in (flow.float32, flow.float64)}


def run_graphs(programs, states) -> list:
    """Inference (eval) and 3 training steps of all programs in one pair of graphs (float32, or
    float64 for a program that says so)."""
    data = [make_data(p) for p in programs]
    models = [_fresh(p, s, _dtype(p)) for p, s in zip(programs, states)]
    batch = _Batch(models)
    batch.eval()
    outs = _Infer(batch)(*[_tensor(x, _dtype(p)) for p, (x, _) in zip(programs, data)])
    results = [{"inference": o.numpy().astype(np.float64)} for o in outs]
    batch.train()
    optimizers = [_optimizer(p, m.parameters()) for p, m in zip(programs, models)]
    graph = _Train(batch, [loss_fn(p) for p in programs], optimizers)
    args = ([_tensor(x, _dtype(p)) for p, (x, _) in zip(programs, data)]
            + [_tensor(t, _dtype(p)) for p, (_, t) in zip(programs, data)])
    with_aux = [r for p, r in zip(programs, results) if p.aux]
    for step in range(STEPS):
        values = graph(*args)
        for r, loss in zip(results, values):
            r[f"loss step {step}"] = np.asarray(loss.numpy(), np.float64)
        for r, aux in zip(with_aux, values[len(programs):]):
            r[f"aux step {step}"] = np.asarray(aux.numpy(), np.float64)
    for r, m in zip(results, models):
        r.update({f"after {STEPS} steps: {k}": v for k, v in _state_arrays(m).items()})
    return results


def _perturbed(array, rng, relative: float):
    """`array` with each float element moved by up to `relative` of itself (in float64)."""
    if array.dtype.kind != "f":
        return array
    return array.astype(np.float64) * (1 + relative * rng.uniform(-1, 1, array.shape))


@contextlib.contextmanager
def rounding_noise(seed: int, relative: float):
    """Eager ops whose float results are each moved by up to `relative` of themselves, and an
    exactly zero element by up to `relative` of the largest finite magnitude among the op's
    inputs and outputs (a cancellation summed in another valid order leaves about an ulp of its
    terms, which `abs`, `relu` or Adam may turn into a different result). Results that share
    memory with an input (views: no rounding happens) are left alone. The NumPy references of
    the op registry are wrapped while the block runs."""
    rng = np.random.default_rng(seed)

    def noisy(array, scale):
        if not isinstance(array, np.ndarray) or array.dtype.kind != "f" or not array.size:
            return array
        a = array.astype(np.float64)
        r = relative * rng.uniform(-1, 1, a.shape)
        moved = np.where(a == 0, r * scale, a * (1 + r))
        return np.asarray(moved.astype(array.dtype))

    def wrapped(ref):
        def run(*arrays, **attrs):
            result = ref(*arrays, **attrs)
            outs = result if isinstance(result, tuple) else (result,)
            ins = [a for a in arrays if isinstance(a, np.ndarray) and a.dtype.kind == "f"]
            if any(isinstance(o, np.ndarray) and np.shares_memory(o, a) for o in outs for a in ins):
                return result
            floats = [np.abs(a[np.isfinite(a)]) for a in ins + [o for o in outs if isinstance(o, np.ndarray)
                                                                and o.dtype.kind == "f"]]
            scale = max((float(f.max()) for f in floats if f.size), default=0.0)
            moved = tuple(noisy(o, scale) for o in outs)
            return moved if isinstance(result, tuple) else moved[0]
        return run

    refs = {name: op.ref for name, op in REGISTRY.items()}
    try:
        for op in REGISTRY.values():
            op.ref = wrapped(op.ref)
        yield
    finally:
        for name, ref in refs.items():
            REGISTRY[name].ref = ref


def run_eager(program, state, dtype, perturb: int | None = None, noise: int | None = None) -> tuple:
    """The same as `run_graphs` for one program in eager mode; also the first step's gradients.
    With `perturb` (a seed), the input and initial state are first moved by up to one float32
    ulp each (float64: 2**-40, a few thousand ulps, enough to flip a comparison that rounding
    decides); with `noise` (a seed), every op's result is moved as much (`rounding_noise`)."""
    relative = 2.0 ** -23 if dtype == flow.float32 else 2.0 ** -40
    if noise is not None:
        with rounding_noise(noise, relative):
            return run_eager(program, state, dtype, perturb)
    x, target = make_data(program)
    if perturb is not None:
        rng = np.random.default_rng(perturb)
        x = _perturbed(x, rng, relative)
        state = {k: _perturbed(v, rng, relative) for k, v in state.items()}
    model = _fresh(program, state, dtype)
    model.eval()
    result = {"inference": _out_and_aux(model(_tensor(x, dtype)))[0].numpy().astype(np.float64)}
    model.train()
    opt = _optimizer(program, model.parameters())
    fn = loss_fn(program)
    grads = {}
    for step in range(STEPS):
        out, aux = _out_and_aux(model(_tensor(x, dtype)))
        loss = fn(out, _tensor(target, dtype))
        opt.zero_grad()
        _backward(loss, aux)
        if step == 0:
            grads = {k: p.grad.numpy().astype(np.float64) for k, p in model.named_parameters() if p.grad is not None}
        opt.step()
        result[f"loss step {step}"] = np.asarray(loss.numpy(), np.float64)
        if aux is not None:
            result[f"aux step {step}"] = np.asarray(aux.numpy(), np.float64)
    result.update({f"after {STEPS} steps: {k}": v for k, v in _state_arrays(model).items()})
    return result, grads


def run_torch(program, state) -> tuple:
    """Torch float64: eval output, first training loss and gradients (None without torch)."""
    try:
        import torch   # the optional oracle
    except ImportError:
        return None
    x, target = make_data(program)
    model = model_class(program, "torch")()
    model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in state.items()}, strict=True)
    model = model.double()
    for module in model.modules():
        if isinstance(module, (torch.nn.modules.batchnorm._BatchNorm, torch.nn.modules.instancenorm._InstanceNorm,
                               torch.nn.GroupNorm)):
            module.register_forward_pre_hook(_contiguous_inputs)
            module.register_forward_hook(_contiguous_output_gradient)
    model.eval()
    with torch.no_grad():
        out = _out_and_aux(model(torch.from_numpy(x.astype(np.float64))))[0].numpy()
    model.train()
    t = torch.from_numpy(target.astype(np.float64) if target.dtype.kind == "f" else target)
    train_out, aux = _out_and_aux(model(torch.from_numpy(x.astype(np.float64))))
    loss = loss_fn(program, "torch")(train_out, t)
    _backward(loss, aux)
    grads = {k: p.grad.numpy() for k, p in model.named_parameters() if p.grad is not None}
    values = {"inference": out, "loss step 0": loss.detach().numpy()}
    if aux is not None:
        values["aux step 0"] = aux.detach().numpy()
    return values, grads


def _contiguous_inputs(module, inputs):
    """Torch BatchNorm's, InstanceNorm's and GroupNorm's inputs with row-major strides (same
    values): torch 2.13's CPU BatchNorm2d backward is wrong where the input or the output's
    gradient has strides that also read as channels_last (a transposed [N, C, H, 1]) and the other
    does not -- the bias gradient is not the sum of the output gradient (fuzz seeds 730247, 702446;
    InstanceNorm2d, which runs batch_norm, with a permuted output: 931347); its GroupNorm backward
    crashes the process (segmentation fault) on a [3, 1, 3, 1] with strides (3, 1, 1, 1), which
    contiguous() keeps (fuzz seed 2071)."""
    return tuple(_row_major(t) for t in inputs)


def _contiguous_output_gradient(module, inputs, output):
    """The gradient reaching torch BatchNorm's backward made row-major (see `_contiguous_inputs`)."""
    if output.requires_grad:
        output.register_hook(_row_major)


def _row_major(t):
    import torch   # the optional oracle

    return t.clone(memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------------------------
# Comparing

def mismatch(name, graph32, eager32_runs, eager64) -> str | None:
    """Why `graph32` is not as close to `eager64` as float32 allows, or None: its error may be
    `ERROR_FACTOR` times the largest error of the eager float32 runs (exact and ulp-perturbed
    inputs: how much float32 rounding can move this result) plus `ROUNDING_UNITS` float32
    units of the result's largest magnitude. An element that some eager float32 run makes
    non-finite is not compared: float32 overflows there (a training step past 3.4e38), or
    rounding alone decides it (centered RMSprop on a gradient that cancels to an ulp-sized
    residue takes the square root of a rounded difference: NaN in one run, a whole step in
    another; fuzz seed 911388)."""
    g, r = np.asarray(graph32, np.float64), np.asarray(eager64, np.float64)
    if g.shape != r.shape:
        return f"{name}: shape {g.shape} in the graph, {r.shape} in eager"
    undecided = np.zeros(g.shape, bool)
    for e in eager32_runs:
        undecided |= ~np.isfinite(np.asarray(e, np.float64))
    if not np.all(np.isfinite(g) | undecided):
        return f"{name}: the graph gives non-finite values {g.ravel()[:6]}"
    keep = ~undecided & np.isfinite(r)
    if not keep.any():
        return None
    scale = float(np.max(np.abs(r[keep])))
    err_eager = max(float(np.max(np.abs(np.asarray(e, np.float64)[keep] - r[keep]))) for e in eager32_runs)
    err_graph = float(np.max(np.abs(g[keep] - r[keep])))
    allowed = ERROR_FACTOR * err_eager + ROUNDING_UNITS * EPS32 * scale
    if err_graph > allowed:
        return (f"{name}: graph float32 is {err_graph:.3g} from eager float64 (allowed {allowed:.3g}: eager float32 "
                f"is {err_eager:.3g} off, largest magnitude {scale:.3g}); graph {g.ravel()[:4]}, eager {r.ravel()[:4]}")
    return None


def torch_mismatch(name, flow64, torch64, flow64_moved=()) -> str | None:
    """Why flowgen's float64 result differs from torch's by more than `TORCH_RTOL` (plus
    `ERROR_FACTOR` times how far the perturbed flowgen float64 runs `flow64_moved` move: a
    comparison that rounding decides, like `where(x > 0, ...)` on an x that cancels to zero), or None."""
    a, b = np.asarray(flow64, np.float64), np.asarray(torch64, np.float64)
    if a.shape != b.shape:
        return f"{name}: shape {a.shape} in flowgen, {b.shape} in torch"
    if not b.size:
        return None
    scale = float(np.max(np.abs(b)))
    err = float(np.max(np.abs(a - b)))
    spread = max((float(np.max(np.abs(np.asarray(m, np.float64) - a))) for m in flow64_moved), default=0.0)
    if err > TORCH_RTOL * max(scale, 1.0) + ERROR_FACTOR * spread:
        return (f"{name}: flowgen float64 is {err:.3g} from torch float64 (largest magnitude {scale:.3g}, "
                f"perturbed flowgen runs move {spread:.3g})")
    return None


class _Eager:
    """One program's eager runs. The exact float32 and the float64 runs are made at once; the
    ulp-perturbed runs only when a comparison fails without them: the allowance of `mismatch`
    and `torch_mismatch` only grows with them, so a comparison that passes without them passes
    with them, and one that fails is decided with them (the same verdicts, fewer runs)."""

    def __init__(self, program, state):
        self.program, self.state = program, state
        self.exact32 = run_eager(program, state, flow.float32)[0]
        self.values64, self.grads64 = run_eager(program, state, flow.float64)

    @functools.cached_property
    def runs32(self) -> list:
        return ([self.exact32]
                + [run_eager(self.program, self.state, flow.float32, perturb)[0]
                   for perturb in PERTURBED_RUNS if perturb is not None]
                + [run_eager(self.program, self.state, flow.float32, noise=noise)[0] for noise in NOISY_RUNS])

    @functools.cached_property
    def moved64(self) -> list:
        """Perturbed float64 runs ((values, first-step gradients) each): inputs moved, op results moved."""
        return [run_eager(self.program, self.state, flow.float64, perturb=3),
                run_eager(self.program, self.state, flow.float64, noise=13)]

    def graph_problem(self, name, graph32) -> str | None:
        """`mismatch` of the graph's `name` against the eager float32 runs; None for what a
        training step after a chaotic one (`chaotic_after`) computes."""
        value = self.values64[name]
        problem = (mismatch(name, graph32, [self.exact32[name]], value)
                   and mismatch(name, graph32, [r[name] for r in self.runs32], value))
        if problem and _step_of(name) > 0:
            chaotic = self.chaotic_after()
            if chaotic is not None and _step_of(name) > chaotic:
                return None
        return problem

    def chaotic_after(self) -> int | None:
        """The first training step whose loss the eager float32 runs put more than CHAOS_RELATIVE
        of its magnitude from float64: rounding alone moved it far beyond an ulp (a comparison
        near a threshold, `where(abs(h) > 0.5, ...)`, going the other way), so the states after it
        are rounding's choice and later steps may land anywhere (fuzz seed 461359: a loss 2.5e-3
        apart at step 1 in eager float32, then the graph's step 2 on another branch than eager's)."""
        for step in range(STEPS):
            name = f"loss step {step}"
            r = np.asarray(self.values64[name], np.float64)
            scale = float(np.max(np.abs(r))) if r.size and np.isfinite(r).all() else 0.0
            spread = max((float(np.max(np.abs(np.asarray(run[name], np.float64) - r))) for run in self.runs32),
                         default=0.0)
            if scale and spread > CHAOS_RELATIVE * scale:
                return step
        return None


    @staticmethod
    def torch_problem(name, flow64, torch64, moved) -> str | None:
        """`torch_mismatch` of `name`; `moved()` lists the perturbed flowgen float64 values."""
        return torch_mismatch(name, flow64, torch64) and torch_mismatch(name, flow64, torch64, moved())


def _step_of(name: str) -> float:
    """The training step a compared value comes from: "loss step 2" -> 2, the state after the
    steps -> STEPS, the inference output -> -1."""
    if name.startswith("after "):
        return STEPS
    match = re.search(r" step (\d+)$", name)
    return int(match.group(1)) if match else -1


def check_programs(programs, graphs: bool = True, use_torch: bool = True) -> list:
    """Run `programs` in eager and (with `graphs`) in one pair of graphs; [(program, problems)]
    for each program that disagrees. A batch whose graphs fail is retried program by program."""
    states = initial_states(programs)
    eager, found = [], []
    for p, s in zip(programs, states):
        try:
            eager.append(_Eager(p, s))
        except Exception:
            found.append((p, [f"eager failed: {traceback.format_exc(limit=-3)}"]))
    if found:
        return found
    graph_results = [None] * len(programs)
    if graphs:
        try:
            graph_results = run_graphs(programs, states)
        except Exception:
            if len(programs) > 1:
                return [found for p in programs for found in check_programs([p], graphs, use_torch)]
            return [(programs[0], [f"graph failed: {traceback.format_exc(limit=-3)}"])]
    for p, s, g, e in zip(programs, states, graph_results, eager):
        if not all(np.all(np.isfinite(v)) for v in e.values64.values()):
            continue   # overflowed in float64 already: nothing to compare against
        try:
            problems = _problems(p, s, g, e, use_torch)
        except Exception:
            problems = [f"eager failed (an ulp-perturbed run): {traceback.format_exc(limit=-3)}"]
        if problems:
            found.append((p, problems))
    return found


def _problems(program, state, graph_result, eager: _Eager, use_torch: bool) -> list:
    """The comparisons of one program: graph vs eager (with `graph_result`), eager vs torch."""
    problems = []
    if graph_result is not None:
        problems += [m for k in eager.values64
                     if (m := eager.graph_problem(k, graph_result.get(k, np.full(1, np.nan))))]
    try:
        oracle = run_torch(program, state) if use_torch else None
    except Exception:
        oracle = None
        problems.append(f"torch failed (flowgen eager ran): {traceback.format_exc(limit=-2)}")
    if oracle is not None:
        t_values, t_grads = oracle
        problems += [m for k, v in t_values.items()
                     if (m := eager.torch_problem(k, eager.values64[k], v,
                                                  lambda: [values[k] for values, _ in eager.moved64]))]
        missing = np.full(1, np.nan)
        problems += [m for k in sorted(set(t_grads) | set(eager.grads64))
                     if (m := eager.torch_problem(f"step 0 grad {k}", eager.grads64.get(k, missing),
                                                  t_grads.get(k, missing),
                                                  lambda: [grads.get(k, missing) for _, grads in eager.moved64]))]
    return problems


# ----------------------------------------------------------------------------------------------
# Minimising and reporting

def _kind(problem: str) -> str:
    """What failed: "eager" (flowgen eager raised), "graph failed" (compiling or running the
    graphs raised), "torch" (eager vs torch), or "graph" (graph vs eager numbers)."""
    if problem.startswith("eager failed"):
        return "eager"
    if problem.startswith("graph failed"):
        return "graph failed"
    return "torch" if "torch" in problem else "graph"


def minimise(program: Program, problems: list) -> Program:
    """Drop forward statements one at a time (later uses of a dropped `hK = expr` read one of
    its operands instead) while the program still fails in the same way (same kind of
    problem: see `_kind`)."""
    kinds = {_kind(p) for p in problems}
    graphs = bool(kinds - {"torch", "eager"})
    use_torch = "torch" in kinds

    def fails(candidate) -> bool:
        try:
            return any(_kind(q) in kinds for _, found in check_programs([candidate], graphs, use_torch)
                       for q in found)
        except Exception:
            return False   # broken differently: not the same failure

    current, changed = program, True
    while changed:
        changed = False
        for k in range(len(current.body) - 1):   # the last line assigns `out`
            candidate = _without_statement(current, k)
            if candidate is not None and fails(candidate):
                current, changed = candidate, True
                break
    return current


def _out_shape(program: Program):
    """The shape of `out` in eager float32, or None when the program does not run."""
    try:
        flow.manual_seed(program.seed)
        x, _ = make_data(program)
        return tuple(_out_and_aux(model_class(program)()(flow.tensor(x)))[0].shape)
    except Exception:
        return None


def _without_statement(program: Program, k: int) -> Program | None:
    """`program` with body line k removed and its variable replaced by one of its operands (an
    in-place write is dropped as a whole; a tensor written in place later stays), or None when
    no operand leaves a program with the same output shape."""
    want = _out_shape(program)
    bound = _binds(program.body[k])
    if bound is None:
        return _if_same_shape(program, program.body[:k] + program.body[k + 1:], program.aux, want)
    if any(_binds(line) is None and _reads(line, bound) for line in program.body[k + 1:]):
        return None
    expr = program.body[k].split(" = ", 1)[1]
    operands = [v for v in ["x"] + [b for b in map(_binds, program.body[:k]) if b] if _reads(expr, v)]
    for operand in operands:
        body = program.body[:k] + [_rename(line, bound, operand) for line in program.body[k + 1:]]
        candidate = _if_same_shape(program, body, _rename(program.aux, bound, operand), want)
        if candidate is not None:
            return candidate
    return None


def _binds(line: str) -> str | None:
    """The variable a body line assigns (None for an in-place write: `h3[0] = 1.0`, `h3.mul_(2)`)."""
    match = re.match(r"(\w+) = ", line)
    return match.group(1) if match else None


def _if_same_shape(program: Program, body: list, aux: str, want) -> Program | None:
    """`program` with `body` and `aux` (and the modules they use), if its output has shape `want`."""
    init = [line for line in program.init if any(_reads(b, line.split(" = ")[0]) for b in body + [aux])]
    candidate = replace(program, init=init, body=body, aux=aux)
    return candidate if init and _out_shape(candidate) == want else None


def _reads(expr: str, var: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(var)}(?!\w)", expr) is not None


def _rename(line: str, old: str, new: str) -> str:
    return re.sub(rf"(?<![\w.]){re.escape(old)}(?!\w)", new, line)


def report(program: Program, problems: list) -> str:
    return "\n".join([f"MISMATCH in fuzz program seed {program.seed}:", program.source(), "problems:"]
                     + [f"  {p}" for p in problems[:8]])


def fuzz(count: int, first_seed: int = 0, batch: int = 10, use_torch: bool = True, out=sys.stdout) -> list:
    """Check `count` programs (seeds first_seed...), `batch` per pair of graphs; minimise and
    print each mismatch. Returns the list of (minimised program, its problems)."""
    failures = []
    for start in range(first_seed, first_seed + count, batch):
        programs = [generate(s) for s in range(start, min(start + batch, first_seed + count))]
        found = check_programs(programs, True, use_torch)
        if found and len(programs) > 1:   # only in a batch? check alone (the repro must stand alone)
            found = [f for p, _ in found for f in check_programs([p], True, use_torch)] or found
        for program, problems in found:
            small = minimise(program, problems)
            small_found = check_programs([small], True, use_torch) if small is not program else []
            small_problems = small_found[0][1] if small_found else problems
            print(report(small, small_problems), file=out, flush=True)
            failures.append((small, small_problems))
        print(f"checked seeds {start}..{min(start + batch, first_seed + count) - 1}: "
              f"{len(failures)} mismatches so far", file=out, flush=True)
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--long", type=int, default=30, metavar="N", help="number of programs")
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--batch", type=int, default=10, help="programs per pair of graphs")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch comparison")
    parser.add_argument("--show", type=int, default=None, metavar="SEED", help="print one program and exit")
    args = parser.parse_args(argv)
    if args.show is not None:
        print(generate(args.show).source())
        return 0
    failures = fuzz(args.long, args.seed, args.batch, not args.no_torch)
    print(f"{args.long} programs, {len(failures)} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
