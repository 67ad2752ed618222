"""`flow.nn.Graph` and its configuration."""
from flowgen.nn.graph.config import GraphConfig  # noqa: F401
from flowgen.nn.graph.graph import Graph  # noqa: F401
from flowgen.nn.graph.proxy import GraphModule, Proxy  # noqa: F401
