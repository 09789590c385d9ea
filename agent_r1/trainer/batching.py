"""Group training rows into micro-batches under a token budget, computing every shared prefix once.

Agent rows repeat long prefixes: system prompt, tool schemas, few-shot examples; within a GRPO group the
whole question and often the first sampled tokens; within an agent harness's episode (a tree: sub-agents,
retries, compactions; rollout/merge.py) whole branches of history. A micro-batch's rows form a trie over
their ids, and the micro-batch runs as one sequence holding each trie node once (in depth-first order),
with a 4D attention mask that lets a token see exactly the tokens on its own root-to-token path
(`_shared_forward`). Each row's hidden states are gathered from the one sequence, so a token trained in
one row and prompt in another is computed once and serves both. The gradient is exact: the attention of
every token reads the same keys as in its row alone (as in Claw-R1's prefix-tree merge and AReaL's tree
training). `MicroBatch.num_tokens` is what is computed; the update logs its share of the rows' tokens
(`computed_share`). On the calculator task this removes most of the training tokens (figures:
docs/log/measurements.md). An earlier version ran the prefix with a KV cache copied to every row and the
suffixes right-padded to the longest: on the demo's micro-batches a large share of the suffix positions
were padding; against it the one sequence holds less for backward and runs faster (CPU SDPA's flash
kernel takes the mask and holds only its output and log-sum-exp; figures: docs/log/measurements.md). The
one sequence also works where a cache cannot carry the prefix: with activation checkpointing
(transformers drops the cache inside checkpointed layers) and under FSDP2 (a layer's gathered weights are
freed after each forward call).

Rows without a worthwhile shared prefix are packed instead: concatenated into one sequence whose
position ids restart at 0 at every row, which transformers turns into a block-diagonal causal mask
(its "packed sequence" detection). On CPU the masked attention over a packed sequence is dense, so
keep `max_tokens` near a row's length there (1024 by default).

Rows are sorted by their ids, so that the rows of a trie are neighbours and each row's new tokens start
where it parts from the one before it (the trie's size is the rows' tokens less their neighbours'
common prefixes). A run of rows sharing a prefix is cut into consecutive bins, as few as filling makes
but even (`_balanced_cut`); the other rows are packed first-fit-decreasing, both by the tokens they will
compute.

Rows with images (a vision-language model) are compared by their keys, the ids with each placeholder
standing for its image's digest, and every forward starts from the same input embeddings with the vision
tower's features in the placeholders, so the tower is trained too (docs/vision.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from agent_r1.distributed.fsdp import ROOT_FORWARD
from agent_r1.distributed.group import SINGLE, Dist
from agent_r1.engines.protocol import SLOT_ATTENTION
from agent_r1.models.grammar import allowed
from agent_r1.models.precision import autocast, model_device
from agent_r1.models.tree_attention import TREE_KWARG, Tree, tree
from agent_r1.models.vision import embed_with_images, image_token_id, placeholder_keys, rope_index, rope_positions
from agent_r1.types import Image


@dataclass
class Row:
    """One training row with every per-token tensor the losses need; all [T]."""

    input_ids: torch.Tensor  # long
    mask: torch.Tensor  # float, 1 on sampled tokens
    old_logp: torch.Tensor  # rollout log-probs (0 off the mask)
    adv: torch.Tensor  # advantages (0 off the mask)
    seg: torch.Tensor  # long, segment id of each token (one per step response) for seq aggregation / GSPO
    ref_logp: torch.Tensor | None = None  # reference-policy log-probs when KL is on
    old_values: torch.Tensor | None = None  # critic values at rollout time (PPO)
    returns: torch.Tensor | None = None  # critic targets (PPO)
    rollout_logp: torch.Tensor | None = None  # the engine's log-probs when old_logp was recomputed (TIS)
    version: torch.Tensor | None = None  # long: the version that sampled each token's step (-1: none, or several)
    images: list[Image] = field(default_factory=list)  # the images of input_ids' placeholders, in order
    key: torch.Tensor | None = None  # long [T]: input_ids with placeholders as image keys (rows with images)
    # sampled under a grammar: the positions [K] of those tokens, and the bitmask [K, ceil(V / 32)] (int32) of
    # the tokens the grammar allowed there (models/grammar.py), under which their log-probs are computed
    constrained: torch.Tensor | None = None
    allowed: torch.Tensor | None = None


@dataclass
class MicroBatch:
    """Rows concatenated: one [L] sequence per field, position ids restart per row.

    With `take` the rows share prefixes, computed once: the forward runs the L' tokens `take` [L'] picks
    (the rows' trie, depth first), each row's new tokens attending to their own path (`tree`), and row
    token p reads computed token `src[p]` [L]."""

    input_ids: torch.Tensor  # [L]
    position_ids: torch.Tensor  # [L]
    mask: torch.Tensor  # [L]
    old_logp: torch.Tensor  # [L]
    adv: torch.Tensor  # [L]
    seg: torch.Tensor  # [L]
    ref_logp: torch.Tensor | None
    old_values: torch.Tensor | None
    returns: torch.Tensor | None
    rows: list[Row]  # the rows, in the order they are concatenated
    take: torch.Tensor | None = None  # [L'] where each computed token sits in the flat rows
    src: torch.Tensor | None = None  # [L] the computed token each row token reads
    tree: Tree | None = None  # per row: its new tokens' span in the L' and the keys it reads
    shared: list[int] = field(default_factory=list)  # per row: its leading tokens computed for an earlier row
    # [M] positions of the sampled tokens (mask == 1), found on the CPU while packing: `nonzero` on the
    # device would wait for the GPU at every micro-batch (its output size is data-dependent)
    targets: torch.Tensor | None = None
    constrained: torch.Tensor | None = None  # [K] positions of tokens sampled under a grammar (Row.constrained)
    allowed: torch.Tensor | None = None  # [K, W] int32 their grammars' bitmasks

    @property
    def images(self) -> list[Image]:
        """The images of `input_ids`' placeholders, in order (the rows' images, concatenated)."""
        return [image for r in self.rows for image in r.images]

    @property
    def row_lens(self) -> list[int]:
        return [len(r.input_ids) for r in self.rows]

    @property
    def row_spans(self) -> list[tuple[int, int]]:
        """(offset, length) of each row in the flat tensors."""
        starts = [0]
        for n in self.row_lens[:-1]:
            starts.append(starts[-1] + n)
        return list(zip(starts, self.row_lens, strict=True))

    @property
    def num_tokens(self) -> int:
        """Tokens the forward pass computes (each shared prefix once)."""
        return len(self.take) if self.take is not None else int(self.input_ids.numel())

    @property
    def prefix_len(self) -> int:
        """The prefix every row shares (the trie's root), 0 for packed rows."""
        return min(self.shared[1:], default=0) if self.take is not None else 0


def pack(
    rows: list[Row], max_tokens: int, min_shared_prefix: int = 32, device: torch.device | str = "cpu"
) -> list[MicroBatch]:
    """Micro-batches of at most `max_tokens` computed tokens (a longer row gets one of its own), their
    tensors on `device` (rows stay where they are, on the CPU: only a micro-batch is on the GPU at once).

    Rows are sorted by their ids, so rows sharing a prefix of >= `min_shared_prefix` tokens become
    neighbours; each such run is cut into consecutive bins that compute each shared prefix once. The
    other rows are packed first-fit-decreasing.
    """
    for row in rows:
        if len(row.input_ids) and float(row.mask[0]) != 0.0:
            raise ValueError("a training row must start with a prompt token (its first token has no prediction)")
    runs: list[list[Row]] = []
    for row in sorted(rows, key=lambda r: _key(r).tolist()):
        if runs and _common(_key(runs[-1][-1]), _key(row)) >= min_shared_prefix:
            runs[-1].append(row)
        else:
            runs.append([row])
    out, loose = [], []
    for run in runs:
        if len(run) == 1:
            loose += run
            continue
        out += [_concat(b, len(b) > 1, device) for b in _balanced_cut(run, max_tokens)]
    return out + [_concat(b, False, device) for b in _first_fit(loose, max_tokens)]


def forward_rows(
    model: torch.nn.Module,
    rows: list[Row],
    max_tokens: int,
    fn: Callable[[MicroBatch], torch.Tensor],
    dist: Dist = SINGLE,
) -> list[torch.Tensor]:
    """`fn(micro-batch) -> [L]` over the rows packed like the update; returns each row's part [T] on the
    CPU, in the order of `rows`. Under torchrun each rank runs its share of the rows (as many
    micro-batches as the busiest rank: FSDP2's gathers pair up) and the parts are all-gathered."""
    device = model_device(model)
    mine = dist.shard(range(len(rows)), cost=lambda i: len(rows[i].input_ids))
    micro = pack([rows[i] for i in mine], max_tokens, device=device)
    index = {id(rows[i]): i for i in mine}
    parts: dict[int, torch.Tensor] = {}
    for k in range(dist.max(len(micro))):
        if k >= len(micro):  # this rank is out of rows: a repeat whose result is dropped
            fn(micro[0] if micro else pack(rows[:1], max_tokens, device=device)[0])
            continue
        mb = micro[k]
        for row, part in zip(mb.rows, fn(mb).cpu().split(mb.row_lens), strict=True):
            parts[index[id(row)]] = part
    if dist.world > 1:
        parts = {i: t for rank_parts in dist.gather(parts) for i, t in rank_parts.items()}
    return [parts[i] for i in range(len(rows))]


def _cut(run: list[Row], max_tokens: int) -> list[list[Row]]:
    """`run` (sorted by ids) cut into consecutive bins, each filled while it computes at most `max_tokens`
    tokens: a row joining a bin adds the tokens after its common prefix with the bin's last row."""
    bins: list[list[Row]] = []
    total = 0  # the last bin's computed tokens
    for row in run:
        if bins:
            extra = len(row.input_ids) - _common(_key(bins[-1][-1]), _key(row))
            if total + extra <= max_tokens:
                bins[-1].append(row)
                total += extra
                continue
        bins.append([row])
        total = len(row.input_ids)
    return bins


def _balanced_cut(run: list[Row], max_tokens: int) -> list[list[Row]]:
    """As few consecutive bins as `_cut` makes, as even as a smaller budget keeps them.

    Why: a micro-batch's activations are what backward holds, so the peak memory of an update follows its
    largest micro-batch. Filling bins to the budget one after another leaves a small last bin (on the
    demo: 7 rows of ~980 tokens, then 1 row of ~340); the smallest budget that still needs as many bins
    computes the same prefixes as often and lowers the largest bin. The number of bins only grows as the
    budget shrinks (a bin's cost only falls when rows leave it), so the budget is found by bisection."""
    bins = _cut(run, max_tokens)
    lo = max(len(r.input_ids) for r in run)  # a bin of one row computes all of it
    hi = max(max_tokens, lo)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_cut(run, mid)) <= len(bins):
            hi = mid
        else:
            lo = mid + 1
    return _cut(run, hi)


def _first_fit(rows: list[Row], max_tokens: int) -> list[list[Row]]:
    bins: list[list[Row]] = []
    room: list[int] = []
    for row in sorted(rows, key=lambda r: -len(r.input_ids)):
        n = len(row.input_ids)
        for i, free in enumerate(room):
            if n <= free:
                bins[i].append(row)
                room[i] -= n
                break
        else:
            bins.append([row])
            room.append(max_tokens - n)
    return bins


def _common(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the common prefix of `a` and `b`."""
    c = min(len(a), len(b))
    diff = (a[:c] != b[:c]).nonzero()
    return int(diff[0]) if len(diff) else c


def _key(row: Row) -> torch.Tensor:
    """What rows are compared by: their ids, with each image's placeholders as a key of its pixels."""
    return row.key if row.key is not None else row.input_ids


def image_row_key(input_ids: list[int], images: list[Image], token_id: int | None) -> torch.Tensor | None:
    """`Row.key` for a row with images (None without: its ids are its key)."""
    return torch.tensor(placeholder_keys(input_ids, images, token_id)) if images else None


def _concat(rows: list[Row], share: bool, device: torch.device | str = "cpu") -> MicroBatch:
    """The rows as one micro-batch; with `share` (rows sorted by ids) their trie: each row's tokens after
    its common prefix with the row before it are new, the ones before are read where they were computed."""

    def cat(name: str) -> torch.Tensor | None:
        parts = [getattr(r, name) for r in rows]
        return None if parts[0] is None else torch.cat(parts).to(device, non_blocking=True)

    positions = torch.cat([torch.arange(len(r.input_ids), device=device) for r in rows])
    targets = torch.cat([r.mask for r in rows]).nonzero().squeeze(-1).to(device, non_blocking=True)
    mb = MicroBatch(
        input_ids=cat("input_ids"),
        position_ids=positions,
        mask=cat("mask"),
        old_logp=cat("old_logp"),
        adv=cat("adv"),
        seg=cat("seg"),
        ref_logp=cat("ref_logp"),
        old_values=cat("old_values"),
        returns=cat("returns"),
        rows=rows,
        targets=targets,
    )
    if any(r.constrained is not None for r in rows):
        starts = [0, *torch.tensor([len(r.input_ids) for r in rows]).cumsum(0).tolist()]
        held = [(r, s) for r, s in zip(rows, starts, strict=False) if r.constrained is not None]
        mb.constrained = torch.cat([r.constrained + s for r, s in held]).to(device)
        mb.allowed = torch.cat([r.allowed for r, _ in held]).to(device)
    if share:
        take, src, spans, paths, mb.shared = _trie(rows)
        mb.take, mb.src, mb.tree = take.to(device), src.to(device), tree(spans, paths).to(device)
    return mb


def _trie(rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]], list[torch.Tensor], list[int]]:
    """(take [L'], src [L], each row's new tokens' span [a, b) in the L', each row's path [c], shared per row)
    of rows sorted by ids, built on the CPU.

    Row k's first `shared[k]` = c tokens are row k-1's (read where row k-1 reads them: its path); the rest
    are new, laid out after everything before them, so the layout is the trie depth first. A new token
    sees its row's path and the earlier new tokens of its own row."""
    take, src, spans, paths, shared = [], [], [], [], []
    offset = computed = 0
    prev: torch.Tensor | None = None
    for k, row in enumerate(rows):
        n = len(row.input_ids)
        c = _common(_key(rows[k - 1]), _key(row)) if k else 0
        own = torch.arange(computed, computed + n - c)  # [n - c]
        path = torch.cat([prev[:c], own]) if prev is not None else own  # [n]
        take.append(torch.arange(offset + c, offset + n))
        src.append(path)
        spans.append((computed, computed + n - c))
        paths.append(path[:c])
        shared.append(c)
        offset, computed, prev = offset + n, computed + n - c, path
    return torch.cat(take), torch.cat(src), spans, paths, shared


def token_logprobs(
    model: torch.nn.Module,
    mb: MicroBatch,
    temperature: float = 1.0,
    *,
    entropy: bool = False,
    entropy_grad: bool = False,
    hidden: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-prob of every masked token under `model` from one forward pass over the micro-batch.

    Logits are computed only at positions that predict a masked token, which skips the vocabulary
    projection for prompt and tool tokens; the model's own logit processing (`_logit_ops`: soft-cap,
    scale) follows the projection, then the temperature. Returns logp [L] (0 off the mask); entropy
    [L] (0 off the mask; differentiable when `entropy_grad`) or None; the last hidden state aligned
    to inputs [L, H] (zeros inside a shared prefix that was run once) or None.
    """
    ops = _logit_ops(model)  # before the forward, so that an unsupported model fails at once
    targets = mb.targets if mb.targets is not None else mb.mask.nonzero().squeeze(-1)  # [M] sampled positions
    with autocast(model):  # bf16 matrix products when dtype=bf16; everything after the head is fp32
        states, logits = _as_forward(model, _states_and_logits, model, mb, targets)  # [L, H], [M, V]
    logits = logits.float()  # [M, V]
    for op, value in ops:  # none for most models (Llama, Qwen, Mistral, SmolLM, ...)
        if op == "softcap":
            logits = torch.tanh(logits / value) * value
        elif op == "mul":
            logits = logits * value
        else:  # "div"
            logits = logits / value
    if temperature != 1.0:
        logits = logits / temperature
    if mb.constrained is not None:  # tokens sampled under a grammar: log-probs over what it allowed, as sampled
        logits = _grammar_masked(logits, targets, mb.constrained, mb.allowed)
    ids = mb.input_ids[targets]  # [M]
    if entropy and entropy_grad and torch.is_grad_enabled():  # an entropy bonus: autograd through both
        lse = torch.logsumexp(logits, dim=-1)  # [M]
        picked = logits.gather(-1, ids[:, None]).squeeze(-1) - lse  # [M]
        per_token = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # [M]
    else:
        picked, per_token = _TokenLogprobs.apply(logits, ids, entropy)  # [M], [M] (entropy as a metric)
    logp = picked.new_zeros(len(mb.input_ids)).index_put((targets,), picked)
    ent = per_token.new_zeros(len(mb.input_ids)).index_put((targets,), per_token) if entropy else None
    return logp, ent, states if hidden else None


def _grammar_masked(
    logits: torch.Tensor, targets: torch.Tensor, constrained: torch.Tensor, bits: torch.Tensor
) -> torch.Tensor:
    """logits [M, V] with every token a grammar did not allow at a constrained target set to the lowest float:
    the engine sampled those tokens from the softmax over the allowed ones (models/grammar.py), so the
    ratio's log-probs are taken over them too, and the disallowed tokens get no gradient. (The lowest float,
    not -inf: 0 x -inf would make the entropy NaN.)"""
    if not len(targets):
        return logits
    k = torch.searchsorted(targets, constrained).clamp_(max=len(targets) - 1)  # [K] its row among the targets
    hit = targets[k] == constrained  # [K] False for a constrained token outside the loss mask (unseen)
    banned = torch.zeros_like(logits, dtype=torch.bool)  # [M, V]
    banned[k[hit]] = ~allowed(bits[hit], logits.shape[-1])
    return logits.masked_fill(banned, torch.finfo(logits.dtype).min)


class _TokenLogprobs(torch.autograd.Function):
    """log p(target) of each row of logits [M, V], and optionally its entropy (no gradient).

    Why: with M ~ 1000 sampled tokens and V = 49152, every [M, V] temporary is 200 MB. Autograd
    through logsumexp, plus an entropy metric, makes about six of them; this makes one, the softmax,
    and its backward reuses it in place: d log p(t) / dz = onehot(t) - softmax(z). The in-place reuse
    means the graph must not be backpropagated twice (the trainer never retains it).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, ids: torch.Tensor, with_entropy: bool):
        lse = torch.logsumexp(logits, dim=-1)  # [M]
        logp = logits.gather(-1, ids[:, None]).squeeze(-1) - lse  # [M]
        ent = torch.zeros_like(lse)
        if ctx.needs_input_grad[0] or with_entropy:
            probs = (logits - lse[:, None]).exp_()  # [M, V]
            if with_entropy:  # H = lse - sum_v p_v z_v, the dot product without a [M, V] temporary
                ent = lse - torch.bmm(probs[:, None, :], logits[:, :, None]).view(-1)
            ctx.save_for_backward(probs, ids)
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_ent: torch.Tensor):
        probs, ids = ctx.saved_tensors
        grad = probs.mul_(-grad_logp[:, None])  # [M, V] = -g * softmax
        grad.scatter_add_(-1, ids[:, None], grad_logp[:, None])  # + g at the target
        return grad, None, None


def _states_and_logits(
    model: torch.nn.Module, mb: MicroBatch, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Last hidden states [L, H] and the logits [M, V] at the positions that predict `targets`."""
    embeds, rope = _image_embeds(model, mb), _rope(model, mb)  # [L, H] and [3, L], None without images
    forward = _packed_forward if mb.take is None else _shared_forward
    states = forward(model, mb, embeds, rope)  # [L, H]
    return states, model.get_output_embeddings()(states[targets - 1])


def _image_embeds(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor | None:
    """Input embeddings [L, H] with the vision tower's features in the placeholders of the micro-batch's
    images (gradients reach the tower), or None for rows without images (the decoder embeds the ids)."""
    images = mb.images
    if not images:
        return None
    return embed_with_images(model, mb.input_ids, images, image_token_id(model))


def _rope(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor | None:
    """Multi-dimensional rotary positions [3, L] of the micro-batch's rows (each from its own start, by
    the model's `get_rope_index`) for a Qwen2-VL-family model given images; None otherwise (positions
    are `mb.position_ids`)."""
    fn = rope_index(model) if mb.images else None
    if fn is None:
        return None
    token = image_token_id(model)
    parts = [
        rope_positions(fn, mb.input_ids[start : start + n], row.images, token)
        if row.images
        else mb.position_ids[start : start + n].expand(3, -1)
        for row, (start, n) in zip(mb.rows, mb.row_spans, strict=True)
    ]
    return torch.cat(parts, dim=1)


def _as_forward(model: torch.nn.Module, fn, *args):
    """`fn(*args)` as the model's forward: a model sharded by FSDP2 gathers its root weights (embeddings,
    LM head) only around one (agent_r1/distributed/fsdp.py); any other model just runs `fn`."""
    run = getattr(model, ROOT_FORWARD, None)
    return run(fn, *args) if run is not None else fn(*args)


def _packed_forward(
    model: torch.nn.Module, mb: MicroBatch, embeds: torch.Tensor | None = None, rope: torch.Tensor | None = None
) -> torch.Tensor:
    """Last hidden states [L, H] of the rows packed into one sequence (block-diagonal attention). With
    mrope the positions are [4, 1, L]: the text positions that restart per row (how transformers sees
    the packing), then the three rotary ones."""
    tokens = {"input_ids": mb.input_ids[None]} if embeds is None else {"inputs_embeds": embeds[None]}
    positions = mb.position_ids[None] if rope is None else torch.cat([mb.position_ids[None], rope])[:, None]
    out = _backbone(model)(
        **tokens,
        position_ids=positions,
        use_cache=False,  # a cache would switch off transformers' packed-sequence (block-diagonal) mask
    )
    return out.last_hidden_state[0]


def _shared_forward(
    model: torch.nn.Module, mb: MicroBatch, embeds: torch.Tensor | None = None, rope: torch.Tensor | None = None
) -> torch.Tensor:
    """Last hidden states [L, H]: the rows' trie as one sequence in one forward call, each token seeing its
    own path, at its position in its rows; each row token then reads its computed state. Under SDPA the
    attention runs row by row along the tree (models/tree_attention.py); other attention gets the tree as
    one [L', L'] mask (`_tree_masks`)."""
    take = mb.take  # [L']
    positions = mb.position_ids[take]  # [L'] each token's position in the rows that hold it
    tokens = {"input_ids": mb.input_ids[take][None]} if embeds is None else {"inputs_embeds": embeds[take][None]}
    mask = _tree_masks(model, mb.tree, positions)
    extra = {TREE_KWARG: mask} if isinstance(mask, Tree) else {}
    out = _backbone(model)(
        **tokens,
        position_ids=positions[None] if rope is None else rope[:, take][:, None],
        # a Tree: a stand-in 4D mask (used as given, and not read: tree_sdpa reads the tree); else the mask
        attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool, device=take.device) if extra else mask,
        use_cache=False,
        **extra,
    ).last_hidden_state[0]  # [L', H]
    return out[mb.src]  # [L, H]: a shared token's gradient sums over the rows that read it, as row by row


def _tree_masks(
    model: torch.nn.Module, t: Tree, positions: torch.Tensor
) -> Tree | torch.Tensor | dict[str, torch.Tensor]:
    """The tree in the form the model's attention takes it. SDPA: the `Tree` itself, its masks additive in
    fp32 on the CPU (the mask SDPA would make of booleans, made once for all layers). Eager attention: one
    [1, 1, L', L'] additive mask over the sequence (a token sees the earlier tokens of its own path).

    transformers uses a 4D mask as given for every layer, so what its own masks would add must be
    here: sliding windows, by position (a token's window reaches back along its own path, not into
    other branches), as one mask for a model whose layers all slide (Mistral, `sliding_window` without
    `layer_types`) or as a mask per layer type for one that mixes them (Gemma 2/3: `layer_types`); under
    SDPA the layer's window comes with its call. Attention that takes no 4D mask (flash-attention) is
    refused in one line: the branches would see each other."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    impl = text._attn_implementation
    if impl not in ("sdpa", "eager", SLOT_ATTENTION):
        raise ValueError(
            f"shared-prefix micro-batches need an attention implementation that takes a 4D mask (sdpa or eager), "
            f"not {impl!r}: load the model with attn_implementation='sdpa'"
        )
    dtype = _backbone(model).get_input_embeddings().weight.dtype
    if impl != "eager":
        # SDPA would turn boolean masks into these (0 where seen, -inf elsewhere) in every layer and keep each
        # layer's copy for backward; given them, all layers keep these
        cpu_fp32 = dtype == torch.float32 and positions.device.type == "cpu" and not torch.is_autocast_enabled("cpu")
        return t.additive(dtype) if cpu_fp32 else t
    sees = torch.zeros(len(positions), len(positions), dtype=torch.bool, device=positions.device)  # [L', L']
    for (a, b), keys, seen in zip(t.spans, t.keys, t.masks, strict=True):
        sees[a:b, keys] = seen[0, 0]

    def form(m: torch.Tensor) -> torch.Tensor:  # [L', L'] -> [1, 1, L', L'], additive
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, torch.finfo(dtype).min)[None, None]

    window = getattr(text, "sliding_window", None)
    types = set(getattr(text, "layer_types", None) or ())
    windowed = sees & (positions[:, None] - positions[None, :] < window) if window else sees
    if "sliding_attention" not in types:  # every layer alike: windowed where a window is all it has
        return form(sees if types else windowed)
    if unknown := types - {"full_attention", "sliding_attention"}:
        raise ValueError(f"shared-prefix micro-batches do not support the layer types {sorted(unknown)}")
    return {"full_attention": form(sees), "sliding_attention": form(windowed)}


def _backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder without its LM head (works for plain and peft-wrapped causal LMs)."""
    return model.get_decoder()


# What some causal LMs' forward does to `lm_head(hidden)` before it returns logits (transformers 5.x), by
# model type: (config attribute, operation). Text configs with `final_logit_softcapping` set (Gemma 2, the
# Gemma 3 text model, ...) soft-cap; any other logit-changing attribute is refused by `_logit_ops`.
_LOGIT_OPS: dict[str, tuple[str, str]] = {
    **dict.fromkeys(("cohere", "cohere2"), ("logit_scale", "mul")),
    **dict.fromkeys(("granite", "granitemoe", "granitemoehybrid", "granitemoeshared"), ("logits_scaling", "div")),
}
_LOGIT_ATTRS = (  # config attributes that some causal LM's forward uses to change its logits
    "final_logit_softcapping", "logits_soft_cap", "logit_scale", "logits_scaling", "lm_head_multiplier",
    "output_multiplier", "output_logit_soft_cap", "logits_mup_width_multiplier",
)  # fmt: skip


def _logit_ops(model: torch.nn.Module) -> list[tuple[str, float]]:
    """The (operation, value) steps that `model`'s forward applies to its LM head's output.

    Why: `token_logprobs` runs the vocabulary projection itself (at sampled positions only), so the
    logit processing in the model's forward (Gemma's soft-cap, Cohere's and Granite's scales) must be
    redone here, exactly, or the trained log-probs are not those the rollout sampled from. Any other
    logit-changing attribute is refused with one line naming the model type, rather than trained on
    wrong log-probs. The steps run in float32 after the projection.
    """
    config = getattr(model, "config", None)
    if config is None:
        return []
    kind = getattr(config, "model_type", None)
    if kind in _LOGIT_OPS:
        attr, op = _LOGIT_OPS[kind]
    elif getattr(config, "final_logit_softcapping", None) is not None:
        attr, op = "final_logit_softcapping", "softcap"
    else:
        attr, op = None, None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for other in _LOGIT_ATTRS:
        value = getattr(text, other, None)
        if other != attr and value is not None and value != 1:
            raise ValueError(
                f"model type {kind!r} sets {other}={value!r}, which changes its logits in a way "
                "token_logprobs does not reproduce; training this model type is not supported"
            )
    value = getattr(config, attr, None) if attr else None
    return [(op, float(value))] if value is not None and (op == "softcap" or value != 1) else []
