"""`flow.utils.data`: Dataset, TensorDataset, samplers and DataLoader.

Loading runs in the calling process (`num_workers` is accepted and ignored).
Shuffling draws a permutation per epoch from flowgen's global generator
(`flow.manual_seed` makes it reproducible) or from ``generator=`` (a NumPy
``Generator``, as flowgen's creation functions take).
"""
from __future__ import annotations

import collections.abc
import math

import numpy as np

from flowgen import random as _random
from flowgen.tensor import Tensor

__all__ = ["Dataset", "TensorDataset", "Subset", "random_split", "Sampler", "SequentialSampler", "RandomSampler",
           "BatchSampler", "DataLoader", "default_collate"]


def _rng(generator):
    if generator is None:
        return _random.generator()
    if not hasattr(generator, "permutation"):
        raise TypeError(f"generator must be a NumPy Generator (np.random.default_rng(seed)), got "
                        f"{type(generator).__name__}")
    return generator


# ------------------------------------------------------------------ datasets
class Dataset:
    """Map-style dataset: implement `__getitem__(index)` and `__len__()`."""

    def __getitem__(self, index):
        raise NotImplementedError(f"{type(self).__name__} must implement __getitem__")


class TensorDataset(Dataset):
    """Samples are the i-th rows of the given tensors (all with the same first dimension)."""

    def __init__(self, *tensors: Tensor):
        if not tensors:
            raise ValueError("TensorDataset needs at least one tensor")
        n = tensors[0].shape[0]
        for i, t in enumerate(tensors):
            if t.shape[0] != n:
                raise ValueError(f"Size mismatch between tensors: tensor 0 has {n} rows, tensor {i} has "
                                 f"{t.shape[0]}")
        self.tensors = tensors

    def __getitem__(self, index):
        return tuple(_rows(t, index) for t in self.tensors)

    def __len__(self) -> int:
        return self.tensors[0].shape[0]


def _rows(t: Tensor, index) -> Tensor:
    """Rows of a tensor as a new tensor (NumPy indexing; samples carry no autograd history)."""
    return Tensor(np.array(t.numpy_view()[index]), dtype=t.dtype, device=t.device)


class Subset(Dataset):
    def __init__(self, dataset, indices):
        self.dataset = dataset
        self.indices = list(indices)

    def __getitem__(self, index):
        return self.dataset[self.indices[index]]

    def __len__(self) -> int:
        return len(self.indices)


def random_split(dataset, lengths, generator=None) -> list:
    """Split into non-overlapping random subsets; `lengths` are counts or fractions summing to 1."""
    n = len(dataset)
    lengths = list(lengths)
    if math.isclose(sum(lengths), 1) and sum(lengths) <= 1:
        counts = [int(math.floor(n * f)) for f in lengths]
        for i in range(n - sum(counts)):
            counts[i % len(counts)] += 1
        lengths = counts
    if sum(lengths) != n:
        raise ValueError(f"Sum of input lengths ({sum(lengths)}) does not equal the length of the dataset ({n})")
    perm = _rng(generator).permutation(n).tolist()
    out, offset = [], 0
    for length in lengths:
        out.append(Subset(dataset, perm[offset:offset + length]))
        offset += length
    return out


# ------------------------------------------------------------------ samplers
class Sampler:
    def __iter__(self):
        raise NotImplementedError


class SequentialSampler(Sampler):
    def __init__(self, data_source):
        self.data_source = data_source

    def __iter__(self):
        return iter(range(len(self.data_source)))

    def __len__(self) -> int:
        return len(self.data_source)


class RandomSampler(Sampler):
    """A fresh permutation each epoch (drawn when iteration starts)."""

    def __init__(self, data_source, replacement: bool = False, num_samples: int | None = None, generator=None):
        self.data_source = data_source
        self.replacement = replacement
        self._num_samples = num_samples
        self.generator = generator

    @property
    def num_samples(self) -> int:
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def __iter__(self):
        n, rng = len(self.data_source), _rng(self.generator)
        if self.replacement:
            return iter(rng.integers(0, n, size=self.num_samples).tolist())
        reps = -(-self.num_samples // n) if n else 0
        order = np.concatenate([rng.permutation(n) for _ in range(reps)]) if reps else np.zeros(0, np.int64)
        return iter(order[:self.num_samples].tolist())

    def __len__(self) -> int:
        return self.num_samples


class BatchSampler(Sampler):
    def __init__(self, sampler, batch_size: int, drop_last: bool):
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
            raise ValueError(f"batch_size should be a positive integer value, but got batch_size={batch_size}")
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last

    def __iter__(self):
        batch = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)


# ------------------------------------------------------------------ collate
def default_collate(batch):
    """Stack a list of samples into batched tensors, recursing into tuples, lists and dicts.

    Tensors and NumPy arrays are stacked (float64 arrays become float32, as
    everywhere in flowgen); Python ints → int64, floats → float32, bools → bool;
    strings stay a list.
    """
    elem = batch[0]
    if isinstance(elem, Tensor):
        return Tensor(np.stack([t.numpy_view() for t in batch]), dtype=elem.dtype, device=elem.device)
    if isinstance(elem, (np.ndarray, np.generic)) and elem.dtype.kind not in "OUS":
        return Tensor(np.stack([np.asarray(b) for b in batch]))
    if isinstance(elem, bool):
        return Tensor(np.array(batch, dtype=np.bool_))
    if isinstance(elem, int):
        return Tensor(np.array(batch, dtype=np.int64))
    if isinstance(elem, float):
        return Tensor(np.array(batch, dtype=np.float32))
    if isinstance(elem, (str, bytes)):
        return list(batch)
    if isinstance(elem, collections.abc.Mapping):
        return {key: default_collate([d[key] for d in batch]) for key in elem}
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):  # namedtuple
        return type(elem)(*(default_collate(list(samples)) for samples in zip(*batch)))
    if isinstance(elem, collections.abc.Sequence):
        if any(len(b) != len(elem) for b in batch):
            raise RuntimeError("each element in list of batch should be of equal size")
        return [default_collate(list(samples)) for samples in zip(*batch)]
    raise TypeError(f"default_collate: batch must contain tensors, NumPy arrays, numbers, dicts or lists; "
                    f"found {type(elem).__name__}")


# ---------------------------------------------------------------- DataLoader
class DataLoader:
    """Iterate over `dataset` in (optionally shuffled) batches.

    ``DataLoader(dataset, batch_size=1, shuffle=False, sampler=None, batch_sampler=None, num_workers=0,
    collate_fn=None, drop_last=False, generator=None)``; ``batch_size=None`` yields single samples.
    """

    def __init__(self, dataset, batch_size: int | None = 1, shuffle: bool = False, sampler=None,
                 batch_sampler=None, num_workers: int = 0, collate_fn=None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0, worker_init_fn=None, generator=None, **kwargs):
        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if batch_sampler is not None and (batch_size != 1 or shuffle or sampler is not None or drop_last):
            raise ValueError("batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, "
                             "and drop_last")
        self.dataset = dataset
        self.num_workers = num_workers
        self.generator = generator
        self.drop_last = drop_last
        if sampler is None:
            sampler = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
        self.sampler = sampler
        if batch_sampler is not None:
            self.batch_size = None
            self.batch_sampler = batch_sampler
        elif batch_size is not None:
            self.batch_size = batch_size
            self.batch_sampler = BatchSampler(sampler, batch_size, drop_last)
        else:
            self.batch_size = None
            self.batch_sampler = None
        self.collate_fn = collate_fn if collate_fn is not None else (
            default_collate if self.batch_sampler is not None else (lambda sample: sample))

    def __iter__(self):
        if self.batch_sampler is None:
            for index in self.sampler:
                yield self.collate_fn(self.dataset[index])
            return
        fast = isinstance(self.dataset, TensorDataset) and self.collate_fn is default_collate
        for indices in self.batch_sampler:
            if fast:  # one NumPy gather per tensor instead of one per sample
                yield [_rows(t, np.asarray(indices, dtype=np.int64)) for t in self.dataset.tensors]
            else:
                yield self.collate_fn([self.dataset[i] for i in indices])

    def __len__(self) -> int:
        return len(self.batch_sampler) if self.batch_sampler is not None else len(self.sampler)
