"""Op definitions. Importing this package registers every op."""
from flowgen.ops import elementwise  # noqa: F401
from flowgen.ops import reduction  # noqa: F401
from flowgen.ops import shape  # noqa: F401
from flowgen.ops import linalg  # noqa: F401
from flowgen.ops import graph_ops  # noqa: F401
from flowgen.ops import nn_ops  # noqa: F401
from flowgen.ops import norm_ops  # noqa: F401
from flowgen.ops import random_ops  # noqa: F401
from flowgen.ops import sorting  # noqa: F401
