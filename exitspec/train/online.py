"""Online training data: the frozen target answers fresh prompts while the drafter trains (ExitTrain's
setting), instead of a fixed rollout folder replayed every epoch.

The prompt list (`training_prompts`: GSM8K train, ShareGPT first turns, code prompts, interleaved) is cut into
chunks of C prompts. Chunk k is answered by the target in one continuous batch (generate.py) at temperature
temperatures[k mod n], so greedy and sampled chunks alternate, and stored as a rollout folder
run_dir/online/chunk-k/ (rollouts.py). Its sequences then feed S = C / step_size training steps in a seeded,
length-bucketed order (RolloutData), after which chunk k + 1 is made. When the prompts run out the list
starts over, each prompt sampled with a new seed per pass.

Everything is a function of the data position (the sequences the run has consumed): chunk k's prompts,
its sampling seed (generate.py: per prompt id) and its order. A resumed run therefore sees exactly the data
an uninterrupted one does, and a chunk a killed run left unfinished is made again, identically. Under torchrun
rank r answers the chunk's prompts r, r + world, ... in its own folder and every rank reads them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from itertools import islice
from pathlib import Path

from torch import Tensor

from exitspec.data import gsm8k_train, interleave, python_functions, sharegpt
from exitspec.decode import encode_prompt
from exitspec.train import dist
from exitspec.train.rollouts import GenerationSettings, RolloutData, load_rollouts, make_rollouts, stop_and_pad


def training_prompts(
    tokenizer, gsm8k: int, sharegpt_turns: int, code: int, skip: int = 0, max_tokens: int = 512, data_dir=None
) -> list[tuple[str, list[int]]]:
    """(id, chat-template ids) of the training prompts: the first `gsm8k` GSM8K train questions, `sharegpt_turns`
    ShareGPT first turns and `code` code-writing prompts (-1: all of a source) of at most `max_tokens` tokens,
    interleaved source by source, then the first `skip` dropped. Never a benchmark set."""
    sources = []
    kinds = ((gsm8k, lambda: gsm8k_train(data_dir)), (sharegpt_turns, sharegpt), (code, python_functions))
    for limit, prompts in kinds:
        if limit:
            fitting = ((p.id, ids) for p in prompts() if len(ids := encode_prompt(tokenizer, p.text)) <= max_tokens)
            sources.append(list(fitting if limit < 0 else islice(fitting, limit)))
    prompts = interleave(*sources)[skip:]
    if not prompts:
        raise ValueError("no training prompts: give --gsm8k, --sharegpt or --code a count, and a smaller "
                         "--skip-prompts")
    return prompts


class OnlineData:
    """RolloutData's interface over rollouts the target makes as training reaches them (module docstring).

    Position g (a count of sequences, over all processes) falls in chunk g // (S · step_size); len() is the
    number of prompts, so the log's epoch counts passes over the prompt list."""

    def __init__(
        self, target, tokenizer, prompts: list[tuple[str, list[int]]], folder: str | Path, settings: GenerationSettings,
        temperatures: Sequence[float], chunk: int, max_len: int, seed: int, gen_batch_size: int,
        d: dist.Dist, batch_size: int, progress: bool = True,
    ):
        step_size = d.world * batch_size
        if chunk < step_size:
            raise ValueError(f"an online chunk of {chunk} prompts is smaller than one step's {step_size} sequences")
        self.target, self.prompts, self.folder, self.settings = target, prompts, Path(folder), settings
        self.temperatures, self.chunk, self.max_len, self.seed = tuple(temperatures), chunk, max_len, seed
        self.step_size, self.gen_batch_size, self.d, self.progress = step_size, gen_batch_size, d, progress
        self.positions = chunk // step_size * step_size  # stream positions per chunk, whole steps only
        self.stop_and_pad = stop_and_pad(target, tokenizer)
        self._current: tuple[int, RolloutData] | None = None  # (chunk index, its RolloutData)

    def __len__(self) -> int:
        return len(self.prompts)

    def prompt(self, g: int) -> tuple[str, list[int]]:
        """The g-th prompt of the stream: the list, over and over; from the second pass on its id gets "@pass",
        which gives it a sampling seed of its own (generate.py seeds each prompt by its id)."""
        passes, i = divmod(g, len(self.prompts))
        pid, ids = self.prompts[i]
        return (f"{pid}@{passes}" if passes else pid), ids

    def chunk_data(self, k: int) -> RolloutData:
        """Chunk k's RolloutData, made (generated and stored) first if need be."""
        if self._current is None or self._current[0] != k:
            folder = self.folder / f"chunk-{k:05d}"
            ids = [self.prompt(g) for g in range(k * self.chunk, (k + 1) * self.chunk)]
            settings = replace(self.settings, temperature=self.temperatures[k % len(self.temperatures)])
            d = self.d
            make_rollouts(self.target, ids[d.rank :: d.world], folder / f"rank-{d.rank}", settings,
                          *self.stop_and_pad, self.gen_batch_size, shard_size=self.chunk, progress=self.progress)
            dist.barrier()
            data = RolloutData(load_rollouts(folder), self.max_len, self.seed * 100_003 + k, self.step_size)
            self._current = (k, data)
        return self._current[1]

    def _locate(self, position: int) -> tuple[RolloutData, int]:
        k, offset = divmod(position, self.positions)
        return self.chunk_data(k), offset

    @property
    def seqs(self) -> list[tuple[list[int], int]]:
        """The sequences of the first chunk (what the draft vocabulary of a fresh drafter is counted on)."""
        return self.chunk_data(0).seqs

    def keys_at(self, position: int, rank: int, batch_size: int) -> list[str]:
        data, offset = self._locate(position)
        return data.keys_at(offset, rank, batch_size)

    def batch(self, position: int, rank: int, batch_size: int) -> tuple[Tensor, Tensor, Tensor]:
        data, offset = self._locate(position)
        return data.batch(offset, rank, batch_size)
