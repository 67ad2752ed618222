"""Learning-rate schedulers with PyTorch's semantics, plus `lr_at(step)` for the graph compiler.

Eager use is PyTorch's: construct after the optimizer (this sets the step-0
LR), call `scheduler.step()` after each `optimizer.step()`. Most schedulers
update recursively from the group's current LR, like PyTorch, so the floats
match PyTorch's exactly.

A scheduler whose LR is a function of the epoch writes it once, as `formula(group, e)`: an
expression of the epoch (optim/closed_form.py) that `closed_form` evaluates and the standalone
program computes in C++ (passes/optimizer.lr_schedule, codegen/aot.py).

`lr_at(step)` is the LR the optimizer uses on training iteration `step`
(0-based) under that loop, i.e. `get_last_lr()` after `step` calls to
`scheduler.step()`. It replays the schedule on a private copy of the
scheduler (taken when it was constructed), so it is exactly what eager mode
computes and never touches the real optimizer. An `nn.Graph` uses it to
compute the schedule ahead of time.
"""
from __future__ import annotations

import copy
import functools
import math
import operator
import types
from bisect import bisect_right
from collections import Counter

from flowgen.optim.closed_form import (EPOCH, call_python, ceil, cos, evaluate, floor, maximum, minimum,
                                       restart_period, restarts, since_restart, where)
from flowgen.optim.optimizer import Optimizer

# Attributes that are lr_at's private machinery, not scheduler state.
_REPLAY_ATTRS = ("_replay", "_replay_table", "_replay_start")


class _ReplayOptimizer:
    """Stands in for the optimizer in lr_at's private copy: each group's options (the LR fields, and
    the momentum a cycling scheduler writes), never its parameters."""

    def __init__(self, optimizer):
        self.defaults = dict(optimizer.defaults)
        self.param_groups = [copy.deepcopy({k: v for k, v in g.items() if k != "params"})
                             for g in optimizer.param_groups]


class LRScheduler:
    def __init__(self, optimizer: Optimizer, last_epoch: int = -1):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")
        self.optimizer = optimizer
        if last_epoch == -1:
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
        else:
            for i, group in enumerate(optimizer.param_groups):
                if "initial_lr" not in group:
                    raise KeyError(f"param 'initial_lr' is not specified in param_groups[{i}] when resuming a "
                                   f"scheduler with last_epoch={last_epoch}; load the optimizer's state first")
        self.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._initial_step()
        self._start_replay()

    def _initial_step(self) -> None:
        self._step_count = 0
        self._is_initial = True
        try:
            self.step()
        finally:
            self._is_initial = False

    # ------------------------------------------------------------------ eager
    def get_lr(self) -> list[float]:
        """The next LRs, computed from the groups' current LRs (called by `step`)."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def step(self, epoch: int | None = None) -> None:
        self._step_count += 1
        self._update_lr(epoch)

    def _update_lr(self, epoch: int | None = None) -> None:
        if epoch is None:
            self.last_epoch += 1
            values = self.get_lr()
        else:
            self.last_epoch = epoch
            # a PyTorch-style subclass may define _get_closed_form_lr itself
            own_closed_form = type(self)._get_closed_form_lr is not LRScheduler._get_closed_form_lr
            values = self._get_closed_form_lr() if own_closed_form or self.has_closed_form() else self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, values):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def _group_lrs(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    # ------------------------------------------------------------ closed form
    def formula(self, group: int, epoch):
        """The LR of parameter group `group` at `epoch` (EPOCH, or an expression of it) as an
        expression (optim/closed_form.py), for schedulers whose LR is a function of the epoch;
        None for the others."""
        return None

    def closed_form(self, group: int, epoch) -> float:
        """The LR of parameter group `group` at `epoch`: `formula` evaluated; schedulers without
        one raise."""
        formula = self.formula(group, EPOCH)
        if formula is None:
            raise NotImplementedError(f"{type(self).__name__} has no closed form")
        return evaluate(formula, epoch)

    def has_closed_form(self) -> bool:
        return self.formula(0, EPOCH) is not None

    def _get_closed_form_lr(self) -> list[float]:
        return [self.closed_form(group, self.last_epoch) for group in range(len(self.base_lrs))]

    def check_graph_replay(self) -> None:
        """Raise if a graph cannot replay this scheduler (nn.Graph.add_optimizer calls it)."""

    # The LR is the base LR times a factor of the epoch alone, and eager steps multiply the current
    # LR by the factor's change: chained with others of the kind, the factors multiply.
    multiplicative = False

    # ----------------------------------------------------------- state dict
    def state_dict(self) -> dict:
        """Every attribute except the optimizer (PyTorch's layout)."""
        return {k: v for k, v in self.__dict__.items() if k != "optimizer" and k not in _REPLAY_ATTRS}

    def load_state_dict(self, state_dict: dict) -> None:
        self.__dict__.update({k: v for k, v in state_dict.items() if k not in _REPLAY_ATTRS})

    # -------------------------------------------------------------- lr_at
    def _start_replay(self) -> None:
        """Remember this scheduler as constructed; lr_at replays from here."""
        replay_optimizer = _ReplayOptimizer(self.optimizer)
        self._replay = None
        self._replay = copy.deepcopy(self, memo={id(self.optimizer): replay_optimizer})
        self._replay_start = self.last_epoch
        self._replay_table = [list(self._last_lr)]

    def __deepcopy__(self, memo):
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        for key, value in self.__dict__.items():
            if key not in _REPLAY_ATTRS:
                clone.__dict__[key] = copy.deepcopy(value, memo)
        return clone

    def lrs_at(self, step: int) -> list[float]:
        """The LR of every parameter group on training iteration `step` (see the module docstring)."""
        step = int(step)
        if step < self._replay_start:
            raise ValueError(f"lr_at({step}): this scheduler was constructed at epoch {self._replay_start}; "
                             f"earlier steps are unknown")
        table = self._replay_table
        while len(table) <= step - self._replay_start:
            self._replay.step()
            table.append(list(self._replay.get_last_lr()))
        return table[step - self._replay_start]

    def lr_at(self, step: int, group: int = 0) -> float:
        """The LR of parameter group `group` on training iteration `step`."""
        return float(self.lrs_at(step)[group])


class StepLR(LRScheduler):
    """Multiply the LR by `gamma` every `step_size` steps."""

    multiplicative = True

    def __init__(self, optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1):
        self.step_size = step_size
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:
            return self._group_lrs()
        return [lr * self.gamma for lr in self._group_lrs()]

    def formula(self, group, epoch):
        return self.base_lrs[group] * self.gamma ** (epoch // self.step_size)


class MultiStepLR(LRScheduler):
    """Multiply the LR by `gamma` at each milestone (a repeated milestone multiplies twice)."""

    multiplicative = True

    def __init__(self, optimizer, milestones, gamma: float = 0.1, last_epoch: int = -1):
        self.milestones = Counter(milestones)
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        if self.last_epoch not in self.milestones:
            return self._group_lrs()
        return [lr * self.gamma ** self.milestones[self.last_epoch] for lr in self._group_lrs()]

    def formula(self, group, epoch):
        passed = [epoch >= m for m in sorted(self.milestones.elements())]   # counted: bisect_right
        return self.base_lrs[group] * self.gamma ** (sum(passed[1:], passed[0]) if passed else 0)

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self.milestones = Counter({int(k): int(v) for k, v in dict(self.milestones).items()})


class ExponentialLR(LRScheduler):
    """Multiply the LR by `gamma` every step."""

    multiplicative = True

    def __init__(self, optimizer, gamma: float, last_epoch: int = -1):
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        if self._is_initial:
            return self._group_lrs()
        return [lr * self.gamma for lr in self._group_lrs()]

    def formula(self, group, epoch):
        return self.base_lrs[group] * self.gamma ** epoch


class ConstantLR(LRScheduler):
    """Scale the LR by `factor` until step `total_iters`, then restore it."""

    multiplicative = True

    def __init__(self, optimizer, factor: float = 1.0 / 3, total_iters: int = 5, last_epoch: int = -1):
        if not 0 <= factor <= 1:
            raise ValueError("Constant multiplicative factor expected to be between 0 and 1.")
        self.factor = factor
        self.total_iters = total_iters
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        if self.last_epoch == 0:
            return [lr * self.factor for lr in self._group_lrs()]
        if self.last_epoch != self.total_iters:
            return self._group_lrs()
        return [lr * (1.0 / self.factor) for lr in self._group_lrs()]

    def formula(self, group, epoch):
        return self.base_lrs[group] * (self.factor + (epoch >= self.total_iters) * (1 - self.factor))


class LinearLR(LRScheduler):
    """Scale the LR linearly from `start_factor` to `end_factor` over `total_iters` steps."""

    multiplicative = True

    def __init__(self, optimizer, start_factor: float = 1.0 / 3, end_factor: float = 1.0, total_iters: int = 5,
                 last_epoch: int = -1):
        if start_factor > 1.0 or start_factor <= 0:
            raise ValueError("Starting multiplicative factor expected to be greater than 0 and less or equal to 1.")
        if end_factor > 1.0 or end_factor < 0:
            raise ValueError("Ending multiplicative factor expected to be between 0 and 1.")
        self.start_factor = start_factor
        self.end_factor = end_factor
        self.total_iters = total_iters
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        if self.last_epoch == 0:
            return [lr * self.start_factor for lr in self._group_lrs()]
        if self._is_initial or self.last_epoch > self.total_iters:
            return self._group_lrs()
        delta = self.end_factor - self.start_factor
        ratio = 1.0 + delta / (self.total_iters * self.start_factor + (self.last_epoch - 1) * delta)
        return [lr * ratio for lr in self._group_lrs()]

    def formula(self, group, epoch):
        progress = minimum(self.total_iters, epoch) / self.total_iters
        return self.base_lrs[group] * (self.start_factor + (self.end_factor - self.start_factor) * progress)


class CosineAnnealingLR(LRScheduler):
    """eta_min + (base - eta_min) * (1 + cos(pi * t / T_max)) / 2, computed recursively as PyTorch."""

    def __init__(self, optimizer, T_max: int, eta_min: float = 0.0, last_epoch: int = -1):  # noqa: N803
        self.T_max = T_max
        self.eta_min = eta_min
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        t, T, eta_min = self.last_epoch, self.T_max, self.eta_min  # noqa: N806
        if self._is_initial:
            return self._group_lrs()
        if self._step_count == 1 and t > 0:
            return [eta_min + (base - eta_min) * (1 + math.cos(t * math.pi / T)) / 2 for base in self.base_lrs]
        if (t - 1 - T) % (2 * T) == 0:
            return [lr + (base - eta_min) * (1 - math.cos(math.pi / T)) / 2
                    for base, lr in zip(self.base_lrs, self._group_lrs())]
        return [(1 + math.cos(math.pi * t / T)) / (1 + math.cos(math.pi * (t - 1) / T)) * (lr - eta_min) + eta_min
                for lr in self._group_lrs()]

    def formula(self, group, epoch):
        base = self.base_lrs[group]
        return self.eta_min + (base - self.eta_min) * (1 + cos(math.pi * epoch / self.T_max)) / 2


class _Lambdas:
    """Schedulers built on `lr_lambdas` (one function, or one per parameter group). In state
    dicts functions are code, not state: like PyTorch, only callable objects' attributes are kept."""

    def _set_lambdas(self, optimizer, lr_lambda) -> None:
        if isinstance(lr_lambda, (list, tuple)):
            if len(lr_lambda) != len(optimizer.param_groups):
                raise ValueError(f"{type(self).__name__}: expected {len(optimizer.param_groups)} lr_lambdas, but "
                                 f"got {len(lr_lambda)}")
            self.lr_lambdas = list(lr_lambda)
        else:
            self.lr_lambdas = [lr_lambda] * len(optimizer.param_groups)

    def state_dict(self):
        state = super().state_dict()
        state["lr_lambdas"] = [None if isinstance(fn, types.FunctionType) else dict(fn.__dict__)
                               for fn in self.lr_lambdas]
        return state

    def load_state_dict(self, state_dict):
        state = dict(state_dict)
        saved = state.pop("lr_lambdas", None) or []
        super().load_state_dict(state)
        for fn, attrs in zip(self.lr_lambdas, saved):
            if attrs is not None:
                fn.__dict__.update(attrs)


class LambdaLR(_Lambdas, LRScheduler):
    """LR = initial LR * lr_lambda(step); one function, or one per parameter group."""

    def __init__(self, optimizer, lr_lambda, last_epoch: int = -1):
        self._set_lambdas(optimizer, lr_lambda)
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        return [self.closed_form(group, self.last_epoch) for group in range(len(self.base_lrs))]

    def formula(self, group, epoch):
        return self.base_lrs[group] * call_python(self.lr_lambdas[group], epoch)


class _Composite:
    """Schedulers that drive others (`_schedulers`): a graph replays them if it can replay each;
    state dicts hold each child's own."""

    def check_graph_replay(self):
        for scheduler in self._schedulers:
            scheduler.check_graph_replay()

    def state_dict(self):
        state = {k: v for k, v in super().state_dict().items() if k != "_schedulers"}
        state["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return state

    def load_state_dict(self, state_dict):
        state = dict(state_dict)
        children = state.pop("_schedulers")
        super().load_state_dict(state)
        for scheduler, child in zip(self._schedulers, children):
            scheduler.load_state_dict(child)


class SequentialLR(_Composite, LRScheduler):
    """Run `schedulers[i]` between `milestones[i-1]` and `milestones[i]` (PyTorch semantics)."""

    def __init__(self, optimizer, schedulers, milestones, last_epoch: int = -1):
        if len(schedulers) < 1:
            raise ValueError("SequentialLR expects at least one scheduler")
        for i, scheduler in enumerate(schedulers):
            if getattr(scheduler, "optimizer", None) is not optimizer:
                raise ValueError(f"SequentialLR expects all schedulers to belong to the same optimizer, but "
                                 f"scheduler {i} ({type(scheduler).__name__}) has a different one")
        if len(milestones) != len(schedulers) - 1:
            raise ValueError(f"SequentialLR expects number of schedulers provided to be one more than the number "
                             f"of milestone points, but got {len(schedulers)} schedulers and "
                             f"{len(milestones)} milestones")
        self._schedulers = list(schedulers)
        self._milestones = list(milestones)
        self.last_epoch = last_epoch + 1
        self.optimizer = optimizer
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"]
        # Undo the initial step each scheduler took when it was built, then start the first one.
        for scheduler in self._schedulers:
            scheduler.last_epoch -= 1
        first = self._schedulers[bisect_right(self._milestones, 0)]
        first._initial_step()
        self._last_lr = first.get_last_lr()
        self.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        self._start_replay()

    def step(self) -> None:  # noqa: D102 - no epoch argument, as PyTorch
        self.last_epoch += 1
        idx = bisect_right(self._milestones, self.last_epoch)
        scheduler = self._schedulers[idx]
        if idx > 0 and self._milestones[idx - 1] == self.last_epoch:
            scheduler._update_lr(0)
        else:
            scheduler.step()
        self._last_lr = scheduler.get_last_lr()

    def formula(self, group, epoch):
        """Scheduler i's closed form from epoch 0 at milestone i - 1 (where `step` restarts it with
        its closed form), when every scheduler has one."""
        starts = [0, *self._milestones]
        pieces = [scheduler.formula(group, epoch - start if start else epoch)
                  for scheduler, start in zip(self._schedulers, starts)]
        if any(piece is None for piece in pieces):
            return None
        lr = pieces[-1]
        for milestone, piece in zip(reversed(self._milestones), reversed(pieces[:-1])):
            lr = where(epoch < milestone, piece, lr)
        return lr


class MultiplicativeLR(_Lambdas, LRScheduler):
    """Multiply the LR by lr_lambda(epoch) every step (one function, or one per parameter group)."""

    def __init__(self, optimizer, lr_lambda, last_epoch: int = -1):
        self._set_lambdas(optimizer, lr_lambda)
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        if self._is_initial:
            return self._group_lrs()
        return [lr * fn(self.last_epoch) for fn, lr in zip(self.lr_lambdas, self._group_lrs())]


class PolynomialLR(LRScheduler):
    """Polynomial decay to `end_learning_rate` over `total_iters` steps.

    PyTorch's signature ``PolynomialLR(optimizer, total_iters=5, power=1.0)`` decays to 0 and
    updates recursively as PyTorch does. OneFlow's ``PolynomialLR(optimizer, decay_batch,
    end_learning_rate=0.0001, power=1.0, cycle=False)`` (chosen by any of its keywords) is the
    closed form ``(base - end) * (1 - min(e, decay_batch) / decay_batch)^power + end``; with
    `cycle` the decay period grows to the next multiple of decay_batch instead of stopping.
    """

    def __init__(self, optimizer, total_iters: int = 5, power: float = 1.0, last_epoch: int = -1, *,
                 decay_batch: int | None = None, end_learning_rate: float | None = None, cycle: bool | None = None):
        self.oneflow = decay_batch is not None or end_learning_rate is not None or cycle is not None
        self.total_iters = int(decay_batch if decay_batch is not None else total_iters)
        if self.total_iters <= 0:
            raise ValueError(f"PolynomialLR: the number of decay steps must be > 0, got {self.total_iters}")
        self.power = power
        self.end_learning_rate = (1e-4 if end_learning_rate is None else end_learning_rate) if self.oneflow else 0.0
        self.cycle = bool(cycle)
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        if self.oneflow:
            return self._get_closed_form_lr()
        if self._is_initial or self.last_epoch > self.total_iters:
            return self._group_lrs()
        decay = ((1.0 - self.last_epoch / self.total_iters) / (1.0 - (self.last_epoch - 1) / self.total_iters)) \
            ** self.power
        return [lr * decay for lr in self._group_lrs()]

    def formula(self, group, epoch):
        period = self.total_iters
        if self.cycle:
            period = period * ceil(maximum(epoch, 1) / period)
        else:
            epoch = minimum(epoch, period)
        end = self.end_learning_rate
        return (self.base_lrs[group] - end) * (1 - epoch / period) ** self.power + end


class CosineDecayLR(LRScheduler):
    """OneFlow's CosineDecayLR: base * ((1 - alpha) * (1 + cos(pi * e / decay_steps)) / 2 + alpha)
    until decay_steps, then base * alpha."""

    def __init__(self, optimizer, decay_steps: int, alpha: float = 0.0, last_epoch: int = -1):
        if decay_steps <= 0:
            raise ValueError(f"CosineDecayLR: decay_steps must be > 0, got {decay_steps}")
        self.decay_steps = decay_steps
        self.alpha = alpha
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        return self._get_closed_form_lr()

    def formula(self, group, epoch):
        cos_decay = 0.5 * (1 + cos(math.pi * epoch / self.decay_steps))
        return where(epoch >= self.decay_steps, self.base_lrs[group] * self.alpha,
                     self.base_lrs[group] * ((1 - self.alpha) * cos_decay + self.alpha))


class WarmupLR(LRScheduler):
    """OneFlow's WarmupLR (WarmUpLR): `warmup_iters` steps of warmup, then the wrapped scheduler.

    Warmup multiplies the base LR by `warmup_factor` ("constant") or by a factor rising linearly
    from `warmup_factor` ("linear") to where the wrapped scheduler is at `warmup_iters` (1 without
    one). Afterwards the LR is the wrapped scheduler's closed form at the same epoch, or at
    epoch - warmup_iters with `warmup_prefix`. The wrapped scheduler needs a closed form (all of
    OneFlow's schedulers have one); it is not stepped itself.
    """

    def __init__(self, scheduler_or_optimizer, warmup_factor: float = 1.0 / 3, warmup_iters: int = 5,
                 warmup_method: str = "linear", warmup_prefix: bool = False, last_epoch: int = -1):
        if isinstance(scheduler_or_optimizer, LRScheduler):
            self.scheduler, optimizer = scheduler_or_optimizer, scheduler_or_optimizer.optimizer
            if getattr(self.scheduler, "cycle_momentum", False):
                raise ValueError(f"WarmupLR: the wrapped {type(self.scheduler).__name__} cycles the momentum, which "
                                 f"WarmupLR (using only its LR's closed form) would ignore; pass "
                                 f"cycle_momentum=False to it")
            if not self.scheduler.has_closed_form():
                raise ValueError(f"WarmupLR: the wrapped {type(self.scheduler).__name__} has no closed form; wrap "
                                 f"a scheduler whose LR is a function of the epoch (StepLR, CosineDecayLR, ...)")
        elif isinstance(scheduler_or_optimizer, Optimizer):
            self.scheduler, optimizer = None, scheduler_or_optimizer
        else:
            raise ValueError(f"WarmupLR: scheduler_or_optimizer must be an LRScheduler or an Optimizer, got "
                             f"{type(scheduler_or_optimizer).__name__}")
        if warmup_method not in ("linear", "constant"):
            raise ValueError(f"WarmupLR: warmup_method must be 'linear' or 'constant', got {warmup_method!r}")
        if self.scheduler is None and warmup_iters <= 0:
            raise ValueError(f"WarmupLR: warmup_iters = {warmup_iters} without a scheduler to wrap warms up nothing")
        self.warmup_factor = warmup_factor
        self.warmup_iters = warmup_iters
        self.warmup_method = warmup_method
        self.warmup_prefix = warmup_prefix
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        return self._get_closed_form_lr()

    def formula(self, group, epoch):
        base = self.base_lrs[group]
        if self.scheduler is None:
            after = base
        else:   # the wrapped scheduler's LR (from epoch 0 after warmup with warmup_prefix)
            after = self.scheduler.formula(group, epoch - self.warmup_iters if self.warmup_prefix else epoch)
        if self.warmup_method == "constant":
            warm = base * self.warmup_factor
        else:   # linear, to the wrapped scheduler's factor at warmup_iters (1 alone or with warmup_prefix)
            end_factor = 1.0 if self.scheduler is None or self.warmup_prefix else \
                self.scheduler.closed_form(group, self.warmup_iters) / base
            warm = base * (self.warmup_factor + (end_factor - self.warmup_factor) * epoch / self.warmup_iters)
        return where(epoch >= self.warmup_iters, after, warm)

    def state_dict(self):
        state = super().state_dict()
        state["scheduler"] = None if self.scheduler is None else self.scheduler.state_dict()
        return state

    def load_state_dict(self, state_dict):
        state = dict(state_dict)
        inner = state.pop("scheduler", None)
        super().load_state_dict(state)
        if inner is not None:
            self.scheduler.load_state_dict(inner)


WarmUpLR = WarmupLR   # OneFlow's other spelling


class CosineAnnealingWarmRestarts(LRScheduler):
    """Cosine annealing from the base LR to eta_min over T_i steps, then a restart; the period
    starts at T_0 and is multiplied by T_mult at each restart (PyTorch semantics, fractional
    epochs given to step(epoch) included). OneFlow's options: the peak after restart r is
    `base_lr * decay_rate ** r`, and after `restart_limit` restarts (0: no limit) the LR stays at
    eta_min."""

    def __init__(self, optimizer, T_0: int, T_mult: int = 1, eta_min: float = 0.0,  # noqa: N803
                 decay_rate: float = 1.0, restart_limit: int = 0, last_epoch: int = -1):
        if T_0 <= 0 or not isinstance(T_0, int):
            raise ValueError(f"CosineAnnealingWarmRestarts: expected a positive integer T_0, but got {T_0}")
        if T_mult < 1 or not isinstance(T_mult, int):
            raise ValueError(f"CosineAnnealingWarmRestarts: expected an integer T_mult >= 1, but got {T_mult}")
        if restart_limit < 0 or not isinstance(restart_limit, int):
            raise ValueError(f"CosineAnnealingWarmRestarts: expected an integer restart_limit >= 0, but got "
                             f"{restart_limit}")
        self.T_0 = T_0
        self.T_mult = T_mult
        self.eta_min = eta_min
        self.decay_rate = float(decay_rate)
        self.restart_limit = restart_limit
        self.epoch = float(last_epoch)   # the (possibly fractional) epoch; last_epoch is its floor
        super().__init__(optimizer, last_epoch)

    def step(self, epoch: float | None = None) -> None:
        if epoch is not None and epoch < 0:
            raise ValueError(f"CosineAnnealingWarmRestarts: expected a non-negative epoch, but got {epoch}")
        self._step_count += 1
        self.epoch = self.epoch + 1 if epoch is None else float(epoch)
        self.last_epoch = math.floor(self.epoch)
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr
        self._last_lr = self._group_lrs()

    def get_lr(self):
        return [self.closed_form(group, self.epoch) for group in range(len(self.base_lrs))]

    def formula(self, group, epoch):
        # T_cur within the current period T_i, after `before` restarts
        t_cur, t_i = since_restart(epoch, self.T_0, self.T_mult), restart_period(epoch, self.T_0, self.T_mult)
        before = restarts(epoch, self.T_0, self.T_mult)
        peak = self.base_lrs[group] * self.decay_rate ** before
        lr = self.eta_min + (peak - self.eta_min) * (1 + cos(math.pi * t_cur / t_i)) / 2
        return where(before >= self.restart_limit, self.eta_min, lr) if self.restart_limit else lr


def _per_group(name: str, scheduler: str, optimizer, value) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"{scheduler}: expected {len(optimizer.param_groups)} values for {name}, got "
                             f"{len(value)}")
        return list(value)
    return [value] * len(optimizer.param_groups)


class _MomentumCycling:
    """OneCycleLR's and CyclicLR's `cycle_momentum`: the momentum (SGD, RMSprop, LARS) or beta1
    (Adam, AdamW, LAMB) moves opposite to the LR. Eager steps write it into the groups."""

    def _start_momentum_cycling(self, optimizer, base_momentum, max_momentum, last_epoch):
        name = type(self).__name__
        if "momentum" not in optimizer.defaults and "betas" not in optimizer.defaults:
            raise ValueError(f"{name}: cycle_momentum=True needs an optimizer with momentum or betas, and "
                             f"{type(optimizer).__name__} has neither; pass cycle_momentum=False")
        self.use_beta1 = "betas" in optimizer.defaults
        self.base_momentums = _per_group("base_momentum", name, optimizer, base_momentum)
        self.max_momentums = _per_group("max_momentum", name, optimizer, max_momentum)
        if last_epoch == -1:
            for group, high, low in zip(optimizer.param_groups, self.max_momentums, self.base_momentums):
                self._set_momentum(group, high)
                group["max_momentum"], group["base_momentum"] = high, low

    def _get_closed_form_lr(self):
        return self.get_lr()   # step(epoch), as PyTorch: the LR and the cycled momentum at that epoch

    def _set_momentum(self, group, value):
        if self.use_beta1:
            group["betas"] = (value, *group["betas"][1:])
        else:
            group["momentum"] = value

    def check_graph_replay(self):
        if self.cycle_momentum:
            raise ValueError(f"{type(self).__name__}: cycle_momentum=True changes the optimizer's "
                             f"{'beta1' if self.use_beta1 else 'momentum'} every step, which a compiled graph "
                             f"keeps constant; pass cycle_momentum=False to use it with nn.Graph")


class OneCycleLR(_MomentumCycling, LRScheduler):
    """The 1cycle policy (PyTorch semantics): from max_lr / div_factor up to max_lr over pct_start of
    total_steps, then down to initial_lr / final_div_factor (three_phase: back to the initial LR
    first), annealed by cosine or linearly."""

    def __init__(self, optimizer, max_lr, total_steps: int | None = None, epochs: int | None = None,
                 steps_per_epoch: int | None = None, pct_start: float = 0.3, anneal_strategy: str = "cos",
                 cycle_momentum: bool = True, base_momentum=0.85, max_momentum=0.95, div_factor: float = 25.0,
                 final_div_factor: float = 1e4, three_phase: bool = False, last_epoch: int = -1):
        if total_steps is not None:
            if not isinstance(total_steps, int) or total_steps <= 0:
                raise ValueError(f"OneCycleLR: expected a positive integer total_steps, but got {total_steps}")
            self.total_steps = total_steps
        elif epochs is not None and steps_per_epoch is not None:
            if not isinstance(epochs, int) or epochs <= 0 or not isinstance(steps_per_epoch, int) or \
                    steps_per_epoch <= 0:
                raise ValueError(f"OneCycleLR: expected positive integers epochs and steps_per_epoch, but got "
                                 f"{epochs} and {steps_per_epoch}")
            self.total_steps = epochs * steps_per_epoch
        else:
            raise ValueError("OneCycleLR: define either total_steps or (epochs and steps_per_epoch)")
        if not isinstance(pct_start, float) or not 0 <= pct_start <= 1:
            raise ValueError(f"OneCycleLR: expected a float pct_start between 0 and 1, but got {pct_start}")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"OneCycleLR: anneal_strategy must be 'cos' or 'linear', got {anneal_strategy!r}")
        self.anneal_strategy = anneal_strategy
        up = float(pct_start * self.total_steps) - 1
        last = self.total_steps - 1
        # (end step, start LR key, end LR key, start momentum key, end momentum key)
        self.phases = ([(up, "initial_lr", "max_lr", "max_momentum", "base_momentum"),
                        (float(2 * pct_start * self.total_steps) - 2, "max_lr", "initial_lr", "base_momentum",
                         "max_momentum"),
                        (last, "initial_lr", "min_lr", "max_momentum", "max_momentum")] if three_phase else
                       [(up, "initial_lr", "max_lr", "max_momentum", "base_momentum"),
                        (last, "max_lr", "min_lr", "base_momentum", "max_momentum")])
        max_lrs = _per_group("max_lr", "OneCycleLR", optimizer, max_lr)
        if last_epoch == -1:
            for group, high in zip(optimizer.param_groups, max_lrs):
                group["initial_lr"] = high / div_factor
                group["max_lr"] = high
                group["min_lr"] = group["initial_lr"] / final_div_factor
        self.cycle_momentum = cycle_momentum
        if cycle_momentum:
            self._start_momentum_cycling(optimizer, base_momentum, max_momentum, last_epoch)
        super().__init__(optimizer, last_epoch)

    def anneal(self, start: float, end: float, pct):
        """From `start` to `end` as `pct` goes from 0 to 1 (a number, or an LR formula's expression)."""
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def _phase(self, epoch: int):
        """(phase, fraction of it done) at `epoch`."""
        start = 0.0
        for i, phase in enumerate(self.phases):
            if epoch <= phase[0] or i == len(self.phases) - 1:
                return phase, (epoch - start) / (phase[0] - start)
            start = phase[0]

    def get_lr(self):
        if self.last_epoch > self.total_steps:
            raise ValueError(f"OneCycleLR: tried to step {self.last_epoch} times; the specified number of total "
                             f"steps is {self.total_steps}")
        if self.cycle_momentum:
            (_end, _lr_from, _lr_to, m_from, m_to), pct = self._phase(self.last_epoch)
            for group in self.optimizer.param_groups:
                self._set_momentum(group, self.anneal(group[m_from], group[m_to], pct))
        return [self.closed_form(group, self.last_epoch) for group in range(len(self.optimizer.param_groups))]

    def formula(self, group, epoch):
        values = self.optimizer.param_groups[group]
        start, pieces = 0.0, []
        for end, lr_from, lr_to, _m_from, _m_to in self.phases:
            pieces.append((end, self.anneal(values[lr_from], values[lr_to], (epoch - start) / (end - start))))
            start = end
        lr = pieces[-1][1]
        for end, phase_lr in reversed(pieces[:-1]):
            lr = where(epoch <= end, phase_lr, lr)
        return lr


class CyclicLR(_MomentumCycling, LRScheduler):
    """Cyclical LR between base_lr and max_lr (PyTorch semantics): triangular, triangular2,
    exp_range or a custom scale_fn; the momentum cycles opposite with cycle_momentum."""

    def __init__(self, optimizer, base_lr, max_lr, step_size_up: int = 2000, step_size_down: int | None = None,
                 mode: str = "triangular", gamma: float = 1.0, scale_fn=None, scale_mode: str = "cycle",
                 cycle_momentum: bool = True, base_momentum=0.8, max_momentum=0.9, last_epoch: int = -1):
        self.cyclic_base_lrs = _per_group("base_lr", "CyclicLR", optimizer, base_lr)
        if last_epoch == -1:
            for group, lr in zip(optimizer.param_groups, self.cyclic_base_lrs):
                group["lr"] = lr
        self.max_lrs = _per_group("max_lr", "CyclicLR", optimizer, max_lr)
        up = float(step_size_up)
        down = float(step_size_down) if step_size_down is not None else up
        self.total_size = up + down
        self.step_ratio = up / self.total_size
        if mode not in ("triangular", "triangular2", "exp_range") and scale_fn is None:
            raise ValueError(f"CyclicLR: mode {mode!r} is invalid and scale_fn is None")
        self.mode = mode
        self.gamma = gamma
        self.custom_scale_fn = scale_fn
        self.scale_mode = scale_mode if scale_fn is not None else ("iterations" if mode == "exp_range" else "cycle")
        self.cycle_momentum = cycle_momentum
        if cycle_momentum:
            self._start_momentum_cycling(optimizer, base_momentum, max_momentum, last_epoch)
        super().__init__(optimizer, last_epoch)
        self.base_lrs = list(self.cyclic_base_lrs)

    def scale_fn(self, x):
        """The amplitude's scale at `x` (a number, or an LR formula's expression)."""
        if self.custom_scale_fn is not None:
            return call_python(self.custom_scale_fn, x)
        if self.mode == "triangular":
            return 1.0
        if self.mode == "triangular2":
            return 1 / (2.0 ** (x - 1))
        return self.gamma ** x

    def _heights(self, epoch) -> tuple:
        """(scale factor within the cycle, scale_fn's value) at `epoch`, as expressions."""
        cycle = floor(1 + epoch / self.total_size)
        x = 1.0 + epoch / self.total_size - cycle
        factor = where(x <= self.step_ratio, x / self.step_ratio, (x - 1) / (self.step_ratio - 1))
        return factor, self.scale_fn(cycle if self.scale_mode == "cycle" else epoch)

    def get_lr(self):
        factor, scale = (evaluate(height, self.last_epoch) for height in self._heights(EPOCH))
        if self.cycle_momentum:
            for group, low, high in zip(self.optimizer.param_groups, self.base_momentums, self.max_momentums):
                self._set_momentum(group, high - (high - low) * factor * scale)
        return [self.closed_form(group, self.last_epoch) for group in range(len(self.cyclic_base_lrs))]

    def formula(self, group, epoch):
        factor, scale = self._heights(epoch)
        base = self.cyclic_base_lrs[group]
        return base + (self.max_lrs[group] - base) * factor * scale

    def state_dict(self):
        state = super().state_dict()
        fn = state.pop("custom_scale_fn")
        state["custom_scale_fn"] = None if fn is None or isinstance(fn, types.FunctionType) else dict(fn.__dict__)
        return state

    def load_state_dict(self, state_dict):
        state = dict(state_dict)
        attrs = state.pop("custom_scale_fn", None)
        super().load_state_dict(state)
        if attrs is not None:
            self.custom_scale_fn.__dict__.update(attrs)


class ChainedScheduler(_Composite, LRScheduler):
    """Step several chainable schedulers of one optimizer together (PyTorch semantics): each
    multiplies the LR the previous one left."""

    def __init__(self, schedulers, optimizer=None):
        if len(schedulers) < 1:
            raise ValueError("ChainedScheduler expects at least one scheduler to be chained, but got none")
        optimizer = optimizer or schedulers[0].optimizer
        for i, scheduler in enumerate(schedulers):
            if isinstance(scheduler, ReduceLROnPlateau):
                raise ValueError(f"ChainedScheduler does not support ReduceLROnPlateau (index {i}): its step() "
                                 f"needs a metric")
            if getattr(scheduler, "optimizer", None) is not optimizer:
                raise ValueError(f"ChainedScheduler expects all schedulers to belong to the same optimizer, but "
                                 f"scheduler {i} ({type(scheduler).__name__}) has a different one")
        self._schedulers = list(schedulers)
        self.optimizer = optimizer
        self.last_epoch = 0
        self.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        self._last_lr = self._group_lrs()
        self._start_replay()

    def step(self) -> None:  # noqa: D102 - no epoch argument, as PyTorch
        self.last_epoch += 1
        for scheduler in self._schedulers:
            scheduler.step()
        self._last_lr = self._group_lrs()

    def formula(self, group, epoch):
        """Chained multiplicative schedulers (StepLR, MultiStepLR, ExponentialLR, ConstantLR,
        LinearLR): the base LR times each one's factor at `epoch`; others chained have none."""
        if not all(scheduler.multiplicative for scheduler in self._schedulers):
            return None
        base = self.base_lrs[group]
        factors = [scheduler.formula(group, epoch) / base for scheduler in self._schedulers]
        return base * functools.reduce(operator.mul, factors)


class ReduceLROnPlateau(LRScheduler):
    """Divide the LR by 1/`factor` when a metric stopped improving for `patience` epochs (PyTorch
    semantics): `step(metric)` after each validation. A graph cannot know future metrics, so it
    is refused as `lr_sch`; step it in Python and leave lr_sch out: the graph uses each group's
    current `lr` on every call."""

    def __init__(self, optimizer, mode: str = "min", factor: float = 0.1, patience: int = 10,
                 threshold: float = 1e-4, threshold_mode: str = "rel", cooldown: int = 0, min_lr=0,
                 eps: float = 1e-8):
        if factor >= 1.0:
            raise ValueError(f"ReduceLROnPlateau: factor should be < 1.0, got {factor}")
        if mode not in ("min", "max"):
            raise ValueError(f"ReduceLROnPlateau: mode {mode!r} is unknown (min or max)")
        if threshold_mode not in ("rel", "abs"):
            raise ValueError(f"ReduceLROnPlateau: threshold mode {threshold_mode!r} is unknown (rel or abs)")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")
        self.optimizer = optimizer
        self.factor, self.patience, self.cooldown, self.eps = factor, patience, cooldown, eps
        self.mode, self.threshold, self.threshold_mode = mode, threshold, threshold_mode
        self.min_lrs = _per_group("min_lr", "ReduceLROnPlateau", optimizer, min_lr)
        self.last_epoch = 0
        self._last_lr = self._group_lrs()
        self.best = math.inf if mode == "min" else -math.inf
        self.cooldown_counter = 0
        self.num_bad_epochs = 0

    def is_better(self, value: float) -> bool:
        if self.threshold_mode == "rel":
            scale = 1.0 - self.threshold if self.mode == "min" else 1.0 + self.threshold
            return value < self.best * scale if self.mode == "min" else value > self.best * scale
        return value < self.best - self.threshold if self.mode == "min" else value > self.best + self.threshold

    def step(self, metrics, epoch=None) -> None:  # noqa: D102 - PyTorch's signature
        current = float(metrics)
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        if self.is_better(current):
            self.best = current
            self.num_bad_epochs = 0
        else:
            self.num_bad_epochs += 1
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0
        if self.num_bad_epochs > self.patience:
            for group, min_lr in zip(self.optimizer.param_groups, self.min_lrs):
                old = float(group["lr"])
                new = max(old * self.factor, min_lr)
                if old - new > self.eps:
                    group["lr"] = new
            self.cooldown_counter = self.cooldown
            self.num_bad_epochs = 0
        self._last_lr = self._group_lrs()

    def lrs_at(self, step):
        raise ValueError("ReduceLROnPlateau: its LR depends on metrics not known ahead of time, so it cannot be "
                         "replayed; call step(metric) in Python (a graph uses each group's current lr)")

    def check_graph_replay(self):
        raise ValueError("ReduceLROnPlateau cannot be add_optimizer's lr_sch: a graph replays its schedule ahead "
                         "of time, and this one depends on metrics; leave lr_sch out and call "
                         "scheduler.step(metric) in Python: the graph uses each group's current lr on every call")


# PyTorch's old name.
_LRScheduler = LRScheduler
