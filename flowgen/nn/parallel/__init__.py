"""`flow.nn.parallel`: data parallelism over the ranks a launcher started."""
from flowgen.nn.parallel.distributed import DistributedDataParallel  # noqa: F401
