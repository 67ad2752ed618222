"""`flow.optim`: optimizers (eager NumPy steps; passes/optimizer.py lowers them for graphs) and LR schedulers."""
from flowgen.optim import lr_scheduler  # noqa: F401
from flowgen.optim.adam import Adam, AdamW
from flowgen.optim.optimizer import Optimizer
from flowgen.optim.sgd import SGD

__all__ = ["Adam", "AdamW", "Optimizer", "SGD", "lr_scheduler"]
