"""`graph.config`: the seeds' GraphConfig options.

Every option acts or says why it cannot:

* `allow_fuse_model_update_ops`, `allow_fuse_add_to_output`, `allow_fuse_cast_scale` switch a
  fusion family (passes/fusion.py). flowgen turns all three on by default (OneFlow: off);
  `False` turns that family off and the program gets more, smaller kernels.
* `enable_multi_tensor_update` switches the multi-tensor kernel: parameter updates that joined no
  gradient kernel run as segments of one kernel (passes/fusion.py). On by default in flowgen
  (OneFlow: off); `False` gives each of them a kernel of its own.
* `enable_fused_model_update_cast` warns that it has no effect: flowgen keeps no half-precision copy
  of the weights for the update to write (under AMP the forward casts each weight every step).
* `enable_compress_memory` plans the arena with a search over placement orders
  (memory/search.py) instead of one greedy pass.
* `enable_zero` and `GraphModule.set_stage` shard or pipeline across ranks; in a process started
  alone (world size 1) they warn that they have no effect. On several ranks a data-parallel graph
  shards with ZeRO (passes/zero.py): stage 1 the optimizer state, 2 the gradients too, 3 the
  parameters too (each module's gathered just before its forward and again before its backward);
  set_stage runs each stage on its rank, the micro-batches of `set_gradient_accumulation_steps`
  in 1F1B order (distributed/pipeline.py).
* `enable_cudnn_conv_heuristic_search_algo` times conv tile shapes on the GPU (runtime/autotune.py);
  a new graph starts with it on when `flow.backends.cudnn.benchmark` is True (backends/cudnn.py).
* `set_outputs_buffer_size(n)`: outputs are copied into fresh tensors after every call, so the
  outputs of every earlier call stay valid, which covers OneFlow's "the last n calls".
"""
from __future__ import annotations

import warnings

from flowgen import dtype as dt
from flowgen.backends import cudnn
from flowgen.distributed import env


def warn_single_device(option: str):
    warnings.warn(f"{option} has no effect on a single device yet: flowgen runs a graph on one device, "
                  f"so there is nothing to shard or pipeline across", UserWarning, stacklevel=3)


class GraphConfig:
    def __init__(self):
        self.training = False
        self.fusion = True              # flowgen: fuse elementwise chains and reduction prologues/epilogues
        self.naive_memory = False       # flowgen: one allocation per intermediate (debugging)
        self.amp = False
        self.amp_dtype = dt.float16     # the autocast dtype under enable_amp (flowgen/mixed_precision.py)
        self.tf32 = False               # float32 GEMMs may run on tensor cores with TF32 inputs
        self.zero = False
        self.zero_stage = 2
        self.zero_shard_min_size = 1024
        self.fuse_model_update_ops = True
        self.fuse_add_to_output = True
        self.fuse_cast_scale = True
        self.multi_tensor_update = True
        self.gradient_accumulation_steps = 1
        # flow.backends.cudnn.benchmark (and .enabled) when the graph is made: PyTorch's switch for it
        self.cudnn_conv_heuristic_search_algo = cudnn.conv_search_for_new_graphs()
        self.straighten = False
        self.compress_memory = False
        self.dynamic = None             # flowgen: per input of build(), {axis: flow.Dim} or None (dynamic_shapes)

    def enable_amp(self, mode: bool = True, dtype=dt.float16):
        """Mixed precision with PyTorch's autocast semantics (the op lists: flowgen/mixed_precision.py):
        matmul, conv and attention take `dtype` (float16 or bfloat16) operands, accumulate in float32
        on tensor cores and keep their results in `dtype`; softmax, cross entropy, layer_norm and
        sums upcast to float32; other ops run in their inputs' dtype. Parameters and their
        gradients stay float32."""
        if dtype not in (dt.float16, dt.bfloat16):
            raise ValueError(f"enable_amp: dtype must be flow.float16 or flow.bfloat16, got {dtype}")
        self.amp = bool(mode)
        self.amp_dtype = dtype

    def allow_tf32(self, mode: bool = True):
        """Let float32 matmuls run on tensor cores with inputs rounded to TF32 (10 mantissa bits,
        fp32 accumulation), like PyTorch's `torch.backends.cuda.matmul.allow_tf32`."""
        self.tf32 = bool(mode)

    def enable_zero(self, mode: bool = True, *, stage: int = 2, shard_min_size: int = 1024, shard_restore_level: int = 1):
        # A data-parallel graph on several ranks shards optimizer state (stage 1), gradients (2) and
        # parameters (3) in passes/zero.py. One rank has nothing to shard across.
        if stage not in (1, 2, 3):
            raise ValueError(f"enable_zero: stage must be 1, 2 or 3, got {stage!r}")
        if mode and env.get_world_size() == 1:
            warn_single_device("enable_zero")
        self.zero = bool(mode)
        self.zero_stage, self.zero_shard_min_size = int(stage), int(shard_min_size)

    def allow_fuse_model_update_ops(self, mode: bool = True):
        """Optimizer updates run in the kernel making their gradient (GEMM/reduction epilogue) and the
        leftover ones in one multi-tensor kernel. Default on in flowgen."""
        self.fuse_model_update_ops = bool(mode)

    def enable_multi_tensor_update(self, mode: bool = True):
        """Parameter updates that joined no gradient kernel (a conv weight's, whose gradient comes
        from a template kernel) run as segments of one multi-tensor kernel. Default on in flowgen."""
        self.multi_tensor_update = bool(mode)

    def enable_fused_model_update_cast(self, mode: bool = True):
        """OneFlow (under AMP): the optimizer update also writes a float16 copy of each weight, which
        the next forward reads instead of casting. flowgen keeps no such copy, so this cannot act."""
        if mode:
            warnings.warn("enable_fused_model_update_cast has no effect in flowgen: it keeps no float16 copy "
                          "of the weights for the optimizer update to write; under enable_amp the forward "
                          "casts each float32 weight every step (one elementwise kernel per weight)",
                          UserWarning, stacklevel=2)

    def allow_fuse_add_to_output(self, mode: bool = True):
        """A residual add runs in the epilogue of the conv/GEMM producing one operand. Default on in flowgen."""
        self.fuse_add_to_output = bool(mode)

    def allow_fuse_cast_scale(self, mode: bool = True):
        """Casts and multiplies by a one-element tensor join neighbouring kernels. Default on in flowgen."""
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
        """Search placement orders for the smallest arena (slower planning; see memory/search.py)."""
        self.compress_memory = bool(mode)

    def dynamic_shapes(self, spec):
        """Sizes given at run time (flowgen/dims.py): one entry per input of build(), a dict
        {axis: flow.Dim} or None, as torch.export's dynamic_shapes. The step compiles once, its
        memory planned for each Dim's max, and takes any size from the Dim's min to its max without
        recompiling; a size out of range is an error naming the input. None: fixed shapes again.
        Inference graphs only for now."""
        self.dynamic = None if spec is None else list(spec)

    def set_outputs_buffer_size(self, value: int = 2):
        """OneFlow keeps the outputs of the last `value` calls valid. flowgen copies every output into a
        fresh tensor, so all earlier outputs stay valid whatever `value` is: there is no buffer to size."""
        if int(value) < 1:
            raise ValueError(f"set_outputs_buffer_size: expected a positive integer, got {value}")

    def __repr__(self):
        extra = "".join(f"{k}={v}, " for k, v in (("amp", self.amp and self.amp_dtype.name), ("tf32", self.tf32),
                                                     ("zero", self.zero)) if v)
        return f"GraphConfig(training={self.training}, {extra})"
