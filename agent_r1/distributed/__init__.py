"""Scaling out: training on N processes (torch.distributed, FSDP2, launched by torchrun) and rollout
workers on Ray (docs/distributed.md). A single-process run starts neither a process group nor Ray."""
