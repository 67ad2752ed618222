"""flowgen: an ahead-of-time compiler for neural networks that emits readable CUDA C++.

`import flowgen as flow` gives a OneFlow/PyTorch-style eager API (NumPy on the
CPU, the numerical reference) and `flow.nn.Graph`, which compiles a step to
CUDA C++ and runs it on a GPU or on the CPU emulator.
"""
from flowgen import dtype as _dt
from flowgen.dtype import DType, bfloat16, float16, float32, float64, int8, int16, int32, int64, uint8
from flowgen.dtype import bool_ as bool  # noqa: A001 - flow.bool, as in OneFlow
from flowgen.device import device
from flowgen.tensor import Tensor, Size
from flowgen.autograd import no_grad, enable_grad, is_grad_enabled
from flowgen.inference import inference_mode, is_inference_mode_enabled
from flowgen import ops as _ops  # noqa: F401  (registers every op)
from flowgen.functional import *  # noqa: F401,F403
from flowgen.creation import *  # noqa: F401,F403

float = float32  # noqa: A001
half = float16
double = float64
long = int64
short = int16
char = int8
int = int32  # noqa: A001

from flowgen.version import __version__  # noqa: E402,F401
from flowgen import nn, optim, utils, amp, models, one_embedding, backends  # noqa: E402,F401
from flowgen.mixed_precision import autocast  # noqa: E402
from flowgen import _C  # noqa: E402,F401  (OneFlow's functional namespace, flow._C)
from flowgen.serialization import save, load  # noqa: E402
from flowgen.dims import Dim  # noqa: E402,F401  (a dynamic dimension: graph.config.dynamic_shapes)
from flowgen.deploy import load_compiled  # noqa: E402,F401  (a `flowgen build --lib` library, through ctypes)
from flowgen.errors import FlowgenInternalError  # noqa: E402,F401  (a failed internal check while compiling)
from flowgen.distributed import env, sbp  # noqa: E402
from flowgen.distributed import global_ops as _global_ops  # noqa: E402,F401  (installs eager ops on global tensors)
from flowgen import sysconfig  # noqa: E402
from flowgen.distributed.placement import placement  # noqa: E402
from flowgen.frontends import from_torch  # noqa: E402,F401  (a PyTorch model as a flowgen Module)
