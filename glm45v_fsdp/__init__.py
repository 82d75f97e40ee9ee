"""glm45v-fsdp: a training backend for GLM-4.5V on PyTorch FSDP2."""

__version__ = "0.1.0"
