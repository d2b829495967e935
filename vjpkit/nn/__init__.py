"""vjpkit.nn: layers as pure ``(init, apply)`` pairs whose calls are hookable by name."""

from ._attention import multi_head_attention as multi_head_attention
from ._combinators import residual as residual
from ._combinators import serial as serial
from ._elementwise import avg_pool as avg_pool
from ._elementwise import dropout as dropout
from ._elementwise import flatten as flatten
from ._elementwise import gelu as gelu
from ._elementwise import max_pool as max_pool
from ._elementwise import relu as relu
from ._elementwise import sigmoid as sigmoid
from ._elementwise import tanh as tanh
from ._layer import Layer as Layer
from ._layer import layer as layer
from ._linear import conv1d as conv1d
from ._linear import conv2d as conv2d
from ._linear import dense as dense
from ._linear import embedding as embedding
from ._linear import layer_norm as layer_norm
from ._norm import batch_norm as batch_norm
from ._norm import rms_norm as rms_norm
from ._recurrent import gru as gru
from ._recurrent import rnn as rnn

__all__ = [
    "Layer",
    "avg_pool",
    "batch_norm",
    "conv1d",
    "conv2d",
    "dense",
    "dropout",
    "embedding",
    "flatten",
    "gelu",
    "gru",
    "layer",
    "layer_norm",
    "max_pool",
    "multi_head_attention",
    "relu",
    "residual",
    "rms_norm",
    "rnn",
    "serial",
    "sigmoid",
    "tanh",
]
