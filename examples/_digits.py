"""Shared by the digits examples: scikit-learn's 8x8 digits as NHWC arrays, and their small CNN.

Not an example itself: ``grad_moderation.py``, ``train_digits.py`` and ``plot_gradients.py``
import it (a script's own folder is on ``sys.path``).
"""

from __future__ import annotations

import numpy as np

try:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
except ImportError as err:  # the README's first command installs vjpkit alone
    raise ImportError(
        'this example needs scikit-learn, in the examples extra: pip install -e ".[examples]"'
    ) from err

from vjpkit import nn


def cnn(**head) -> nn.Layer:
    """Two 3x3 convs (8 and 16 channels) with ReLUs, a 2x2 average pool and a flatten, then ``head``.

    Examples:
        >>> model = cnn(fc=nn.dense(10))
    """
    return nn.serial(
        conv1=nn.conv2d(8, 3),
        relu1=nn.relu(),
        conv2=nn.conv2d(16, 3),
        relu2=nn.relu(),
        pool=nn.avg_pool(2),
        flat=nn.flatten(),
        **head,
    )


def load_images() -> tuple[np.ndarray, np.ndarray]:
    """All digits as NHWC float32 images in [0, 1] (1797, 8, 8, 1) and int32 labels."""
    digits = load_digits()
    return (digits.images / 16.0).astype(np.float32)[..., None], digits.target.astype(np.int32)


def load_data(seed: int = 0):
    """``load_images()`` split 75/25, stratified: ``(x_train, y_train), (x_test, y_test)``."""
    x, y = load_images()
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    return (x_train, y_train), (x_test, y_test)
