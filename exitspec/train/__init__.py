"""Drafter training.

config       TrainConfig and ExitConfig: the settings, plain dataclasses (no torch), checked on construction
generate     batched generation of rollouts: continuous batching over a static KV cache
rollouts     the target's own responses, cached as resumable JSONL shards
online       online training data: the frozen target answers fresh prompts as training reaches them
features     the frozen target's hidden states of every rollout, cached once as safetensors shards
dflash_loss  the DFlash objective: anchors, masked blocks, position-decayed cross-entropy
tree_eval    the drafter's inference-time trees at training anchors, scored exactly by one target forward
exit_loss    ExitTrain: the exit-weighted (or prefix-weighted) likelihood of those trees' nodes
checkpoint   pickle-free checkpoints: safetensors tensors, JSON scalars and RNG states
dist         torch.distributed set-up (nccl on GPUs, gloo on CPUs)
trainer      the training loop (AdamW, warmup + cosine, DDP, exact resume), split along its stages
heldout      held-out responses, and the cheap greedy check that training logs as it goes
acceptance   held-out E[τ] = 1 + C_p of a drafter's trees, exact and without decoding
eval_report  `train eval`'s paired comparisons of several drafters on the same anchors
curve        `train curve`: the held-out curve of training runs, from their logs
cli          what `exitspec train dflash | exit | lookup | eval | curve` run (their options are in exitspec/cli.py)
"""
