"""Prints torch's random_split lengths for fractions, the reference of
dataloader_test.cc's RandomSplitByFractionsTakesTorchsLengths (torch 1.13)."""
import warnings

import torch
from torch.utils.data import random_split

warnings.simplefilter("ignore")  # torch warns about a part of 0 examples
CASES = [(10, [0.5, 0.5]), (10, [0.33, 0.33, 0.34]), (7, [0.1, 0.1, 0.8]),
         (3, [0.1, 0.1, 0.8]), (10, [1 / 3, 1 / 3, 1 / 3]), (5, [0.0, 1.0]),
         (10, [0.3, 0.3, 0.3, 0.1]), (10, [0.7, 0.2, 0.1]), (1, [0.5, 0.5]),
         (0, [0.5, 0.5])]
for size, fractions in CASES:
    parts = random_split(range(size), fractions, generator=torch.Generator().manual_seed(0))
    print(size, fractions, [len(p) for p in parts])
