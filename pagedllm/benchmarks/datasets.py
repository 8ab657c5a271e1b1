"""Synthetic benchmark requests: vLLM's `random` dataset, and W1 (the peers' workload) drawn exactly.

Every request is a list of random token ids plus the number of tokens to generate (EOS ignored).
The draw is one `random.Random(seed)` stream, in this order, so that a workload is a pure function
of its arguments and lines up with the peer scripts in /work/shared/peers:

    for each request: its input length, then its token ids      (input lens interleaved with ids)
    then, for each request: its output length

W1 (nano-vllm's bench, the issue's reference workload) is the random dataset with 256 requests,
input and output lengths uniform in [100, 1024], token ids uniform in [0, 10000] (inclusive, as
the peers' `rng.randint(0, 10000)`: that is `--random-token-max 10001`), seed 0.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

W1_NUM_PROMPTS = 256
W1_LEN_RANGE = (100, 1024)
W1_TOKEN_MAX = 10001  # ids in [0, 10000]: randint(0, 10000) == randrange(10001)

DATASETS = ("random", "w1")


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request (vLLM's name): a tokenized prompt and how many tokens to generate."""

    prompt_token_ids: list[int]
    expected_output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def random_requests(
    num_prompts: int,
    input_len_range: tuple[int, int],
    output_len_range: tuple[int, int],
    token_max: int = 10000,
    seed: int = 0,
) -> list[SampleRequest]:
    """Lengths uniform in the inclusive ranges, token ids uniform in [0, token_max).

    Example: random_requests(2, (3, 3), (5, 5), token_max=10) -> two 3-token prompts, 5 tokens each.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}.")
    for name, (lo, hi) in (("input", input_len_range), ("output", output_len_range)):
        if lo < 1 or hi < lo:
            raise ValueError(f"the {name} length range must satisfy 1 <= min <= max, got [{lo}, {hi}].")
    if token_max < 1:
        raise ValueError(f"random token max must be >= 1, got {token_max}.")
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    for _ in range(num_prompts):
        n = rng.randint(*input_len_range)
        prompts.append([rng.randrange(token_max) for _ in range(n)])
    outs = [rng.randint(*output_len_range) for _ in range(num_prompts)]
    return [SampleRequest(p, o) for p, o in zip(prompts, outs)]


def w1_requests(num_prompts: int = W1_NUM_PROMPTS, seed: int = 0) -> list[SampleRequest]:
    """Workload W1, token for token the draw of the peers' `peer_vllm.py` / `peer_hf_cb.py`."""
    return random_requests(num_prompts, W1_LEN_RANGE, W1_LEN_RANGE, W1_TOKEN_MAX, seed)


def len_range(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's --random-range-ratio: lengths uniform in [L * (1 - r), L * (1 + r)].

    Example: len_range(1000, 0.1) -> (900, 1100).
    """
    if length < 1:
        raise ValueError(f"lengths must be >= 1, got {length}.")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}.")
    return max(1, int(length * (1 - range_ratio))), int(length * (1 + range_ratio))


# -- command line ----------------------------------------------------------------------------------
def add_dataset_args(
    parser: argparse.ArgumentParser,
    default_input_len: int = 1024,
    default_output_len: int = 128,
    default_num_prompts: int = 1000,
) -> None:
    g = parser.add_argument_group("dataset")
    g.add_argument(
        "--dataset-name",
        "--dataset",
        dest="dataset_name",
        default="random",
        choices=DATASETS,
        help="random: vLLM's random token ids; w1: the peers' workload (256 requests, lengths in "
        "[100, 1024], ids <= 10000, seed 0)",
    )
    g.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"number of requests (default {default_num_prompts}; {W1_NUM_PROMPTS} for w1)",
    )
    g.add_argument(
        "--input-len",
        "--random-input-len",
        dest="input_len",
        type=int,
        default=None,
        help=f"prompt length in tokens (default {default_input_len})",
    )
    g.add_argument(
        "--output-len",
        "--random-output-len",
        dest="output_len",
        type=int,
        default=None,
        help=f"tokens to generate per request, EOS ignored (default {default_output_len})",
    )
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len * (1 - r), len * (1 + r)]",
    )
    g.add_argument(
        "--random-input-len-range",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        default=None,
        help="prompt lengths uniform in [MIN, MAX] (overrides --input-len)",
    )
    g.add_argument(
        "--random-output-len-range",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        default=None,
        help="output lengths uniform in [MIN, MAX] (overrides --output-len)",
    )
    g.add_argument("--random-token-max", type=int, default=10000, help="token ids are drawn in [0, MAX)")
    # --seed is the engine's flag too (vLLM shares it the same way): one seed for the draw and the engine.
    parser.set_defaults(_default_lens=(default_input_len, default_output_len, default_num_prompts))


def requests_from_args(args: argparse.Namespace) -> list[SampleRequest]:
    default_in, default_out, default_n = args._default_lens
    seed = getattr(args, "seed", 0) or 0
    if args.dataset_name == "w1":
        given = [
            f
            for f, v in (
                ("--input-len", args.input_len),
                ("--output-len", args.output_len),
                ("--random-input-len-range", args.random_input_len_range),
                ("--random-output-len-range", args.random_output_len_range),
            )
            if v is not None
        ]
        if given:
            raise ValueError(
                f"--dataset w1 fixes its lengths; drop {', '.join(given)} or use --dataset random."
            )
        return w1_requests(args.num_prompts or W1_NUM_PROMPTS, seed)
    in_range = tuple(
        args.random_input_len_range or len_range(args.input_len or default_in, args.random_range_ratio)
    )
    out_range = tuple(
        args.random_output_len_range or len_range(args.output_len or default_out, args.random_range_ratio)
    )
    return random_requests(args.num_prompts or default_n, in_range, out_range, args.random_token_max, seed)


def check_fits(requests: list[SampleRequest], vocab_size: int, max_model_len: int) -> None:
    """Fail before timing anything when a request can never run on this model."""
    top = max(max(r.prompt_token_ids) for r in requests)
    if top >= vocab_size:
        raise ValueError(
            f"the workload draws token id {top} but the model's vocabulary has {vocab_size} tokens; "
            f"lower --random-token-max to <= {vocab_size}."
        )
    longest = max(r.prompt_len + r.expected_output_len for r in requests)
    if longest > max_model_len:
        raise ValueError(
            f"a request needs {longest} tokens (prompt + output) but max_model_len is {max_model_len}; "
            "raise --max-model-len or shorten the lengths."
        )
