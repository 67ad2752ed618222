"""`nn.Module` and the containers (Sequential, ModuleList, ModuleDict, Identity).

A module owns three ordered registries filled by `__setattr__`: parameters,
buffers and child modules. Everything else (state_dict, to(), train(), repr)
walks those registries, so a module assigned as an attribute is found by
every one of them — as in PyTorch.

Graph tracing hooks in through one module-level global: while
`_module_call_hook` is set, ``module(*args, **kwargs)`` returns
``_module_call_hook(module, forward, args, kwargs)``, where ``forward`` is a
callable running the module's forward (and its forward hooks). The tracer uses
it to keep the module path (``model.features.0``) and print INPUT/OUTPUT lines.
"""
from __future__ import annotations

import functools
import itertools
from collections import OrderedDict, namedtuple
from typing import Callable, Iterator

import numpy as np

from flowgen import dtype as dt
from flowgen.device import as_device, device as _device_type
from flowgen.autograd import zero_grads
from flowgen.distributed import global_tensor
from flowgen.nn.parameter import Parameter
from flowgen.tensor import Tensor

# Set by the graph tracer: hook(module, forward, args, kwargs) -> output.
_module_call_hook: Callable | None = None


def set_module_call_hook(hook: Callable | None) -> Callable | None:
    """Install `hook` as the module-call hook; returns the previous one (to restore it)."""
    global _module_call_hook
    previous = _module_call_hook
    _module_call_hook = hook
    return previous


class _IncompatibleKeys(namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])):
    def __repr__(self):
        if not self.missing_keys and not self.unexpected_keys:
            return "<All keys matched successfully>"
        return super().__repr__()

    __str__ = __repr__


class RemovableHandle:
    _ids = itertools.count()

    def __init__(self, hooks: dict):
        self._hooks = hooks
        self.id = next(RemovableHandle._ids)

    def remove(self):
        self._hooks.pop(self.id, None)


def _indent(text: str, spaces: int) -> str:
    lines = text.split("\n")
    return "\n".join(lines[:1] + [" " * spaces + line if line.strip() else "" for line in lines[1:]])


def _parse_to_args(args, kwargs):
    """`.to(...)` arguments → (device or None, dtype or None)."""
    target_device = target_dtype = None
    for value in list(args) + [kwargs.get("device"), kwargs.get("dtype")]:
        if value is None or isinstance(value, bool):
            continue
        if isinstance(value, Tensor):
            target_device, target_dtype = value.device, value.dtype
        elif isinstance(value, dt.DType):
            target_dtype = value
        elif isinstance(value, (str, _device_type)):
            target_device = as_device(value)
        else:
            target_dtype = dt.get(value)
    return target_device, target_dtype


class Module:
    """Base class for layers and models: subclass it, assign layers in `__init__`, write `forward`."""

    def __init__(self, *args, **kwargs):
        if args or kwargs:
            raise TypeError(f"{type(self).__name__}.__init__() got unexpected arguments; "
                            f"Module.__init__ takes none")
        self._init_registries()

    def _init_registries(self):
        setattr_ = object.__setattr__
        setattr_(self, "training", True)
        setattr_(self, "_parameters", OrderedDict())
        setattr_(self, "_buffers", OrderedDict())
        setattr_(self, "_non_persistent_buffers", set())
        setattr_(self, "_modules", OrderedDict())
        setattr_(self, "_forward_hooks", OrderedDict())
        setattr_(self, "_forward_pre_hooks", OrderedDict())

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"Module [{self._get_name()}] is missing the required \"forward\" function")

    # ------------------------------------------------------------------ calling
    def __call__(self, *args, **kwargs):
        return self._call_forward(self.forward, args, kwargs)

    def _call_forward(self, forward, args, kwargs):
        """`module(*args, **kwargs)` running `forward`: the module's own, or inside a graph the one
        its Proxy binds to itself (flowgen/nn/graph/proxy.py). Hooks see the module either way."""
        if _module_call_hook is not None:
            return _module_call_hook(self, functools.partial(self._run_forward, forward), args, kwargs)
        if not self._forward_hooks and not self._forward_pre_hooks:
            return forward(*args, **kwargs)
        return self._run_forward(forward, *args, **kwargs)

    def _run_forward(self, forward, *args, **kwargs):
        for hook in list(self._forward_pre_hooks.values()):
            replaced = hook(self, args)
            if replaced is not None:
                args = replaced if isinstance(replaced, tuple) else (replaced,)
        out = forward(*args, **kwargs)
        for hook in list(self._forward_hooks.values()):
            replaced = hook(self, args, out)
            if replaced is not None:
                out = replaced
        return out

    def register_forward_hook(self, hook) -> RemovableHandle:
        """`hook(module, args, output)`; a non-None return value replaces the output."""
        handle = RemovableHandle(self._forward_hooks)
        self._forward_hooks[handle.id] = hook
        return handle

    def register_forward_pre_hook(self, hook) -> RemovableHandle:
        """`hook(module, args)`; a non-None return value replaces the positional args."""
        handle = RemovableHandle(self._forward_pre_hooks)
        self._forward_pre_hooks[handle.id] = hook
        return handle

    # ------------------------------------------------------------- registration
    def __setattr__(self, name, value):
        if "_parameters" not in self.__dict__:
            # A subclass forgot super().__init__(): set up the registries instead of failing later.
            Module._init_registries(self)
        params, buffers, modules = self._parameters, self._buffers, self._modules
        if isinstance(value, Parameter):
            self._forget(name, keep=params)
            self.register_parameter(name, value)
        elif name in params:
            if value is not None:
                raise TypeError(f"cannot assign '{type(value).__name__}' as parameter '{name}' "
                                f"(nn.Parameter or None expected)")
            params[name] = None
        elif isinstance(value, Module):
            self._forget(name, keep=modules)
            modules[name] = value
        elif name in modules:
            if value is not None:
                raise TypeError(f"cannot assign '{type(value).__name__}' as child module '{name}' "
                                f"(nn.Module or None expected)")
            modules[name] = None
        elif name in buffers:
            if value is not None and not isinstance(value, Tensor):
                raise TypeError(f"cannot assign '{type(value).__name__}' as buffer '{name}' "
                                f"(flowgen.Tensor or None expected)")
            buffers[name] = value
        else:
            object.__setattr__(self, name, value)

    def _forget(self, name, keep):
        # Reassigning a name in the same registry keeps its place there (as in torch): state_dict(),
        # parameters() and so the optimizer's order stay those of the first assignment.
        self.__dict__.pop(name, None)
        for registry in (self._parameters, self._buffers, self._modules):
            if registry is not keep:
                registry.pop(name, None)
        self._non_persistent_buffers.discard(name)

    def __getattr__(self, name):
        # Only reached when normal lookup fails: look in the registries.
        d = self.__dict__
        for registry in ("_parameters", "_buffers", "_modules"):
            if registry in d and name in d[registry]:
                return d[registry][name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __delattr__(self, name):
        for registry in (self._parameters, self._buffers, self._modules):
            if name in registry:
                del registry[name]
                self._non_persistent_buffers.discard(name)
                return
        object.__delattr__(self, name)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self._parameters) | set(self._buffers) | set(self._modules))

    @staticmethod
    def _check_name(kind, name, owner):
        if not isinstance(name, str):
            raise TypeError(f"{kind} name should be a string, got {type(name).__name__}")
        if not name or "." in name:
            raise KeyError(f"{kind} name can't be empty or contain \".\", got {name!r}")
        if hasattr(type(owner), name) or (name in owner.__dict__):
            raise KeyError(f"attribute '{name}' already exists on {type(owner).__name__}")

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        if "_parameters" not in self.__dict__:
            Module._init_registries(self)
        if name not in self._parameters:
            self._check_name("parameter", name, self)
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(f"cannot assign '{type(param).__name__}' object to parameter '{name}' "
                            f"(nn.Parameter or None required)")
        self._parameters[name] = param

    def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> None:
        if "_parameters" not in self.__dict__:
            Module._init_registries(self)
        if name not in self._buffers:
            self._check_name("buffer", name, self)
        if tensor is not None and not isinstance(tensor, Tensor):
            raise TypeError(f"cannot assign '{type(tensor).__name__}' object to buffer '{name}' "
                            f"(flowgen.Tensor or None required)")
        self._buffers[name] = tensor
        if persistent:
            self._non_persistent_buffers.discard(name)
        else:
            self._non_persistent_buffers.add(name)

    def add_module(self, name: str, module: "Module | None") -> None:
        if "_parameters" not in self.__dict__:
            Module._init_registries(self)
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"{type(module).__name__} is not a Module subclass")
        if name not in self._modules:
            self._check_name("module", name, self)
        self._modules[name] = module

    register_module = add_module

    def get_submodule(self, target: str) -> "Module":
        module = self
        for part in target.split(".") if target else []:
            child = module._modules.get(part)
            if child is None:
                raise AttributeError(f"{module._get_name()} has no submodule `{part}` (looking up {target!r})")
            module = child
        return module

    def get_parameter(self, target: str) -> Parameter:
        path, _, name = target.rpartition(".")
        module = self.get_submodule(path)
        if name not in module._parameters:
            raise AttributeError(f"{module._get_name()} has no parameter `{name}`")
        return module._parameters[name]

    def get_buffer(self, target: str) -> Tensor:
        path, _, name = target.rpartition(".")
        module = self.get_submodule(path)
        if name not in module._buffers:
            raise AttributeError(f"{module._get_name()} has no buffer `{name}`")
        return module._buffers[name]

    # ---------------------------------------------------------------- iteration
    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        if memo is None:
            memo = set()
        if remove_duplicate:
            if id(self) in memo:
                return
            memo.add(id(self))
        yield prefix, self
        for name, module in self._modules.items():
            if module is None:
                continue
            yield from module.named_modules(memo, f"{prefix}.{name}" if prefix else name, remove_duplicate)

    def modules(self) -> Iterator["Module"]:
        for _, m in self.named_modules():
            yield m

    def named_children(self):
        seen = set()
        for name, module in self._modules.items():
            if module is not None and id(module) not in seen:
                seen.add(id(module))
                yield name, module

    def children(self) -> Iterator["Module"]:
        for _, m in self.named_children():
            yield m

    def _named_members(self, registry: str, prefix: str, recurse: bool, remove_duplicate: bool = True):
        seen = set()
        modules = self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate) if recurse else [(prefix, self)]
        for module_prefix, module in modules:
            for name, value in getattr(module, registry).items():
                if value is None or (remove_duplicate and id(value) in seen):
                    continue
                seen.add(id(value))
                yield (f"{module_prefix}.{name}" if module_prefix else name), value

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        yield from self._named_members("_parameters", prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        yield from self._named_members("_buffers", prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    # -------------------------------------------------------------- state dict
    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        """Parameters and persistent buffers by dotted name. Values share memory with the module."""
        if destination is None:
            destination = OrderedDict()
        for name, p in self._parameters.items():
            if p is not None:
                destination[prefix + name] = p if keep_vars else p.detach()
        for name, b in self._buffers.items():
            if b is not None and name not in self._non_persistent_buffers:
                destination[prefix + name] = b if keep_vars else b.detach()
        for name, module in self._modules.items():
            if module is not None:
                module.state_dict(destination, prefix + name + ".", keep_vars)
        return destination

    def load_state_dict(self, state_dict, strict: bool = True):
        """Copy values into this module's tensors in place (their identity is kept).

        Every key and shape is checked before anything is written, so a failed
        load leaves the module untouched.
        """
        if not hasattr(state_dict, "keys"):
            raise TypeError(f"load_state_dict expects a dict of tensors, got {type(state_dict).__name__}")
        own = self.state_dict(keep_vars=True)
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        errors = []
        if strict and unexpected:
            errors.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ".")
        if strict and missing:
            errors.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
        updates = []
        for key, target in own.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            if isinstance(value, Tensor):   # a global value's whole value: every rank loads together
                array = value.numpy() if value.is_global else value.numpy_view()
            else:
                array = np.asarray(value)
            if tuple(array.shape) != tuple(target.shape):
                errors.append(f"size mismatch for {key}: copying a param with shape {tuple(array.shape)} from "
                              f"checkpoint, the shape in current model is {tuple(target.shape)}.")
                continue
            updates.append((target, array))
        if errors:
            raise RuntimeError(f"Error(s) in loading state_dict for {self._get_name()}:\n\t" + "\n\t".join(errors))
        for target, array in updates:
            if target.is_global:    # each rank of its placement writes its part
                global_tensor.assign_whole(target, array)
                continue
            dest = target.numpy_view()
            if dest is not array:
                dest[...] = array.astype(dest.dtype, copy=False)
                target._version += 1
        return _IncompatibleKeys(missing, unexpected)

    # ---------------------------------------------------------- mode & moving
    def train(self, mode: bool = True) -> "Module":
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def requires_grad_(self, requires_grad: bool = True) -> "Module":
        for p in self.parameters():
            p.requires_grad_(requires_grad)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        zero_grads(self.parameters(), set_to_none)

    def apply(self, fn) -> "Module":
        for child in self.children():
            child.apply(fn)
        fn(self)
        return self

    def to(self, *args, **kwargs) -> "Module":
        """Move/cast every parameter and buffer in place: the same tensor objects afterwards.

        A dtype applies to floating-point tensors only (integer buffers such as
        `num_batches_tracked` keep theirs), as in PyTorch.
        """
        target_device, target_dtype = _parse_to_args(args, kwargs)
        if target_dtype is not None and not target_dtype.is_floating:
            raise TypeError(f"nn.Module.to only accepts floating point dtypes, but got desired dtype={target_dtype}")
        tensors = list(self.parameters()) + list(self.buffers())
        tensors += [p.grad for p in self.parameters() if p.grad is not None]
        for t in tensors:
            _move_in_place(t, target_device, target_dtype)
        return self

    def to_global(self, placement=None, sbp=None) -> "Module":
        """OneFlow's `Module.to_global`: every parameter and buffer becomes `t.to_global(placement, sbp)`.
        The module holds new tensors afterwards (parameters are new `Parameter`s keeping
        `requires_grad`, gradients converted too), so build optimizers after the call, as in OneFlow.
        A tensor shared by several modules stays shared."""
        return self._replace_tensors(lambda t: t.to_global(placement=placement, sbp=sbp), {})

    def to_local(self) -> "Module":
        """OneFlow's `Module.to_local`: every global parameter and buffer becomes its local component."""
        return self._replace_tensors(lambda t: t.to_local(), {})

    def _replace_tensors(self, convert, converted: dict) -> "Module":
        """Replace each parameter and buffer `t` (of this module and its children) by `convert(t)`;
        `converted` maps id(old) -> (old, new) across the walk (old kept alive so its id stays
        its own), so shared tensors stay shared."""
        for child in self.children():
            child._replace_tensors(convert, converted)
        for key, p in self._parameters.items():
            if p is not None and id(p) not in converted:
                new = Parameter(convert(p), requires_grad=p.requires_grad)
                if p.grad is not None:
                    new.grad = convert(p.grad)
                converted[id(p)] = (p, new)
            if p is not None:
                self._parameters[key] = converted[id(p)][1]
        for key, b in self._buffers.items():
            if b is not None and id(b) not in converted:
                converted[id(b)] = (b, convert(b))
            if b is not None:
                self._buffers[key] = converted[id(b)][1]
        return self

    def cuda(self, device=None) -> "Module":
        return self.to(device if device is not None else "cuda")

    def cpu(self) -> "Module":
        return self.to("cpu")

    def float(self) -> "Module":
        return self.to(dt.float32)

    def half(self) -> "Module":
        return self.to(dt.float16)

    def bfloat16(self) -> "Module":
        return self.to(dt.bfloat16)

    def double(self) -> "Module":
        return self.to(dt.float64)

    # -------------------------------------------------------------------- repr
    def _get_name(self) -> str:
        return type(self).__name__

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = self.extra_repr().split("\n") if self.extra_repr() else []
        for name, module in self._modules.items():
            lines.append(f"({name}): " + _indent(repr(module), 2))
        body = self._get_name() + "("
        if lines:
            if len(lines) == 1 and not self._modules:
                body += lines[0]
            else:
                body += "\n  " + "\n  ".join(lines) + "\n"
        return body + ")"


def _move_in_place(t: Tensor, target_device, target_dtype) -> None:
    if target_dtype is not None and t.dtype.is_floating and t.dtype != target_dtype:
        t._data = np.array(t.numpy_view(), dtype=target_dtype.np_dtype, order="C")
        t._dtype = target_dtype
        t._version += 1
    if target_device is not None and t.device != target_device:
        t.numpy_view()  # pull the latest values before the label changes
        t.device = target_device
        t._version += 1


# ---------------------------------------------------------------- containers
class Sequential(Module):
    """Modules run in order. Index (`seq[0]`), slice (`seq[1:]`), `len`, iterate, `append`."""

    def __init__(self, *args):
        super().__init__()
        if len(args) == 1 and isinstance(args[0], OrderedDict):
            for name, module in args[0].items():
                self.add_module(name, module)
        else:
            for i, module in enumerate(args):
                self.add_module(str(i), module)

    def _index(self, idx: int) -> int:
        n = len(self._modules)
        if not -n <= idx < n:
            raise IndexError(f"index {idx} is out of range for {self._get_name()} of length {n}")
        return idx % n

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return type(self)(OrderedDict(list(self._modules.items())[idx]))
        return list(self._modules.values())[self._index(idx)]

    def __setitem__(self, idx: int, module: Module) -> None:
        key = list(self._modules)[self._index(idx)]
        self.add_module(key, module)

    def __delitem__(self, idx) -> None:
        keys = list(self._modules)
        for key in keys[idx] if isinstance(idx, slice) else [keys[self._index(idx)]]:
            del self._modules[key]
        # Renumber so that indices stay 0..n-1, as in PyTorch.
        items = list(self._modules.values())
        if all(k.isdigit() for k in keys):
            self._modules.clear()
            for i, module in enumerate(items):
                self._modules[str(i)] = module

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def __add__(self, other: "Sequential") -> "Sequential":
        return Sequential(*self, *other)

    def append(self, module: Module) -> "Sequential":
        self.add_module(str(len(self)), module)
        return self

    def extend(self, modules) -> "Sequential":
        for m in modules:
            self.append(m)
        return self

    def insert(self, index: int, module: Module) -> "Sequential":
        items = list(self._modules.values())
        n = len(items)
        if not -n <= index <= n:
            raise IndexError(f"index {index} is out of range for insert into {self._get_name()} of length {n}")
        items.insert(index if index >= 0 else index + n, module)
        self._modules.clear()
        for i, m in enumerate(items):
            self.add_module(str(i), m)
        return self

    def pop(self, idx: int = -1) -> Module:
        module = self[idx]
        del self[idx]
        return module

    def forward(self, x):
        for module in self:   # in a graph, self is the Proxy and yields the children's Proxies
            x = module(x)
        return x


class ModuleList(Module):
    """A list of modules whose parameters the parent sees."""

    def __init__(self, modules=None):
        super().__init__()
        if modules is not None:
            self.extend(modules)

    def _index(self, idx: int) -> int:
        n = len(self._modules)
        if not -n <= idx < n:
            raise IndexError(f"index {idx} is out of range for ModuleList of length {n}")
        return idx % n

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return type(self)(list(self._modules.values())[idx])
        return self._modules[str(self._index(idx))]

    def __setitem__(self, idx: int, module: Module) -> None:
        self.add_module(str(self._index(idx)), module)

    def __delitem__(self, idx) -> None:
        items = list(self._modules.values())
        if isinstance(idx, slice):
            del items[idx]
        else:
            del items[self._index(idx)]
        self._modules.clear()
        for i, m in enumerate(items):
            self._modules[str(i)] = m

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def __iadd__(self, modules) -> "ModuleList":
        return self.extend(modules)

    def __add__(self, other) -> "ModuleList":
        return ModuleList(list(self) + list(other))

    def append(self, module: Module) -> "ModuleList":
        self.add_module(str(len(self)), module)
        return self

    def extend(self, modules) -> "ModuleList":
        for m in modules:
            self.append(m)
        return self

    def insert(self, index: int, module: Module) -> None:
        items = list(self._modules.values())
        items.insert(index, module)
        self._modules.clear()
        for i, m in enumerate(items):
            self.add_module(str(i), m)

    def pop(self, idx: int = -1) -> Module:
        module = self[idx]
        del self[idx]
        return module


class ModuleDict(Module):
    """A dict of modules whose parameters the parent sees (insertion order kept)."""

    def __init__(self, modules=None):
        super().__init__()
        if modules is not None:
            self.update(modules)

    def __getitem__(self, key: str) -> Module:
        return self._modules[key]

    def __setitem__(self, key: str, module: Module) -> None:
        self.add_module(key, module)

    def __delitem__(self, key: str) -> None:
        del self._modules[key]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules)

    def __contains__(self, key) -> bool:
        return key in self._modules

    def keys(self):
        return self._modules.keys()

    def values(self):
        return self._modules.values()

    def items(self):
        return self._modules.items()

    def clear(self) -> None:
        self._modules.clear()

    def pop(self, key: str) -> Module:
        return self._modules.pop(key)

    def update(self, modules) -> None:
        items = modules.items() if hasattr(modules, "items") else modules
        for key, module in items:
            self[key] = module


class ParameterList(Module):
    """A list of parameters the parent sees, named "0", "1", ... (PyTorch's ParameterList)."""

    def __init__(self, values=None):
        super().__init__()
        for value in values or ():
            self.append(value)

    def _index(self, idx: int) -> int:
        n = len(self._parameters)
        if not -n <= idx < n:
            raise IndexError(f"index {idx} is out of range for ParameterList of length {n}")
        return idx % n

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return type(self)(list(self._parameters.values())[idx])
        return self._parameters[str(self._index(idx))]

    def __setitem__(self, idx: int, param) -> None:
        self.register_parameter(str(self._index(idx)), _as_parameter(param))

    def __len__(self) -> int:
        return len(self._parameters)

    def __iter__(self):
        return iter(self._parameters.values())

    def __iadd__(self, values) -> "ParameterList":
        return self.extend(values)

    def append(self, value) -> "ParameterList":
        self.register_parameter(str(len(self)), _as_parameter(value))
        return self

    def extend(self, values) -> "ParameterList":
        for v in values:
            self.append(v)
        return self

    def extra_repr(self) -> str:
        return "\n".join(f"({k}): Parameter containing: [{p.dtype} of size {tuple(p.shape)}]"
                         for k, p in self._parameters.items())


class ParameterDict(Module):
    """A dict of parameters the parent sees, insertion order kept (PyTorch's ParameterDict)."""

    def __init__(self, parameters=None):
        super().__init__()
        if parameters is not None:
            self.update(parameters)

    def __getitem__(self, key: str):
        return self._parameters[key]

    def __setitem__(self, key: str, param) -> None:
        self.register_parameter(key, _as_parameter(param))

    def __delitem__(self, key: str) -> None:
        del self._parameters[key]

    def __contains__(self, key) -> bool:
        return key in self._parameters

    def __len__(self) -> int:
        return len(self._parameters)

    def __iter__(self):
        return iter(self._parameters)

    def keys(self):
        return self._parameters.keys()

    def values(self):
        return self._parameters.values()

    def items(self):
        return self._parameters.items()

    def pop(self, key: str):
        return self._parameters.pop(key)

    def update(self, parameters) -> None:
        items = parameters.items() if hasattr(parameters, "items") else parameters
        for key, value in items:
            self[key] = value

    def extra_repr(self) -> str:
        return "\n".join(f"({k}): Parameter containing: [{p.dtype} of size {tuple(p.shape)}]"
                         for k, p in self._parameters.items())


def _as_parameter(value) -> Parameter:
    """A tensor put into a ParameterList/Dict becomes a Parameter (as in PyTorch)."""
    return value if isinstance(value, Parameter) else Parameter(value)


class Identity(Module):
    """Returns its input; accepts and ignores constructor arguments (as PyTorch)."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x):
        return x
