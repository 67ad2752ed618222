"""Learning-rate schedulers with PyTorch's semantics, plus `lr_at(step)` for the graph compiler.

Eager use is PyTorch's: construct after the optimizer (this sets the step-0
LR), call `scheduler.step()` after each `optimizer.step()`. Most schedulers
update recursively from the group's current LR, like PyTorch, so the floats
match PyTorch's exactly.

`lr_at(step)` is the LR the optimizer uses on training iteration `step`
(0-based) under that loop, i.e. `get_last_lr()` after `step` calls to
`scheduler.step()`. It replays the schedule on a private copy of the
scheduler (taken when it was constructed), so it is exactly what eager mode
computes and never touches the real optimizer. An `nn.Graph` uses it to
compute the schedule ahead of time.
"""
from __future__ import annotations

import copy
import math
import types
from bisect import bisect_right
from collections import Counter

from flowgen.optim.optimizer import Optimizer

# Attributes that are lr_at's private machinery, not scheduler state.
_REPLAY_ATTRS = ("_replay", "_replay_table", "_replay_start")


class _ReplayOptimizer:
    """Stands in for the optimizer in lr_at's private copy: only the LR fields of each group."""

    def __init__(self, optimizer):
        self.param_groups = [{k: g[k] for k in ("lr", "initial_lr") if k in g} for g in optimizer.param_groups]


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
            closed_form = getattr(self, "_get_closed_form_lr", None)
            values = closed_form() if closed_form is not None else self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, values):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def _group_lrs(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

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

    def __init__(self, optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1):
        self.step_size = step_size
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:
            return self._group_lrs()
        return [lr * self.gamma for lr in self._group_lrs()]

    def _get_closed_form_lr(self):
        return [base * self.gamma ** (self.last_epoch // self.step_size) for base in self.base_lrs]


class MultiStepLR(LRScheduler):
    """Multiply the LR by `gamma` at each milestone (a repeated milestone multiplies twice)."""

    def __init__(self, optimizer, milestones, gamma: float = 0.1, last_epoch: int = -1):
        self.milestones = Counter(milestones)
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        if self.last_epoch not in self.milestones:
            return self._group_lrs()
        return [lr * self.gamma ** self.milestones[self.last_epoch] for lr in self._group_lrs()]

    def _get_closed_form_lr(self):
        passed = bisect_right(sorted(self.milestones.elements()), self.last_epoch)
        return [base * self.gamma ** passed for base in self.base_lrs]

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self.milestones = Counter({int(k): int(v) for k, v in dict(self.milestones).items()})


class ExponentialLR(LRScheduler):
    """Multiply the LR by `gamma` every step."""

    def __init__(self, optimizer, gamma: float, last_epoch: int = -1):
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        if self._is_initial:
            return self._group_lrs()
        return [lr * self.gamma for lr in self._group_lrs()]

    def _get_closed_form_lr(self):
        return [base * self.gamma ** self.last_epoch for base in self.base_lrs]


class ConstantLR(LRScheduler):
    """Scale the LR by `factor` until step `total_iters`, then restore it."""

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

    def _get_closed_form_lr(self):
        return [base * (self.factor + (self.last_epoch >= self.total_iters) * (1 - self.factor))
                for base in self.base_lrs]


class LinearLR(LRScheduler):
    """Scale the LR linearly from `start_factor` to `end_factor` over `total_iters` steps."""

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

    def _get_closed_form_lr(self):
        progress = min(self.total_iters, self.last_epoch) / self.total_iters
        return [base * (self.start_factor + (self.end_factor - self.start_factor) * progress)
                for base in self.base_lrs]


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

    def _get_closed_form_lr(self):
        return [self.eta_min + (base - self.eta_min) * (1 + math.cos(math.pi * self.last_epoch / self.T_max)) / 2
                for base in self.base_lrs]


class LambdaLR(LRScheduler):
    """LR = initial LR * lr_lambda(step); one function, or one per parameter group."""

    def __init__(self, optimizer, lr_lambda, last_epoch: int = -1):
        if isinstance(lr_lambda, (list, tuple)):
            if len(lr_lambda) != len(optimizer.param_groups):
                raise ValueError(f"Expected {len(optimizer.param_groups)} lr_lambdas, but got {len(lr_lambda)}")
            self.lr_lambdas = list(lr_lambda)
        else:
            self.lr_lambdas = [lr_lambda] * len(optimizer.param_groups)
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        return [base * fn(self.last_epoch) for fn, base in zip(self.lr_lambdas, self.base_lrs)]

    def state_dict(self):
        # Functions are code, not state: like PyTorch, keep only callable objects' attributes.
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


class SequentialLR(LRScheduler):
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


# PyTorch's old name.
_LRScheduler = LRScheduler
