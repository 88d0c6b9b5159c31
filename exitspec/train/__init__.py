"""Drafter training.

config       TrainConfig and ExitConfig: the settings, plain dataclasses (no torch), checked on construction
rollouts     the target's own responses, cached as resumable JSONL shards
features     the frozen target's hidden states of every rollout, cached once as safetensors shards
dflash_loss  the DFlash objective: anchors, masked blocks, position-decayed cross-entropy
tree_eval    the drafter's inference-time trees at training anchors, scored exactly by one target forward
exit_loss    ExitTrain: the exit-weighted (or prefix-weighted) likelihood of those trees' nodes
checkpoint   pickle-free checkpoints: safetensors tensors, JSON scalars and RNG states
dist         torch.distributed set-up (nccl on GPUs, gloo on CPUs)
trainer      the training loop (AdamW, warmup + cosine, DDP, exact resume)
acceptance   held-out E[τ] = 1 + C_p of a drafter's trees, exact and without decoding
cli          what `exitspec train dflash | exit | eval` run (their options are in exitspec/cli.py)
"""
