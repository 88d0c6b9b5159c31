"""Drafter training.

prompts      training prompts: GSM8K train, ShareGPT first turns (never the evaluation sets)
rollouts     the target's own responses, cached as resumable JSONL shards
dflash_loss  the DFlash objective: anchors, masked blocks, position-decayed cross-entropy
checkpoint   pickle-free checkpoints: safetensors tensors, JSON scalars and RNG states
dist         torch.distributed set-up (nccl on GPUs, gloo on CPUs)
trainer      the training loop (AdamW, warmup + cosine, DDP, exact resume)
cli          `exitspec train dflash` (main_dflash), also `python -m exitspec.train.dflash`
"""
