"""Bad input to `specd generate`: one clear line on stderr starting with "error:",
a non-zero exit code, never a traceback.

The cases the issue names run as real subprocesses (warnings or stray prints from
libraries would break the one-line contract too); they are launched at once by a
module fixture. Start-up costs a few CPU-seconds a process, so the remaining cases
call `specd.cli.main(argv)` in-process and check the same contract on captured output.
"""
from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = pytest.mark.timeout(300)

# case id -> (model key, extra args, substrings the message must contain (any of each tuple))
# model key: "llama" (tokenizer), "qwen2" (no tokenizer), "gpt2" (unsupported), "missing"
CASES: dict[str, tuple[str, list[str], list[tuple[str, ...]]]] = {
    "unknown_model_path": ("missing", ["--prompt-ids", "1,2,3"], [("no_such_model",)]),
    "unsupported_architecture": ("gpt2", ["--prompt-ids", "1,2,3"],
                                 [("GPT2LMHeadModel",), ("LlamaForCausalLM",), ("Qwen3ForCausalLM",)]),
    "prompt_longer_than_max_model_len": ("llama", ["--prompt-ids", ",".join(["5"] * 40), "--max-model-len", "32"],
                                         [("max_model_len", "max-model-len", "too long")]),
    "negative_temperature": ("llama", ["--prompt-ids", "1,2,3", "--temperature", "-1"], [("temperature",)]),
    "absurd_temperature": ("llama", ["--prompt-ids", "1,2,3", "--temperature", "1e9"], [("temperature",)]),
    "top_p_2": ("llama", ["--prompt-ids", "1,2,3", "--top-p", "2"], [("top_p", "top-p")]),
    "top_p_0": ("llama", ["--prompt-ids", "1,2,3", "--top-p", "0"], [("top_p", "top-p")]),
    "top_k_negative": ("llama", ["--prompt-ids", "1,2,3", "--top-k", "-5"], [("top_k", "top-k")]),
    "min_p_above_1": ("llama", ["--prompt-ids", "1,2,3", "--min-p", "1.5"], [("min_p", "min-p")]),
    "max_tokens_0": ("llama", ["--prompt-ids", "1,2,3", "--max-tokens", "0"], [("max_tokens", "max-tokens")]),
    "absurd_max_tokens": ("llama", ["--prompt-ids", "1,2,3", "--max-tokens", str(10**12)], [("max_tokens", "max-tokens")]),
    "negative_seed": ("llama", ["--prompt-ids", "1,2,3", "--seed", "-3"], [("seed",)]),
    "non_numeric_max_tokens": ("llama", ["--prompt-ids", "1,2,3", "--max-tokens", "lots"], [("max-tokens", "max_tokens")]),
    "bad_prompt_ids": ("llama", ["--prompt-ids", "1,x,3"], [("prompt-ids", "prompt_ids")]),
    "token_id_out_of_vocab": ("llama", ["--prompt-ids", "5,99999"], [("99999", "vocab")]),
    "negative_token_id": ("llama", ["--prompt-ids", "5,-4"], [("-4", "vocab", "token")]),
    "text_prompt_without_tokenizer": ("qwen2", ["--prompt", "hello"], [("tokenizer",)]),
    "missing_prompts_file": ("llama", ["--prompts-file", "{tmp}/nope.jsonl"], [("nope.jsonl",)]),
    "malformed_prompts_file": ("llama", ["--prompts-file", "{tmp}/bad.jsonl"], [("bad.jsonl",)]),
    "max_model_len_above_model_limit": ("llama", ["--prompt-ids", "1,2,3", "--max-model-len", "100000"],
                                        [("max_model_len", "max-model-len", "max_position")]),
    "zero_kv_blocks": ("llama", ["--prompt-ids", "1,2,3", "--num-kv-blocks", "0"], [("num_kv_blocks", "num-kv-blocks")]),
    "zero_block_size": ("llama", ["--prompt-ids", "1,2,3", "--block-size", "0"], [("block_size", "block-size")]),
    "kv_too_small_for_one_sequence": ("llama", ["--prompt-ids", "1,2,3", "--num-kv-blocks", "1",
                                                "--max-model-len", "128"], [("block", "kv", "KV")]),
    "bad_dtype": ("llama", ["--prompt-ids", "1,2,3", "--dtype", "float8"], [("dtype",)]),
}


# the cases named by the issue, run as real processes; the rest run in-process
SUBPROCESS_CASES = ["unknown_model_path", "unsupported_architecture", "prompt_longer_than_max_model_len",
                    "negative_temperature", "top_p_2", "token_id_out_of_vocab"]


def _argv(case, models, tmp):
    model, args, _ = CASES[case]
    argv = ["generate", "--model", models[model], "--max-tokens", "4", "--threads", "1"]
    return argv + [a.replace("{tmp}", str(tmp)) for a in args]


@pytest.fixture(scope="module")
def case_env(model_dirs, unsupported_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli_errors")
    (tmp / "bad.jsonl").write_text('{"prompt_token_ids": [1, 2]}\n{not json\n')
    models = dict(model_dirs, gpt2=unsupported_model_dir, missing=str(tmp / "no_such_model"))
    return models, tmp


@pytest.fixture(scope="module")
def results(case_env, specd_cli, cli_env):
    models, tmp = case_env
    procs = {name: subprocess.Popen(specd_cli + _argv(name, models, tmp), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=cli_env)
             for name in SUBPROCESS_CASES}
    out = {}
    for name, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        out[name] = (p.returncode, stdout, stderr)
    return out


def _run_in_process(argv, capsys):
    from specd.cli import main

    try:
        rc = main(argv)
    except SystemExit as e:  # argparse errors exit through SystemExit
        rc = e.code if isinstance(e.code, int) else 1
    # any other exception propagates: that would be a traceback for a user
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_one_line_error(case, request, case_env, capsys):
    if case in SUBPROCESS_CASES:
        rc, stdout, stderr = request.getfixturevalue("results")[case]
    else:
        rc, stdout, stderr = _run_in_process(_argv(case, *case_env), capsys)
    assert "Traceback" not in stderr, stderr
    assert rc != 0, f"exit code 0; stdout={stdout!r}"
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"stderr is not one line: {stderr!r}"
    assert lines[0].startswith("error:"), lines[0]
    for alternatives in CASES[case][2]:
        assert any(a in lines[0] for a in alternatives), f"message {lines[0]!r} lacks any of {alternatives}"
    assert stdout.strip() == "", f"nothing should be printed on stdout: {stdout!r}"


def test_good_input_exit_zero(model_dirs, specd_cli, cli_env):
    """The control case: the same harness with valid input succeeds, with nothing on stderr but
    the summary line (tests/engine/test_cli_summary.py checks its content)."""
    argv = specd_cli + ["generate", "--model", model_dirs["llama"], "--prompt", "w5 w6", "--max-tokens", "3",
                        "--seed", "1", "--threads", "1"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=cli_env, timeout=240)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("summary: prompts=1 "), proc.stderr
    (row,) = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(row["token_ids"]) <= 3 and row["finish_reason"] in ("length", "stop")
