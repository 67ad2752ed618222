"""Several processes, one model: ranks (`env`), global tensors (`placement`, `sbp`,
`global_tensor`), MPI collectives (`collectives`), the launcher (`launch`) and data-parallel
graphs (`data_parallel`). `flow.nn.parallel.DistributedDataParallel` is the eager wrapper."""
