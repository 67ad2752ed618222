"""Several processes, one model: ranks (`env`), global tensors (`placement`, `sbp`,
`global_tensor`), MPI collectives (`collectives`), the launcher (`launch`) and data-parallel
graphs (`data_parallel`). `flow.nn.parallel.DistributedDataParallel` is the eager wrapper.

How they work together (global tensors, DDP, data-parallel graphs, ZeRO, pipelines, SyncBatchNorm,
standalone data-parallel programs) and a design note for several machines: docs/distributed.md.
"""
