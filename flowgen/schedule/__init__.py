"""Kernel scheduling: a linear order of kernel groups that respects every dependency."""
from flowgen.schedule.order import (  # noqa: F401
    ScheduleError,
    check_order,
    order_kernels,
    straighten,
    topological_order,
)

__all__ = ["ScheduleError", "check_order", "order_kernels", "straighten", "topological_order"]
