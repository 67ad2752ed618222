"""`flow.nn`: modules, layers, losses, initialisers and the functional API.

`nn.Graph` (the compiler entry point) is added by `flowgen/nn/graph/`.
"""
from flowgen.nn import functional, init  # noqa: F401
from flowgen.nn.module import (Identity, Module, ModuleDict, ModuleList, ParameterDict, ParameterList,  # noqa: F401
                               Sequential)
from flowgen.nn.modules import *  # noqa: F401,F403
from flowgen.nn.parameter import Parameter
from flowgen.nn import utils  # noqa: F401
from flowgen.nn import parallel  # noqa: F401
from flowgen.nn.graph import Graph  # noqa: F401,E402
