"""Training a small EAGLE-3 head for a target, on CPU: the demo head (examples/train_demo_head.py) and tests.

The head learns the target's next-token distribution (soft labels from the target's own logits, so it
learns what verification will accept) from the target's states, with EAGLE-3's training-time test: at
depth s (1..depth) the head reads its own output of depth s - 1 where the target's states were, and its
queries see the committed positions (depth 1's keys, which came from the target's states) and their
own branch (the diagonal of every deeper level), exactly the keys a tree node sees at depth s - 1 below
its root when drafting.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.nn.functional as F

from ..models.compat import apply_rotary_pos_emb
from ..drafters.eagle3 import Eagle3Config, Eagle3Head, FeatureTap, default_layer_ids


def new_head_for(target, hidden: int | None = None, intermediate: int | None = None, heads: int = 4,
                 kv_heads: int | None = None, layer_ids: tuple[int, ...] | None = None, seed: int = 0) -> Eagle3Head:
    """A fresh head for `target` with its own embeddings (copied from the target's where the widths agree)
    and the full vocabulary as its draft vocabulary."""
    text = target.config.get_text_config(decoder=True)
    hidden = hidden or text.hidden_size
    rope = dict(getattr(text, "rope_parameters", None) or {"rope_theta": getattr(text, "rope_theta", 10000.0)})
    config = Eagle3Config.from_dict({
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {
            "hidden_size": hidden, "intermediate_size": intermediate or 3 * hidden, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads or heads, "head_dim": hidden // heads, "rms_norm_eps": text.rms_norm_eps,
            "hidden_act": "silu", "rope_theta": rope.get("rope_theta", 10000.0),
            "max_position_embeddings": text.max_position_embeddings, "vocab_size": text.vocab_size,
        },
        "draft_vocab_size": text.vocab_size, "target_hidden_size": text.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(layer_ids or default_layer_ids(text.num_hidden_layers)),
    })
    torch.manual_seed(seed)
    head = Eagle3Head(config)
    with torch.no_grad():
        embeddings = target.get_input_embeddings().weight
        if embeddings.shape[1] == hidden:
            head.embed_tokens.weight.copy_(embeddings[: config.vocab_size])
        else:
            head.embed_tokens.weight.normal_(0, 0.02)
        for module in (head.fc, head.lm_head, *head.midlayer.modules()):
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0, 0.02)
                if module.bias is not None:
                    module.bias.zero_()
    return head.bind(target)


def train_head(head: Eagle3Head, target, batches: Iterator[torch.Tensor], steps: int, lr: float = 3e-3,
               depth: int = 3, decay: float = 0.8, log=None) -> list[float]:
    """Train `head` on token windows (B, N) from `batches` for `steps` steps; returns each step's loss."""
    target.eval()
    params = [p for n, p in head.named_parameters() if not (head.shares_embeddings and n.startswith("embed_tokens"))]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(steps // 20, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: min((i + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(i / steps, 1.0))))
    )
    losses = []
    head.train()
    for step in range(steps):
        ids = next(batches)
        states, probs = target_states(target, head.layer_ids, ids)
        loss = ttt_loss(head, ids, states, probs, depth, decay)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if log is not None and (step % 50 == 0 or step == steps - 1):
            log(f"step {step}: loss {sum(losses[-50:]) / len(losses[-50:]):.3f}")
    head.eval()
    return losses


@torch.no_grad()
def target_states(target, layer_ids, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's states at `layer_ids` (B, N, 3H) and its next-token probabilities (B, N, V)."""
    with FeatureTap(target, layer_ids) as tap:
        logits = target(ids).logits.float()
        return tap.take(), torch.softmax(logits, dim=-1)


def ttt_loss(head: Eagle3Head, ids, states, probs, depth: int, decay: float) -> torch.Tensor:
    """Soft cross-entropy of `depth` levels of training-time test (see the module docstring and ttt_levels);
    probs (B, N, V): the target's next-token probabilities."""
    M = ids.shape[1] - depth
    d2t_ids = head.target_ids(torch.arange(head.config.draft_vocab_size, device=ids.device))
    total = 0.0
    for s, logits in enumerate(ttt_levels(head, ids, states, depth), start=1):
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        labels = probs[:, s : s + M][..., d2t_ids]
        labels = labels / labels.sum(-1, keepdim=True).clamp_min(1e-9)
        total = total + decay ** (s - 1) * -(labels * logprobs).sum(-1).mean()
    return total


def ttt_levels(head: Eagle3Head, ids: torch.Tensor, states: torch.Tensor, depth: int) -> Iterator[torch.Tensor]:
    """The head's logits (B, M, V_draft), M = N - depth, at each of `depth` levels of training-time test.

    ids (B, N): the token window; states (B, N, 3H): the target's states at head.layer_ids. Level s
    (1-based) at window position j: token x_{j+s} with hidden input f_j (s = 1) or the level s - 1 output
    at j, position j + s - 1; it predicts x_{j+s+1}, whose target distribution is the target's at
    position j + s (so level s's labels are the target's [:, s : s + M]).
    """
    B, N = ids.shape
    M = N - depth
    attn = head.midlayer.self_attn
    hidden = head.fuse(states[:, :M])
    keys, values = [], []
    for s in range(1, depth + 1):
        tokens = ids[:, s : s + M]
        embeds = head.embed_tokens(tokens)
        positions = torch.arange(s - 1, s - 1 + M, device=ids.device)[None].expand(B, M)
        layer = head.midlayer
        residual = layer.hidden_norm(hidden) if layer.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        q = attn.q_proj(x).view(B, M, attn.heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(B, M, attn.kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(B, M, attn.kv_heads, attn.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *head.rotary(embeds, positions))
        keys.append(k)
        values.append(v)
        K, V = torch.cat(keys, dim=2), torch.cat(values, dim=2)
        groups = attn.heads // attn.kv_heads
        if groups > 1:
            K, V = K.repeat_interleave(groups, dim=1), V.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, K, V, attn_mask=ttt_mask(M, s, ids.device))
        hidden = residual + attn.o_proj(out.transpose(1, 2).reshape(B, M, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        yield head.lm_head(head.norm(hidden))


def ttt_mask(M: int, level: int, device) -> torch.Tensor:
    """(M, level * M) bool: level `level`'s query j sees level 1's keys i <= j and every deeper level's key j."""
    causal = torch.ones(M, M, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(M, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * (level - 1), dim=1)


def token_windows(sequences: list[list[int]], length: int, batch: int, seed: int = 0) -> Iterator[torch.Tensor]:
    """Endless random windows (batch, length) cut from token sequences at least `length` long."""
    usable = [s for s in sequences if len(s) >= length]
    if not usable:
        raise ValueError(f"no sequence holds {length} tokens")
    g = torch.Generator().manual_seed(seed)
    while True:
        rows = []
        for _ in range(batch):
            seq = usable[int(torch.randint(len(usable), (1,), generator=g))]
            start = int(torch.randint(len(seq) - length + 1, (1,), generator=g))
            rows.append(seq[start : start + length])
        yield torch.tensor(rows)
