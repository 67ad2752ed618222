"""Optimizer lowering: append each parameter's update to the graph.

SGD, Adam and AdamW have their math written here with flowgen ops on lazy
tensors (every constructor option and OneFlow's group keys: `lr_scale`,
per-group `clip_grad_max_norm`/`clip_grad_norm_type`, `do_bias_correction`), so
it is traced into IR like the model. A `RuleOptimizer` (Adagrad, Adadelta,
RMSprop, LAMB, LARS, FTRL) has its `update()` traced per parameter: the very
function its eager `step()` runs. Any other `Optimizer` subclass has its own
`step()` traced on lazy parameters and gradients. Optimizer slots (momentum,
exp_avg, exp_avg_sq, ...) become persistent state; per-step scalars that
depend on the step count or the LR schedule (lr, bias corrections, Adagrad's
lr_decay, first-step momentum switch) become ``hyper`` state that the host
writes before each call (`HostScalar`), so the schedule is exactly the eager
one, and each carries a plain-data `schedule` (`lr_schedule` turns a
scheduler's formula into one) by which a standalone program advances it.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from flowgen import creation
from flowgen import functional as F
from flowgen.distributed.global_tensor import graph_state_like
from flowgen.ir.graph import NameGen
from flowgen.ir.trace import TraceError, Tracer
from flowgen.nn.utils import clip_by_total_norm
from flowgen.ops.registry import apply
from flowgen.optim import SGD, Adam, AdamW, Optimizer, RuleOptimizer
from flowgen.optim.adam import bias_corrections
from flowgen.optim.closed_form import EPOCH, to_data, uses_python
from flowgen.optim.optimizer import SCHEDULER_KEYS, group_clip, group_lr
from flowgen.passes.autodiff import next_value_index
from flowgen.tensor import Tensor

LOWERED = (SGD, Adam, AdamW)   # optimizers with their own lowering here


def lowering_kind(optimizer) -> str | None:
    """"SGD", "Adam" or "AdamW" (lowered here), "rule" (a RuleOptimizer whose eager step is its
    `update`: traced per parameter), or None (any other Optimizer, a RuleOptimizer subclass that
    rewrites step() included: its whole `step()` traced)."""
    if type(optimizer) in LOWERED:
        return type(optimizer).__name__
    cls = type(optimizer)
    steps_by_rule = cls.step is Optimizer.step and cls._update_group is RuleOptimizer._update_group
    return "rule" if isinstance(optimizer, RuleOptimizer) and steps_by_rule else None


@dataclass
class HostScalar:
    name: str
    compute: Callable[[], object]   # evaluated on the host right before each call (number or array)


@dataclass
class GraphScaler:
    """A GradScaler inside the step: `scale` and `tracker` are hyper state values the host
    writes before each call and reads back after it (see nn/graph/compiled.py)."""
    scale: object         # Value: the current loss scale (float32)
    tracker: object       # Value: clean steps since the last change (float32)
    growth_factor: float
    backoff_factor: float
    growth_interval: int


@dataclass
class SlotBinding:
    state_name: str
    tensor: object   # the eager Tensor that holds the slot (shared with optimizer.state)


def scheduler_epoch(scheduler, counter: dict) -> int:
    """The scheduler epoch of the graph's next call: OneFlow's contract is that the graph advances
    the scheduler given to `add_optimizer` itself and never steps the Python object, so call t
    runs at epoch `last_epoch + t` (the object's own epoch stays where the user left it)."""
    return int(scheduler.last_epoch) + counter["calls"]


def group_lr_now(group: dict, g_index: int, scheduler, counter: dict) -> float:
    """The LR group `g_index` uses on the graph's next call: the scheduler's (replayed, exactly as
    eager computes it) or, without one, the group's current `lr` (code may write it every step);
    times OneFlow's `lr_scale`."""
    if scheduler is None:
        return group_lr(group)
    return scheduler.lr_at(scheduler_epoch(scheduler, counter), g_index) * group.get("lr_scale", 1.0)


def lr_schedule(scheduler, group: dict, g_index: int) -> dict:
    """The LR schedule as plain data for a standalone program: the scheduler's formula
    (optim/closed_form.py) at epoch e = t + offset of graph call t, times `scale` (the group's
    lr_scale). Without a scheduler, or with one that has no formula or runs Python code
    (LambdaLR, MultiplicativeLR, CyclicLR with a scale_fn, ChainedScheduler of others than
    multiplicative schedulers), the program keeps the saved LR ("constant"); with a scheduler, a
    "note" says so, which `flow.save` shows as a warning."""
    if scheduler is None:
        return {"kind": "constant"}
    formula = scheduler.formula(g_index, EPOCH)
    if formula is None or uses_python(formula):
        what = "runs Python code" if formula is not None else "has no closed form"
        return {"kind": "constant",
                "note": f"{type(scheduler).__name__} {what} to compute the LR: a standalone program built from "
                        f"this save keeps the LR the graph was saved with for every step"}
    return {"kind": "lr_" + type(scheduler).__name__, "formula": to_data(formula), "offset": int(scheduler.last_epoch),
            "scale": float(group.get("lr_scale", 1.0))}


def lower_optimizers(graph, grads: dict, optimizers: list, param_name: dict, device, counter: dict,
                     grad_unscale: float = 1.0, scaler: GraphScaler | None = None):
    """Returns (graph, host scalars, slot bindings, checks run on the host before every call).

    `param_name` maps id(param) -> state name; `counter["calls"]` is the number of
    steps the graph has run and `counter["skipped"]` how many of them a GradScaler skipped,
    kept by the caller (used for SGD's first step). With a `scaler`, gradients are divided by
    its scale, and a step whose gradients hold an inf or NaN changes no parameter or slot
    and backs the scale off; `growth_interval` clean steps in a row grow it (PyTorch's rule).
    SGD, Adam and AdamW are lowered here; any other Optimizer has its `step()` traced.
    """
    out = graph.copy_with()
    tracer = Tracer(graph.name, device)
    tracer.graph = out
    tracer.new_name = NameGen(start=next_value_index(graph))
    state = graph.state_by_name()
    found_inf = None
    if grad_unscale != 1.0 or scaler is not None:   # undo the loss scaling before any update math
        with tracer:
            tracer.scopes.append("grad_scaler.unscale")
            factor = grad_unscale if scaler is None else (1.0 / tracer.lazy(scaler.scale)) * grad_unscale
            grads = {name: (tracer.lazy(g) * factor)._value for name, g in grads.items()}
            if scaler is not None:
                found_inf = _found_inf(tracer, grads)
            tracer.scopes.pop()
    first_update = len(out.updates)
    host: list = []
    slots: list = []
    checks: list = []

    def new_state(name, tensor, kind, schedule=None):
        var = tracer.add_state(name, tensor, kind)
        var.schedule = schedule
        tracer.state_tensors.pop()  # bound explicitly below, not through the tracer
        return tracer.lazy(var.value)

    with tracer:
        for opt_index, (optimizer, scheduler) in enumerate(optimizers):
            kind = lowering_kind(optimizer)
            grads = _clip_groups(tracer, optimizer, opt_index, grads, param_name)
            if kind is None:
                if scheduler is not None:
                    raise TraceError(f"{type(optimizer).__name__}: a graph traces a user-written optimizer's step() "
                                     f"with its options as constants, so it cannot follow lr_sch="
                                     f"{type(scheduler).__name__}; write it as a flow.optim.RuleOptimizer "
                                     f"(its update() follows the schedule), or build a graph per LR")
                checks.append(_trace_user_step(tracer, optimizer, opt_index, grads, param_name, state, slots))
                continue
            checks.append(options_unchanged(optimizer, NOT_COMPILED, "compiled its update"))
            for g_index, group in enumerate(optimizer.param_groups):
                prefix = f"optim{opt_index}.group{g_index}"
                params = [p for p in group["params"] if param_name.get(id(p)) in grads]
                if not params:
                    continue
                tracer.scopes.append(f"{prefix}.{type(optimizer).__name__.lower()}")

                # float64 parameters get float64 hyper scalars (a float32 LR would round the update)
                hyper_dtype = "float64" if all(p.dtype.name == "float64" for p in params) else "float32"

                def hyper(name, fn, schedule, hyper_dtype=hyper_dtype):
                    host.append(HostScalar(f"{prefix}.{name}", fn))
                    return new_state(f"{prefix}.{name}", creation.tensor(fn(), dtype=hyper_dtype), "hyper", schedule)

                # In Python the host recomputes these before every call (LR schedulers included);
                # `schedule` says how a standalone program advances them.
                lr = hyper("lr", lambda group=group, g_index=g_index, scheduler=scheduler:
                           group_lr_now(group, g_index, scheduler, counter), lr_schedule(scheduler, group, g_index))
                if kind == "SGD":
                    _sgd(tracer, optimizer, group, params, grads, param_name, state, lr, hyper, new_state, slots,
                         counter)
                elif kind == "rule":
                    _rule(tracer, optimizer, group, params, grads, param_name, state, lr, hyper, new_state, slots,
                          counter)
                else:
                    _adam(tracer, optimizer, group, params, grads, param_name, state, lr, hyper, new_state, slots,
                          counter, decoupled=(kind == "AdamW"))
                tracer.scopes.pop()
        _keep_state_dtypes(tracer, out, first_update)
    if scaler is not None:
        _skip_or_grow(tracer, out, first_update, found_inf, scaler)
    return out, host, slots, checks


def _keep_state_dtypes(tracer, graph, first_update: int) -> None:
    """An update whose math promoted (a bfloat16 parameter minus lr times a float32 gradient) is
    cast back to its state's dtype, as eager's in-place update stores it: the state buffer keeps
    its dtype and size (the float32 value written into a bfloat16 parameter overran it)."""
    state = graph.state_by_name()
    for k in range(first_update, len(graph.updates)):
        name, value = graph.updates[k]
        target = state[name].value.dtype
        if value.dtype != target:
            graph.updates[k] = (name, F.cast(tracer.lazy(value), target)._value)


def _clip_groups(tracer, optimizer, opt_index: int, grads: dict, param_name: dict) -> dict:
    """OneFlow's per-group `clip_grad_max_norm` / `clip_grad_norm_type`: each such group's
    gradients scaled by min(max_norm / (their joint norm + 1e-6), 1) before the update."""
    for g_index, group in enumerate(optimizer.param_groups):
        clip = group_clip(group)
        names = [param_name[id(p)] for p in group["params"] if param_name.get(id(p)) in grads]
        if clip is None or not names:
            continue
        tracer.scopes.append(f"optim{opt_index}.group{g_index}.clip_grad")
        _total, clipped = clip_by_total_norm([tracer.lazy(grads[n]) for n in names], *clip)
        grads = {**grads, **{n: g._value for n, g in zip(names, clipped)}}
        tracer.scopes.pop()
    return grads


NONFINITE_CHUNK = 256   # gradients per nonfinite_flag launch (kernel parameters stay within 4 KB)


def _found_inf(tracer, grads: dict):
    """A bool scalar: some gradient element is inf or NaN (one scan over all gradients)."""
    values = [tracer.lazy(g) for g in grads.values()]
    flag = None
    for start in range(0, len(values), NONFINITE_CHUNK):
        part = apply("nonfinite_flag", *values[start:start + NONFINITE_CHUNK])
        flag = part if flag is None else flag + part
    return F.ne(flag, 0)


def _skip_or_grow(tracer, graph, first_update: int, found_inf, scaler: GraphScaler):
    """Keep every parameter and slot as it was when `found_inf`; the scale update rule."""
    state = graph.state_by_name()
    with tracer:
        tracer.scopes.append("grad_scaler.update")
        for k in range(first_update, len(graph.updates)):
            name, value = graph.updates[k]
            graph.updates[k] = (name, F.where(found_inf, tracer.lazy(state[name].value), tracer.lazy(value))._value)
        scale, tracker = tracer.lazy(scaler.scale), tracer.lazy(scaler.tracker)
        grown = tracker + 1.0
        at_interval = F.ge(grown, float(scaler.growth_interval))
        new_scale = F.where(found_inf, scale * scaler.backoff_factor,
                            F.where(at_interval, scale * scaler.growth_factor, scale))
        new_tracker = F.where(found_inf, 0.0, F.where(at_interval, 0.0, grown))
        graph.updates += [(scaler_state_name("scale"), new_scale._value),
                          (scaler_state_name("growth_tracker"), new_tracker._value)]
        tracer.scopes.pop()


def scaler_state_name(what: str) -> str:
    return f"grad_scaler.{what}"


def _slot(optimizer, p, key, new_state, slots, name, init: float = 0.0):
    st = optimizer.state.setdefault(p, {})
    if key not in st or st[key] is None:   # a global (broadcast) parameter's slot is shaped like its component
        st[key] = graph_state_like(p, name, lambda storage: creation.full_like(storage.detach(), init))
    slots.append(SlotBinding(name, st[key]))
    return new_state(name, st[key], "optim")


def _start_value(tracer, state, name):
    """The value a parameter's update starts from: its last in-place write in build() (Embedding's
    max_norm renormalises rows of its weight in the forward, as PyTorch), else its value at the call's start."""
    for written, value in reversed(tracer.graph.updates):
        if written == name:
            return value
    return state[name].value


def _sgd(tracer, optimizer, group, params, grads, param_name, state, lr, hyper, new_state, slots, counter):
    momentum, dampening = group["momentum"], group["dampening"]
    nesterov, wd, maximize = group["nesterov"], group["weight_decay"], group["maximize"]
    for p in params:
        name = param_name[id(p)]
        param = tracer.lazy(_start_value(tracer, state, name))
        g = tracer.lazy(grads[name])
        if maximize:
            g = -g
        if wd:
            g = g + param * wd
        if momentum:
            first = "momentum_buffer" not in optimizer.state.get(p, {}) or optimizer.state[p]["momentum_buffer"] is None
            buf = _slot(optimizer, p, "momentum_buffer", new_state, slots, f"{name}.momentum_buffer")
            # Eager SGD starts the buffer as the first gradient; afterwards buf = m*buf + (1-d)*g.
            def started(first=first):
                return not first or counter["calls"] > counter.get("skipped", 0)

            keep = hyper(f"{name}.momentum", lambda: momentum if started() else 0.0,
                         {"kind": "first_step", "first": 0.0 if first else momentum, "then": momentum})
            scale = hyper(f"{name}.grad_scale", lambda: (1.0 - dampening) if started() else 1.0,
                          {"kind": "first_step", "first": 1.0 if first else 1.0 - dampening, "then": 1.0 - dampening})
            buf_new = buf * keep + g * scale
            tracer.graph.updates.append((f"{name}.momentum_buffer", buf_new._value))
            g = g + buf_new * momentum if nesterov else buf_new
        tracer.graph.updates.append((name, (param - lr * g)._value))


def _adam(tracer, optimizer, group, params, grads, param_name, state, lr, hyper, new_state, slots, counter,
          decoupled):
    """The Adam class docstring's arithmetic; the step size is lr times 1 / (1 - beta1^k) and the
    decoupled decay 1 - lr * weight_decay, so both follow the LR hyper (and its schedule)."""
    beta1, beta2 = group["betas"]
    eps, wd, amsgrad, maximize = group["eps"], group["weight_decay"], group["amsgrad"], group["maximize"]
    # without bias correction both corrections are 1: a beta of 0 in the schedule gives 1 - 0^k = 1
    corrected = bool(group["do_bias_correction"])
    for p in params:
        name = param_name[id(p)]
        st = optimizer.state.setdefault(p, {})
        param = tracer.lazy(_start_value(tracer, state, name))
        g = tracer.lazy(grads[name])
        if maximize:
            g = -g
        m = _slot(optimizer, p, "exp_avg", new_state, slots, f"{name}.exp_avg")
        v = _slot(optimizer, p, "exp_avg_sq", new_state, slots, f"{name}.exp_avg_sq")

        def step(st=st):
            return _step_count(st)

        # Adam's step count k at graph call t is k = t + offset (t counts the graph's calls).
        offset = step() - counter["calls"]
        inv_bc1 = hyper(f"{name}.inv_bc1", lambda: 1.0 / bias_corrections(group, step())[0],
                        {"kind": "bias_correction", "scale": 1.0, "beta": beta1 if corrected else 0.0, "power": 1.0,
                         "offset": offset})
        inv_sqrt_bc2 = hyper(f"{name}.inv_sqrt_bc2", lambda: 1.0 / bias_corrections(group, step())[1],
                             {"kind": "bias_correction", "scale": 1.0, "beta": beta2 if corrected else 0.0,
                              "power": 0.5, "offset": offset})
        if decoupled and wd:
            param = param * (1.0 - lr * wd)
        elif wd:
            g = g + param * wd
        m_new = m * beta1 + g * (1 - beta1)
        v_new = v * beta2 + g * g * (1 - beta2)
        tracer.graph.updates.append((f"{name}.exp_avg", m_new._value))
        tracer.graph.updates.append((f"{name}.exp_avg_sq", v_new._value))
        if amsgrad:
            v_max = _slot(optimizer, p, "max_exp_avg_sq", new_state, slots, f"{name}.max_exp_avg_sq")
            v_new = F.maximum(v_max, v_new)
            tracer.graph.updates.append((f"{name}.max_exp_avg_sq", v_new._value))
        denom = (v_new.sqrt() * inv_sqrt_bc2) + eps
        updated = param - (lr * inv_bc1) * m_new / denom
        tracer.graph.updates.append((name, updated._value))


def _step_count(st: dict) -> int:
    """The number of the parameter's next update (1-based) from its optimizer state."""
    s = st.get("step", 0)
    return int(s.item() if hasattr(s, "item") else s) + 1


def _rule(tracer, optimizer, group, params, grads, param_name, state, lr, hyper, new_state, slots, counter):
    """A RuleOptimizer's `update` traced on lazy tensors: the eager arithmetic, with its state
    tensors as graph slots and its step scalars (`step_hypers`) as hyper state."""
    names = optimizer.slot_names(group)
    for p in params:
        name = param_name[id(p)]
        st = optimizer.state.setdefault(p, {})
        g = tracer.lazy(grads[name])
        held = {key: _slot(optimizer, p, key, new_state, slots, f"{name}.{key}", optimizer.slot_init(group, key))
                for key in names}
        # the update count k at graph call t is k = t + offset (t counts the graph's calls)
        offset = _step_count(st) - counter["calls"]
        hypers = {"lr": lr}
        for key in optimizer.step_hypers(group, 1):
            hypers[key] = hyper(f"{name}.{key}",
                                lambda key=key, st=st: optimizer.step_hypers(group, _step_count(st))[key],
                                optimizer.hyper_schedule(group, key, offset))
        new_w, new_slots = optimizer.update(group, tracer.lazy(_start_value(tracer, state, name)),
                                            optimizer.descent_gradient(group, g), held, hypers)
        for key, value in new_slots.items():
            tracer.graph.updates.append((f"{name}.{key}", value._value))
        tracer.graph.updates.append((name, new_w._value))


class _TracedSlots(dict):
    """One parameter's optimizer state while a user-written `step()` is traced. A tensor it
    holds becomes persistent graph state: an eager tensor gives the initial value (as made by
    `flow.zeros_like(p)`), and storing a traced tensor under the same key is that state's update."""

    def __init__(self, items, make_slot):
        super().__init__()
        self._make_slot = make_slot
        for key, value in items.items():
            self[key] = value

    def __setitem__(self, key, value):
        held = self.get(key)
        if isinstance(value, Tensor) and not value.is_lazy:
            value = self._make_slot(key, value)
        elif isinstance(value, Tensor):
            if not isinstance(held, Tensor):
                raise TraceError(f"optimizer state {key!r} is first stored from a value computed in the traced "
                                 f"step(); create it with flow.zeros_like(param) (a value that does not depend on "
                                 f"the step) so the graph keeps it as state between calls")
            value = held.copy_(value)
        super().__setitem__(key, value)

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]


# Group keys a compiled update does not hold as constants: lr and lr_scale (the hyper state reads
# them before each call), a label, and the schedulers' bookkeeping.
NOT_COMPILED = ("lr", "lr_scale", "param_names") + SCHEDULER_KEYS


def _group_numbers(optimizer, ignored: tuple) -> list:
    return [{k: v for k, v in group.items() if k != "params" and k not in ignored}
            for group in optimizer.param_groups]


def options_unchanged(optimizer, ignored: tuple, compiled_what: str):
    """The check run before every call: the groups' options other than `ignored` are constants
    of the compiled step, so changing one later (code, or a scheduler's momentum cycling stepped
    in Python) is refused rather than ignored."""
    cls = type(optimizer).__name__
    numbers = _group_numbers(optimizer, ignored)

    def unchanged():
        now = _group_numbers(optimizer, ignored)
        for g_index, (old, new) in enumerate(zip(numbers, now)):
            for key in sorted(set(old) | set(new)):
                if old.get(key) != new.get(key):
                    raise RuntimeError(f"{cls}: parameter group {g_index} option {key!r} changed from "
                                       f"{old.get(key)!r} to {new.get(key)!r} after nn.Graph {compiled_what}, "
                                       f"which made it a constant of the compiled step; build a new graph to "
                                       f"change it (flow.optim's optimizers follow their lr every call)")
    return unchanged


def _trace_user_step(tracer, optimizer, opt_index: int, grads: dict, param_name: dict, state: dict, slots: list):
    """Trace a user-written optimizer's `step()` (flowgen tensor ops, in-place updates of its
    parameters and state) on lazy parameters and gradients: its in-place writes become the
    graph's updates. Returns the check run before every call: the groups' hyper-parameters are
    constants of the traced step, so changing one later is refused rather than ignored."""
    cls = type(optimizer).__name__
    params = [p for group in optimizer.param_groups for p in group["params"]]
    eager_grads = {id(p): p.grad for p in params}
    eager_state = optimizer.state
    created: list = []

    def bind_slot(p, key, tensor):
        name = f"{param_name[id(p)]}.{key}"
        var = tracer.add_state(name, tensor, "optim")
        tracer.state_tensors.pop()   # bound by hand: lazy only while step() is traced
        tensor._value = var.value
        slots.append(SlotBinding(name, tensor))
        created.append((p, key, tensor))
        return tensor

    traced_state: defaultdict = defaultdict(dict)
    for p in params:
        name = param_name.get(id(p))
        p.grad = tracer.lazy(grads[name]) if name in grads else None
        if name is None:
            continue
        p._value = _start_value(tracer, state, name)
        tracer.state_of[id(p)] = state[name]
        traced_state[p] = _TracedSlots(eager_state.get(p, {}), lambda key, t, p=p: bind_slot(p, key, t))
    plain_before = {p: {k: v for k, v in s.items() if not isinstance(v, Tensor)} for p, s in list(traced_state.items())}
    optimizer.state = traced_state
    unchanged = options_unchanged(optimizer, (), f"traced {cls}.step()")
    tracer.scopes.append(f"optim{opt_index}.{cls.lower()}")
    try:
        optimizer.step()
    except (RuntimeError, TypeError, ValueError, AttributeError, NotImplementedError) as exc:
        raise TraceError(f"nn.Graph traces {cls}.step() to update the parameters, and it failed: {exc}. A "
                         f"user-written optimizer in a graph must update with flowgen tensor ops (in-place "
                         f"ops on its parameters and state), not NumPy") from exc
    finally:
        tracer.scopes.pop()
        optimizer.state = eager_state
        for p in params:
            p._value = None
            p.grad = eager_grads[id(p)]
        for p, key, tensor in created:
            tensor._value = None
            eager_state[p][key] = tensor
    for p, before in plain_before.items():
        after = {k: v for k, v in traced_state[p].items() if not isinstance(v, Tensor)}
        if after != before:
            raise TraceError(f"{cls}.step() keeps Python values in its state ({after}); a graph traces step() "
                             f"once, so they would stay fixed: keep counters as tensors (flow.zeros(()) and "
                             f"in-place .add_(1))")

    return unchanged
