"""The two graphs most tests and benchmarks need: run a model, or train it one step."""
import flowgen.nn as nn


class InferGraph(nn.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def build(self, x):
        return self.model(x)


class TrainGraph(nn.Graph):
    def __init__(self, model, loss_fn, *optimizers):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        for opt in optimizers:   # an optimizer, or (optimizer, lr scheduler)
            if isinstance(opt, tuple):
                self.add_optimizer(opt[0], lr_sch=opt[1])
            else:
                self.add_optimizer(opt)

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss
