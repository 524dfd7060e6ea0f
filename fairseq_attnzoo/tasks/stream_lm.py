"""``attnzoo_stream_lm``: language modelling over contiguous streams, for models with a cache.

The corpus (a fairseq binarised ``--only-source`` dataset, e.g. enwik8 bytes) is one token stream,
cut into G = B * W * U equal streams for a batch size B (``--batch-size``, or ``--max-tokens`` /
``--tokens-per-sample``), W workers and U = ``--update-freq``. Streams are grouped by B; update
step i of worker r reads block i (``--tokens-per-sample`` M tokens) of groups u * W + r for
u = 0..U-1, one batch each. So consecutive batches of a group continue each other and a model can
carry a cache across them (Transformer-XL "truncated BPTT"), and -- as everywhere in fairseq --
``--update-freq U`` on one worker computes exactly the update of U workers. Targets are the next
tokens, including the first token of the next block: every token but the first of a stream is
predicted.

``net_input`` carries ``stream_pos`` (block index) and ``stream_id`` (global stream index) per row;
a model that knows them (the adaptive-span LM) keeps one cache per stream group; others ignore
them. Validation and ``fairseq-eval-lm`` read their split the same way from block 0 with fresh
caches (eval-lm: ``--batch-size`` sets the number of streams; the reference evaluates with 8, which
leaves few tokens without context).

Generation (``fairseq-interactive``, ``SequenceGenerator``) is fairseq's language-modelling path.
"""

import logging
import math
import os
from dataclasses import dataclass
from typing import List

import numpy as np
import torch
from omegaconf import II

from fairseq import utils
from fairseq.data import FairseqDataset, data_utils, iterators
from fairseq.tasks import register_task
from fairseq.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask

from .. import compat


logger = logging.getLogger(__name__)


@dataclass
class StreamLMConfig(LanguageModelingConfig):
    """``--tokens-per-sample`` is the block length M; ``--batch-size`` the number of streams per
    batch (``--batch-size-valid`` for validation). Break mode, shortening and padding options of
    ``language_modeling`` do not apply to streams."""

    update_freq: List[int] = II("optimization.update_freq")


def read_tokens(dataset) -> np.ndarray:
    """All tokens of an indexed dataset as one array, in order (a copy: fairseq closes the mmap of
    an indexed dataset when it is garbage-collected; byte-level data stays 2 bytes a token)."""
    total = int(np.sum(dataset.sizes))
    buf, index = getattr(dataset, "_bin_buffer", None), getattr(dataset, "_index", None)
    if buf is not None and index is not None and len(dataset) > 0:  # items are stored back to back
        ptr, _ = index[0]
        return np.array(np.frombuffer(buf, dtype=index.dtype, count=total, offset=int(ptr)))
    out = np.empty(total, dtype=np.int64)
    pos = 0
    for i in range(len(dataset)):
        item = dataset[i].numpy()
        out[pos:pos + len(item)] = item
        pos += len(item)
    return out


class TokenStream(FairseqDataset):
    """A split as one token stream; batches are made by :class:`StreamBatches`."""

    def __init__(self, tokens: np.ndarray, name: str = ""):
        super().__init__()
        self.tokens = tokens
        self.name = name

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        return torch.tensor(int(self.tokens[index]))

    @property
    def sizes(self):
        return np.ones(1, dtype=np.int64) * len(self.tokens)


class StreamBatches(torch.utils.data.Dataset):
    """Item k = one batch: block k // U of stream group (k % U) * W + r (see module docstring)."""

    def __init__(self, tokens: np.ndarray, batch_size: int, block: int, num_shards: int = 1,
                 shard_id: int = 0, update_freq: int = 1, name: str = ""):
        streams = batch_size * num_shards * update_freq
        self.length = len(tokens) // streams  # tokens per stream; the tail (< G tokens) is dropped
        if self.length < 2:
            raise ValueError(
                f"split {name!r} has {len(tokens)} tokens: too few for {streams} streams "
                f"(--batch-size {batch_size} x {num_shards} workers x --update-freq {update_freq})"
                "; lower --batch-size")
        self.grid = tokens[: streams * self.length].reshape(streams, self.length)
        self.groups = [(u * num_shards + shard_id) * batch_size for u in range(update_freq)]
        self.batch_size = batch_size
        self.block = block
        self.update_freq = update_freq
        self.num_blocks = math.ceil((self.length - 1) / block)

    def __len__(self):
        return self.num_blocks * self.update_freq

    def __getitem__(self, k):
        i, first = k // self.update_freq, self.groups[k % self.update_freq]
        start = i * self.block
        end = min(start + self.block, self.length - 1)
        rows = self.grid[first: first + self.batch_size, start:end + 1]
        return i, first, torch.from_numpy(np.ascontiguousarray(rows).astype(np.int64))

    def collater(self, items):
        assert len(items) == 1, "every item is already a whole batch"
        i, first, chunk = items[0]
        src, tgt = chunk[:, :-1], chunk[:, 1:]
        b, t = src.shape
        ids = torch.arange(first, first + b)
        return {
            "id": ids * self.num_blocks + i,
            "nsentences": b,
            "ntokens": b * t,
            "net_input": {
                "src_tokens": src.contiguous(),
                "src_lengths": torch.full((b,), t, dtype=torch.long),
                "stream_pos": torch.full((b,), i, dtype=torch.long),
                "stream_id": ids,
            },
            "target": tgt.contiguous(),
        }


@register_task("attnzoo_stream_lm", dataclass=StreamLMConfig)
class StreamLanguageModelingTask(LanguageModelingTask):
    """Contiguous streams of blocks for cached (Transformer-XL style) LMs; see module docstring."""

    @classmethod
    @compat.built_by_fairseq
    def setup_task(cls, args, **kwargs):
        return super().setup_task(args, **kwargs)

    def load_dataset(self, split: str, epoch=1, combine=False, **kwargs):
        paths = utils.split_paths(self.args.data)
        assert len(paths) > 0
        split_path = os.path.join(paths[(epoch - 1) % len(paths)], split)
        data = data_utils.load_indexed_dataset(split_path, self.dictionary,
                                               self.args.dataset_impl, combine=combine)
        if data is None:
            raise FileNotFoundError(f"Dataset not found: {split} ({split_path})")
        self.datasets[split] = TokenStream(read_tokens(data), split)
        logger.info(f"{split}: {len(self.datasets[split]):,} tokens as one stream")

    def get_batch_iterator(self, dataset, max_tokens=None, max_sentences=None, max_positions=None,
                           ignore_invalid_inputs=False, required_batch_size_multiple=1, seed=1,
                           num_shards=1, shard_id=0, num_workers=0, epoch=1, data_buffer_size=0,
                           disable_iterator_cache=False, skip_remainder_batch=False, **kwargs):
        if not isinstance(dataset, TokenStream):  # e.g. fairseq-interactive's inference dataset
            return super().get_batch_iterator(
                dataset, max_tokens=max_tokens, max_sentences=max_sentences,
                max_positions=max_positions, ignore_invalid_inputs=ignore_invalid_inputs,
                required_batch_size_multiple=required_batch_size_multiple, seed=seed,
                num_shards=num_shards, shard_id=shard_id, num_workers=num_workers, epoch=epoch,
                data_buffer_size=data_buffer_size, disable_iterator_cache=disable_iterator_cache,
                skip_remainder_batch=skip_remainder_batch, **kwargs)
        block = self.args.tokens_per_sample
        bsz = max_sentences or max(1, (max_tokens or block) // block)
        update_freq = getattr(self.args, "update_freq", None) or [1]
        update_freq = update_freq if isinstance(update_freq, int) else int(update_freq[0])
        batches = StreamBatches(dataset.tokens, bsz, block, num_shards, shard_id, update_freq,
                                dataset.name)
        return iterators.EpochBatchIterator(
            dataset=batches, collate_fn=batches.collater,
            batch_sampler=[[i] for i in range(len(batches))], seed=seed, num_workers=num_workers,
            epoch=epoch, buffer_size=data_buffer_size, disable_shuffling=True,
            skip_remainder_batch=skip_remainder_batch)

    def eval_lm_dataloader(self, dataset, max_tokens=36000, batch_size=None, max_positions=None,
                           num_shards=1, shard_id=0, num_workers=1, data_buffer_size=10,
                           context_window=0):
        if context_window > 0:
            raise ValueError("--context-window does not apply to attnzoo_stream_lm: the model's "
                             "cache gives every token its context; drop the flag")
        return self.get_batch_iterator(
            dataset, max_tokens=max_tokens, max_sentences=batch_size, num_shards=num_shards,
            shard_id=shard_id, num_workers=num_workers, data_buffer_size=data_buffer_size,
        ).next_epoch_itr(shuffle=False)

