"""flashinfer-python 0.7.x signatures of every function the engine calls, kept as data so that CI needs no wheel.

Read with `ast` from the wheels' sources (annotations dropped; the implementation after any `@overload`):

    pip download --no-deps flashinfer-python==0.7.4 -d /tmp/fi && unzip -q /tmp/fi/*.whl -d /tmp/fi/src
    python -m tests.unit.engine.flashinfer_signatures /tmp/fi/src

prints the table of that source, to paste under its version. The fake flashinfer (fake_flashinfer.py) binds
every call against each version's table, so a keyword one of them lacks, or an argument passed positionally
where it only takes keywords, fails the tests.
"""

from __future__ import annotations

import ast
import inspect
import sys
from functools import cache
from pathlib import Path

SIGNATURES: dict[str, dict[str, tuple[str, ...]]] = {
    "0.7.0": {
        'BatchDecodeWithPagedKVCacheWrapper.__init__': (
            'self', 'float_workspace_buffer', "kv_layout='NHD'", 'use_cuda_graph=False', 'use_tensor_cores=False',
            'paged_kv_indptr_buffer=None', 'paged_kv_indices_buffer=None', 'paged_kv_last_page_len_buffer=None',
            "backend='auto'", 'jit_args=None',
        ),
        'BatchDecodeWithPagedKVCacheWrapper.plan': (
            'self', 'indptr', 'indices', 'last_page_len', 'num_qo_heads', 'num_kv_heads', 'head_dim', 'page_size',
            '*deprecated_positional_args', '**kwargs',
        ),
        'BatchDecodeWithPagedKVCacheWrapper._plan_impl': (
            'self', 'indptr', 'indices', 'last_page_len', 'num_qo_heads', 'num_kv_heads', 'head_dim', 'page_size', '*',
            "pos_encoding_mode='NONE'", 'window_left=-1', 'window_right=0', 'logits_soft_cap=None',
            "q_data_type='float16'", 'kv_data_type=None', 'o_data_type=None', 'data_type=None', 'sm_scale=None',
            'rope_scale=None', 'rope_theta=None', 'non_blocking=True', 'block_tables=None', 'seq_lens=None',
            'fixed_split_size=None', 'disable_split_kv=False', 'q_len_per_req=1', 'is_causal=None',
        ),
        'BatchDecodeWithPagedKVCacheWrapper.run': (
            'self', 'q', 'paged_kv_cache', '*args', 'q_scale=None', 'k_scale=None', 'v_scale=None', 'out=None',
            'lse=None', 'return_lse=False', 'enable_pdl=None', 'window_left=None', 'sinks=None', 'q_len_per_req=None',
            'skip_softmax_threshold_scale_factor=None', 'kv_cache_sf=None',
        ),
        'CUDAGraphBatchDecodeWithPagedKVCacheWrapper.__init__': (
            'self', 'workspace_buffer', 'indptr_buffer', 'indices_buffer', 'last_page_len_buffer', "kv_layout='NHD'",
            'use_tensor_cores=False',
        ),
        'BatchPrefillWithPagedKVCacheWrapper.__init__': (
            'self', 'float_workspace_buffer', "kv_layout='NHD'", 'use_cuda_graph=False', 'qo_indptr_buf=None',
            'paged_kv_indptr_buf=None', 'paged_kv_indices_buf=None', 'paged_kv_last_page_len_buf=None',
            'custom_mask_buf=None', 'mask_indptr_buf=None', "backend='auto'", 'jit_args=None', 'jit_kwargs=None',
            'variant_owns_mask=False',
        ),
        'BatchPrefillWithPagedKVCacheWrapper.plan': (
            'self', 'qo_indptr', 'paged_kv_indptr', 'paged_kv_indices', 'paged_kv_last_page_len', 'num_qo_heads',
            'num_kv_heads', 'head_dim_qk', 'page_size', 'head_dim_vo=None', 'custom_mask=None',
            'packed_custom_mask=None', 'causal=False', "pos_encoding_mode='NONE'", 'use_fp16_qk_reduction=False',
            'sm_scale=None', 'window_left=-1', 'logits_soft_cap=None', 'rope_scale=None', 'rope_theta=None',
            "q_data_type='float16'", 'kv_data_type=None', 'o_data_type=None', 'non_blocking=True',
            'prefix_len_ptr=None', 'token_pos_in_items_ptr=None', 'token_pos_in_items_len=0', 'max_item_len_ptr=None',
            'seq_lens=None', 'seq_lens_q=None', 'block_tables=None', 'max_token_per_sequence=None',
            'max_sequence_kv=None', 'fixed_split_size=None', 'disable_split_kv=False',
        ),
        'BatchPrefillWithPagedKVCacheWrapper.run': (
            'self', 'q', 'paged_kv_cache', '*args', 'q_scale=None', 'k_scale=None', 'v_scale=None', 'out=None',
            'lse=None', 'return_lse=False', 'enable_pdl=None', 'window_left=None', 'sinks=None', 'kv_cache_sf=None',
            'skip_softmax_threshold_scale_factor=None', 'use_fp16_softmax=None', 'uses_spcompress=None',
        ),
        'sampling.sampling_from_logits': (
            'logits', 'indices=None', 'deterministic=True', 'generator=None', 'check_nan=False', 'seed=None',
            'offset=None',
        ),
        'sampling.top_k_top_p_sampling_from_logits': (
            'logits', 'top_k', 'top_p', 'indices=None', "filter_apply_order='top_k_first'", 'deterministic=True',
            'generator=None', 'check_nan=False', 'seed=None', 'offset=None',
        ),
        'SegmentGEMMWrapper.__init__': ('self', 'float_workspace_buffer', "backend='auto'"),
        'SegmentGEMMWrapper.run': (
            'self', 'x', 'weights', 'batch_size', 'weight_column_major', 'out=None', 'seg_lens=None', 'seg_indptr=None',
            'weight_indices=None',
        ),
    },
    "0.7.4": {
        'BatchDecodeWithPagedKVCacheWrapper.__init__': (
            'self', 'float_workspace_buffer', "kv_layout='NHD'", 'use_cuda_graph=False', 'use_tensor_cores=False',
            'paged_kv_indptr_buffer=None', 'paged_kv_indices_buffer=None', 'paged_kv_last_page_len_buffer=None',
            "backend='auto'", 'jit_args=None', 'jit_kwargs=None',
        ),
        'BatchDecodeWithPagedKVCacheWrapper.plan': (
            'self', 'indptr', 'indices', 'last_page_len', 'num_qo_heads', 'num_kv_heads', 'head_dim', 'page_size',
            '*deprecated_positional_args', '**kwargs',
        ),
        'BatchDecodeWithPagedKVCacheWrapper._plan_impl': (
            'self', 'indptr', 'indices', 'last_page_len', 'num_qo_heads', 'num_kv_heads', 'head_dim', 'page_size', '*',
            "pos_encoding_mode='NONE'", 'window_left=-1', 'window_right=0', 'logits_soft_cap=None',
            "q_data_type='float16'", 'kv_data_type=None', 'o_data_type=None', 'data_type=None', 'sm_scale=None',
            'rope_scale=None', 'rope_theta=None', 'non_blocking=True', 'block_tables=None', 'seq_lens=None',
            'fixed_split_size=None', 'disable_split_kv=False', 'q_len_per_req=1', 'is_causal=None',
            'use_token_head_sf=False',
        ),
        'BatchDecodeWithPagedKVCacheWrapper.run': (
            'self', 'q', 'paged_kv_cache', '*args', 'q_scale=None', 'k_scale=None', 'v_scale=None', 'out=None',
            'lse=None', 'return_lse=False', 'enable_pdl=None', 'window_left=None', 'sinks=None', 'q_len_per_req=None',
            'skip_softmax_threshold_scale_factor=None', 'kv_cache_sf=None',
        ),
        'CUDAGraphBatchDecodeWithPagedKVCacheWrapper.__init__': (
            'self', 'workspace_buffer', 'indptr_buffer', 'indices_buffer', 'last_page_len_buffer', "kv_layout='NHD'",
            'use_tensor_cores=False',
        ),
        'BatchPrefillWithPagedKVCacheWrapper.__init__': (
            'self', 'float_workspace_buffer', "kv_layout='NHD'", 'use_cuda_graph=False', 'qo_indptr_buf=None',
            'paged_kv_indptr_buf=None', 'paged_kv_indices_buf=None', 'paged_kv_last_page_len_buf=None',
            'custom_mask_buf=None', 'mask_indptr_buf=None', "backend='auto'", 'jit_args=None', 'jit_kwargs=None',
            'variant_owns_mask=False', 'max_total_num_rows=None',
        ),
        'BatchPrefillWithPagedKVCacheWrapper.plan': (
            'self', 'qo_indptr', 'paged_kv_indptr', 'paged_kv_indices', 'paged_kv_last_page_len', 'num_qo_heads',
            'num_kv_heads', 'head_dim_qk', 'page_size', 'head_dim_vo=None', 'custom_mask=None',
            'packed_custom_mask=None', 'causal=False', "pos_encoding_mode='NONE'", 'use_fp16_qk_reduction=False',
            'sm_scale=None', 'window_left=-1', 'logits_soft_cap=None', 'rope_scale=None', 'rope_theta=None',
            "q_data_type='float16'", 'kv_data_type=None', 'o_data_type=None', 'non_blocking=True',
            'prefix_len_ptr=None', 'token_pos_in_items_ptr=None', 'token_pos_in_items_len=0', 'max_item_len_ptr=None',
            'seq_lens=None', 'seq_lens_q=None', 'block_tables=None', 'max_token_per_sequence=None',
            'max_sequence_kv=None', 'fixed_split_size=None', 'disable_split_kv=False', 'uniform_q_len=None',
            'use_token_head_sf=False',
        ),
        'BatchPrefillWithPagedKVCacheWrapper.run': (
            'self', 'q', 'paged_kv_cache', '*args', 'q_scale=None', 'k_scale=None', 'v_scale=None', 'out=None',
            'lse=None', 'return_lse=False', "lse_base='log2'", "lse_layout='NH'", 'enable_pdl=None', 'window_left=None',
            'sinks=None', 'kv_cache_sf=None', 'skip_softmax_threshold_scale_factor=None', 'use_fp16_softmax=None',
            'uses_spcompress=None',
        ),
        'sampling.sampling_from_logits': (
            'logits', 'indices=None', 'deterministic=True', 'generator=None', 'check_nan=False', 'seed=None',
            'offset=None',
        ),
        'sampling.top_k_top_p_sampling_from_logits': (
            'logits', 'top_k', 'top_p', 'indices=None', "filter_apply_order='top_k_first'", 'deterministic=True',
            'generator=None', 'check_nan=False', 'seed=None', 'offset=None', 'top_k_max=None',
        ),
        'SegmentGEMMWrapper.__init__': ('self', 'float_workspace_buffer', "backend='auto'"),
        'SegmentGEMMWrapper.run': (
            'self', 'x', 'weights', 'batch_size', 'weight_column_major', 'out=None', 'seg_lens=None', 'seg_indptr=None',
            'weight_indices=None',
        ),
    },
}

# what the table covers: (file in the wheel, class or None for module functions, names)
COVERED = (
    ("decode.py", "BatchDecodeWithPagedKVCacheWrapper", ("__init__", "plan", "_plan_impl", "run")),
    ("decode.py", "CUDAGraphBatchDecodeWithPagedKVCacheWrapper", ("__init__",)),
    ("prefill.py", "BatchPrefillWithPagedKVCacheWrapper", ("__init__", "plan", "run")),
    ("sampling.py", None, ("sampling_from_logits", "top_k_top_p_sampling_from_logits")),
    ("gemm/gemm_base.py", "SegmentGEMMWrapper", ("__init__", "run")),
)


@cache
def signature(version: str, name: str) -> inspect.Signature:
    """The signature `name` ("Class.method" or "sampling.function") has in that version."""
    params = ", ".join(SIGNATURES[version][name])
    namespace: dict = {}
    exec(f"def f({params}): pass", namespace)  # the parameters are names and literal defaults only
    return inspect.signature(namespace["f"])


def bind(name: str, *args, **kwargs) -> None:
    """Raise TypeError unless the call binds against every version's signature of `name`."""
    for version in SIGNATURES:
        try:
            signature(version, name).bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"flashinfer {version} {name}: {e}") from None


def _params(fn: ast.FunctionDef) -> tuple[str, ...]:
    a = fn.args
    out = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for arg, default in zip(positional, defaults, strict=True):
        out.append(arg.arg + ("" if default is None else "=" + ast.unparse(default)))
    if a.vararg:
        out.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        out.append("*")
    for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append(arg.arg + ("" if default is None else "=" + ast.unparse(default)))
    if a.kwarg:
        out.append("**" + a.kwarg.arg)
    return tuple(out)


def read_source(root: str) -> dict[str, tuple[str, ...]]:
    """The table of an unzipped wheel whose `flashinfer/` is under `root`."""
    table = {}
    for file, cls, names in COVERED:
        tree = ast.parse((Path(root) / "flashinfer" / file).read_text())
        body = tree.body if cls is None else next(
            n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
        for name in names:
            fn = [n for n in body if isinstance(n, ast.FunctionDef) and n.name == name][-1]
            table[f"{cls or 'sampling'}.{name}"] = _params(fn)
    return table


if __name__ == "__main__":
    for key, params in read_source(sys.argv[1]).items():
        print(f"        {key!r}: {params!r},")
