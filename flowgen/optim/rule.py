"""`RuleOptimizer`: an optimizer whose per-parameter update is written once, with flowgen tensor ops.

`update()` is the whole arithmetic of one parameter's step. Eager `step()` runs it
on eager tensors (NumPy) and writes the results into the parameter's and the
state's buffers; `passes/optimizer.py` runs the same function on lazy tensors, so
a graph's update is the eager one by construction. What changes from step to step
is passed in `hypers`: the LR (the group's, or the graph's LR schedule) and the
scalars `step_hypers(group, step)` derives from the step count, each with a
`hyper_schedule` that says how a standalone program advances it.
"""
from __future__ import annotations

import numpy as np

from flowgen import dtype as dt
from flowgen.autograd import no_grad
from flowgen.optim.optimizer import Optimizer, compute_view, group_lr, write_back
from flowgen.tensor import Tensor


class RuleOptimizer(Optimizer):
    counts_steps = True   # keeps state["step"], the count of this parameter's updates

    # ------------------------------------------------------------ the rule
    def slot_names(self, group: dict) -> tuple:
        """The state tensors (shaped like the parameter) this group's update keeps."""
        raise NotImplementedError

    def slot_init(self, group: dict, name: str) -> float:
        """The value state `name` starts at (everywhere)."""
        return 0.0

    def step_hypers(self, group: dict, step: int) -> dict:
        """Scalars of update `step` (1, 2, ...) besides the LR, by name."""
        return {}

    def hyper_schedule(self, group: dict, name: str, offset: int) -> dict:
        """How a standalone program computes hyper `name` at update u + offset (passes/optimizer.py)."""
        raise NotImplementedError

    @staticmethod
    def descent_gradient(group: dict, g):
        """The gradient `update` receives: negated when the group maximizes."""
        return -g if group.get("maximize") else g

    def update(self, group: dict, w, g, slots: dict, hypers: dict):
        """(new parameter, {slot name: new value}) from the parameter `w`, its gradient `g`
        (already negated under `maximize`), its state and the step's scalars `hypers` (with "lr")."""
        raise NotImplementedError

    # ---------------------------------------------------------------- eager
    def _update_group(self, group: dict) -> None:
        lr = group_lr(group)
        names = self.slot_names(group)
        for p, w_store, g in self._params_with_grad(group):
            w = compute_view(w_store)
            state = self.state[p]
            state["step"] = step = int(state.get("step", 0)) + 1
            for name in names:
                self._state_tensor(p, name, np.full(tuple(p.shape), self.slot_init(group, name)))
            kind = dt.from_numpy(w.dtype)
            w_t = Tensor(w, dtype=kind, device=p.device)
            g_t = Tensor(g.astype(w.dtype, copy=False), dtype=kind, device=p.device)
            with no_grad():
                new_w, new_slots = self.update(group, w_t, self.descent_gradient(group, g_t),
                                               {name: state[name] for name in names},
                                               {"lr": lr, **self.step_hypers(group, step)})
            for name, value in new_slots.items():
                state[name].numpy_view()[...] = value.numpy()
                state[name]._version += 1
            w[...] = new_w.numpy()
            write_back(w_store, w)
            p._version += 1
