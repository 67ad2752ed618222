"""Arena memory planning: liveness of kernel-produced values -> offsets in one buffer."""
from flowgen.memory.planner import (  # noqa: F401
    DEFAULT_ALIGNMENT,
    MemoryPlan,
    Step,
    align_up,
    check_plan,
    plan_memory,
    plan_naive,
)

__all__ = ["DEFAULT_ALIGNMENT", "MemoryPlan", "Step", "align_up", "check_plan", "plan_memory", "plan_naive"]
