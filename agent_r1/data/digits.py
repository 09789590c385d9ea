"""Pictures of handwritten numbers from scikit-learn's `load_digits` (1,797 8x8 digits, shipped with the
package, no download): the vision demo's data, shared by its task and by the build of its model.

Every digit image belongs to one split (train, val, test) by a stable hash of its index
(`agent_r1.data.splits`), so pictures drawn for one split never show handwriting of another.
"""

from __future__ import annotations

import functools

import numpy as np

from agent_r1.data.splits import Split, split_of

DIGIT_TOKENS = "0123456789"


@functools.cache
def digit_images() -> tuple[np.ndarray, np.ndarray, dict[str, list[list[int]]]]:
    """Images [1797, 8, 8] in 0..16, labels [1797], and per split the image indices of each digit 0-9."""
    from sklearn.datasets import load_digits

    data = load_digits()
    pools: dict[str, list[list[int]]] = {s: [[] for _ in range(10)] for s in ("train", "val", "test")}
    for i, label in enumerate(data.target):
        pools[split_of(f"digits/{i}")][int(label)].append(i)
    return data.images, data.target, pools


def draw(rng, digits: list[int], split: Split) -> list[int]:
    """Image indices of `split` showing `digits`, one drawn at random per digit."""
    pools = digit_images()[2][split]
    return [rng.choice(pools[d]) for d in digits]


def picture(index: list[int]) -> np.ndarray:
    """Four digit images as a 16x16 uint8 picture, two per row, dark on light: one per 8x8 patch."""
    images = digit_images()[0][index]  # [4, 8, 8]
    grid = np.block([[images[0], images[1]], [images[2], images[3]]])  # [16, 16]
    return (255 - grid * (255 / 16)).round().astype(np.uint8)


def overview(full: np.ndarray) -> np.ndarray:
    """The picture with every 4x4 block replaced by its mean: each digit becomes 2x2 blocks."""
    blocks = full.reshape(4, 4, 4, 4).astype(np.float64).mean(axis=(1, 3))  # [4, 4]
    return np.kron(blocks, np.ones((4, 4))).round().astype(np.uint8)
