"""The training loop's data position (`PromptFeed`) and the stops it can raise."""
from __future__ import annotations

import jax
import numpy as np

from rljax import sharding as shd
from rljax.errors import RljaxError
from rljax.rollout.types import Prompts


class TrainingStopped(RljaxError):
  """The run stopped on purpose (e.g. too many non-finite updates); the last good checkpoint is kept."""


class DataExhausted(TrainingStopped):
  """The training data ran out before train.steps; a checkpoint of the last step is saved first."""


class PromptFeed:
  """The loop's data position: hands out prompt batches and remembers where each one ended.

  `next(sharding)` gives a `Prompts` with device arrays [P*O, Lp] on `sharding`; `next_host()`
  gives the host `PromptBatch` (for producers that pad prompts themselves). Either also returns
  the batcher state just after the batch, which is what a checkpoint of the step trained on it
  saves, so a resume draws the next batch.
  """

  def __init__(self, batcher, pad_id: int = 0, agree_width: bool | None = None):
    self.batcher = batcher
    # Processes that each hold rows of one global batch agree on its prompt width (one host
    # all-gather); the generator process of an async run across processes holds all of them.
    self.agree_width = jax.process_count() > 1 if agree_width is None else agree_width
    self.pad_id = pad_id
    self._batches = iter(batcher)

  def restore(self, data_state: dict) -> None:
    self.batcher.restore(data_state)
    self._batches = iter(self.batcher)

  def next_host(self):
    try:
      batch = next(self._batches)
    except StopIteration:
      raise DataExhausted("the dataset ran out (config.data.num_epochs reached); "
                          "raise num_epochs or set it to None to cycle forever.") from None
    return batch, self.batcher.state()

  def next(self, sharding) -> Prompts:
    batch, data_state = self.next_host()
    ids, mask = np.asarray(batch.prompt_ids, np.int32), np.asarray(batch.prompt_mask, bool)
    if self.agree_width:
      # Each process pads its own prompts; the global array needs one width: the widest bucket.
      width = max(shd.allgather_objects(ids.shape[1]))
      left = ((0, 0), (width - ids.shape[1], 0))
      ids, mask = np.pad(ids, left, constant_values=self.pad_id), np.pad(mask, left)
    ids = jax.make_array_from_process_local_data(sharding, ids)
    mask = jax.make_array_from_process_local_data(sharding, mask)
    return Prompts(list(batch.examples), ids, mask, data_state)
