"""Qwen2.5-Omni's token2wav DiT as a flow-matching velocity over one batch of windows, on
the module's own weights, with what the solver's steps share computed once.

The module's ``forward`` rebuilds, at each of a window's 36 solver evaluations (9 RK4
steps of 4, each with its classifier-free-guidance half), what depends on the window
alone: the speaker encoder over the reference mel, the codes' embeddings, the rotary
tables and, in every layer, a (batch, heads, frames, frames) boolean block mask that
attention turns into an additive one. On CPU that rebuilding was about half of a
window's time. :class:`WindowVelocity` builds each of them once per window (the masks
once per distinct layer pattern, broadcast over batch and heads); each evaluation then
runs only the layers. Same weights, same operations in the same order but the mask's
form, so the same mel up to float rounding (``test_qwen_omni.py`` holds the waveform to
``generate``'s within 1e-5 of its peak).
"""

from __future__ import annotations

from typing import Any


class WindowVelocity:
    """``velocity(t, x)`` of the DiT for ``codes`` (B, n) with each row's voice ``cond``
    (B, dim) and reference mel ``ref_mel`` (B, frames, mel), guided by ``guidance`` (the
    module's ``apply_cfg`` path; below 1e-5, the unguided one)."""

    def __init__(self, dit: Any, cond: Any, ref_mel: Any, codes: Any, guidance: float) -> None:
        import torch
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
            apply_rotary_pos_emb,
            deinterleave_head_dim,
        )

        self.dit = dit
        self.guidance = guidance
        self.cfg = guidance >= 1e-5
        self.rope = apply_rotary_pos_emb
        self.deinterleave = deinterleave_head_dim
        frames = codes.shape[1] * dit.repeats
        speaker = cond.unsqueeze(1).repeat(1, frames, 1)
        embed = dit.input_embed
        with torch.inference_mode():
            code = dit.text_embed(codes, drop_code=False)
            if self.cfg:  # the guided rows, then the unconditioned ones (the module's order)
                speaker = torch.cat([speaker, torch.zeros_like(speaker)])
                ref_mel = torch.cat([ref_mel, torch.zeros_like(ref_mel)])
                code = torch.cat([code, dit.text_embed(codes, drop_code=True)])
            voice = embed.spk_encoder(ref_mel).unsqueeze(1).repeat(1, frames, 1)
            self.rest = torch.cat((voice, code, speaker), dim=-1)  # beside x in the input
            positions = torch.arange(frames)[None, :].repeat(self.rest.shape[0], 1)
            self.rotary = dit.rotary_embed(self.rest, positions)
            block = torch.arange(frames) // dit.block_size
            diff = block[None, :] - block[:, None]  # key block - query block
            masks: dict[tuple[int, int], Any] = {}
            self.masks = []
            for layer in dit.transformer_blocks:
                key = (layer.look_backward_block, layer.look_ahead_block)
                if key not in masks:
                    allowed = (diff >= -key[0]) & (diff <= key[1])
                    masks[key] = torch.zeros(frames, frames).masked_fill(~allowed, float("-inf"))
                self.masks.append(masks[key][None, None])

    def __call__(self, t: Any, x: Any) -> Any:
        import torch

        dit = self.dit
        rows = x.shape[0] * (2 if self.cfg else 1)
        time = dit.time_embed(t.repeat(rows) if t.ndim == 0 else t)
        h = torch.cat([x, x]) if self.cfg else x
        h = dit.input_embed.proj(torch.cat((h, self.rest), dim=-1))
        for layer, mask in zip(dit.transformer_blocks, self.masks, strict=True):
            h = self._layer(layer, h, time, mask)
        out = dit.proj_out(dit.norm_out(h, time))
        if not self.cfg:
            return out
        guided, null = torch.chunk(out, 2, dim=0)
        return guided + (guided - null) * self.guidance

    def _layer(self, layer: Any, h: Any, time: Any, mask: Any) -> Any:
        """``DiTDecoderLayer.forward`` with the window's additive ``mask``."""
        import torch.nn.functional as F

        norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = layer.attn_norm(h, emb=time)
        attn = layer.attn
        b = norm.shape[0]
        q, k, v = (
            proj(norm).view(b, -1, attn.heads, attn.inner_dim // attn.heads).transpose(1, 2)
            for proj in (attn.to_q, attn.to_k, attn.to_v)
        )
        cos, sin = self.rotary  # (the checkpoint's RoPE is on the first head only)
        first = self.deinterleave(q[:, :1]), self.deinterleave(k[:, :1])
        q[:, :1], k[:, :1] = self.rope(*first, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        a = a.transpose(1, 2).reshape(b, -1, attn.inner_dim).to(q.dtype)
        h = h + gate_msa.unsqueeze(1) * attn.to_out[1](attn.to_out[0](a))
        norm = layer.ff_norm(h) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        return h + gate_mlp.unsqueeze(1) * layer.ff(norm)
