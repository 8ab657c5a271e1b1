"""What the structured-output GPU scripts (gpu_h42_gate.py, gpu_h48_bar.py) share: a child process whose
lines are shown as they come and kept (a hang costs the child, not the call), and the Llama-3.1-8B
config dressed in the peer model's tokenizer. No torch here: the parent only starts children.

Import it from a script run as `python3 scripts/NAME.py` (its folder is then on sys.path).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from collections.abc import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_child(cmd: list[str], env: dict[str, str], timeout: float, show: Callable[[str], bool] = lambda line: True,
              merge_stderr: bool = False) -> tuple[int | str, list[str]]:
    """Run cmd, printing the stdout lines that `show` picks as they come (a kill of the caller keeps
    the rows printed so far) and keeping them all; killed at `timeout` (5 s at least).
    -> (exit code, or "killed at N s"; every line)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge_stderr else None,
                            text=True, env=env)
    lines: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            if show(line):
                print(line, end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc: int | str = proc.wait(timeout=max(timeout, 5))
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = f"killed at {timeout:.0f} s"
    reader.join(timeout=2)
    return rc, lines


def write_llama8b(peer: str, folder: str, bos_eos: tuple[int, int] | None = None) -> str:
    """Llama-3.1-8B's config (pagedllm/model_configs/llama3-8b) with the peer model's vocabulary size
    (49,152 for SmolLM2's) and its tokenizer files, in folder. bos_eos: the special ids to write; None
    takes the peer config's (1 and 2 where it names none)."""
    os.makedirs(folder, exist_ok=True)
    for f in os.listdir(peer):
        src = os.path.join(peer, f)
        if f != "config.json" and os.path.isfile(src) and not f.endswith((".safetensors", ".bin", ".gguf")):
            shutil.copy(src, folder)
    peer_cfg = json.load(open(os.path.join(peer, "config.json")))
    bos, eos = bos_eos or (peer_cfg.get("bos_token_id", 1), peer_cfg.get("eos_token_id", 2))
    cfg = json.load(open(os.path.join(REPO, "pagedllm", "model_configs", "llama3-8b", "config.json")))
    cfg.update(vocab_size=peer_cfg["vocab_size"], bos_token_id=bos, eos_token_id=eos)
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"), indent=1)
    return folder
