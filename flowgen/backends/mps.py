"""`flow.backends.mps`: flowgen has no Metal (Apple GPU) backend, so neither check is ever true
(model files pick their device with `torch.backends.mps.is_available()`)."""


def is_available() -> bool:
    return False


def is_built() -> bool:
    return False
