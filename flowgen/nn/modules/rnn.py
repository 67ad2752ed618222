"""Recurrent layers (RNN, LSTM, GRU and their cells) with PyTorch's parameter names and gate order.

Parameters per layer and direction: ``weight_ih_l{k}[_reverse]`` (gates * hidden, input),
``weight_hh_l{k}[_reverse]`` (gates * hidden, hidden) and the two biases. Gate order: LSTM
(input, forget, cell, output), GRU (reset, update, new). The input projection of a whole sequence
is one matmul; each time step is one hidden matmul plus the gate math, which nn.Graph fuses into
one elementwise kernel per step. Inter-layer dropout acts in training mode, as in PyTorch.
"""
from __future__ import annotations

import math

from flowgen import creation
from flowgen import functional as F
from flowgen.nn import functional as NF
from flowgen.nn import init
from flowgen.nn.module import Module
from flowgen.nn.modules._utils import new_parameter

_GATES = {"RNN_TANH": 1, "RNN_RELU": 1, "LSTM": 4, "GRU": 3}


def _rnn_cell(mode):
    act = F.tanh if mode == "RNN_TANH" else F.relu

    def cell(x_proj, h, w_hh, b_hh):
        return act(x_proj + NF.linear(h, w_hh, b_hh))
    return cell


def _lstm_cell(x_proj, state, w_hh, b_hh):
    h, c = state
    i, f, g, o = F.chunk(x_proj + NF.linear(h, w_hh, b_hh), 4, -1)
    c = F.sigmoid(f) * c + F.sigmoid(i) * F.tanh(g)
    return F.sigmoid(o) * F.tanh(c), c


def _gru_cell(x_proj, h, w_hh, b_hh):
    xr, xz, xn = F.chunk(x_proj, 3, -1)
    hr, hz, hn = F.chunk(NF.linear(h, w_hh, b_hh), 3, -1)
    r = F.sigmoid(xr + hr)
    z = F.sigmoid(xz + hz)
    n = F.tanh(xn + r * hn)
    return (1.0 - z) * n + z * h


class RNNBase(Module):
    def __init__(self, mode: str, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False, proj_size: int = 0,
                 device=None, dtype=None):
        super().__init__()
        if not 0.0 <= dropout <= 1.0:
            raise ValueError(f"{type(self).__name__}: dropout should be a number in [0, 1], got {dropout}")
        if proj_size:
            raise NotImplementedError(f"{type(self).__name__}: proj_size is not supported yet")
        if hidden_size <= 0 or num_layers <= 0:
            raise ValueError(f"{type(self).__name__}: hidden_size and num_layers must be positive, got "
                             f"{hidden_size} and {num_layers}")
        self.mode, self.input_size, self.hidden_size, self.num_layers = mode, input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout, self.bidirectional = bias, batch_first, float(dropout), bidirectional
        self.proj_size = proj_size
        gates = _GATES[mode] * hidden_size
        directions = 2 if bidirectional else 1
        for layer in range(num_layers):
            layer_input = input_size if layer == 0 else hidden_size * directions
            for suffix in ("", "_reverse")[:directions]:
                kw = {"dtype": dtype, "device": device}
                setattr(self, f"weight_ih_l{layer}{suffix}", new_parameter((gates, layer_input), **kw))
                setattr(self, f"weight_hh_l{layer}{suffix}", new_parameter((gates, hidden_size), **kw))
                if bias:
                    setattr(self, f"bias_ih_l{layer}{suffix}", new_parameter((gates,), **kw))
                    setattr(self, f"bias_hh_l{layer}{suffix}", new_parameter((gates,), **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            init.uniform_(p, -bound, bound)

    def _weights(self, layer, suffix):
        get = lambda name: getattr(self, f"{name}_l{layer}{suffix}")   # noqa: E731
        return (get("weight_ih"), get("weight_hh"), get("bias_ih") if self.bias else None,
                get("bias_hh") if self.bias else None)

    def _cell(self):
        return {"LSTM": _lstm_cell, "GRU": _gru_cell}.get(self.mode) or _rnn_cell(self.mode)

    def _initial_state(self, x, hx, batch):
        directions = 2 if self.bidirectional else 1
        shape = (self.num_layers * directions, batch, self.hidden_size)
        zeros = lambda: creation.zeros(shape, dtype=x.dtype, device=x.device)   # noqa: E731
        if self.mode == "LSTM":
            if hx is None:
                return zeros(), zeros()
            h0, c0 = hx
            for name, t in (("h_0", h0), ("c_0", c0)):
                if tuple(t.shape) != shape:
                    raise RuntimeError(f"LSTM: expected {name} of shape {shape}, got {tuple(t.shape)}")
            return h0, c0
        if hx is None:
            return zeros()
        if tuple(hx.shape) != shape:
            raise RuntimeError(f"{type(self).__name__}: expected hidden state of shape {shape}, got {tuple(hx.shape)}")
        return hx

    def forward(self, input, hx=None):
        unbatched = input.ndim == 2
        if input.ndim not in (2, 3):
            raise ValueError(f"{self._get_name()}: expected a 2-D (unbatched) or 3-D input, got shape "
                             f"{tuple(input.shape)}")
        if input.shape[-1] != self.input_size:
            raise RuntimeError(f"{self._get_name()}: input.size(-1) must be equal to input_size. Expected "
                               f"{self.input_size}, got {input.shape[-1]}")
        x = F.unsqueeze(input, 1) if unbatched else (F.transpose(input, 0, 1) if self.batch_first else input)
        if unbatched and hx is not None:
            hx = tuple(F.unsqueeze(t, 1) for t in hx) if self.mode == "LSTM" else F.unsqueeze(hx, 1)
        steps, batch = x.shape[0], x.shape[1]
        state = self._initial_state(x, hx, batch)
        cell = self._cell()
        directions = 2 if self.bidirectional else 1
        finals_h, finals_c = [], []
        for layer in range(self.num_layers):
            outputs = []
            for d, suffix in enumerate(("", "_reverse")[:directions]):
                w_ih, w_hh, b_ih, b_hh = self._weights(layer, suffix)
                index = layer * directions + d
                if self.mode == "LSTM":
                    s = (state[0][index], state[1][index])
                else:
                    s = state[index]
                projected = NF.linear(x, w_ih, b_ih)          # every time step's input in one matmul
                order = range(steps - 1, -1, -1) if d else range(steps)
                hs = [None] * steps
                for t in order:
                    s = cell(projected[t], s, w_hh, b_hh)
                    hs[t] = s[0] if self.mode == "LSTM" else s
                outputs.append(F.stack(hs, 0))
                if self.mode == "LSTM":
                    finals_h.append(s[0])
                    finals_c.append(s[1])
                else:
                    finals_h.append(s)
            x = outputs[0] if directions == 1 else F.cat(outputs, -1)
            if self.dropout and self.training and layer < self.num_layers - 1:
                x = NF.dropout(x, self.dropout, True)
        h_n = F.stack(finals_h, 0)
        out = F.squeeze(x, 1) if unbatched else (F.transpose(x, 0, 1) if self.batch_first else x)
        if unbatched:
            h_n = F.squeeze(h_n, 1)
        if self.mode == "LSTM":
            c_n = F.stack(finals_c, 0)
            return out, (h_n, F.squeeze(c_n, 1) if unbatched else c_n)
        return out, h_n

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        if not self.bias:
            s += ", bias=False"
        if self.batch_first:
            s += ", batch_first=True"
        if self.dropout:
            s += f", dropout={self.dropout}"
        if self.bidirectional:
            s += ", bidirectional=True"
        return s


class RNN(RNNBase):
    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, nonlinearity: str = "tanh",
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 device=None, dtype=None):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"RNN: unknown nonlinearity {nonlinearity!r} (expected 'tanh' or 'relu')")
        self.nonlinearity = nonlinearity
        super().__init__("RNN_TANH" if nonlinearity == "tanh" else "RNN_RELU", input_size, hidden_size, num_layers,
                         bias, batch_first, dropout, bidirectional, device=device, dtype=dtype)


class LSTM(RNNBase):
    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False, proj_size: int = 0,
                 device=None, dtype=None):
        super().__init__("LSTM", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         proj_size, device=device, dtype=dtype)


class GRU(RNNBase):
    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False, device=None,
                 dtype=None):
        super().__init__("GRU", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         device=device, dtype=dtype)


class _CellBase(Module):
    def __init__(self, mode: str, input_size: int, hidden_size: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.mode, self.input_size, self.hidden_size, self.bias = mode, input_size, hidden_size, bias
        gates = _GATES[mode] * hidden_size
        kw = {"dtype": dtype, "device": device}
        self.weight_ih = new_parameter((gates, input_size), **kw)
        self.weight_hh = new_parameter((gates, hidden_size), **kw)
        if bias:
            self.bias_ih = new_parameter((gates,), **kw)
            self.bias_hh = new_parameter((gates,), **kw)
        else:
            self.register_parameter("bias_ih", None)
            self.register_parameter("bias_hh", None)
        bound = 1.0 / math.sqrt(hidden_size)
        for p in self.parameters():
            init.uniform_(p, -bound, bound)

    def _step(self, input, state):
        cell = {"LSTM": _lstm_cell, "GRU": _gru_cell}.get(self.mode) or _rnn_cell(self.mode)
        return cell(NF.linear(input, self.weight_ih, self.bias_ih), state, self.weight_hh, self.bias_hh)

    def _zeros(self, input):
        return creation.zeros(tuple(input.shape[:-1]) + (self.hidden_size,), dtype=input.dtype, device=input.device)

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}" + ("" if self.bias else ", bias=False")


class RNNCell(_CellBase):
    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, nonlinearity: str = "tanh",
                 device=None, dtype=None):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"RNNCell: unknown nonlinearity {nonlinearity!r} (expected 'tanh' or 'relu')")
        self.nonlinearity = nonlinearity
        super().__init__("RNN_TANH" if nonlinearity == "tanh" else "RNN_RELU", input_size, hidden_size, bias,
                         device, dtype)

    def forward(self, input, hx=None):
        return self._step(input, self._zeros(input) if hx is None else hx)


class LSTMCell(_CellBase):
    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, device=None, dtype=None):
        super().__init__("LSTM", input_size, hidden_size, bias, device, dtype)

    def forward(self, input, hx=None):
        return self._step(input, (self._zeros(input), self._zeros(input)) if hx is None else hx)


class GRUCell(_CellBase):
    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, device=None, dtype=None):
        super().__init__("GRU", input_size, hidden_size, bias, device, dtype)

    def forward(self, input, hx=None):
        return self._step(input, self._zeros(input) if hx is None else hx)


__all__ = ["RNNBase", "RNN", "LSTM", "GRU", "RNNCell", "LSTMCell", "GRUCell"]
