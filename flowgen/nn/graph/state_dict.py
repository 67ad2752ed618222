"""`graph.state_dict()` and `graph.load_state_dict()` in OneFlow's layout, so OneFlow checkpoint
code (`flow.save(graph.state_dict(), path)`, `graph.load_state_dict(flow.load(path))`) runs unchanged::

    {"linear": {"weight": ..., "bias": ...},    each registered module's own state_dict, by its name
     "linear.weight-momentum": Tensor,          optimizer state, "<parameter path>-<slot>" with
                                                OneFlow's slot names (Optimizer.checkpoint_slot_names)
     "System-Train-TrainStep": int64[1],        the steps run (OneFlow's train step variable)
     # what flowgen keeps beyond OneFlow, so that a resumed run is bit-identical:
     "System-Train-SkippedSteps": int64[1],     the steps a GradScaler skipped
     "System-Random-State": int64[8],           flow.get_rng_state()
     "System-Optimizer0": {"param_groups": [{..., "params": [parameter path, ...]}],
                           "param_state": {parameter path: {"step": n}}},   non-tensor state
     "System-LRScheduler0": {...},              the scheduler's state_dict()
     "System-GradScaler": {...}}                set_grad_scaler's GradScaler.state_dict() (scale,
                                                growth tracker), when the graph has one

A parameter that no registered module holds is named "System-Optimizer<i>-Param<j>" (the j-th
parameter of optimizer i). `load_graph_state_dict` also reads the flat layout of earlier flowgen
versions ("linear.weight", "_optimizer0", "_lr_scheduler0", "_step", "_rng_state").
"""
from __future__ import annotations

import numpy as np

from flowgen import dtype as dt
from flowgen import random
from flowgen.tensor import Tensor

TRAIN_STEP = "System-Train-TrainStep"
SKIPPED_STEPS = "System-Train-SkippedSteps"
RANDOM_STATE = "System-Random-State"
GRAD_SCALER = "System-GradScaler"


def optimizer_key(i: int) -> str:
    return f"System-Optimizer{i}"


def scheduler_key(i: int) -> str:
    return f"System-LRScheduler{i}"


def _parameter_paths(graph) -> list:
    """For each optimizer, its parameters in group order as (parameter, path) pairs."""
    path_of = {}
    for mname, module in graph._modules.items():
        for path, p in module.named_parameters(prefix=mname):
            path_of.setdefault(id(p), path)
    return [[(p, path_of.get(id(p), f"{optimizer_key(i)}-Param{j}"))
             for j, p in enumerate(p for group in opt.param_groups for p in group["params"])]
            for i, (opt, _sch) in enumerate(graph._optimizers)]


def _count_tensor(n: int) -> Tensor:
    return Tensor(np.array([n], dtype=np.int64), dtype=dt.int64)


def _count(value, key: str) -> int:
    array = np.asarray(value.numpy() if isinstance(value, Tensor) else value).reshape(-1)
    if array.size != 1:
        raise ValueError(f"load_state_dict: {key!r} holds {array.size} values, expected one step count")
    return int(array[0])


def graph_state_dict(graph) -> dict:
    result = {name: module.state_dict() for name, module in graph._modules.items()}
    for i, ((opt, sch), params) in enumerate(zip(graph._optimizers, _parameter_paths(graph))):
        param_state = {}
        for p, path in params:
            for name, value in opt.state.get(p, {}).items():
                if isinstance(value, Tensor):
                    key = f"{path}-{opt.checkpoint_slot_names.get(name, name)}"
                    if key in result:
                        raise RuntimeError(f"{graph.name}.state_dict(): two optimizer states are both named {key!r}")
                    result[key] = value
                elif value is not None:
                    param_state.setdefault(path, {})[name] = value
        groups = opt.state_dict()["param_groups"]
        paths = iter(path for _p, path in params)
        for group in groups:
            group["params"] = [next(paths) for _ in group["params"]]
        result[optimizer_key(i)] = {"param_groups": groups, "param_state": param_state}
        if sch is not None:
            result[scheduler_key(i)] = sch.state_dict()
    result[TRAIN_STEP] = _count_tensor(graph._counter["calls"])
    result[SKIPPED_STEPS] = _count_tensor(graph._counter.get("skipped", 0))
    result[RANDOM_STATE] = random.get_rng_state()
    if _scaler_state(graph):
        result[GRAD_SCALER] = graph._grad_scaler.state_dict()
    return result


def _scaler_state(graph) -> bool:
    """Whether the graph's GradScaler has state to checkpoint (a dynamic, enabled one)."""
    return graph._grad_scaler is not None and bool(graph._grad_scaler.state_dict())


def _is_flat_layout(graph, state_dict: dict) -> bool:
    return not any(key in graph._modules or str(key).startswith("System-") for key in state_dict)


def load_graph_state_dict(graph, state_dict: dict, strict: bool = True) -> None:
    if not isinstance(state_dict, dict):
        raise TypeError(f"{graph.name}.load_state_dict expects the dict graph.state_dict() returns, "
                        f"got {type(state_dict).__name__}")
    if _is_flat_layout(graph, state_dict):
        _load_flat_state_dict(graph, state_dict, strict)
        return
    params = _parameter_paths(graph)
    slot_owner = {path: i for i, pairs in enumerate(params) for _p, path in pairs}
    expected = [*graph._modules, TRAIN_STEP, SKIPPED_STEPS, RANDOM_STATE] + ([GRAD_SCALER] if _scaler_state(graph) else [])
    for i, (_opt, sch) in enumerate(graph._optimizers):
        expected += [optimizer_key(i)] + ([scheduler_key(i)] if sch is not None else [])
    slots: dict = {}   # optimizer index -> {parameter path: {flowgen slot name: value}}
    unexpected = []
    for key, value in state_dict.items():
        if key in expected:
            continue
        path, _, slot = str(key).rpartition("-")
        opt = graph._optimizers[slot_owner[path]][0] if path in slot_owner else None
        names = {of: own for own, of in opt.checkpoint_slot_names.items()} if opt is not None else {}
        if opt is None or (names and slot not in names):
            unexpected.append(key)
        else:
            slots.setdefault(slot_owner[path], {}).setdefault(path, {})[names.get(slot, slot)] = value
    missing = [key for key in expected if key not in state_dict]
    if strict and (unexpected or missing):
        lines = [f"unexpected key {k!r}" for k in unexpected] + [f"missing key {k!r}" for k in missing]
        raise RuntimeError(f"Error(s) in loading state_dict for {graph.name} (strict=True; pass strict=False "
                           f"to load the rest):\n\t" + "\n\t".join(lines))

    for name, module in graph._modules.items():
        if name in state_dict:
            if not isinstance(state_dict[name], dict):
                raise TypeError(f"{graph.name}.load_state_dict: {name!r} holds a {type(state_dict[name]).__name__}, "
                                f"expected module {name}'s state_dict (a dict)")
            module.load_state_dict(state_dict[name], strict=strict)
    train_step = _count(state_dict[TRAIN_STEP], TRAIN_STEP) if TRAIN_STEP in state_dict else None
    for i, ((opt, sch), pairs) in enumerate(zip(graph._optimizers, params)):
        saved = state_dict.get(optimizer_key(i))
        if saved is not None or i in slots:
            opt.load_state_dict(_optimizer_state(graph, i, opt, pairs, saved, slots.get(i, {}), train_step, strict))
        if sch is not None and scheduler_key(i) in state_dict:
            sch.load_state_dict(state_dict[scheduler_key(i)])
    if train_step is not None:
        graph._counter["calls"] = train_step
    if SKIPPED_STEPS in state_dict:
        graph._counter["skipped"] = _count(state_dict[SKIPPED_STEPS], SKIPPED_STEPS)
    if RANDOM_STATE in state_dict:
        random.set_rng_state(state_dict[RANDOM_STATE])
    if GRAD_SCALER in state_dict and graph._grad_scaler is not None:
        graph._grad_scaler.load_state_dict(state_dict[GRAD_SCALER])


def _optimizer_state(graph, i, opt, pairs, saved, slots, train_step, strict) -> dict:
    """Optimizer i's state in the layout `Optimizer.load_state_dict` reads (parameters by index)."""
    key = optimizer_key(i)
    if saved is None:   # a checkpoint without flowgen's extras (OneFlow's own): keep the groups' options
        groups, param_state = opt.state_dict()["param_groups"], {}
    else:
        groups, param_state = [dict(g) for g in saved["param_groups"]], saved.get("param_state", {})
    current = opt.state_dict()["param_groups"]
    if len(groups) != len(current):
        raise ValueError(f"{graph.name}.load_state_dict: {key!r} has {len(groups)} parameter groups, the "
                         f"{type(opt).__name__} has {len(current)}")
    index, path_iter = {}, iter(pairs)
    for k, (group, now) in enumerate(zip(groups, current)):
        mine = [next(path_iter, (None, None))[1] for _ in now["params"]]
        if strict and saved is not None and list(group["params"]) != mine:
            raise ValueError(f"{graph.name}.load_state_dict: {key!r} parameter group {k} holds "
                             f"{list(group['params'])}, this graph's {type(opt).__name__} holds {mine}")
        index.update((path, j) for path, j in zip(mine, now["params"]))
        group["params"] = list(now["params"])
    state = {}
    for path, j in index.items():
        values = dict(param_state.get(path, {}))
        values.update(slots.get(path, {}))
        if opt.counts_steps and path in slots and "step" not in values and train_step is not None:
            values["step"] = train_step   # OneFlow's optimizers count steps by the train step
        if values:
            state[j] = values
    return {"state": state, "param_groups": groups}


def _load_flat_state_dict(graph, state_dict: dict, strict: bool) -> None:
    """The layout of earlier flowgen versions: "<module>.<name>" tensors, "_optimizer<i>" (PyTorch's
    optimizer state_dict), "_lr_scheduler<i>", "_step" and "_rng_state"."""
    known = {"_step", "_rng_state"}
    for i, (_opt, sch) in enumerate(graph._optimizers):
        known |= {f"_optimizer{i}"} | ({f"_lr_scheduler{i}"} if sch is not None else set())
    unexpected = [k for k in state_dict
                  if k not in known and not any(str(k).startswith(f"{name}.") for name in graph._modules)]
    if strict and unexpected:
        raise RuntimeError(f"Error(s) in loading state_dict for {graph.name} (strict=True; pass strict=False "
                           f"to load the rest):\n\t" + "\n\t".join(f"unexpected key {k!r}" for k in unexpected))
    for name, module in graph._modules.items():
        prefix = f"{name}."
        module.load_state_dict({k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)},
                               strict=strict)
    for i, (opt, sch) in enumerate(graph._optimizers):
        if f"_optimizer{i}" in state_dict:
            opt.load_state_dict(state_dict[f"_optimizer{i}"])
        if sch is not None and f"_lr_scheduler{i}" in state_dict:
            sch.load_state_dict(state_dict[f"_lr_scheduler{i}"])
    graph._counter["calls"] = int(state_dict.get("_step", graph._counter["calls"]))
    if "_rng_state" in state_dict:
        random.set_rng_state(state_dict["_rng_state"])
