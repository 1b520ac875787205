"""`ht.utils.data.Dataset`: a map-style dataset over this rank's tensor of samples, with
Heat's constructor. Heat's cross-rank shuffles of a distributed array (`dataset_shuffle`,
`dataset_ishuffle`) are not provided: give each rank its share (torch's
DistributedSampler) instead."""

from typing import Any, Optional

import torch


class Dataset(torch.utils.data.Dataset):
    """`array`: this rank's samples (a tensor, first dimension the sample), `targets` the
    matching labels or None; `test_set` marks a set that is never shuffled."""

    def __init__(self, array: Any, transforms: Any = None, ishuffle: bool = False, test_set: bool = False, targets: Optional[Any] = None) -> None:
        self.data = torch.as_tensor(array)
        self.targets = None if targets is None else torch.as_tensor(targets)
        if self.targets is not None and len(self.targets) != len(self.data):
            raise ValueError(f"Dataset: {len(self.targets)} targets for {len(self.data)} samples")
        self.transforms = transforms
        self.ishuffle = bool(ishuffle)
        self.test_set = bool(test_set)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Any:
        sample = self.data[index]
        if self.transforms is not None:
            sample = self.transforms(sample)
        return sample if self.targets is None else (sample, self.targets[index])
