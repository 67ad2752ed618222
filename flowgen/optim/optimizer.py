"""`Optimizer`: parameter groups, per-parameter state, torch-format state dicts.

Eager `step()` updates parameters in place on their NumPy buffers (compiled
graphs alias those buffers, so a parameter's array object must never change)
and bumps each parameter's `_version` so a graph knows to re-upload it.

Subclasses implement `_update_group(group)` for the eager math;
`passes/optimizer.py` lowers SGD, Adam and AdamW with the same arithmetic and
traces any other subclass's `step()` (written with flowgen tensor ops).

Parameter-group keys: the optimizer's defaults, plus OneFlow's group keys
(`GROUP_KEYS`): `lr_scale` multiplies the group's LR in every step (eager and
graph; OneFlow's eager step ignores it, its graph applies it);
`clip_grad_max_norm` with `clip_grad_norm_type` clip the group's gradients by
their joint norm: a graph does it inside every step (OneFlow's graph
contract), eager code calls `optimizer.clip_grad()` before `step()` (OneFlow's
eager API). PyTorch's `param_names` is kept as a label. Any other key is an
error: PyTorch and OneFlow keep unknown keys silently, which hides typos and
options flowgen does not have.
"""
from __future__ import annotations

import warnings
from collections import defaultdict

import numpy as np

from flowgen import dtype as dt
from flowgen.autograd import enable_grad, zero_grads
from flowgen.distributed import global_tensor
from flowgen.nn.utils import clip_grad_norm_
from flowgen.tensor import Tensor


class _Required:
    def __repr__(self):
        return "<required parameter>"


required = _Required()


def compute_view(array: np.ndarray) -> np.ndarray:
    """The array the update math runs on: itself for float32/64, a float32 copy for 16-bit floats."""
    return array if array.dtype in (np.float32, np.float64) else array.astype(np.float32)


def write_back(dest: np.ndarray, values: np.ndarray) -> None:
    if values is not dest:
        dest[...] = values.astype(dest.dtype, copy=False)


# Keys LR schedulers write into the groups (as PyTorch's do): their bookkeeping, not update options.
SCHEDULER_KEYS = ("initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum")
GROUP_KEYS = ("lr_scale", "clip_grad_max_norm", "clip_grad_norm_type", "param_names") + SCHEDULER_KEYS
# PyTorch's implementation keywords. Every built-in optimizer takes them (PyTorch's defaults:
# foreach=None, fused=None, capturable=False, differentiable=False) and keeps them in its groups
# as PyTorch does. They choose how PyTorch runs the update, not the update, so flowgen's numbers
# do not depend on them:
#   foreach        PyTorch: one multi-tensor kernel per group instead of a loop over parameters.
#                  flowgen: an eager step loops over NumPy arrays either way; a graph's updates
#                  join their gradients' kernels or run as one multi-tensor kernel anyway.
#   fused          PyTorch: the whole update in one kernel. flowgen: graphs fuse updates anyway
#                  (graph.config.allow_fuse_model_update_ops, on by default). Not with foreach=True.
#   capturable     PyTorch: keep the step count on the device so that a CUDA graph can capture
#                  the step. flowgen: a graph's whole step, update included, is replayed as one
#                  CUDA graph (runtime/executor.py); an eager step runs on the host.
#   differentiable PyTorch: record the update on autograd (for differentiating through step()).
#                  flowgen's steps write the parameters outside autograd: True is refused.
# An optimizer written by a user, whose defaults lack these keys, loads a saved group holding them
# while off (False/None) and refuses them switched on, like any unknown option.
IMPLEMENTATION_HINTS = ("foreach", "fused", "capturable", "differentiable")


def implementation_hints(foreach, fused, capturable, differentiable) -> dict:
    """A built-in optimizer's implementation keywords as entries of its defaults (each group's
    are checked by check_implementation_hints)."""
    return {"foreach": foreach, "fused": fused, "capturable": capturable, "differentiable": differentiable}


def check_implementation_hints(optimizer: str, options: dict, where: str) -> None:
    """Refuse implementation keywords in `options` (a group) that flowgen cannot honour."""
    for key in IMPLEMENTATION_HINTS:
        value = options.get(key)
        if value is not None and not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{optimizer}: {where}{key}={value!r}; expected True, False or None")
    if options.get("differentiable"):
        raise NotImplementedError(f"{optimizer}: {where}differentiable=True is not supported: flowgen's optimizer "
                                  f"steps write the parameters outside autograd, so step() cannot be "
                                  f"differentiated; use differentiable=False (the default)")
    if options.get("foreach") and options.get("fused"):
        raise RuntimeError(f"{optimizer}: {where}`fused` and `foreach` cannot be `True` together.")


def group_lr(group: dict) -> float:
    """The LR a group's step uses: its `lr` times OneFlow's `lr_scale` (1 when absent)."""
    return group["lr"] * group.get("lr_scale", 1.0)


def group_clip(group: dict):
    """(max_norm, norm_type) when the group asks for gradient clipping, else None."""
    if "clip_grad_max_norm" not in group:
        return None
    return float(group["clip_grad_max_norm"]), float(group["clip_grad_norm_type"])


def _global_arrays(optimizer: str, p: Tensor):
    """The arrays an eager step updates for a global parameter: the local components of the
    parameter and of its gradient. Every rank then runs the same update on the same values, which
    keeps a broadcast parameter broadcast; the optimizer's state is kept per rank at the parameter's
    whole shape, so split and partial_sum parameters are refused."""
    if p.sbp[0].kind != "broadcast":
        raise NotImplementedError(f"{optimizer}.step: eager updates of global parameters with sbp {p.sbp[0]!r}: "
                                  f"flowgen updates broadcast global parameters only (or train in an nn.Graph)")
    grad = p.grad.to_global(sbp=p.sbp) if p.grad.is_global else p.grad
    if not grad.is_global:
        raise RuntimeError(f"{optimizer}.step: a global parameter has a local gradient")
    return p.to_local().numpy_view(), grad.to_local().numpy_view()


class Optimizer:
    # Whether state["step"] counts the parameter's updates (Adam's and the RuleOptimizers'); a graph
    # advances it after each applied step, as eager step() does.
    counts_steps = False
    # This optimizer's state tensors under OneFlow's names, which `graph.state_dict()` keys them by
    # ("linear.weight-momentum" for SGD's "momentum_buffer"); a name not listed keeps its own.
    checkpoint_slot_names: dict = {}

    def __init__(self, params, defaults: dict):
        self.defaults = dict(defaults)
        self.state: defaultdict = defaultdict(dict)  # parameter -> {name: value}; tensors hash by identity
        self.param_groups: list[dict] = []
        if isinstance(params, Tensor):
            raise TypeError(f"params argument given to the optimizer should be an iterable of Tensors or dicts, "
                            f"but got {type(params).__name__}")
        params = list(params)
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(params[0], dict):
            params = [{"params": params}]
        for group in params:
            self.add_param_group(group)

    # ---------------------------------------------------------------- groups
    def add_param_group(self, param_group: dict) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        group = dict(param_group)
        params = group["params"]
        if isinstance(params, Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering of "
                            "tensors in sets will change between runs. Please use a list instead.")
        group["params"] = list(params)
        for p in group["params"]:
            if not isinstance(p, Tensor):
                raise TypeError(f"optimizer can only optimize Tensors, but one of the params is {type(p).__name__}")
            if not p.is_leaf:
                raise ValueError("can't optimize a non-leaf Tensor")
        for name, default in self.defaults.items():
            if default is required and name not in group:
                raise ValueError(f"parameter group didn't specify a value of required optimization parameter {name}")
            group.setdefault(name, default)
        self._check_group_keys(group, len(self.param_groups))
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if len({id(p) for p in group["params"]}) != len(group["params"]) or seen & {id(p) for p in group["params"]}:
            raise ValueError("some parameters appear in more than one parameter group (or twice in one)")
        self.param_groups.append(group)

    def _check_group_keys(self, group: dict, index: int) -> None:
        name = type(self).__name__
        for key in group:
            if key != "params" and key not in self.defaults and key not in GROUP_KEYS:
                known = ", ".join(sorted(set(self.defaults) | set(GROUP_KEYS)))
                raise ValueError(f"{name}: parameter group {index} has unknown option {key!r} = {group[key]!r}; "
                                 f"{name} takes {known}")
        if ("clip_grad_max_norm" in group) != ("clip_grad_norm_type" in group):
            given = "clip_grad_max_norm" if "clip_grad_max_norm" in group else "clip_grad_norm_type"
            missing = "clip_grad_norm_type" if given == "clip_grad_max_norm" else "clip_grad_max_norm"
            raise ValueError(f"{name}: parameter group {index} sets {given!r} without {missing!r}; gradient "
                             f"clipping needs both (OneFlow's rule)")
        if any(key in group for key in IMPLEMENTATION_HINTS):
            check_implementation_hints(name, group, f"parameter group {index}: " if index else "")
        clip = group_clip(group)
        if clip is not None and not clip[0] > 0:
            raise ValueError(f"{name}: parameter group {index} has clip_grad_max_norm = {clip[0]!r}; it must be > 0")
        if "lr_scale" in group and not group["lr_scale"] >= 0:
            raise ValueError(f"{name}: parameter group {index} has lr_scale = {group['lr_scale']!r}; it must be >= 0")

    # ------------------------------------------------------------------ step
    def clip_grad(self, error_if_nonfinite: bool = False) -> None:
        """OneFlow's `Optimizer.clip_grad()`: clip each group that sets `clip_grad_max_norm` and
        `clip_grad_norm_type` by its gradients' joint norm (`nn.utils.clip_grad_norm_`). A graph
        does this inside its step; eager code calls it between `backward()` and `step()`."""
        clipped = False
        for group in self.param_groups:
            clip = group_clip(group)
            if clip is not None:
                clip_grad_norm_(group["params"], clip[0], clip[1], error_if_nonfinite)
                clipped = True
        if not clipped:
            warnings.warn(f"{type(self).__name__}.clip_grad(): no parameter group sets clip_grad_max_norm and "
                          f"clip_grad_norm_type, so nothing is clipped")

    def zero_grad(self, set_to_none: bool = True) -> None:
        zero_grads((p for group in self.param_groups for p in group["params"]), set_to_none)

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._update_group(group)
        return loss

    def _update_group(self, group: dict) -> None:
        raise NotImplementedError

    def _params_with_grad(self, group: dict):
        """(parameter, its array, its gradient array) for each parameter that has a gradient."""
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.is_global:
                if global_tensor.holds(p.placement):   # a rank outside the placement has nothing to update
                    yield (p, *_global_arrays(type(self).__name__, p))
                continue
            grad = p.grad.numpy_view()
            if grad.shape != tuple(p.shape):
                raise RuntimeError(f"{type(self).__name__}.step: a gradient of shape {grad.shape} does not match "
                                   f"its parameter of shape {tuple(p.shape)}")
            yield p, p.numpy_view(), grad

    def _state_tensor(self, p: Tensor, name: str, init: np.ndarray | None = None) -> np.ndarray:
        """The array of state `name` for `p` (a flowgen Tensor in `self.state`), created as zeros or `init`."""
        state = self.state[p]
        t = state.get(name)
        if t is None:
            data = np.zeros(tuple(p.shape), self._state_np_dtype(p)) if init is None else np.array(
                init, dtype=self._state_np_dtype(p))
            t = Tensor(data, dtype=dt.from_numpy(data.dtype), device=p.device)
            state[name] = t
        return t.numpy_view()

    @staticmethod
    def _state_np_dtype(p: Tensor):
        return np.float64 if p.dtype == dt.float64 else np.float32

    # ------------------------------------------------------------ state dict
    def state_dict(self) -> dict:
        """``{"state": {index: {...}}, "param_groups": [{..., "params": [index, ...]}]}`` (PyTorch's layout).

        Parameters are numbered in group order. State tensors are returned by
        reference; `flow.save` copies them out.
        """
        index, groups = {}, []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = []
            for p in group["params"]:
                index.setdefault(id(p), len(index))
                packed["params"].append(index[id(p)])
            groups.append(packed)
        state = {index[id(p)]: dict(s) for p, s in self.state.items() if id(p) in index and s}
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("optimizer state_dict must be a dict with 'state' and 'param_groups' "
                             "(as returned by Optimizer.state_dict())")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, this optimizer has "
                             f"{len(self.param_groups)}")
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"loaded state dict contains a parameter group {i} of {len(saved['params'])} "
                                 f"parameters that doesn't match the size of optimizer's group "
                                 f"({len(group['params'])} parameters)")
        for i, saved in enumerate(saved_groups):
            for key, value in saved.items():
                unknown = key != "params" and key not in self.defaults and key not in GROUP_KEYS
                if unknown and not self._matches_without_storing(key, value):
                    raise ValueError(f"{type(self).__name__}.load_state_dict: parameter group {i} has option "
                                     f"{key!r} = {value!r}, which {type(self).__name__} does not have")
            check_implementation_hints(type(self).__name__, saved, f"load_state_dict: parameter group {i}: ")
        id_to_param = {}
        for saved, group in zip(saved_groups, self.param_groups):
            for index, p in zip(saved["params"], group["params"]):
                id_to_param[int(index)] = p
        new_state: defaultdict = defaultdict(dict)
        for index, values in state_dict["state"].items():
            index = int(index)
            if index not in id_to_param:
                raise ValueError(f"loaded optimizer state refers to parameter {index}, which no group contains")
            p = id_to_param[index]
            new_state[p] = {name: self._load_state_value(p, name, value) for name, value in values.items()}
        self.state = new_state
        for saved, group in zip(saved_groups, self.param_groups):
            for key, value in saved.items():
                if key != "params" and not self._matches_without_storing(key, value):
                    group[key] = tuple(value) if isinstance(group.get(key), tuple) else value

    def _matches_without_storing(self, key: str, value) -> bool:
        """A key of PyTorch's saved groups that this optimizer's math already agrees with: an
        implementation switch that is off, or Adam's `decoupled_weight_decay` (True for AdamW)."""
        if key == "decoupled_weight_decay":
            return bool(value) == getattr(self, "_decoupled_weight_decay", None)
        return key in IMPLEMENTATION_HINTS and key not in self.defaults and not value

    def _load_state_value(self, p: Tensor, name: str, value):
        if name == "step":
            return int(round(float(value.item() if isinstance(value, Tensor) else value)))
        if value is None:
            return None
        if isinstance(value, (Tensor, np.ndarray)):
            if isinstance(value, Tensor):   # a global value's whole value: every rank loads together
                array = value.numpy() if value.is_global else value.numpy_view()
            else:
                array = value
            if array.dtype.kind == "f" or array.dtype.kind == "V":
                array = array.astype(self._state_np_dtype(p))
            existing = self.state.get(p, {}).get(name)
            if isinstance(existing, Tensor) and tuple(existing.shape) == array.shape and \
                    existing.dtype.np_dtype == array.dtype:
                if existing.is_global:    # a placed parameter's slot: each rank of its placement its part
                    global_tensor.assign_whole(existing, array)
                    return existing
                existing.numpy_view()[...] = array   # keep the object: a graph may alias it
                existing._version += 1
                return existing
            return Tensor(np.array(array), dtype=dt.from_numpy(array.dtype), device=p.device)
        return value

    # ------------------------------------------------------------------ misc
    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} ("]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            for key in sorted(k for k in group if k != "params"):
                lines.append(f"    {key}: {group[key]}")
        lines.append(")")
        return "\n".join(lines)
