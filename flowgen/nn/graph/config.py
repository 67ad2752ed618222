"""`graph.config`: the seeds' GraphConfig options."""
from __future__ import annotations

from flowgen import dtype as dt


class GraphConfig:
    def __init__(self):
        self.training = False
        self.fusion = True              # flowgen: fuse elementwise chains and reduction prologues/epilogues
        self.naive_memory = False       # flowgen: one allocation per intermediate (debugging)
        self.amp = False
        self.amp_dtype = dt.float16     # what matmul/conv2d compute in under enable_amp
        self.tf32 = False               # float32 GEMMs may run on tensor cores with TF32 inputs
        self.zero = False
        self.fuse_model_update_ops = False
        self.fuse_add_to_output = False
        self.fuse_cast_scale = False
        self.gradient_accumulation_steps = 1
        self.cudnn_conv_heuristic_search_algo = False
        self.straighten = False
        self.compress_memory = False

    def enable_amp(self, mode: bool = True, dtype=dt.float16):
        """Mixed precision: matmul and conv2d of float32 tensors compute in `dtype` (float16 or
        bfloat16) with float32 accumulation, on tensor cores; parameters stay float32."""
        if dtype not in (dt.float16, dt.bfloat16):
            raise ValueError(f"enable_amp: dtype must be flow.float16 or flow.bfloat16, got {dtype}")
        self.amp = bool(mode)
        self.amp_dtype = dtype

    def allow_tf32(self, mode: bool = True):
        """Let float32 matmuls run on tensor cores with inputs rounded to TF32 (10 mantissa bits,
        fp32 accumulation), like PyTorch's `torch.backends.cuda.matmul.allow_tf32`."""
        self.tf32 = bool(mode)

    def enable_zero(self, mode: bool = True, *, stage: int = 2, shard_min_size: int = 1024, shard_restore_level: int = 1):
        # One device: ZeRO sharding has nothing to shard across; recorded for repr.
        self.zero = bool(mode)

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
        extra = "".join(f"{k}={v}, " for k, v in (("amp", self.amp and self.amp_dtype.name), ("tf32", self.tf32),
                                                     ("zero", self.zero)) if v)
        return f"GraphConfig(training={self.training}, {extra})"
