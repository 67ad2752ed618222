"""Optimizer lowering: append each parameter's update (SGD, Adam, AdamW) to the graph.

The update math is written with flowgen ops on lazy tensors, so it is traced
into IR like the model. Optimizer slots (momentum, exp_avg, exp_avg_sq) become
persistent state; per-step scalars that depend on the step count or the LR
schedule (lr, bias corrections, first-step momentum switch) become ``hyper``
state that the host writes before each call (`HostScalar`), so the schedule is
exactly the eager one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from flowgen.ir.trace import Tracer
from flowgen.passes.autodiff import next_value_index


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


def lr_schedule(scheduler, group: int, counter: dict) -> dict:
    """The LR schedule as plain data for a standalone program: closed forms of the common
    schedulers, in the scheduler's epoch e = t + offset at graph call t. Others (LambdaLR,
    SequentialLR) run Python code: the program keeps the saved LR ("constant")."""
    kind = type(scheduler).__name__ if scheduler is not None else None
    if kind not in ("StepLR", "MultiStepLR", "ExponentialLR", "CosineAnnealingLR", "LinearLR", "ConstantLR"):
        return {"kind": "constant"}
    sched = {"kind": "lr_" + kind, "base": float(scheduler.base_lrs[group]),
             "offset": int(scheduler.last_epoch) - counter["calls"]}
    if kind == "StepLR":
        sched.update(step_size=int(scheduler.step_size), gamma=float(scheduler.gamma))
    elif kind == "MultiStepLR":
        sched.update(milestones=sorted(int(m) for m in scheduler.milestones.elements()), gamma=float(scheduler.gamma))
    elif kind == "ExponentialLR":
        sched.update(gamma=float(scheduler.gamma))
    elif kind == "CosineAnnealingLR":
        sched.update(T_max=int(scheduler.T_max), eta_min=float(scheduler.eta_min))
    elif kind == "LinearLR":
        sched.update(start=float(scheduler.start_factor), end=float(scheduler.end_factor),
                     total=int(scheduler.total_iters))
    else:
        sched.update(factor=float(scheduler.factor), total=int(scheduler.total_iters))
    return sched


def _group_kind(optimizer) -> str:
    kind = type(optimizer).__name__
    if kind not in ("SGD", "Adam", "AdamW"):
        raise NotImplementedError(f"nn.Graph cannot lower optimizer {kind}; supported: SGD, Adam, AdamW")
    return kind


def lower_optimizers(graph, grads: dict, optimizers: list, param_name: dict, device, counter: dict,
                     grad_unscale: float = 1.0, scaler: GraphScaler | None = None):
    """Returns (graph, host scalars, slot bindings).

    `param_name` maps id(param) -> state name; `counter["calls"]` is the number of
    steps the graph has run and `counter["skipped"]` how many of them a GradScaler skipped,
    kept by the caller (used for SGD's first step). With a `scaler`, gradients are divided by
    its scale, and a step whose gradients hold an inf or NaN changes no parameter or slot
    and backs the scale off; `growth_interval` clean steps in a row grow it (PyTorch's rule).
    """
    from flowgen import creation
    from flowgen.ir.graph import NameGen

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

    def new_state(name, tensor, kind, schedule=None):
        var = tracer.add_state(name, tensor, kind)
        var.schedule = schedule
        tracer.state_tensors.pop()  # bound explicitly below, not through the tracer
        return tracer.lazy(var.value)

    with tracer:
        for opt_index, (optimizer, _scheduler) in enumerate(optimizers):
            kind = _group_kind(optimizer)
            for g_index, group in enumerate(optimizer.param_groups):
                prefix = f"optim{opt_index}.group{g_index}"
                params = [p for p in group["params"] if param_name.get(id(p)) in grads]
                if not params:
                    continue
                tracer.scopes.append(f"{prefix}.{kind.lower()}")

                # float64 parameters get float64 hyper scalars (a float32 LR would round the update)
                hyper_dtype = "float64" if all(p.dtype.name == "float64" for p in params) else "float32"

                def hyper(name, fn, schedule, hyper_dtype=hyper_dtype):
                    host.append(HostScalar(f"{prefix}.{name}", fn))
                    return new_state(f"{prefix}.{name}", creation.tensor(fn(), dtype=hyper_dtype), "hyper", schedule)

                # In Python the host recomputes these before every call (LR schedulers included);
                # `schedule` says how a standalone program advances them (the LR stays constant there).
                lr = hyper("lr", lambda group=group: group["lr"], lr_schedule(_scheduler, g_index, counter))
                if kind == "SGD":
                    _sgd(tracer, optimizer, group, params, grads, param_name, state, lr, hyper, new_state, slots,
                         counter)
                else:
                    _adam(tracer, optimizer, group, params, grads, param_name, state, hyper, new_state, slots, counter,
                          decoupled=(kind == "AdamW"))
                tracer.scopes.pop()
    if scaler is not None:
        _skip_or_grow(tracer, out, first_update, found_inf, scaler)
    return out, host, slots


NONFINITE_CHUNK = 256   # gradients per nonfinite_flag launch (kernel parameters stay within 4 KB)


def _found_inf(tracer, grads: dict):
    """A bool scalar: some gradient element is inf or NaN (one scan over all gradients)."""
    from flowgen import functional as F
    from flowgen.ops.registry import apply

    values = [tracer.lazy(g) for g in grads.values()]
    flag = None
    for start in range(0, len(values), NONFINITE_CHUNK):
        part = apply("nonfinite_flag", *values[start:start + NONFINITE_CHUNK])
        flag = part if flag is None else flag + part
    return F.ne(flag, 0)


def _skip_or_grow(tracer, graph, first_update: int, found_inf, scaler: GraphScaler):
    """Keep every parameter and slot as it was when `found_inf`; the scale update rule."""
    from flowgen import functional as F

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


def _slot(optimizer, p, key, new_state, slots, name):
    from flowgen import creation

    st = optimizer.state.setdefault(p, {})
    if key not in st or st[key] is None:
        st[key] = creation.zeros_like(p.detach())
    slots.append(SlotBinding(name, st[key]))
    return new_state(name, st[key], "optim")


def _sgd(tracer, optimizer, group, params, grads, param_name, state, lr, hyper, new_state, slots, counter):
    momentum, dampening = group.get("momentum", 0), group.get("dampening", 0)
    nesterov, wd = group.get("nesterov", False), group.get("weight_decay", 0)
    for p in params:
        name = param_name[id(p)]
        param = tracer.lazy(state[name].value)
        g = tracer.lazy(grads[name])
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


def _adam(tracer, optimizer, group, params, grads, param_name, state, hyper, new_state, slots, counter, decoupled):
    beta1, beta2 = group.get("betas", (0.9, 0.999))
    eps, wd = group.get("eps", 1e-8), group.get("weight_decay", 0)
    for p in params:
        name = param_name[id(p)]
        st = optimizer.state.setdefault(p, {})
        param = tracer.lazy(state[name].value)
        g = tracer.lazy(grads[name])
        m = _slot(optimizer, p, "exp_avg", new_state, slots, f"{name}.exp_avg")
        v = _slot(optimizer, p, "exp_avg_sq", new_state, slots, f"{name}.exp_avg_sq")

        def step(st=st):
            s = st.get("step", 0)
            return int(s.item() if hasattr(s, "item") else s) + 1

        # Adam's step count k at graph call t is k = t + offset (t counts the graph's calls).
        offset = step() - counter["calls"]
        step_size = hyper(f"{name}.step_size", lambda: group["lr"] / (1 - beta1 ** step()),
                          {"kind": "bias_correction", "scale": group["lr"], "beta": beta1, "power": 1.0,
                           "offset": offset})
        inv_sqrt_bc2 = hyper(f"{name}.inv_sqrt_bc2", lambda: 1.0 / math.sqrt(1 - beta2 ** step()),
                             {"kind": "bias_correction", "scale": 1.0, "beta": beta2, "power": 0.5, "offset": offset})
        if decoupled and wd:
            decay = hyper(f"{name}.decay", lambda: 1.0 - group["lr"] * wd, {"kind": "constant"})
            param = param * decay
        elif wd:
            g = g + param * wd
        m_new = m * beta1 + g * (1 - beta1)
        v_new = v * beta2 + g * g * (1 - beta2)
        tracer.graph.updates.append((f"{name}.exp_avg", m_new._value))
        tracer.graph.updates.append((f"{name}.exp_avg_sq", v_new._value))
        denom = (v_new.sqrt() * inv_sqrt_bc2) + eps
        updated = param - step_size * m_new / denom
        tracer.graph.updates.append((name, updated._value))
