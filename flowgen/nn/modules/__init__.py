"""Layers and losses, one file per family."""
from flowgen.nn.modules.activation import (CELU, ELU, GELU, GLU, SELU, Hardshrink, Hardsigmoid, Hardswish, Hardtanh,
                                           LeakyReLU, LogSigmoid, LogSoftmax, Mish, PReLU, ReLU, ReLU6, Sigmoid, SiLU,
                                           Softmax, Softmax2d, Softmin, Softplus, Softshrink, Softsign, Tanh,
                                           Tanhshrink, Threshold)
from flowgen.nn.modules.conv import Conv1d, Conv2d, Conv3d, ConvTranspose1d, ConvTranspose2d
from flowgen.nn.modules.dropout import Dropout
from flowgen.nn.modules.flatten import Flatten, Fold, Unflatten, Unfold
from flowgen.nn.modules.linear import Linear
from flowgen.nn.modules.loss import (BCELoss, BCEWithLogitsLoss, CosineEmbeddingLoss, CrossEntropyLoss, HuberLoss,
                                     KLDivLoss, L1Loss, MarginRankingLoss, MSELoss, NLLLoss, SmoothL1Loss,
                                     TripletMarginLoss)
from flowgen.nn.modules.normalization import (BatchNorm1d, BatchNorm2d, BatchNorm3d, GroupNorm, InstanceNorm1d,
                                              InstanceNorm2d, InstanceNorm3d, LayerNorm, RMSNorm, SyncBatchNorm)
from flowgen.nn.modules.padding import ConstantPad2d, ReflectionPad2d, ReplicationPad2d, ZeroPad2d
from flowgen.nn.modules.pixelshuffle import PixelShuffle, PixelUnshuffle
from flowgen.nn.modules.pooling import (AdaptiveAvgPool1d, AdaptiveAvgPool2d, AdaptiveMaxPool2d, AvgPool1d, AvgPool2d,
                                        MaxPool1d, MaxPool2d)
from flowgen.nn.modules.rnn import GRU, LSTM, RNN, GRUCell, LSTMCell, RNNBase, RNNCell
from flowgen.nn.modules.sparse import Embedding
from flowgen.nn.modules.transformer import (MultiheadAttention, Transformer, TransformerDecoder,
                                            TransformerDecoderLayer, TransformerEncoder, TransformerEncoderLayer)
from flowgen.nn.modules.upsampling import Upsample, UpsamplingBilinear2d, UpsamplingNearest2d

__all__ = [
    "ELU", "GELU", "Hardsigmoid", "Hardswish", "Hardtanh", "LeakyReLU", "LogSoftmax", "Mish", "ReLU", "ReLU6",
    "Sigmoid", "SiLU", "Softmax", "Softplus", "Tanh", "Conv2d", "Dropout", "Flatten",
    "Linear", "BCEWithLogitsLoss", "CrossEntropyLoss", "L1Loss", "MSELoss", "NLLLoss", "BatchNorm1d", "BatchNorm2d",
    "GroupNorm", "InstanceNorm2d", "LayerNorm", "AdaptiveAvgPool2d", "AvgPool2d", "MaxPool2d", "Embedding",
    "Upsample", "UpsamplingBilinear2d", "UpsamplingNearest2d", "Unflatten", "BCELoss", "CosineEmbeddingLoss",
    "HuberLoss", "KLDivLoss", "MarginRankingLoss", "SmoothL1Loss", "TripletMarginLoss", "PixelShuffle",
    "PixelUnshuffle", "GRU", "LSTM", "RNN", "GRUCell", "LSTMCell", "RNNBase", "RNNCell", "MultiheadAttention",
    "Transformer", "TransformerDecoder", "TransformerDecoderLayer", "TransformerEncoder", "TransformerEncoderLayer",
    "Conv1d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "BatchNorm3d", "InstanceNorm1d", "InstanceNorm3d",
    "AdaptiveAvgPool1d", "AvgPool1d", "MaxPool1d", "Fold", "Unfold", "SyncBatchNorm",
    "CELU", "GLU", "SELU", "Hardshrink", "LogSigmoid", "PReLU", "Softmax2d", "Softmin", "Softshrink", "Softsign",
    "Tanhshrink", "Threshold", "RMSNorm", "ConstantPad2d", "ReflectionPad2d", "ReplicationPad2d", "ZeroPad2d",
    "AdaptiveMaxPool2d",
]
