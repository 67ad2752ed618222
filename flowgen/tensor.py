"""`Tensor`: an eager NumPy array with autograd metadata, or a lazy IR value.

A tensor is *eager* when it holds data (``_data``, a NumPy array) and *lazy*
while `nn.Graph.build()` is being traced (``_value``, an IR value). Every
computation goes through `flowgen.ops.registry.apply`, so methods here are
one-line delegations to `flowgen.functional` — op logic lives only in the op
definitions.
"""
from __future__ import annotations

import contextlib

import copy
import itertools
import threading

import numpy as np

from flowgen import dtype as dt
from flowgen.device import CPU, as_device

_OPERANDS = (int, float, bool, np.ndarray, np.generic, list, tuple)  # + Tensor, added below

# Every tensor gets a creation number: a graph's tracer tells the eager tensors that existed before
# build() ran (free eager tensors, bound as graph state) from those build() creates (constants).
_creation_numbers = itertools.count()


class _InferenceModeState(threading.local):
    """Whether this thread is inside `flow.inference_mode()` (flowgen/inference.py): tensors made
    there are inference tensors (`is_inference()`)."""
    enabled = False


inference_mode_state = _InferenceModeState()


def creation_mark() -> int:
    """A number above that of every tensor created so far (and below every later one)."""
    return next(_creation_numbers)


def c_array(arr, np_dtype=None) -> np.ndarray:
    """`arr` as a C-contiguous array of `np_dtype`, keeping 0-d arrays 0-d (unlike np.ascontiguousarray)."""
    arr = np.asarray(arr, dtype=np_dtype)
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


class Tensor:
    __array_priority__ = 1000  # so ndarray <op> Tensor defers to Tensor
    _global = None                     # GlobalInfo of a global tensor (flowgen/distributed/global_tensor.py)
    _post_accumulate_grad_hooks = ()   # called after backward() accumulates into .grad (DDP's all-reduce)
    # The strides a OneFlow/PyTorch view would have, set by permute/transpose; None for row-major.
    # flowgen stores every tensor dense and row-major (a permute is a copy), so this is layout
    # metadata for is_contiguous()/stride()/contiguous(), not a description of the NumPy buffer.
    _view_strides = None
    # registry.View of the tensor this one views, for the result of a view op (reshape, permute,
    # slice, expand, detach: registry.record_view), else None. flowgen's tensors own their data,
    # so PyTorch's aliasing of views is carried by this record: see _write_through and
    # _refresh_view.
    _view = None
    _inference = False                 # made inside flow.inference_mode(): see is_inference()
    # Devices and layouts flowgen has no tensors on (PyTorch's predicates, which model files test).
    is_xpu = is_mps = is_ipu = is_mtia = is_maia = is_xla = is_vulkan = is_meta = is_mkldnn = False
    is_sparse = is_sparse_csr = is_quantized = is_nested = False
    # ((write count, stand-in), ...): the values and autograd histories this tensor had before
    # in-place writes gave it new ones (autograd.rebase_history, autograd.as_read)
    _earlier_values = ()

    def __init__(self, *data, dtype=None, device=None, requires_grad=False, _value=None):
        """``Tensor(data)`` copies `data` (a list, scalar, ndarray or tensor) into a new tensor
        (float64 data becomes float32, as torch.Tensor/flow.Tensor do); ``Tensor(2, 3)`` or
        ``Tensor(flow.Size([2, 3]))`` is a zero-filled float32 tensor of that shape."""
        sizes = tuple(data[0]) if len(data) == 1 and isinstance(data[0], Size) else data
        if sizes and all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in sizes):
            data = np.zeros(sizes, dt.get(dtype).np_dtype if dtype is not None else np.float32)
        elif len(data) == 1:
            data = data[0]
        elif data:
            raise TypeError(f"Tensor(): expected one data argument or sizes (ints), got {data!r}")
        elif _value is None:
            data = np.zeros((0,), dt.get(dtype).np_dtype if dtype is not None else np.float32)
        else:
            data = None
        self._value = _value          # IR value while tracing, else None
        self._data = None
        self._dtype = None
        self.device = as_device(device) if device is not None else CPU
        self.requires_grad = bool(requires_grad)
        self.grad = None
        self.grad_fn = None           # autograd node that produced this tensor
        self._retains_grad = False
        self._version = 0             # bumped by in-place writes (graphs re-upload state on change)
        self._sync_from_device = None  # callable that refreshes _data from a graph's device copy
        self._serial = next(_creation_numbers)
        self._storage_shared = False  # .numpy() handed the storage out (graphs keep it in sync)
        if inference_mode_state.enabled:
            self._inference = True
        if _value is not None:
            self._dtype = _value.dtype
        elif data is not None:
            self._set_data(data, dtype)

    @classmethod
    def _wrap(cls, arr: np.ndarray, dtype, device) -> "Tensor":
        """Fast constructor for op results: `arr` (C-contiguous, of `dtype`) is used as is.
        Sets exactly the attributes __init__ sets; keep the two in step."""
        t = object.__new__(cls)
        t._value = None
        t._data = arr
        t._dtype = dtype
        t.device = device
        t.requires_grad = False
        t.grad = None
        t.grad_fn = None
        t._retains_grad = False
        t._version = 0
        t._sync_from_device = None
        t._serial = next(_creation_numbers)
        t._storage_shared = False
        if inference_mode_state.enabled:
            t._inference = True
        return t

    def _set_data(self, data, dtype=None):
        if isinstance(data, Tensor):
            data = data.numpy_view()
        target = dt.get(dtype) if dtype is not None else None
        arr = np.array(data)   # a copy: the tensor never shares the caller's array
        if target is None:
            # float64 data (NumPy's default) becomes float32, flowgen's default float.
            target = dt.from_numpy(arr.dtype)
            target = dt.float32 if target == dt.float64 else target
        self._dtype = target
        self._data = c_array(arr, target.np_dtype)

    # ------------------------------------------------------------------ basics
    @property
    def is_lazy(self) -> bool:
        return self._value is not None

    @property
    def dtype(self) -> dt.DType:
        return self._dtype

    @property
    def shape(self) -> tuple:
        if self._value is not None:
            return Size(self._value.shape)
        if self._global is not None:
            return Size(self._global.shape)
        if self._data is not None:   # (a stale view's shape without recomputing it)
            return Size(self._data.shape)
        return Size(self.numpy_view().shape)

    @property
    def meta(self):
        return registry.TensorMeta(tuple(self.shape), self._dtype)

    def size(self, dim=None):
        shape = self.shape
        return shape if dim is None else shape[dim]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    @property
    def is_leaf(self) -> bool:
        return self.grad_fn is None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"

    def is_inference(self) -> bool:
        """True for a tensor made inside `flow.inference_mode()` (PyTorch's inference tensors).
        A view of one made later, outside the mode, is an ordinary tensor in flowgen (PyTorch:
        an inference tensor too)."""
        return self._inference

    @property
    def data(self) -> "Tensor":
        return self.detach()

    @data.setter
    def data(self, other):
        self._set_data(other.numpy_view() if isinstance(other, Tensor) else other, self._dtype)
        self._version += 1

    def numpy_view(self) -> np.ndarray:
        """The backing array without a copy (internal; syncs from a graph's device copy first)."""
        if self._value is not None:
            raise RuntimeError(
                "tensor.numpy() was called on a lazy tensor inside nn.Graph.build(): the graph has no values "
                "while it is being traced. Return the tensor from build() and read it after the call.")
        if self._global is not None:
            raise RuntimeError(f"this tensor is global ({self._global.sbp[0]!r} on {self._global.placement!r}) and "
                               f"has no storage of its whole value here: use .to_local() for this rank's part or "
                               f".numpy() for the whole value")
        if self._sync_from_device is not None:
            sync, self._sync_from_device = self._sync_from_device, None
            sync(self)
        if self._view_is_stale:
            self._refresh_view()
        return self._data

    @property
    def _view_is_stale(self) -> bool:
        """A view whose root was written in place since it was computed."""
        return self._view is not None and self._view.root._version != self._view.root_version

    def numpy(self) -> np.ndarray:
        """The tensor's storage as an ndarray, shared as in PyTorch: writing into the array writes
        the tensor. For a tensor a compiled graph holds (parameter, buffer, optimizer slot, free
        eager tensor) that sharing holds across graph calls too: once `.numpy()` has handed its
        storage out, the graph uploads the tensor before each call and refreshes the array in place
        after it (nn/graph/compiled.py), so writes reach the graph and the array shows the graph's
        updates. (``np.asarray(tensor)`` is a read: it does not set this up.)"""
        if self._global is not None:   # the logical value (a collective: every rank calls it)
            return global_tensor.logical_value(self)
        arr = self.numpy_view()
        self._storage_shared = True
        return arr

    def __array__(self, dtype=None, copy=None):
        arr = self.numpy_view()
        return arr.astype(dtype) if dtype is not None else arr

    def item(self):
        arr = self.numpy_view()
        if arr.size != 1:
            raise ValueError(f"item(): only one element tensors can be converted to Python scalars, got shape {arr.shape}")
        return arr.reshape(()).item()

    def tolist(self):
        return self.numpy_view().tolist()

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def __bool__(self):
        return bool(self.item())

    def __format__(self, spec):
        if spec and self.numel() == 1:
            return format(self.item(), spec)
        return repr(self) if not spec else format(repr(self), spec)

    def __hash__(self):
        return id(self)

    def __deepcopy__(self, memo):
        """A copy of the data and autograd flags; graph bindings (device copies) are not copied."""
        out = Tensor(self.numpy_view().copy(), dtype=self._dtype, device=self.device)
        out.requires_grad = self.requires_grad
        if self.grad is not None:
            out.grad = copy.deepcopy(self.grad, memo)
        out.__class__ = self.__class__
        memo[id(self)] = out
        return out

    def __repr__(self) -> str:
        extras = []
        if self.device.type == "cuda":
            extras.append(f"device='{self.device}'")
        if self.is_lazy:
            return f"tensor(..., {', '.join(extras + [f'is_lazy={chr(39)}True{chr(39)}'])}, size={tuple(self.shape)}, dtype={self._dtype!r})"
        if self._global is not None:
            extras += [f"placement={self._global.placement!r}", f"sbp={self._global.sbp!r}"]
        arr = self.numpy()
        if self._dtype is dt.bfloat16:
            arr = arr.astype(np.float32)
        body = np.array2string(arr, separator=", ", prefix="tensor(", precision=4,
                               floatmode="fixed" if arr.dtype.kind == "f" else "maxprec")
        extras.append(f"dtype={self._dtype!r}")
        if self.grad_fn is not None:
            extras.append(f"grad_fn=<{self.grad_fn.name}>")
        elif self.requires_grad:
            extras.append("requires_grad=True")
        return f"tensor({body}, {', '.join(extras)})"

    # ---------------------------------------------------------------- autograd
    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        if inputs is not None:
            raise NotImplementedError("backward(inputs=...): flowgen accumulates into every leaf that requires "
                                      "grad; select gradients by requires_grad_(False) instead")
        if self.is_lazy:  # inside nn.Graph.build(): mark the loss for the autodiff pass
            if create_graph:
                raise NotImplementedError("backward(create_graph=True) in nn.Graph.build(): higher-order "
                                          "gradients are not supported")
            return registry._tracer_hook.mark_backward(self, gradient, retain_graph)
        autograd.backward(self, gradient, retain_graph, create_graph)

    def detach(self) -> "Tensor":
        if self.is_lazy:
            return F.detach(self)
        if self._global is not None:
            return global_tensor.detached(self)
        out = Tensor.__new__(Tensor)
        Tensor.__init__(out, None, device=self.device)
        out._data, out._dtype = self.numpy_view(), self._dtype
        # The same memory, and a view for writes (`p.data.mul_(0.5)` bumps p's version: graphs upload it).
        registry.record_view(out, self, "detach", {})
        return out

    def requires_grad_(self, requires_grad=True) -> "Tensor":
        if not self.is_leaf and not requires_grad:
            raise RuntimeError("requires_grad_(False) is only allowed on leaf tensors; use detach()")
        if requires_grad and self._inference and not inference_mode_state.enabled:
            raise RuntimeError("Setting requires_grad=True on inference tensor outside InferenceMode is not allowed "
                               "(the tensor was made inside flow.inference_mode()); clone() it outside the mode "
                               "to get an ordinary tensor")
        self.requires_grad = requires_grad
        return self

    def retain_grad(self):
        self._retains_grad = True

    # ------------------------------------------------------------ conversion
    def to(self, *args, **kwargs) -> "Tensor":
        target_device, target_dtype = self.device, self._dtype
        for a in list(args) + list(kwargs.values()):
            if a is Tensor:  # OneFlow's `graph.block.weight.to(flow.Tensor)`: the tensor itself
                continue
            if isinstance(a, dt.DType):
                target_dtype = a
            elif isinstance(a, Tensor):
                target_dtype, target_device = a.dtype, a.device
            elif isinstance(a, str) and a.partition(":")[0] not in ("cpu", "cuda"):
                target_dtype = dt.get(a)
            elif a is not None and not isinstance(a, bool):
                target_device = as_device(a)
        out = F.cast(self, target_dtype) if target_dtype != self._dtype else self
        if target_device != self.device:
            if self.is_lazy:
                raise RuntimeError("Tensor.to(device) inside nn.Graph.build() is not supported; move "
                                   "inputs and modules before calling the graph")
            moved = out.detach() if out is self else out
            moved = Tensor(moved.numpy_view().copy(), dtype=moved.dtype, device=target_device,
                           requires_grad=self.requires_grad and self.is_leaf)
            return moved
        return out

    def cuda(self):
        return self.to("cuda")

    def cpu(self):
        return self.to("cpu")

    def type_as(self, other):
        return self.to(other.dtype)

    def float(self):
        return self.to(dt.float32)

    def half(self):
        return self.to(dt.float16)

    def long(self):
        return self.to(dt.int64)

    def int(self):
        return self.to(dt.int32)

    def bool(self):
        return self.to(dt.bool_)

    def clone(self):
        return F.clone(self)

    def type(self, dtype=None):
        """``t.type()`` -> "flowgen.FloatTensor"-style name; ``t.type(dtype)`` -> cast."""
        if dtype is None:
            names = {dt.float32: "FloatTensor", dt.float16: "HalfTensor", dt.bfloat16: "BFloat16Tensor",
                     dt.float64: "DoubleTensor", dt.int64: "LongTensor", dt.int32: "IntTensor",
                     dt.int16: "ShortTensor", dt.int8: "CharTensor", dt.uint8: "ByteTensor", dt.bool_: "BoolTensor"}
            return f"flowgen.{names[self._dtype]}"
        return self.to(dt.get(dtype))

    def contiguous(self):
        return F.contiguous(self)

    # ---------------------------------------------------- layout and new tensors
    def is_contiguous(self, memory_format=None) -> bool:
        """False for the result of a permute/transpose that reorders dims (a view in OneFlow),
        until .contiguous(); see `_view_strides`."""
        return self._view_strides is None or self._view_strides == self._row_major_strides()

    def _row_major_strides(self) -> tuple:
        strides, step = [], 1
        for size in reversed(self.shape):
            strides.append(step)
            step *= max(size, 1)
        return tuple(reversed(strides))

    def stride(self, dim=None):
        strides = self._view_strides if self._view_strides is not None else self._row_major_strides()
        return strides if dim is None else strides[dim]

    def storage_offset(self) -> int:
        return 0

    def element_size(self) -> int:
        return self._dtype.itemsize

    def nelement(self) -> int:
        return self.numel()

    def ndimension(self) -> int:
        return self.ndim

    def is_floating_point(self) -> bool:
        return self._dtype.is_floating

    def double(self):
        return self.to(dt.float64)

    def bfloat16(self):
        return self.to(dt.bfloat16)

    def _new(self, fill, size, dtype, device, requires_grad):
        from_size = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
        arr = np.full(tuple(int(s) for s in from_size), fill, dt.get(dtype or self._dtype).np_dtype)
        return Tensor(arr, dtype=dtype or self._dtype, device=device or self.device, requires_grad=requires_grad)

    def new_zeros(self, *size, dtype=None, device=None, requires_grad=False):
        """Zeros of `size` with this tensor's dtype and device (unless given)."""
        return self._new(0, size, dtype, device, requires_grad)

    def new_ones(self, *size, dtype=None, device=None, requires_grad=False):
        return self._new(1, size, dtype, device, requires_grad)

    def new_empty(self, *size, dtype=None, device=None, requires_grad=False):
        return self._new(0, size, dtype, device, requires_grad)

    def new_full(self, size, fill_value, dtype=None, device=None, requires_grad=False):
        return self._new(fill_value, (size,), dtype, device, requires_grad)

    def new_tensor(self, data, dtype=None, device=None, requires_grad=False):
        """A copy of `data` with this tensor's dtype and device (unless given)."""
        arr = data.numpy() if isinstance(data, Tensor) else np.array(data)
        return Tensor(arr, dtype=dtype or self._dtype, device=device or self.device, requires_grad=requires_grad)

    # ---------------------------------------------------------------- DLPack
    def __dlpack__(self, stream=None, **kwargs):
        """Zero-copy export of the host data (``torch.from_dlpack(t)``, ``np.from_dlpack(t)``)."""
        if self._dtype == dt.bfloat16:
            raise BufferError("__dlpack__: bfloat16 tensors cannot be exported through NumPy's DLPack; "
                              "cast with .float() first")
        return self.numpy_view().__dlpack__(**({"stream": stream} if stream is not None else {}), **kwargs)

    def __dlpack_device__(self):
        return self.numpy_view().__dlpack_device__()

    # ------------------------------------------------------------- in-place
    def _assign(self, new: "Tensor") -> "Tensor":
        """Write `new` into this tensor (eager: same buffer; traced: a state update, or a new
        value of a free eager tensor for the rest of the call, ir/trace.py); a view writes
        through to the tensor it views (`_write_through`)."""
        tracer = registry._tracer_hook
        if new is not self and autograd.is_grad_enabled() and self.requires_grad and \
                (self.grad_fn is not None or self.is_lazy):
            # PyTorch: x.fill_(c) or x.copy_(src) gives the old value of x a zero gradient, so what
            # x was computed from still gets a (zero) gradient and the optimizer updates it (weight
            # decay, momentum), eagerly and in graphs; src gets the whole gradient
            new = F.where(Tensor(np.zeros((), bool), device=self.device), self,
                          new if new.dtype == self.dtype else new.to(self.dtype))
        if self.is_lazy or new.is_lazy or (tracer is not None and tracer.is_free(self)):
            if tracer is None:
                raise RuntimeError("an in-place op on a lazy (graph) tensor outside nn.Graph.build()")
            if self._view_is_stale:
                self._refresh_view()
            tracer.assign(self, new)
        else:
            if self._view_is_stale:
                self._refresh_view()   # (fill_ reads no values: a stale view takes its root's first)
            if new is not self and autograd.is_grad_enabled() and (self.requires_grad or new.requires_grad):
                autograd.rebase_history(self, new)
            value = np.broadcast_to(new.numpy_view(), self.shape).astype(self._dtype.np_dtype, copy=False)
            self.numpy_view()[...] = value
        self._version += 1
        if self._view is not None:
            self._write_through()
        return self

    def _write_through(self):
        """After an in-place write to this view: write its new value into the root it views.
        Through a detach() the root's values change but not its autograd history (PyTorch:
        autograd does not see the write)."""
        root, replay, _, whole, differentiable = self._view
        traced = registry._tracer_hook is not None
        with contextlib.nullcontext() if differentiable or traced else autograd.no_grad():
            if whole:
                written = F.reshape(self, tuple(root.shape))
            else:
                positions = replay(Tensor(np.arange(root.numel(), dtype=np.int64).reshape(root.shape),
                                          dtype=dt.int64)).numpy_view()
                if np.unique(positions).size != positions.size:
                    raise RuntimeError(f"unsupported operation: an in-place write to a view of shape "
                                       f"{tuple(self.shape)} whose elements refer to the same element of its base "
                                       f"(an expand()ed view, as PyTorch refuses); clone() it before writing")
                written = F.scatter_positions(root, positions, self)
        if differentiable:
            root._assign(written)
        elif traced:   # functional, as every traced write
            root._assign(F.with_value(root, written))
        else:
            root.numpy_view()[...] = written.numpy_view()
            root._version += 1
        self._view = self._view._replace(root_version=root._version)

    def _refresh_view(self):
        """Recompute this view from its root, which was written in place since it was computed."""
        view, self._view = self._view, None   # replaying reads only the root
        new = view.replay(view.root)
        if new.is_lazy:
            self._value, self.requires_grad = new._value, new.requires_grad
        else:
            if autograd.is_grad_enabled() and (self.requires_grad or new.requires_grad):
                autograd.rebase_history(self, new, walk_all=True)
            self._data = new.numpy_view()
        self._version += 1  # ops that read the old value are refused at backward(), as PyTorch's shared counter
        self._view = view._replace(root_version=view.root._version)

    def copy_(self, src):
        return self._assign(src if isinstance(src, Tensor) else as_tensor_like(src, self))

    def fill_(self, value):
        return self._assign(F.full_like(self, value))

    def zero_(self):
        return self.fill_(0)

    # add_, mul_, clamp_, relu_, masked_fill_, ... : Tensor.__getattr__ (INPLACE_METHODS)

    # Random fills draw from the Philox stream (flowgen/ops/random_ops.py): graph ops inside build().
    def uniform_(self, a=0.0, b=1.0):
        return self._assign(creation.uniform(tuple(self.shape), a, b, dtype=self._dtype))

    def normal_(self, mean=0.0, std=1.0):
        return self._assign(creation.normal(mean, std, tuple(self.shape), dtype=self._dtype))

    def bernoulli_(self, p=0.5):
        return self._assign(creation.bernoulli(self, p))

    def exponential_(self, lambd=1.0):
        """Fill with Exponential(lambd) samples: -log(1 - u) / lambd for u uniform in [0, 1)."""
        if not self._dtype.is_floating:
            raise TypeError(f"Tensor.exponential_: needs a floating point tensor, got {self._dtype!r}")
        if not lambd > 0:
            raise ValueError(f"Tensor.exponential_: lambd must be positive, got {lambd}")
        u = creation.uniform(tuple(self.shape), 0.0, 1.0, dtype=self._dtype)
        return self._assign(F.log1p(-u) * (-1.0 / float(lambd)))

    def bernoulli(self, p=None):
        return creation.bernoulli(self, p)

    def _inplace(self, new: "Tensor") -> "Tensor":
        # `x += y`: in place, as PyTorch (aliases and views of x see it); autograd takes the new
        # value's history (rebase_history).
        return self._assign(new)

    def __iadd__(self, o): return self._inplace(F.add(self, o))
    def __isub__(self, o): return self._inplace(F.sub(self, o))
    def __imul__(self, o): return self._inplace(F.mul(self, o))
    def __itruediv__(self, o): return self._inplace(F.div(self, o))

    def __setitem__(self, key, value):
        """``x[key] = value`` writes in place, as PyTorch: through views, with autograd, and in
        graphs (functional.setitem_value says which indices)."""
        self._assign(F.setitem_value(self, key, value))

    # ------------------------------------------------------------ operators
    def __add__(self, o): return F.add(self, o)
    def __radd__(self, o): return F.add(o, self)
    def __sub__(self, o): return F.sub(self, o)
    def __rsub__(self, o): return F.sub(o, self)
    def __mul__(self, o): return F.mul(self, o)
    def __rmul__(self, o): return F.mul(o, self)
    def __truediv__(self, o): return F.div(self, o)
    def __rtruediv__(self, o): return F.div(o, self)
    def __floordiv__(self, o): return F.floor_divide(self, o)
    def __rfloordiv__(self, o): return F.floor_divide(o, self)
    def __mod__(self, o): return F.remainder(self, o)
    def __rmod__(self, o): return F.remainder(o, self)
    def __pow__(self, o): return F.pow(self, o)
    def __rpow__(self, o): return F.pow(o, self)
    def __matmul__(self, o): return F.matmul(self, o)
    def __rmatmul__(self, o): return F.matmul(o, self)
    def __neg__(self): return F.neg(self)
    def __abs__(self): return F.abs(self)
    def __eq__(self, o): return F.eq(self, o) if isinstance(o, _OPERANDS) else NotImplemented
    def __ne__(self, o): return F.ne(self, o) if isinstance(o, _OPERANDS) else NotImplemented
    def __lt__(self, o): return F.lt(self, o)
    def __le__(self, o): return F.le(self, o)
    def __gt__(self, o): return F.gt(self, o)
    def __ge__(self, o): return F.ge(self, o)
    # bitwise, as PyTorch (on bools: the logical ops); `&` of integers was a logical and
    def __and__(self, o): return F.bitwise_and(self, o)
    def __or__(self, o): return F.bitwise_or(self, o)
    def __xor__(self, o): return F.bitwise_xor(self, o)
    def __rand__(self, o): return F.bitwise_and(o, self)
    def __ror__(self, o): return F.bitwise_or(o, self)
    def __rxor__(self, o): return F.bitwise_xor(o, self)
    def __invert__(self): return F.bitwise_not(self)
    def __getitem__(self, key): return F.getitem(self, key)

    # -------------------------------------------------------------- methods
    def __getattr__(self, name):
        # Tensor.foo(*args) is flowgen.functional.foo(self, *args) for every op in TENSOR_METHODS,
        # and Tensor.foo_(*args) writes it into the tensor for every op in INPLACE_METHODS.
        if name in TENSOR_METHODS:
            fn = getattr(F, name)
            return lambda *args, **kwargs: fn(self, *args, **kwargs)
        if name.endswith("_") and name[:-1] in INPLACE_METHODS:
            fn = getattr(F, name[:-1])
            return lambda *args, **kwargs: self._assign(fn(self, *args, **kwargs))
        raise AttributeError(f"'Tensor' object has no attribute {name!r}")

    def view(self, *shape, **keyword):
        return F.reshape(self, *shape, **keyword)

    @property
    def is_global(self) -> bool:
        """OneFlow: whether the tensor has a placement and SBP across ranks (see `to_global`)."""
        return self._global is not None

    @property
    def is_local(self) -> bool:
        return self._global is None

    def to_global(self, placement=None, sbp=None) -> "Tensor":
        """A local tensor becomes this rank's component of a global one (`broadcast` takes the data of
        the placement's first rank); a global tensor changes its placement/SBP, differentiably
        (flowgen/distributed/global_tensor.py). Inside nn.Graph.build() a broadcast is the identity."""
        return global_tensor.to_global(self, placement, sbp)

    def to_local(self) -> "Tensor":
        """This rank's component of a global tensor (an empty tensor on a rank outside its placement)."""
        if self._global is None:
            raise RuntimeError("to_local(): the tensor is already local (to_local needs a global tensor)")
        return global_tensor.local_or_empty(self)

    @property
    def placement(self):
        if self._global is None:
            raise RuntimeError("a local tensor has no placement; it is global after .to_global(placement, sbp)")
        return self._global.placement

    @property
    def sbp(self) -> tuple:
        if self._global is None:
            raise RuntimeError("a local tensor has no sbp; it is global after .to_global(placement, sbp)")
        return self._global.sbp

    def register_post_accumulate_grad_hook(self, hook):
        """`hook(tensor)` runs after backward() has accumulated this leaf's gradient into .grad."""
        self._post_accumulate_grad_hooks = (*self._post_accumulate_grad_hooks, hook)

    def where(self, condition, other):
        """``x.where(cond, y)`` == ``flow.where(cond, x, y)``."""
        return F.where(condition, self, other)

    def size_bytes(self) -> int:
        return self.numel() * self._dtype.itemsize

    @property
    def T(self):
        return F.permute(self, *reversed(range(self.ndim)))

    @property
    def mT(self):
        """The last two dims swapped (a batch of matrices transposed)."""
        if self.ndim < 2:
            raise RuntimeError(f"tensor.mT is only supported on matrices or batches of matrices. Got "
                               f"{self.ndim}-D tensor.")
        return F.transpose(self, -2, -1)

    def sum_to_size(self, *size):
        """Summed down to `size`, which must broadcast to this tensor's shape (torch.Tensor.sum_to_size)."""
        if len(size) == 1 and isinstance(size[0], (tuple, list)):
            size = tuple(size[0])
        return F.sum_to(self, tuple(int(s) for s in size))


_OPERANDS = _OPERANDS + (Tensor,)

# Functional ops that are also Tensor methods (t.sum(1) == flow.sum(t, 1)).
TENSOR_METHODS = frozenset("""
reshape view_as reshape_as flatten unsqueeze squeeze transpose permute expand expand_as repeat t
narrow select unbind split chunk
sum mean max min amax amin argmax argmin var std all any
pow exp log sqrt rsqrt abs neg clamp clip clamp_min clamp_max sign floor reciprocal square
relu sigmoid tanh gelu silu softmax log_softmax sin cos
matmul mm bmm masked_fill gather index_select where
eq ne lt le gt ge logical_and logical_or logical_not logical_xor bitwise_and bitwise_or bitwise_xor bitwise_not
add sub mul div floor_divide maximum minimum
erf erfinv log1p expm1 ceil trunc fix round frac isnan isinf isfinite nan_to_num atan2 arctan2 fmod remainder
tan asin acos atan sinh cosh asinh acosh atanh arcsin arccos arctan arcsinh arccosh arctanh log2 log10 exp2 sinc logit
deg2rad rad2deg xlogy hypot logaddexp copysign
lerp addcmul addcdiv logsumexp norm movedim moveaxis unflatten tril triu flip roll diff outer ger addmm baddbmm
trace diagonal diag sort argsort topk cumsum cumprod allclose equal swapaxes swapdims repeat_interleave multinomial
prod mv isclose index_add scatter_add
""".split())

# Ops whose result has the tensor's shape: Tensor.foo_(*args) writes foo(tensor, *args) into it in
# place (PyTorch's in-place methods).
INPLACE_METHODS = frozenset("""
add sub mul div floor_divide fmod remainder pow atan2 arctan2 hypot copysign xlogy lerp addcmul addcdiv
abs neg exp exp2 expm1 log log1p log2 log10 sqrt rsqrt square reciprocal sign floor ceil trunc fix round frac
clamp clip clamp_min clamp_max nan_to_num relu sigmoid tanh sin cos tan asin acos atan sinh cosh asinh acosh atanh
arcsin arccos arctan arcsinh arccosh arctanh erf erfinv sinc logit deg2rad rad2deg
masked_fill index_add scatter_add tril triu cumsum cumprod
""".split())


class Size(tuple):
    """`tensor.shape`: a tuple that prints like OneFlow's."""

    def __repr__(self):
        return f"flowgen.Size([{', '.join(map(str, self))}])"

    def numel(self):
        return int(np.prod(self, dtype=np.int64))


def as_tensor_like(value, like: Tensor | None) -> Tensor:
    """A Python scalar/array as a tensor, typed to sit beside `like` (weak scalar typing); a scalar
    beside a global tensor is a broadcast global tensor on its placement."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (bool, int, float)) and like is not None:
        # Weak scalar typing (as PyTorch): the scalar takes the tensor's dtype unless its kind is
        # higher (a float beside an int tensor is float32, an int beside a bool tensor int64).
        target = like._dtype
        if isinstance(value, float):
            if not target.is_floating:
                target = dt.float32
        elif not isinstance(value, bool) and target is dt.bool_:
            target = dt.int64
        scalar = Tensor._wrap(np.array(value, dtype=target.np_dtype), target, like.device)
        return scalar if like._global is None else global_tensor.broadcast_beside(scalar, like)
    arr = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
    device = like.device if like is not None else None
    if arr.dtype == np.float64 and like is not None and like._dtype == dt.float64:
        return Tensor(arr, dtype=dt.float64, device=device)   # beside a float64 tensor it stays exact
    if arr.dtype == np.float64:
        arr = arr.astype(np.float32)   # flowgen's default float
    return Tensor(arr, device=device)


# Global tensors (flowgen/distributed/global_tensor.py) are built on Tensor, a layer above it: that
# module installs itself here when it loads (`import flowgen` loads it); Tensor's methods call it,
# autograd and creation reach it through `global_tensors()`.
global_tensor = None


def install_global_tensor(module) -> None:
    global global_tensor
    global_tensor = module


def global_tensors():
    """flowgen/distributed/global_tensor.py, as it installed itself."""
    return global_tensor


# Below the class: these modules import Tensor (the op registry through its op definitions).
from flowgen import functional as F  # noqa: E402  (functional imports Tensor)
from flowgen.ops import registry  # noqa: E402
from flowgen import creation  # noqa: E402
from flowgen import autograd  # noqa: E402  (autograd imports Tensor)
