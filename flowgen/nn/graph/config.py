"""`graph.config`: the seeds' GraphConfig options."""
from __future__ import annotations


class GraphConfig:
    def __init__(self):
        self.training = False
        self.fusion = True              # flowgen: fuse elementwise chains and reduction prologues/epilogues
        self.naive_memory = False       # flowgen: one allocation per intermediate (debugging)
        self.amp = False
        self.zero = False
        self.zero_stage = 2
        self.zero_shard_min_size = 1024
        self.fuse_model_update_ops = False
        self.fuse_add_to_output = False
        self.fuse_cast_scale = False
        self.gradient_accumulation_steps = 1
        self.cudnn_conv_heuristic_search_algo = False
        self.straighten = False
        self.compress_memory = False

    def enable_amp(self, mode: bool = True):
        self.amp = bool(mode)

    def enable_zero(self, mode: bool = True, *, stage: int = 2, shard_min_size: int = 1024, shard_restore_level: int = 1):
        # One rank: nothing to shard across (recorded for repr). A data-parallel graph on several
        # ranks shards optimizer state (stage 1) and gradients (2) in passes/zero.py; stage 3 raises.
        if stage not in (1, 2, 3):
            raise ValueError(f"enable_zero: stage must be 1, 2 or 3, got {stage!r}")
        self.zero = bool(mode)
        self.zero_stage, self.zero_shard_min_size = int(stage), int(shard_min_size)

    def allow_fuse_model_update_ops(self, mode: bool = True):
        self.fuse_model_update_ops = bool(mode)

    def allow_fuse_add_to_output(self, mode: bool = True):
        self.fuse_add_to_output = bool(mode)

    def allow_fuse_cast_scale(self, mode: bool = True):
        self.fuse_cast_scale = bool(mode)

    def set_gradient_accumulation_steps(self, value: int):
        if int(value) < 1:
            raise ValueError(f"set_gradient_accumulation_steps: expected a positive integer, got {value}")
        self.gradient_accumulation_steps = int(value)

    def enable_cudnn_conv_heuristic_search_algo(self, mode: bool = True):
        self.cudnn_conv_heuristic_search_algo = bool(mode)

    def enable_straighten_algorithm(self, mode: bool = True):
        self.straighten = bool(mode)

    def enable_compress_memory(self, mode: bool = True):
        self.compress_memory = bool(mode)

    def __repr__(self):
        extra = "".join(f"{k}={v}, " for k, v in (("amp", self.amp), ("zero", self.zero)) if v)
        return f"GraphConfig(training={self.training}, {extra})"
