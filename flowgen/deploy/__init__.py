"""Running what `flowgen build` made, from Python: `load_compiled` opens a `--lib` build."""
from flowgen.deploy.loader import CompiledModel, TensorInfo, load_compiled  # noqa: F401
