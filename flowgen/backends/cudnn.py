"""`flow.backends.cudnn`: PyTorch's cuDNN switches, for flowgen, which runs convolutions as kernels
it generates and never loads cuDNN. An `nn.Graph` reads them when it is constructed (its
`graph.config` starts from them), so a setting acts on the graphs made after it:

* `benchmark` (default False): True makes new graphs time the cost model's best few tile shapes
  for each conv on the GPU and keep the fastest, cached per GPU architecture, which is what
  `graph.config.enable_cudnn_conv_heuristic_search_algo(True)` does (runtime/autotune.py; a
  graph on the CPU warns that it has no effect there). PyTorch: cuDNN times its algorithms.
* `enabled` (default True): False turns the search of `benchmark` off, as PyTorch without cuDNN
  has no algorithms to time; flowgen's own conv kernels run either way.
* `deterministic` (default False): no effect in either value. flowgen's graph kernels add no
  floats with atomics (the scatter-style gradients add each output's entries in a fixed order),
  so a compiled program gives the same bits on every run; PyTorch needs the switch to restrict
  cuDNN to deterministic algorithms. With `benchmark`, a conv's numbers may depend on the tile
  the search picked (once per GPU architecture, then cached), as PyTorch's depend on the
  algorithm cuDNN picks.
* `allow_tf32` (default False; PyTorch's is True): True is refused. flowgen never rounds float32
  operands to TF32 unless asked, and it has one switch for GEMMs and convs together:
  `graph.config.allow_tf32(True)`.
* `is_available()` is False and `version()` None: there is no cuDNN in flowgen.

Any other setting raises AttributeError naming it.
"""
import sys
import types

import numpy as np

benchmark = False
deterministic = False
enabled = True
allow_tf32 = False

SETTINGS = ("benchmark", "deterministic", "enabled", "allow_tf32")


def is_available() -> bool:
    return False


def version():
    return None


def conv_search_for_new_graphs() -> bool:
    """The value a new graph's `config.cudnn_conv_heuristic_search_algo` starts from."""
    return benchmark and enabled


class _CudnnModule(types.ModuleType):
    """This module, checking what is assigned to its settings (`flow.backends.cudnn.x = v`)."""

    def __setattr__(self, name, value):
        if name not in SETTINGS:
            raise AttributeError(f"flow.backends.cudnn has no setting {name!r}; flowgen's are "
                                 f"{', '.join(SETTINGS)} (see help(flow.backends.cudnn))")
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"flow.backends.cudnn.{name} must be True or False, got {value!r}")
        if name == "allow_tf32" and value:
            raise NotImplementedError("flow.backends.cudnn.allow_tf32 = True: flowgen has one TF32 switch for "
                                      "float32 GEMMs and convs together, per graph: graph.config.allow_tf32(True)")
        super().__setattr__(name, bool(value))


sys.modules[__name__].__class__ = _CudnnModule
