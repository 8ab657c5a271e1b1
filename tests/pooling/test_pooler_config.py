"""PoolerConfig resolution: the checkpoint's sentence-transformers files, the user's pooler_config,
and the runner / convert / task arguments; every refusal names the problem."""

from __future__ import annotations

import json

import pytest
import transformers

from pagedllm.pooling.config import PoolerConfig, read_sentence_transformers_config, resolve_runner


def _bert(**kw) -> transformers.BertConfig:
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, **kw)
    cfg.architectures = ["BertModel"]
    return cfg


def test_minilm_sentence_transformers_config():
    from pagedllm.pooling.embedded import embedded_embedding_model_path

    path = embedded_embedding_model_path()
    assert read_sentence_transformers_config(path) == {"normalize": True, "pooling_type": "MEAN", "max_seq_length": 256}
    run = resolve_runner("auto", "auto", None, None, None, transformers.AutoConfig.from_pretrained(path), path)
    assert run.runner_type == "pooling" and run.max_model_len == 256
    assert run.pooler_config == PoolerConfig(pooling_type="MEAN", normalize=True)


def test_user_pooler_config_and_refusals(tmp_path):
    cfg = _bert()
    run = resolve_runner("pooling", "auto", None, '{"pooling_type": "mean", "normalize": false}', None, cfg, None)
    assert run.pooler_config.pooling_type == "MEAN" and not run.pooler_config.normalize
    with pytest.raises(ValueError, match="not supported; supported"):
        resolve_runner("pooling", "auto", None, {"softmax": True}, None, cfg, None)
    with pytest.raises(ValueError, match="cannot generate"):
        resolve_runner("generate", "auto", None, None, None, cfg, None)
    with pytest.raises(ValueError, match="no classification head"):
        resolve_runner("auto", "classify", None, None, None, cfg, None)
    with pytest.raises(ValueError, match="matryoshka"):
        resolve_runner("pooling", "auto", None, {"dimensions": 16}, None, cfg, None)
    cfg.matryoshka_dimensions = [16, 32]
    assert resolve_runner("pooling", "auto", None, {"dimensions": 16}, None, cfg, None).pooler_config.dimensions == 16
    # Older vLLM's task argument maps onto the runner.
    llama = transformers.LlamaConfig()
    llama.architectures = ["LlamaForCausalLM"]
    assert resolve_runner("auto", "auto", "embed", None, None, llama, None).pooler_config.pooling_type == "LAST"
    assert resolve_runner("auto", "auto", None, None, None, llama, None).runner_type == "generate"
    (tmp_path / "modules.json").write_text(json.dumps([{"idx": 0, "path": "", "type": "x.Transformer"},
                                                       {"idx": 1, "path": "2_Dense", "type": "x.Dense"}]))
    with pytest.raises(ValueError, match="Dense module"):
        read_sentence_transformers_config(tmp_path)
