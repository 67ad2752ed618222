"""2-d padding layers: F.pad over the last two dims with a fixed mode (one index_select per dim)."""
from __future__ import annotations

from flowgen.nn import functional as NF
from flowgen.nn.module import Module


def _quadruple(padding, name):
    """2 -> (2, 2, 2, 2); (left, right, top, bottom) as given."""
    if isinstance(padding, (tuple, list)):
        if len(padding) != 4:
            raise ValueError(f"{name}: padding must be an int or a 4-tuple (left, right, top, bottom), "
                             f"got {padding!r}")
        return tuple(int(p) for p in padding)
    return (int(padding),) * 4


class _Pad2d(Module):
    mode = "constant"
    value = None        # the fill of ConstantPad2d / ZeroPad2d

    def __init__(self, padding):
        super().__init__()
        self.padding = _quadruple(padding, type(self).__name__)

    def forward(self, x):
        if x.ndim not in (3, 4):
            raise ValueError(f"{self._get_name()}: expected a 3-D or 4-D input, got shape {tuple(x.shape)}")
        # self.__class__, not type(self): in a graph, forward runs on the module's Proxy (nn/graph/proxy.py)
        return NF.pad(x, self.padding, self.__class__.mode, self.value)

    def extra_repr(self) -> str:
        return f"{self.padding}"


class ConstantPad2d(_Pad2d):
    def __init__(self, padding, value: float):
        super().__init__(padding)
        self.value = value

    def extra_repr(self) -> str:
        return f"padding={self.padding}, value={self.value}"


class ZeroPad2d(ConstantPad2d):
    def __init__(self, padding):
        super().__init__(padding, 0.0)

    def extra_repr(self) -> str:
        return f"{self.padding}"


class ReflectionPad2d(_Pad2d):
    mode = "reflect"


class ReplicationPad2d(_Pad2d):
    mode = "replicate"


__all__ = ["ConstantPad2d", "ZeroPad2d", "ReflectionPad2d", "ReplicationPad2d"]
