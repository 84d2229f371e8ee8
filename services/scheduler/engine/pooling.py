"""Prefill-only requests (shared/messages.py `Pooling`): embeddings pooled from the final hidden states, and
SGLang's scores (the probabilities of label tokens at the position after the prompt).

The paged engine (paged.py) runs such a sequence's prompt like any other, in the same packed steps as
generation, and ends it after the step that computes its last prompt token, with no token sampled. An
embedding reads the model's final hidden states (after its last norm, what transformers reports as the last
of `hidden_states`, as vLLM's pooling models do): "last" pooling the last prompt token's, "mean" pooling the
mean over every prompt token, summed over the prefill's chunks on the device (so a mean-pooled prompt is
computed whole, never read from the prefix cache); then its first `dimensions` kept and L2-normalized. A
score reads the logits the step computes for the last prompt token, as a sampled sequence's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from services.scheduler.engine.base import RequestRejected, StepOutput
from services.scheduler.engine.transfer import DeviceResult, to_device
from shared.messages import Pooling

if TYPE_CHECKING:
    from services.scheduler.engine.scheduler import Scheduled
    from services.scheduler.engine.sequence import Seq

TASKS = ("embed", "score")
POOLINGS = ("last", "mean")


def truncatable(config) -> list[int] | bool:
    """Output dimensions a model was trained to be truncated to (vLLM's convention: `matryoshka_dimensions` in
    its config, or `is_matryoshka` for any): the list, True for any, False for none."""
    dims = getattr(config, "matryoshka_dimensions", None)
    if dims:
        return sorted(int(d) for d in dims)
    return bool(getattr(config, "is_matryoshka", False))


def check_pooling(p: Pooling, vocab: int, hidden: int, truncation: list[int] | bool) -> None:
    """Refuse a prefill-only request the model cannot serve, naming the request field at fault."""
    if p.task not in TASKS:
        raise RequestRejected(f"unknown pooling task {p.task!r}; one of {', '.join(TASKS)}")
    if p.task == "score":
        if not p.label_token_ids:
            raise RequestRejected("`label_token_ids` must name at least one token id", param="label_token_ids")
        bad = [t for t in p.label_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(f"Token ID {bad[0]} in `label_token_ids` is out of vocabulary (vocab size: {vocab})",
                                  param="label_token_ids")
        return
    if p.pooling not in POOLINGS:
        raise RequestRejected(f"unknown pooling {p.pooling!r}; one of {', '.join(POOLINGS)}", param="pooling")
    check_dimensions(p.dimensions, hidden, truncation)


def check_dimensions(dimensions: int, hidden: int, truncation: list[int] | bool) -> None:
    """`dimensions` (0: not given) must be the model's own size, or one it allows truncation to."""
    if not dimensions or dimensions == hidden:
        return
    if not truncation:
        raise RequestRejected(f"`dimensions` {dimensions}: this model's embeddings have {hidden} dimensions and it "
                              "does not support truncating them (no matryoshka_dimensions in its config)",
                              param="dimensions")
    allowed = truncation if isinstance(truncation, list) else None
    if not 1 <= dimensions <= hidden or (allowed is not None and dimensions not in allowed):
        raise RequestRejected(f"`dimensions` {dimensions} is not one this model allows: "
                              f"{allowed if allowed is not None else f'1 to {hidden}'}", param="dimensions")


def embedding(p: Pooling, pooled: torch.Tensor, tokens: int) -> torch.Tensor:
    """The request's vector from its pooled hidden state (`tokens` of them summed, for mean pooling), fp32."""
    v = pooled.float()
    if p.pooling == "mean":
        v = v / tokens
    if p.dimensions:
        v = v[:p.dimensions]
    return torch.nn.functional.normalize(v, dim=-1) if p.normalize else v


def scores(p: Pooling, logits: torch.Tensor) -> torch.Tensor:
    """SGLang's scores from the next-token logits: the label tokens' probabilities, renormalized over the labels
    alone with `apply_softmax` (a softmax of their logprobs)."""
    labels = torch.tensor(p.label_token_ids, dtype=torch.long, device=logits.device)
    chosen = torch.log_softmax(logits.float(), -1).index_select(-1, labels)
    return torch.softmax(chosen, -1) if p.apply_softmax else chosen.exp()


def float32_bytes(values: list[float]) -> bytes:
    """Little-endian float32, what OpenAI's `encoding_format: base64` encodes."""
    import numpy as np

    return np.asarray(values, dtype="<f4").tobytes()


# ---- in the paged engine's steps (launch.py launches them, resolve.py reads their results)


def split_pooled(sampling: list[Seq], logits: torch.Tensor) -> tuple[list[Seq], torch.Tensor, list[Seq], DeviceResult]:
    """Take the prefill-only sequences out of those that sample: the sequences that still sample and their
    logits, and the others with their results (an embedding, or scores from their logits row) on their way
    to the host, one transfer for all."""
    keep = [j for j, s in enumerate(sampling) if s.pooling is None]
    pooled = [s for s in sampling if s.pooling is not None]
    values = []
    for j, seq in enumerate(sampling):
        p = seq.pooling
        if p is not None:
            values.append(embedding(p, seq.pool_sum, seq.prompt_len) if p.task == "embed" else scores(p, logits[j]))
    if keep and len(keep) != len(sampling):
        (index,) = to_device([keep], torch.int64, logits.device)
        logits = logits.index_select(0, index)
    return [sampling[j] for j in keep], logits, pooled, DeviceResult(values)


def hidden_rows(rows: list[tuple[Scheduled, int]]) -> tuple[list[int], list[tuple[Seq, int, int, int]]]:
    """The packed token indices whose final hidden states the embeddings of these rows pool, and per such
    sequence (seq, its first index in them, how many, the prompt position pooled up to after this step):
    last pooling reads its last prompt token, mean pooling every position of the chunk not summed before."""
    idx: list[int] = []
    spans = []
    for sc, first in rows:
        seq = sc.seq
        p = seq.pooling
        if p is None or p.task != "embed":
            continue
        c, n = seq.num_computed, sc.num_new
        if p.pooling == "mean":
            positions = range(max(c, seq.pooled_upto), c + n)
        elif c + n == len(seq.tokens):
            positions = range(c + n - 1, c + n)
        else:
            continue
        if positions:
            spans.append((seq, len(idx), len(positions), c + n))
            idx.extend(first + q - c for q in positions)
    return idx, spans


def add_pooled(spans: list[tuple[Seq, int, int, int]], hidden: torch.Tensor) -> None:
    """Add each sequence's hidden states of the step to its pooled state, on the device."""
    for seq, at, k, upto in spans:
        part = hidden[at:at + k].sum(0)
        mean = seq.pools_every_token
        seq.pool_sum = part if seq.pool_sum is None or not mean else seq.pool_sum + part
        seq.pooled_upto = upto


def pooled_outputs(pooled: list[Seq], result: DeviceResult) -> list[StepOutput]:
    """The prefill-only requests' one output each: finished, with their embedding or scores."""
    outputs = []
    for seq, values in zip(pooled, result.wait(), strict=True):
        p = seq.pooling
        assert p is not None
        out = StepOutput(seq.uid, 0, [], 0, "stop", cached_tokens=max(seq.cached_tokens, 0))
        if p.task == "embed":
            out.embedding = float32_bytes(values)
        else:
            out.scores = values
        outputs.append(out)
    return outputs
