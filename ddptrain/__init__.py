"""ddptrain: Hydra-configured LoRA fine-tuning on PyTorch DistributedDataParallel."""

__version__ = "0.1.0"
