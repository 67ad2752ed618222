"""`flow.one_embedding` as far as flowgen has it: OneFlow's `Ftrl` optimizer (flowgen/optim/ftrl.py),
usable on any parameters in eager mode and in nn.Graph. OneFlow's sharded embedding tables
(`MultiTableEmbedding`, the key-value stores and their persistent readers/writers) are not in
flowgen: a name other than `Ftrl` raises AttributeError."""
from flowgen.optim.ftrl import FTRL as Ftrl

__all__ = ["Ftrl"]
