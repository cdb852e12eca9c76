"""Training: the torchrun entry (main), the loop, parallelize (FSDP2/DDP, AC, compile), checkpoints, torchx launch."""
