"""`nn.Parameter`: a leaf tensor that a `Module` registers as learnable state."""
from __future__ import annotations

import numpy as np

from flowgen.tensor import Tensor


class Parameter(Tensor):
    """A tensor that requires grad and is registered by `Module.__setattr__`.

    ``Parameter(t)`` shares ``t``'s NumPy buffer (no copy), as in PyTorch, so
    ``nn.Parameter(flow.randn(3))`` costs nothing and in-place optimizer updates
    write the one array that compiled graphs alias. A global ``t`` makes a global
    parameter sharing ``t``'s local component.
    """

    def __init__(self, data=None, requires_grad: bool = True):
        if isinstance(data, Tensor):
            if data.is_lazy:
                raise RuntimeError("nn.Parameter() cannot wrap a lazy tensor inside nn.Graph.build(); "
                                   "create parameters in the module's __init__")
            super().__init__(None, device=data.device, requires_grad=requires_grad)
            if data.is_global:   # the parameter is that global tensor: same layout, same component
                self._data, self._dtype, self._global = None, data.dtype, data._global
            else:
                self._data, self._dtype = data.numpy_view(), data.dtype
                self._view_strides = data._view_strides
        elif data is None:
            super().__init__(np.zeros((0,), np.float32), requires_grad=requires_grad)
        else:
            super().__init__(data, requires_grad=requires_grad)

    def __repr__(self) -> str:
        return "Parameter containing:\n" + super().__repr__()
