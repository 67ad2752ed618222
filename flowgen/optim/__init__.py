"""`flow.optim`: optimizers (eager NumPy steps; passes/optimizer.py lowers them for graphs) and LR schedulers."""
from flowgen.optim import lr_scheduler  # noqa: F401
from flowgen.optim.adadelta import Adadelta
from flowgen.optim.adagrad import Adagrad
from flowgen.optim.adam import Adam, AdamW
from flowgen.optim.ftrl import FTRL
from flowgen.optim.lamb import LAMB
from flowgen.optim.lars import LARS
from flowgen.optim.optimizer import Optimizer
from flowgen.optim.rmsprop import RMSprop
from flowgen.optim.rule import RuleOptimizer
from flowgen.optim.sgd import SGD

Ftrl = FTRL   # OneFlow's spelling (flow.one_embedding.Ftrl)

__all__ = ["Adadelta", "Adagrad", "Adam", "AdamW", "FTRL", "Ftrl", "LAMB", "LARS", "Optimizer", "RMSprop",
           "RuleOptimizer", "SGD", "lr_scheduler"]
