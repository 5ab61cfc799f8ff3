"""ResNet-50 on scikit-learn's digits, upsampled to 32x32 RGB.

The model is torchvision's ResNet-50 (He et al. 2016, arXiv 1512.03385; torchvision's
``resnet50`` with bottleneck stride on the 3x3 convolution, "ResNet v1.5"). When
torchvision imports cleanly it is used; otherwise this module builds the same network
itself, with the same module names, parameter order, shapes and initialisation, so a
capture's layer table reads the same either way. The own copy exists because PyPI's
torchvision wheels are built against PyPI's CUDA torch and fail to import beside the
CPU build of torch that gradstat pins ("operator torchvision::nms does not exist"),
and the matching CUDA torchvision would pull in gigabytes of CUDA libraries.

Sizes scale the base width (64 at ``large``, the real ResNet-50: 23,528,522 parameters
with 10 classes); ``tiny`` also has one bottleneck block per stage instead of [3, 4, 6, 3].
"""

from __future__ import annotations

import torch
from torch import nn

from gradstat.capture.workloads import Workload
from gradstat.capture.workloads.digits import load_digits_tensors, sharded_batches

CLASSES = 10
IMAGE_SIZE = 32
RESNET50_BLOCKS = (3, 4, 6, 3)
# size -> (base width, bottleneck blocks per stage)
SHAPES = {
    "tiny": (8, (1, 1, 1, 1)),
    "small": (16, RESNET50_BLOCKS),
    "medium": (32, RESNET50_BLOCKS),
    "large": (64, RESNET50_BLOCKS),
}


def _conv3x3(inputs: int, outputs: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False)


def _conv1x1(inputs: int, outputs: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand by 4, plus the shortcut."""

    expansion = 4

    def __init__(
        self, inputs: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.conv1 = _conv1x1(inputs, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision's ``ResNet`` with bottleneck blocks (groups 1, no dilation)."""

    def __init__(self, blocks: tuple[int, ...], num_classes: int, width: int = 64) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(width, blocks[0])
        self.layer2 = self._make_layer(width * 2, blocks[1], stride=2)
        self.layer3 = self._make_layer(width * 4, blocks[2], stride=2)
        self.layer4 = self._make_layer(width * 8, blocks[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * Bottleneck.expansion, num_classes)
        for module in self.modules():  # torchvision's initialisation
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.constant_(module.weight, 1)
                nn.init.constant_(module.bias, 0)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                _conv1x1(self.inplanes, planes * Bottleneck.expansion, stride),
                nn.BatchNorm2d(planes * Bottleneck.expansion),
            )
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def torchvision_resnet50() -> nn.Module | None:
    """torchvision's own ``resnet50(num_classes=10)``, or None where it does not import."""
    try:
        from torchvision.models import resnet50
    except Exception:  # ImportError, or torchvision's RuntimeError beside a foreign torch
        return None
    return resnet50(num_classes=CLASSES)


def model(size: str) -> nn.Module:
    width, blocks = SHAPES[size]
    if size == "large" and (reference := torchvision_resnet50()) is not None:
        return reference
    return ResNet(blocks, CLASSES, width)


def digits_rgb(image_size: int = IMAGE_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """The digits upsampled (bilinear) to ``image_size`` pixels, 3 equal channels,
    normalised to mean 0 and standard deviation 1."""
    images, labels = load_digits_tensors()
    images = nn.functional.interpolate(
        images, size=(image_size, image_size), mode="bilinear", align_corners=False
    )
    images = ((images - images.mean()) / images.std()).expand(-1, 3, -1, -1).contiguous()
    return images, labels


def build(size: str) -> Workload:
    images, labels = digits_rgb()
    width, blocks = SHAPES[size]
    shape = "ResNet-50" if size == "large" else f"ResNet, width {width}, blocks {list(blocks)},"
    return Workload(
        name="resnet50",
        size=size,
        description=f"{shape} on scikit-learn's digits upsampled to 32x32 RGB",
        model=model(size),
        batches=sharded_batches(images, labels),
        loss=nn.functional.cross_entropy,
    )
