"""The command line: `exitspec check` and `exitspec generate` (JSON and streamed), and its error messages."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exitspec.cli import main
from exitspec.settings import native_bf16


def test_check_prints_a_passing_table(capsys):
    assert main(["check", "--draws", "3000", "--trees", "1"]) == 0
    out = capsys.readouterr().out
    for word in ("predraw", "sequential", "tev", "greedy", "G-test p", "1 + C_p"):
        assert word in out
    assert "✗" not in out


def test_a_bad_argument_gets_a_clear_error(capsys):
    assert main(["generate", "hi", "--model", "/no/such/folder"]) == 2
    assert "/no/such/folder" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_json_and_stream_on_the_default_model(capsys):
    assert main(["generate", "Count from one to five.", "--max-new-tokens", "12", "--json", "--compare"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 12 and out["text"] and out["identical_to_autoregressive"]
    assert out["stats"]["tau"] >= 1 and out["speedup"] > 0 and out["settings"]["verifier"] == "tev"
    forward = out["stats"]["forward"]  # the baseline ran exactly as the speculative rounds did
    assert forward == out["autoregressive"]["forward"]
    assert forward["backend"] == ("LeanLlama" if native_bf16() else "QuantLlama")  # the default precision's forward
    assert main(["generate", "Count from one to five.", "--max-new-tokens", "12", "--budget", "-1"]) == 2
    assert "budget must be >= 0" in capsys.readouterr().err
    assert main(["generate", "Count from one to five.", "--max-new-tokens", "12", "--temperature", "0.8"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "τ" in captured.err


# -- bad input: refused while parsing, in one line, before anything heavy loads ------------------------------

BAD_OPTIONS = [
    (["generate", ""], "the prompt is empty"),
    (["generate", "hi", "--budget", "100000"], "over the limit of 4096"),
    (["generate", "hi", "--budget", "auto:x"], "budget must be a number"),
    (["generate", "hi", "--device", "foo"], "unknown device 'foo'"),
    (["generate", "hi", "--top-p", "0"], "expected a number in (0, 1]"),
    (["generate", "hi", "--temperature", "nan"], "out of range"),
    (["generate", "hi", "--max-new-tokens", "0"], "out of range"),
    (["check", "--draws", "-5"], "out of range"),
    (["check", "--draws", "0"], "out of range"),
    (["check", "--trees", "0"], "out of range"),
    (["bench", "--num-prompts", "0"], "out of range"),
    (["inspect", "x", "--rounds", "0"], "out of range"),
    (["train", "dflash", "--lr", "-1"], "out of range"),
    (["train", "exit", "--weight", "bogus"], "invalid choice"),
    (["latency", "--budgets", "0"], "out of range"),
]


@pytest.fixture
def no_loading(monkeypatch):
    """Any attempt to load a model fails the test: bad options must be refused before that."""
    import exitspec.app

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded for a command with a bad option")

    monkeypatch.setattr(exitspec.app, "load_decoders", refuse)
    monkeypatch.setattr(exitspec.app, "load_model_and_tokenizer", refuse)


@pytest.mark.parametrize(("argv", "message"), BAD_OPTIONS)
def test_bad_options_get_one_line_and_exit_code_2(argv, message, capsys, no_loading):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_the_parser_imports_no_torch():
    """Parsing (and refusing) options is instant: the command line's modules import neither torch nor transformers."""
    import subprocess
    import sys

    code = ("import sys; from exitspec.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_verifier_names_match_the_deciders():
    from exitspec.settings import VERIFIERS
    from exitspec.verify import DECIDERS

    assert sorted(VERIFIERS) == sorted(DECIDERS)


def test_unavailable_devices_and_debug(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["generate", "hi", "--device", "cuda", "--model", "/no/such/folder"]) == 2
    assert "asked for CUDA, but none is available" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError):  # --debug: the traceback instead of the one line
        main(["generate", "hi", "--model", "/no/such/folder", "--debug"])


def test_budgets_are_checked_against_context_and_memory(tmp_path):
    from transformers import LlamaConfig

    from exitspec.app import check_budgets

    LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=512).save_pretrained(tmp_path)
    check_budgets([32, "auto:64"], tmp_path, "cpu")
    with pytest.raises(ValueError, match="does not fit the context of 512 tokens"):
        check_budgets([600], tmp_path, "cpu")
    LlamaConfig(vocab_size=4_000_000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=8192).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GiB per tree forward"):
        check_budgets([4000], tmp_path, "cpu")  # 4001 rows of 4M-word logits: 64 GB and more


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["generate", "check", "inspect", "bench", "latency", "train dflash", "train eval"]),
       st.lists(st.sampled_from(["--budget", "--budgets", "--top-p", "--top-k", "--temperature", "--seed",
                                 "--draws", "--rounds", "--num-prompts", "--device", "--threads", "--steps",
                                 "--lr", "--max-new-tokens", "--repeats", "--dtype", "--bogus"]),
                min_size=1, max_size=3),
       st.lists(st.one_of(st.text(max_size=6), st.integers(-10**9, 10**9).map(str),
                          st.sampled_from(["nan", "inf", "-inf", "-1", "0", "1e9", "auto:-3", "cuda:x"])),
                min_size=1, max_size=3))
def test_random_options_never_give_a_traceback(command, flags, values):
    """Random option values: refused with exit code 2 and one line, or accepted by the parser; never a traceback."""
    import contextlib
    import io

    argv = command.split() + (["hi"] if command in ("generate", "inspect") else [])
    for flag, value in zip(flags, values * len(flags)):
        argv += [flag, value]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        from exitspec.cli import build_parser

        try:
            build_parser().parse_args(argv)
            return  # a valid command line: nothing to refuse
        except SystemExit as done:
            code = done.code
    assert code == 2 and err.getvalue().count("\n") == 1 and "Traceback" not in err.getvalue()


def test_each_command_keeps_its_own_defaults():
    """argparse shares a parent group's option objects: one command's default must not leak into another's."""
    from exitspec.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["generate", "x"]).temperature == 0.0
    assert parser.parse_args(["inspect", "x"]).temperature == 1.0
    assert parser.parse_args(["generate", "x"]).temperature == 0.0


def test_config_files_give_options_and_the_command_line_wins(tmp_path, capsys):
    """--config FILE (TOML) expands where it stands: later options win; a bad file is one line and exit 2."""
    from exitspec.cli import build_parser
    from exitspec.options import expand_config

    recipe = tmp_path / "recipe.toml"
    recipe.write_text('steps = 7\ntarget_layers = "2,15,27"\neval-datasets = ["gsm8k", "math500"]\n'
                      "no-progress = true\nlr = 0.001\nfeatures-only = false\n")
    argv = expand_config(["train", "dflash", "--config", str(recipe), "--steps", "9"])
    args = build_parser().parse_args(argv)
    assert (args.steps, args.target_layers, args.eval_datasets) == (9, (2, 15, 27), ["gsm8k", "math500"])
    assert args.no_progress and args.lr == 0.001 and not args.features_only
    assert build_parser().parse_args(expand_config(["train", "dflash", f"--config={recipe}"])).steps == 7
    (tmp_path / "bad.toml").write_text("x = {a = 1}\n")
    (tmp_path / "broken.toml").write_text("x = \n")
    for argv, message in [
        (["--config", str(tmp_path / "nope.toml")], "No such file or directory"),
        (["--config", str(tmp_path / "bad.toml")], "x must be a number, a string, true/false or a list"),
        (["--config", str(tmp_path / "broken.toml")], "is not TOML"),
        (["--config"], "--config needs a file"),
        (["--config", str(recipe), "--steps", "0"], "--steps"),
    ]:
        assert main(["train", "dflash", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


def test_calibrate_measures_again_and_prints_the_grid(tmp_path, monkeypatch, capsys):
    from tiny_models import save_tiny_llama

    monkeypatch.setenv("EXITSPEC_CACHE", str(tmp_path / "cache"))
    save_tiny_llama(tmp_path / "model")
    assert main(["calibrate", "--model", str(tmp_path / "model"), "--budget", "auto:8", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "one step:" in out and "other processes used" in out and "row plan" in out
    assert out.splitlines()[1].split()[1:] == [str(n) for n in range(9)]  # N = 0..8 measured


def test_compare_alternates_its_runs_and_divides_tokens_per_second(tmp_path, monkeypatch, capsys):
    """--compare at T = 1: after one warm-up of each loop the runs alternate S A S A S A, and each pair's speedup is
    the ratio of the two runs' tokens per second, not of their seconds, since the answers differ in length (here
    the autoregressive ones are cut to a third, so that they surely do)."""
    import dataclasses

    from tiny_models import save_tiny_llama, save_word_tokenizer

    from exitspec.decode import SpeculativeDecoder

    monkeypatch.setenv("EXITSPEC_CACHE", str(tmp_path / "cache"))
    save_tiny_llama(tmp_path / "model")
    save_word_tokenizer(tmp_path / "model")
    order, speculative, autoregressive = [], SpeculativeDecoder.generate, SpeculativeDecoder.autoregressive

    def logged_speculative(self, *args, **kwargs):
        order.append("S")
        return speculative(self, *args, **kwargs)

    def shorter_autoregressive(self, *args, **kwargs):
        order.append("A")
        result = autoregressive(self, *args, **kwargs)
        return dataclasses.replace(result, tokens=result.tokens[: len(result.tokens) // 3 + 1])

    monkeypatch.setattr(SpeculativeDecoder, "generate", logged_speculative)
    monkeypatch.setattr(SpeculativeDecoder, "autoregressive", shorter_autoregressive)
    assert main(["generate", "w3 w4 w5", "--model", str(tmp_path / "model"), "--device", "cpu", "--budget", "6",
                 "--temperature", "1", "--max-new-tokens", "24", "--compare", "--repeats", "3", "--json",
                 "--no-warm-start"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert order == ["S", "A"] + ["S", "A"] * 3
    rates = out["tokens_per_second"]
    assert out["speedups"] == pytest.approx([s / a for s, a in zip(rates["speculative"], rates["autoregressive"])])
    assert out["speedup"] == pytest.approx(sorted(out["speedups"])[1])  # the median of three
    last = out["autoregressive"]
    assert last["new_tokens"] < out["stats"]["new_tokens"]
    assert last["tokens_per_second"] == pytest.approx(rates["autoregressive"][-1])
    assert "memory" in out  # what the suffix memory held: None for a drafter without one
