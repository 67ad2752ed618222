"""`flow.utils`: data loading (`flow.utils.data`)."""
from flowgen.utils import data  # noqa: F401
