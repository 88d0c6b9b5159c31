"""Training settings: plain dataclasses, checked on construction, importable without torch (the command
line builds its options and defaults from them)."""

from __future__ import annotations

from dataclasses import dataclass

WEIGHT_MODES = ("exit", "prefix", "reach", "none")  # ExitTrain's node weights (exit_loss.py)
BENCHMARKS = ("gsm8k", "math500", "humaneval", "mtbench")  # held-out sets (never trained on) of the drafter goals
LOSSES = ("ce", "kl", "ce+kl")  # the block loss (dflash_loss.py): sampled tokens, the target's distribution, both
# TrainConfig's exit-loss fields, in ExitConfig's order: (TrainConfig field, ExitConfig field)
EXIT_FIELDS = (("exit_weight", "weight"), ("lam", "lam"), ("budget", "budget"),
               ("exclude_horizon_leaves", "exclude_horizon_leaves"))


@dataclass(frozen=True)
class ExitConfig:
    weight: str = "exit"  # one of WEIGHT_MODES
    lam: float = 1.0  # λ in L_tok + λ·L_exit
    budget: int = 32  # nodes per DDTree, as at inference
    temperature: float = 1.0  # the target warp the exit law refers to
    exclude_horizon_leaves: bool = False

    def __post_init__(self):
        if self.weight not in WEIGHT_MODES:
            raise ValueError(f"exit weight must be one of {WEIGHT_MODES}, got {self.weight!r}")
        if self.lam < 0 or self.budget < 1:
            raise ValueError(f"need lam >= 0 and budget >= 1, got lam={self.lam}, budget={self.budget}")

    @property
    def active(self) -> bool:
        return self.weight != "none" and self.lam > 0



@dataclass
class TrainConfig:
    rollouts: str  # rollout folder (rollouts.py)
    run_dir: str
    target: str | None = None  # HF causal-LM folder; None: the default SmolLM2-135M-Instruct
    init: str | None = None  # start from this drafter checkpoint instead of a fresh one
    features: str | None = None  # read the target's features from this cache (features.py) instead of the target
    num_layers: int = 1  # fresh drafter only
    block_size: int = 16  # fresh drafter only
    target_layers: tuple[int, ...] | None = None  # fresh drafter only; None: the reference's default layers
    context_window: int | None = None  # fresh drafter only; blocks see the last W context rows (None: all)
    draft_vocab: int = 0  # > 0: logits over the Vd tokens most frequent in the responses (drafters/vocab.py)
    steps: int = 1000
    batch_size: int = 8  # sequences per process and step
    anchors: int = 32  # blocks per sequence
    max_len: int = 1024  # sequences are cut to this many tokens
    lr: float = 6e-4
    min_lr_ratio: float = 0.1  # cosine floor, as a fraction of lr
    warmup: int = 50  # linear warmup steps
    weight_decay: float = 0.0  # on matrices only
    grad_clip: float = 1.0
    gamma: float = 7.0  # loss decay over block positions
    loss: str = "ce"  # one of LOSSES; kl needs a feature cache with the target's top-k probabilities
    seed: int = 0
    dtype: str = "float32"  # the target's dtype; bfloat16 also runs the drafter under bf16 autocast
    save_every: int = 200
    log_every: int = 10
    keep: int = 2  # checkpoints kept
    eval_every: int = 0  # > 0: log the held-out greedy check (heldout.py) every so many steps
    eval_dir: str = "runs/heldout"  # the target's held-out responses, made once per dataset
    eval_datasets: tuple[str, ...] = BENCHMARKS
    eval_prompts: int = 20  # prompts per held-out dataset
    data_dir: str | None = None  # GSM8K / MATH-500 folder (None: $EXITSPEC_DATA, else shared/data)
    # rollouts: made by --rollouts-only, or (online > 0) by the target as training reaches them (online.py)
    online: int = 0  # > 0: online training, the target answering chunks of this many fresh prompts
    online_temperatures: tuple[float, ...] = (0.0, 1.0)  # chunk k is answered at temperatures[k mod n]
    gsm8k: int = 2000  # training prompts from each source (-1: all), interleaved (online.training_prompts)
    sharegpt: int = 2000
    code: int = 0
    skip_prompts: int = 0
    max_prompt_tokens: int = 512
    max_new_tokens: int = 256
    loop_repeats: int = 3  # stop a response at the R-th back-to-back copy of a span (rollouts.py; 0: off)
    gen_batch_size: int = 64  # responses in flight at once
    exit_weight: str = "none"  # exit loss (exit_loss.py): exit | prefix | reach | none (plain DFlash)
    lam: float = 0.0  # λ in L_tok + λ·L_exit
    budget: int = 32  # DDTree budget of the exit loss's trees
    exclude_horizon_leaves: bool = False

    def __post_init__(self):
        small = [
            k for k in ("steps", "batch_size", "anchors", "save_every", "log_every", "keep") if getattr(self, k) < 1
        ]
        if small:
            raise ValueError(f"{', '.join(small)} must be >= 1")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.online and (self.features or self.loss != "ce"):
            raise ValueError("--online makes its rollouts as it trains: it reads no --features cache, so it trains "
                             "with --loss ce")
        if self.online and (not self.online_temperatures or min(self.online_temperatures) < 0):
            raise ValueError(f"--online-temperatures must be >= 0, got {self.online_temperatures}")
        if self.loss != "ce" and not self.features:
            raise ValueError(f"--loss {self.loss} needs --features DIR, a cache made with --topk K > 0")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        self.exit_config()  # validates the exit-loss fields

    def exit_config(self) -> ExitConfig:
        return ExitConfig(**{exit: getattr(self, mine) for mine, exit in EXIT_FIELDS})
