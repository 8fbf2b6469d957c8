"""Batches for a pipe's ranks: one share per replica, every rank of a pipeline the same one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, IterableDataset


def shard_over_replicas(loader: DataLoader[Any], replica: int, replicas: int) -> DataLoader[Any]:
    """`loader` as accelerate prepared it (sharded over every process of the job), sharded
    over the data-parallel replicas instead: the processes of one pipeline read the same
    batches, each replica its own (accelerate's samplers and shards read these two numbers
    at each iteration, as transformers' Trainer itself resets them for its rebalancing
    sampler). A loader accelerate dispatches from the first process is refused: it would
    hand every process its own slice."""
    from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard

    if isinstance(loader, DataLoaderDispatcher):
        raise ValueError(
            "PipelineTrainer: accelerate dispatches this dataset's batches from the first "
            "process, a slice to each process, but the processes of one pipeline need the "
            "same batch; pass TrainingArguments(accelerator_config={'dispatch_batches': "
            "False}) so that each process reads its replica's batches itself"
        )
    holders = (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None),
               getattr(loader, "dataset", None))  # fmt: skip
    for holder in holders:
        if isinstance(holder, (BatchSamplerShard, IterableDatasetShard)):
            holder.num_processes, holder.process_index = replicas, replica
        if isinstance(holder, BatchSamplerShard) and replicas == 1:
            # One replica reads every batch, the last one short, as an unsharded loader
            # does (evening out is for replicas that must step together).
            holder.even_batches = False
    return loader


def example_batch(dataset: Any, collate: Callable[[list[Any]], Any], rows: int = 2) -> Any:
    """A small batch of `dataset`'s first items, collated as training will be: the form
    (which inputs, their dtypes) the pipe is planned for."""
    if isinstance(dataset, IterableDataset):
        items = []
        for item in dataset:
            items.append(item)
            if len(items) == rows:
                break
    else:
        items = [dataset[i] for i in range(min(rows, len(dataset)))]
    if not items:
        raise ValueError("PipelineTrainer: the dataset is empty, so no batch shows the inputs")
    return collate(items)
