"""Seeded odd calls of the offline pooling API (LLM.embed / encode / score / classify, PoolingParams),
and the check each must pass: a refusal is ValueError or TypeError naming what the call set; an
answer has one output per prompt (per pair for score) of the right shape, all finite, embeddings
unit length when normalized. (LLM.generate / chat / SamplingParams: fuzz_requests.OfflineFuzzer.)

    fuzz = OfflinePoolingFuzzer(seed=0, vocab_size=30522, dims=384, task="embed")
    for case in fuzz.cases(200):
        problems = run_offline_pooling_case(llm, case)
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tests.reliability.fuzz_requests import ANY, REJECT


@dataclass
class PoolingCase:
    name: str
    method: str  # "embed" | "encode" | "score" | "classify"
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    pooling_params: dict[str, Any] | str | None = None  # PoolingParams(**this), or a wrong object as is
    expect: str = ANY
    fields: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.name}: LLM.{self.method}({', '.join(f'{a!r:.60}' for a in self.args)}, {self.kwargs!r:.100}, " \
               f"pooling_params={self.pooling_params!r:.80})"


LONG = "long"  # a prompt past max_model_len: refused unless truncate_prompt_tokens cuts it


class OfflinePoolingFuzzer:
    """Seeded calls for an embedding model (task "embed") or a one-label cross-encoder ("classify")."""

    def __init__(self, seed: int, *, vocab_size: int, dims: int, task: str) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab_size
        self.dims = dims
        self.task = task

    def _prompt(self) -> tuple[Any, str]:
        v = self.vocab
        return copy.deepcopy(self.rng.choice([
            ("hi", ANY), (["a", "b"], ANY), ([101, 7592, 102], ANY), ([[101, 102], [101, 7592, 102]], ANY), ("", ANY),
            ([""], ANY), ([], ANY), ([[]], REJECT), ([-1], REJECT), ([v], REJECT), ([2**63], REJECT), ([1.5], REJECT),
            (["a", 1], REJECT), (None, REJECT), (5, REJECT), ({"prompt": "x"}, ANY), ({"prompt_token_ids": [101]}, ANY),
            ({"prompt_token_ids": []}, REJECT), ({"prompt_token_ids": "12"}, REJECT), ({}, REJECT), ({"prompt": 5}, REJECT),
            ("word " * 600, LONG), ([[1] * 600], LONG), ({"prompt": "x", "nope": 1}, REJECT), (("a", "b"), ANY),
            (b"ab", REJECT), ("\u0000\u202e\U0001f600", ANY)]))

    def _texts(self) -> tuple[Any, str]:
        return copy.deepcopy(self.rng.choice([
            ("q", ANY), (["a", "b"], ANY), ([], REJECT), ("", ANY), (["x"] * 3, ANY), (5, REJECT), ([1, 2], REJECT),
            ({"prompt": "x"}, REJECT), (None, REJECT), (("a",), ANY), (b"ab", REJECT), (["word " * 600], ANY)]))

    def _truncate(self) -> tuple[Any, str]:
        return self.rng.choice([(None, ANY), (-1, ANY), (1, ANY), (3, ANY), (0, REJECT), (-2, REJECT), (10**6, REJECT),
                                (10**30, REJECT), ("3", REJECT), (1.5, REJECT), (True, REJECT)])

    def _pooling_params(self) -> tuple[Any, str]:
        d = self.dims
        embed_only = ANY if self.task == "embed" else REJECT  # dimensions applies to embeddings
        return copy.deepcopy(self.rng.choice([
            (None, ANY), ({}, ANY), ({"dimensions": 8}, embed_only), ({"dimensions": d}, embed_only),
            ({"dimensions": d + 1}, REJECT), ({"dimensions": 0}, REJECT), ({"dimensions": 10**30}, REJECT),
            ({"normalize": False}, ANY), ({"normalize": "yes"}, REJECT), ({"task": "nope"}, REJECT),
            ({"truncate_prompt_tokens": 3}, ANY), ({"truncate_prompt_tokens": 10**30}, REJECT),
            ({"use_activation": False}, ANY), ("x", REJECT), (5, REJECT), ([None], REJECT), ({"dimensions": True}, REJECT)]))

    def cases(self, count: int) -> Iterator[PoolingCase]:
        rng = self.rng
        methods = ["embed", "encode", "score", "classify"]
        for _ in range(count):
            method = rng.choice(methods)
            expects: dict[str, str] = {}
            if method == "score":
                (a, ea), (b, eb) = self._texts(), self._texts()
                args: tuple[Any, ...] = (a, b)
                expects["data_1"], expects["data_2"] = ea, eb
            else:
                prompt, expects["prompts"] = self._prompt()
                args = (prompt,)
            kwargs: dict[str, Any] = {"use_tqdm": False}
            if rng.random() < 0.4:
                kwargs["truncate_prompt_tokens"], kw_expect = self._truncate()
                expects["truncate_prompt_tokens"] = kw_expect
            pp = None
            if rng.random() < 0.5:
                pp, expects["pooling_params"] = self._pooling_params()
                if isinstance(pp, dict):
                    for k in pp:
                        expects[k] = expects.pop("pooling_params")  # a refusal names the field itself
                        break
            # truncate_prompt_tokens= replaces the PoolingParams' own; either, when valid, cuts a long prompt.
            trunc_kw = kwargs.get("truncate_prompt_tokens")
            if trunc_kw is not None:
                expects["truncate_prompt_tokens"] = kw_expect
            trunc = trunc_kw if trunc_kw is not None else (pp or {}).get("truncate_prompt_tokens") \
                if isinstance(pp, dict) else trunc_kw
            if expects.get("prompts") == LONG:
                expects["prompts"] = ANY if trunc is not None else REJECT
            if method == "encode" and rng.random() < 0.3:
                kwargs["pooling_task"], expects["pooling_task"] = rng.choice(
                    [("embed", ANY), ("encode", ANY), ("nope", REJECT), (5, REJECT)])
            wrong = {"embed": "classify", "classify": "embed"}.get(self.task)
            if method == wrong:
                expects[method] = REJECT  # the other kind of model's call
            expect = REJECT if REJECT in expects.values() else ANY
            names = [f"{k}={v}" for k, v in expects.items() if v == REJECT] or ["fine"]
            yield PoolingCase(", ".join(names), method, args, kwargs, pp, expect, tuple(expects))


def _output_problems(case: PoolingCase, outs: list[Any], normalized: bool) -> list[str]:
    problems = []
    for o in outs:
        data = o.outputs
        if case.method == "embed":
            vec = data.embedding
            if not vec or not all(math.isfinite(x) for x in vec):
                problems.append(f"embedding of {len(vec)} values, not all finite")
            elif normalized and abs(math.sqrt(sum(x * x for x in vec)) - 1) > 1e-3:
                problems.append(f"normalized embedding of norm {math.sqrt(sum(x * x for x in vec))}")
            dims = (case.pooling_params or {}).get("dimensions") if isinstance(case.pooling_params, dict) else None
            if dims is not None and len(vec) != dims:
                problems.append(f"{len(vec)} dimensions for dimensions={dims}")
        elif case.method == "score":
            if not math.isfinite(data.score):
                problems.append(f"score {data.score}")
        elif case.method == "classify":
            if not data.probs or not all(math.isfinite(x) for x in data.probs):
                problems.append(f"probs {data.probs!r:.100}")
        elif not bool(data.data.isfinite().all()):
            problems.append("encode output not finite")
    return problems


def _count(case: PoolingCase) -> int | None:
    if case.method == "score":
        a, b = case.args
        left = 1 if isinstance(a, str) else len(a)
        right = 1 if isinstance(b, str) else len(b)
        return max(left, right)
    prompt = case.args[0]
    if isinstance(prompt, (str, dict)) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        return 1
    return len(prompt) if isinstance(prompt, (list, tuple)) else None


def run_offline_pooling_case(llm: Any, case: PoolingCase) -> list[str]:
    """One call; -> its problems."""
    from pagedllm.pooling.params import PoolingParams

    try:
        kwargs = dict(case.kwargs)
        pp = case.pooling_params
        if pp is not None:
            kwargs["pooling_params"] = PoolingParams(**pp) if isinstance(pp, dict) else pp
        outs = getattr(llm, case.method)(*case.args, **kwargs)
    except (ValueError, TypeError) as e:
        msg = str(e)
        words = (*case.fields, "prompt", "token id", "maximum context length", "vocabulary", "PoolingParams",
                 "texts", "this model")
        if not any(w in msg for w in words):
            return [f"{type(e).__name__} names none of {case.fields}: {msg!r:.200}"]
        return []
    except Exception as e:  # noqa: BLE001 - every other exception is the finding
        return [f"{type(e).__name__} (not ValueError/TypeError): {e!s:.300}"]
    want = _count(case)
    if case.expect == REJECT and not (want == 0 and not outs):  # no prompt: nothing to check against the model
        return [f"accepted a call that must be refused: {len(outs)} outputs"]
    if want is not None and len(outs) != want:
        return [f"{len(outs)} outputs for {want} inputs"]
    normalized = not (isinstance(case.pooling_params, dict) and case.pooling_params.get("normalize") is False)
    return _output_problems(case, outs, normalized)
