"""Scaling out: training on N processes (torch.distributed, FSDP2, launched by torchrun) and rollout
workers on Ray. Single-process runs never import torch.distributed's process group or Ray."""
