"""Tensor-parallel sharding of a loaded transformers decoder, in place: each rank keeps its share of the heads
and of the MLP's intermediate width, and of the vocabulary.

Megatron's split (as vLLM, SGLang and mini-sglang do it): q/k/v and gate/up are split by output columns (by
whole heads), o and down by input rows, so each decoder layer needs one all-reduce after attention and one after
the MLP; the embedding and the LM head are split by vocabulary rows (the embedding sums its ranks' lookups, the
head gathers its ranks' logits). KV heads are split like the query heads, or replicated when there are fewer of
them than ranks (each rank then keeps the one KV head its query heads read). transformers' decoder code runs
unchanged on the smaller modules: its attention reshapes with -1 heads, and the config's head counts are set to
one rank's so that the paged engine sizes its KV cache for that share.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class UnshardableModel(RuntimeError):
    """The model's shape or modules cannot be split across the requested ranks."""


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int
    heads: int  # query heads of this rank
    kv_heads: int  # KV heads this rank keeps
    kv_first: int  # the first of them, in the full model
    intermediate: int  # MLP width of this rank
    vocab: int  # the full vocabulary (the LM head's rows)


def plan(config, rank: int, world: int, vocab: int) -> Shard:
    """This rank's share of a model of `config`, or UnshardableModel saying why none fits."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    inter = config.intermediate_size
    if heads % world or inter % world:
        raise UnshardableModel(f"--tensor-parallel-size {world} must divide the query heads ({heads}) and the MLP "
                               f"width ({inter})")
    if kv % world and world % kv:
        raise UnshardableModel(f"--tensor-parallel-size {world} and the KV heads ({kv}) must divide one another")
    per = heads // world
    if kv >= world:
        kv_per, kv_first = kv // world, rank * (kv // world)
    else:  # replicated: the KV head that this rank's query heads (all in one group) read
        kv_per, kv_first = 1, rank * per // (heads // kv)
    return Shard(rank, world, per, kv_per, kv_first, inter // world, vocab)


def shard_model(model: nn.Module, rank: int, world: int, group=None) -> Shard:
    """Split `model`'s weights in place for `rank` of `world`, its collectives on `group` (torch.distributed
    initialised; None: the default group); its config then describes one rank's share of the heads and MLP."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise UnshardableModel(f"{type(model).__name__}: the LM head is not a Linear layer")
    shard = plan(config, rank, world, head.weight.shape[0])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attn, mlp = _layers(model, ATTENTION), _layers(model, MLP)
    if len(attn) != config.num_hidden_layers or len(mlp) != config.num_hidden_layers:
        raise UnshardableModel(f"{type(model).__name__}: tensor parallelism needs separate q/k/v/o and gate/up/down "
                               f"projections in every layer (found {len(attn)} attention and {len(mlp)} MLP modules)")
    for module in attn:
        _shard_attention(module, shard, head_dim, group)
    for module in mlp:
        lo = rank * shard.intermediate
        _columns(module.gate_proj, lo, shard.intermediate)
        _columns(module.up_proj, lo, shard.intermediate)
        _rows(module.down_proj, lo, shard.intermediate, rank, group)
    _shard_vocab(model, shard, group)
    config.head_dim = head_dim
    config.num_attention_heads = shard.heads
    config.num_key_value_heads = shard.kv_heads
    config.intermediate_size = shard.intermediate
    return shard


def _layers(model: nn.Module, names: tuple[str, ...]) -> list[nn.Module]:
    return [m for m in model.modules() if all(isinstance(getattr(m, n, None), nn.Linear) for n in names)]


def _shard_attention(module: nn.Module, shard: Shard, head_dim: int, group) -> None:
    for norm in ("q_norm", "k_norm"):  # per-head norms (Qwen3) need nothing; a norm over all heads cannot split
        weight = getattr(getattr(module, norm, None), "weight", None)
        if weight is not None and weight.shape[-1] != head_dim:
            raise UnshardableModel(f"{type(module).__name__}.{norm} normalises across heads; it cannot be split")
    q_lo = shard.rank * shard.heads * head_dim
    _columns(module.q_proj, q_lo, shard.heads * head_dim)
    _columns(module.k_proj, shard.kv_first * head_dim, shard.kv_heads * head_dim)
    _columns(module.v_proj, shard.kv_first * head_dim, shard.kv_heads * head_dim)
    _rows(module.o_proj, q_lo, shard.heads * head_dim, shard.rank, group)
    module.num_key_value_groups = shard.heads // shard.kv_heads
    for name, value in (("num_heads", shard.heads), ("num_key_value_heads", shard.kv_heads)):
        if hasattr(module, name):
            setattr(module, name, value)


def _columns(linear: nn.Linear, lo: int, n: int) -> None:
    """Keep output features [lo, lo + n)."""
    linear.weight = nn.Parameter(linear.weight.data[lo:lo + n].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[lo:lo + n].clone(), requires_grad=False)
    linear.out_features = n


def _rows(linear: nn.Linear, lo: int, n: int, rank: int, group) -> None:
    """Keep input features [lo, lo + n); the ranks' partial outputs are summed (the bias added once)."""
    linear.weight = nn.Parameter(linear.weight.data[:, lo:lo + n].clone(), requires_grad=False)
    if linear.bias is not None and rank != 0:
        linear.bias = None
    linear.in_features = n
    linear.register_forward_hook(functools.partial(_all_reduce, group))


def _all_reduce(group, _module: nn.Module, _args, out: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(out, group=group)
    return out


def _shard_vocab(model: nn.Module, shard: Shard, group) -> None:
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    per = -(-shard.vocab // shard.world)
    lo = shard.rank * per
    tied = embed is not None and getattr(embed, "weight", None) is head.weight
    weight = _vocab_rows(head.weight.data, lo, per)
    bias = None if head.bias is None else _vocab_rows(head.bias.data, lo, per)
    new_head = VocabParallelHead(weight, shard.vocab, bias, group)
    model.set_output_embeddings(new_head)
    if type(embed) is nn.Embedding:  # a subclass may scale or offset its lookups: it stays whole
        rows = new_head.weight if tied else nn.Parameter(_vocab_rows(embed.weight.data, lo, per), requires_grad=False)
        model.set_input_embeddings(VocabParallelEmbedding(rows, lo, embed.weight.shape[0], group))


def _vocab_rows(weight: torch.Tensor, lo: int, per: int) -> torch.Tensor:
    """Rows [lo, lo + per) of `weight`, zero-padded past its end (the last rank of an uneven split)."""
    out = torch.zeros((per, *weight.shape[1:]), dtype=weight.dtype, device=weight.device)
    part = weight[lo:lo + per]
    out[:part.shape[0]] = part
    return out


class VocabParallelEmbedding(nn.Module):
    """The embedding rows of one rank's vocabulary slice; a token's vector comes from the rank that holds it
    (the others add zeros)."""

    def __init__(self, weight: nn.Parameter, lo: int, vocab: int, group=None):
        super().__init__()
        self.weight = weight
        self.lo, self.vocab, self.group = lo, vocab, group
        self.num_embeddings, self.embedding_dim = vocab, weight.shape[1]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.lo
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out = out * mine[..., None].to(out.dtype)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelHead(nn.Module):
    """The LM head rows of one rank's vocabulary slice; every rank gets the full logits (all-gathered), only
    rank 0 samples from them. `vocab`: the full vocabulary (what the engine and grammars size for)."""

    def __init__(self, weight: torch.Tensor | nn.Parameter, vocab: int, bias: torch.Tensor | None = None, group=None):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.vocab, self.group = vocab, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight, self.bias).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., :self.vocab]


def output_vocab(model: nn.Module) -> int:
    """The rows of the model's LM head: the full vocabulary, also when the head is split across ranks."""
    head = model.get_output_embeddings()
    return int(getattr(head, "vocab", None) or head.weight.shape[0])


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters on this rank (shared ones counted once)."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
