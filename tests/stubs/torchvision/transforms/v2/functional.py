from torchvision._unavailable import unavailable

__getattr__ = unavailable("transforms.v2.functional")
