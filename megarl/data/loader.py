"""Batches of training prompts in a seeded order per epoch; the loader's position is part of a checkpoint."""

from __future__ import annotations

import torch

from megarl.data.batch import Batch
from megarl.seeds import data_order_seed


class PromptLoader:
    """Batches of prompts in a seeded order per epoch (``data.shuffle``, seeded by ``trainer.seed`` and the
    epoch); its position (:meth:`state_dict`) is part of a checkpoint, so a resumed run reads on where it
    stopped. ``drop_last``: an epoch ends before a short last batch."""

    def __init__(self, dataset, batch_size: int, *, shuffle: bool, seed: int, drop_last: bool = True):
        if len(dataset) < batch_size and drop_last:
            raise ValueError(f"data.train_batch_size={batch_size} is larger than the {len(dataset)} training prompts; "
                             f"lower data.train_batch_size or add data")
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed
        self.drop_last = drop_last
        self.epoch, self.index = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        """Full batches per epoch (with ``drop_last``), else batches including a short last one."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator().manual_seed(data_order_seed(self.seed, epoch))
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def next(self) -> Batch:
        """The next batch of prompts (collated), moving to the next epoch when this one is spent."""
        if self.index >= self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        rows = self._rows(self.epoch, self.index)
        self.index += 1
        return self.dataset.collate([self.dataset[i] for i in rows])

    def _rows(self, epoch: int, index: int) -> list[int]:
        return self._order(epoch)[index * self.batch_size:(index + 1) * self.batch_size]

    def rows_of(self, number: int) -> list[int]:
        """Dataset rows of the run's batch ``number`` (0-based, epochs end to end), without moving: what
        :meth:`next` returns as that batch."""
        epoch, index = divmod(number, self.batches_per_epoch)
        return self._rows(epoch, index)

    def seek(self, number: int) -> None:
        """Move to just before batch ``number`` (``number`` batches consumed)."""
        self.epoch, self.index = divmod(number, self.batches_per_epoch)

    @property
    def position(self) -> int:
        """Batches consumed so far (epochs end to end)."""
        return self.epoch * self.batches_per_epoch + self.index

    def state_dict(self) -> dict[str, int]:
        """The position: epoch and batch index within it."""
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a position saved by :meth:`state_dict`."""
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
