"""Left padding, the house layout of token batches: each row's tokens at its right end, pad before.

`left_pad` builds such a batch on the host from rows of any lengths; the data batcher, the
sampler's `generate`, the multi-turn engine's re-prefill and the CLI all use it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def left_pad(rows: Sequence[Sequence[int]], pad_id: int | None = 0, width: int | None = None, multiple: int = 1,
             dtype=np.int32) -> tuple[np.ndarray, np.ndarray]:
  """N token-id rows of any lengths as a left-padded batch.

  rows: N sequences of ids (lists, tuples or 1-d arrays; empty rows are allowed). pad_id: the
  fill of the padded columns (None means 0). width: the batch width W; by default the longest
  row rounded up to a multiple of `multiple`. Returns ids [N, W] of `dtype` and mask [N, W]
  bool, row i's tokens in its last len(rows[i]) columns. Raises ValueError when a row is
  longer than `width`.
  """
  arrays = [np.asarray(r, dtype).reshape(-1) for r in rows]
  longest = max((len(r) for r in arrays), default=0)
  if width is None:
    width = -(-longest // multiple) * multiple
  elif longest > width:
    raise ValueError(f"a row has {longest} tokens, more than the width {width}.")
  ids = np.full((len(arrays), width), 0 if pad_id is None else pad_id, dtype)
  mask = np.zeros((len(arrays), width), bool)
  for i, r in enumerate(arrays):
    if len(r):
      ids[i, width - len(r):], mask[i, width - len(r):] = r, True
  return ids, mask
