"""Neural-network layers (``from needle import nn``)."""

from .nn_basic import (
                       GELU,
                       BatchNorm1d,
                       BatchNorm2d,
                       Dropout,
                       Flatten,
                       Identity,
                       LayerNorm1d,
                       Linear,
                       Module,
                       Parameter,
                       ReLU,
                       Residual,
                       RMSNorm,
                       Sequential,
                       Sigmoid,
                       SiLU,
                       SoftmaxLoss,
                       Tanh,
)
from .nn_conv import Conv, Conv2d
from .nn_loss import CrossEntropyLoss, MSELoss
from .nn_sequence import LSTM, RNN, Embedding, LSTMCell, RNNCell
from .nn_transformer import MultiHeadAttention, Transformer, TransformerLayer

__all__ = [
    "GELU", "LSTM", "RNN", "BatchNorm1d", "BatchNorm2d", "Conv", "Conv2d", "CrossEntropyLoss",
    "Dropout", "Embedding", "MSELoss",
    "Flatten", "Identity", "LSTMCell", "LayerNorm1d", "Linear", "Module", "MultiHeadAttention",
    "Parameter", "RMSNorm", "RNNCell", "ReLU", "Residual", "Sequential", "SiLU", "Sigmoid",
    "SoftmaxLoss", "Tanh", "Transformer", "TransformerLayer",
]
