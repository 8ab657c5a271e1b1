"""How a model splits over ranks: which layers a pipeline stage runs, which KV heads a TP rank keeps."""

from __future__ import annotations


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the decoder layers pipeline stage `pp_rank` runs; earlier stages take the
    remainder first (vLLM's split). 30 layers over 4 stages -> [0, 8), [8, 16), [16, 23), [23, 30).
    """
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size {pp_size} is larger than the model's {num_layers} layers; "
                         "every stage needs at least one layer.")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def num_kv_heads_per_rank(total_num_kv_heads: int, tp_size: int) -> int:
    """KV heads each TP rank holds: split when there are at least tp of them, else one replicated
    head per rank (8 kv heads, tp 16 -> 1; 2 kv heads, tp 2 -> 1; 8, tp 2 -> 4)."""
    if tp_size >= total_num_kv_heads:
        if tp_size % total_num_kv_heads:
            raise ValueError(f"tensor_parallel_size {tp_size} is not a multiple of the model's "
                             f"{total_num_kv_heads} KV heads")
        return 1
    if total_num_kv_heads % tp_size:
        raise ValueError(f"the model's {total_num_kv_heads} KV heads do not split over tensor_parallel_size {tp_size}")
    return total_num_kv_heads // tp_size


def check_parallel_sizes(hf_config: object, tp_size: int, pp_size: int) -> None:
    """Refuse, before any process starts, sizes the model cannot split into (vLLM's checks).

    SmolLM2-135M has 9 attention heads: tensor_parallel_size 3 splits them, 2 does not.
    """
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    layers = int(hf_config.num_hidden_layers)
    if heads % tp_size:
        raise ValueError(f"the model's {heads} attention heads are not divisible by tensor_parallel_size {tp_size}.")
    num_kv_heads_per_rank(kv_heads, tp_size)
    if pp_size > layers:
        raise ValueError(f"pipeline_parallel_size {pp_size} is larger than the model's {layers} layers; every "
                         "stage needs at least one layer.")
