"""Reference vision models with torchvision's module layout and state_dict names.

    import flowgen as flow
    model = flow.models.mobilenet_v2(num_classes=10)
    model = flow.models.resnet18(num_classes=10)

The structures follow the published architectures (MobileNetV2, Sandler et al.
2018; ResNet, He et al. 2015) so a torchvision/flowvision checkpoint converted to
a dict of arrays loads with `load_state_dict`. Class names follow OneFlow's
flowvision (`ConvBNActivation`, `InvertedResidual`, `BasicBlock`), which is what
`print(graph)` shows.
"""
from flowgen.models.mobilenet_v2 import ConvBNActivation, ConvBNReLU, InvertedResidual, MobileNetV2, mobilenet_v2
from flowgen.models.resnet import BasicBlock, Bottleneck, ResNet, resnet18, resnet34, resnet50

__all__ = ["ConvBNActivation", "ConvBNReLU", "InvertedResidual", "MobileNetV2", "mobilenet_v2",
           "BasicBlock", "Bottleneck", "ResNet", "resnet18", "resnet34", "resnet50"]
