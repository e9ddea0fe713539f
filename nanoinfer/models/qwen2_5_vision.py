"""Qwen2.5-VL's vision tower: patch embedding, blocks of window attention (full attention in
`fullatt_block_indexes`) with a 2D rotary embedding, then the patch merger (2x2 patches -> one
language-model token).

The tower is replicated on every tensor-parallel rank (it is small next to the language model, and
each rank then has the embeddings without a collective). Its layers use the dense weight method in
the model's dtype, whatever quantization the language model uses. Module names follow the
checkpoint's (`visual.blocks.0.attn.qkv`, ...).

Patches arrive as the image processor lays them out: each image's patches in 2x2 merge groups,
rows of groups top to bottom. Window attention reorders the groups window by window
(`window_order`); the merger's output is put back in the original order."""
from contextlib import nullcontext
from functools import lru_cache
from itertools import groupby

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from nanoinfer.kernels.rotary import rotate_
from nanoinfer.layers.activation import SiluAndMul
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from nanoinfer.layers.model_build import ModelBuild, join, whole_rows
from nanoinfer.layers.rotary_embedding import apply_rotary
from nanoinfer.utils.device_copy import tensor_to_device
from nanoinfer.utils.loader import check_shape


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d (kernel = stride = one patch), computed as the matmul it is."""

    def __init__(self, in_channels: int, temporal_patch_size: int, patch_size: int, embed_dim: int,
                 bias: bool = False, rows_product=whole_rows):
        super().__init__()
        self.rows_product = rows_product  # (ModelBuild's)
        self.shape = (embed_dim, in_channels, temporal_patch_size, patch_size, patch_size)
        self.weight = nn.Parameter(torch.empty(embed_dim, in_channels * temporal_patch_size * patch_size ** 2))
        self.weight.weight_loader = self._load
        self.bias = nn.Parameter(torch.empty(embed_dim)) if bias else None

    def _load(self, param: nn.Parameter, loaded: torch.Tensor):
        check_shape(loaded, self.shape)
        param.data.copy_(loaded.reshape(param.shape))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.rows_product(lambda rows: F.linear(rows, self.weight, self.bias), pixels.to(self.weight.dtype))


# cuDNN's attention builds an execution plan for every new batch shape, and the batch here (a
# step's windows or images) changes from step to step: flash and memory-efficient attention have no
# plan to build.
NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, build: ModelBuild, prefix: str):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = ReplicatedLinear(dim, 3 * dim, bias=True, build=build, prefix=join(prefix, "qkv"))
        self.proj = ReplicatedLinear(dim, dim, bias=True, build=build, prefix=join(prefix, "proj"))

    def forward(self, x: torch.Tensor, segments: list[int], rope: torch.Tensor) -> torch.Tensor:
        """x: [N, dim]; segments: lengths of the runs of rows that attend to each other (windows or
        whole images); rope: the per-row cos/sin table [N, head_dim]."""
        n = x.shape[0]
        qkv = self.qkv(x)
        if qkv.is_cuda:  # q and k, the first 2 * num_heads heads of each row, rotated in one kernel
            rotate_(qkv.view(n, 3 * self.num_heads, self.head_dim)[:, :2 * self.num_heads], rope)
            q, k, v = qkv.view(n, 3, self.num_heads, self.head_dim).unbind(1)
        else:
            q, k, v = qkv.view(n, 3, self.num_heads, self.head_dim).unbind(1)
            rows = torch.arange(n, device=x.device)
            q, k = apply_rotary(q, rows, rope), apply_rotary(k, rows, rope)
        out = torch.empty_like(q)
        start = 0
        with sdpa_kernel(NO_CUDNN) if x.is_cuda else nullcontext():
            for length, run in groupby(segments):  # a run of equal-length segments: one SDPA call
                count = len(list(run))
                end = start + count * length
                q_, k_, v_ = (t[start:end].view(count, length, self.num_heads, self.head_dim).transpose(1, 2)
                              for t in (q, k, v))
                out[start:end] = F.scaled_dot_product_attention(q_, k_, v_).transpose(1, 2).flatten(0, 1)
                start = end
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, intermediate: int, build: ModelBuild, prefix: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(dim, [intermediate] * 2, bias=True, build=build,
                                                       prefix=join(prefix, "gate_up_proj"))
        self.down_proj = ReplicatedLinear(intermediate, dim, bias=True, build=build, prefix=join(prefix, "down_proj"))
        self.act_fn = SiluAndMul()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))

    def process_weights_after_loading(self):
        """On CUDA, pad the intermediate features to a multiple of 64: cuBLAS runs a product whose K
        is not a multiple of 8 elements (Qwen2.5-VL-7B's 3420) on slow unaligned kernels."""
        if self.down_proj.weight.is_cuda:
            self.pad_intermediate(64)

    def pad_intermediate(self, multiple: int):
        """Zero-pad the intermediate features to a multiple of `multiple`. The padded features are
        silu(0) * 0 = 0 and meet zero columns of down_proj: the output is unchanged."""
        gate_up, down = self.gate_up_proj, self.down_proj
        inner = down.in_features
        pad = -inner % multiple
        if pad == 0:
            return

        def padded_rows(t):  # [gate; up] -> [gate; 0; up; 0]
            parts = t.view(2, inner, *t.shape[1:])
            return torch.cat([parts, parts.new_zeros(2, pad, *t.shape[1:])], dim=1).flatten(0, 1)
        gate_up.weight.data = padded_rows(gate_up.weight.data)
        if gate_up.bias is not None:
            gate_up.bias.data = padded_rows(gate_up.bias.data)
        down.weight.data = F.pad(down.weight.data, (0, pad))
        gate_up.out_features, down.in_features = 2 * (inner + pad), inner + pad


class VisionBlock(nn.Module):
    def __init__(self, config, build: ModelBuild, prefix: str):
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, 1e-6)
        self.norm2 = RMSNorm(config.hidden_size, 1e-6)
        self.attn = VisionAttention(config.hidden_size, config.num_heads, build, join(prefix, "attn"))
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, build, join(prefix, "mlp"))

    def forward(self, x, segments, rope):
        x = x + self.attn(self.norm1(x), segments, rope)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, dim: int, merge: int, build: ModelBuild, prefix: str):
        super().__init__()
        self.hidden = dim * merge ** 2
        self.ln_q = RMSNorm(dim, 1e-6)
        self.mlp = nn.ModuleList([
            ReplicatedLinear(self.hidden, self.hidden, bias=True, build=build, prefix=join(prefix, "mlp.0")),
            nn.GELU(),
            ReplicatedLinear(self.hidden, out_dim, bias=True, build=build, prefix=join(prefix, "mlp.2"))])

    def forward(self, x):
        x = self.ln_q(x).view(-1, self.hidden)
        for layer in self.mlp:
            x = layer(x)
        return x


def dummy_images(vision, num_tokens: int, device, dtype) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Patches of images of 32 x 32 patches (the last one smaller) making `num_tokens` language-model
    tokens or more: what memory profiling feeds a vision tower."""
    merge = vision.spatial_merge_size
    side = 32 // merge * merge
    per_image = (side // merge) ** 2
    grids = [(1, side, side)] * (num_tokens // per_image)
    if num_tokens % per_image:
        grids.append((1, merge, merge * (num_tokens % per_image)))
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    patches = sum(t * h * w for t, h, w in grids)
    return torch.zeros(patches, width, device=device, dtype=dtype), grids


def patch_positions(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(row, column) of every patch, in the processor's order (2x2 merge groups, row-major). [N, 2]"""
    return torch.from_numpy(np.concatenate([_grid_positions(*grid, merge) for grid in grids]))


def window_order(grids: list[tuple[int, int, int]], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """The merge groups reordered window by window (each window `window` x `window` groups, the last
    ones cut at the image's edge), and each window's length in patches."""
    order, lengths, base = [], [], 0
    for t, h, w in grids:
        groups, sizes = _grid_windows(t, h, w, merge, window)
        order.append(groups + base)
        lengths.extend(sizes)
        base += t * (h // merge) * (w // merge)
    return torch.from_numpy(np.concatenate(order)), lengths


# Per image size, cached: a step's images mostly share a few sizes, and these loops are host time
# spent before the tower's first kernel.
@lru_cache(maxsize=256)
def _grid_positions(t: int, h: int, w: int, merge: int) -> np.ndarray:
    hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    hh, ww = hh.reshape(shape).swapaxes(1, 2).ravel(), ww.reshape(shape).swapaxes(1, 2).ravel()
    return np.tile(np.stack([hh, ww], axis=-1), (t, 1))


@lru_cache(maxsize=256)
def _grid_windows(t: int, h: int, w: int, merge: int, window: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """One image's merge groups in window order (numbered from 0) and its windows' lengths."""
    gh, gw = h // merge, w // merge
    index = np.arange(t * gh * gw).reshape(t, gh, gw)
    cells = [index[frame, r:r + window, c:c + window].ravel()
             for frame in range(t) for r in range(0, gh, window) for c in range(0, gw, window)]
    return np.concatenate(cells), tuple(cell.size * merge * merge for cell in cells)


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, config, build: ModelBuild, prefix: str = "visual"):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"vision_config.hidden_act {config.hidden_act!r}: only 'silu' is implemented")
        self.merge = config.spatial_merge_size
        self.window = config.window_size // config.spatial_merge_size // config.patch_size  # in merge groups
        if not isinstance(config.window_size, int) or self.window < 1:
            raise ValueError(f"model config: vision_config.window_size={config.window_size!r} must be an int of at "
                             f"least patch_size * spatial_merge_size = {config.patch_size * self.merge} pixels")
        self.full_attention = set(config.fullatt_block_indexes)
        self.patch_embed = nn.ModuleDict({"proj": PatchEmbed(config.in_channels, config.temporal_patch_size,
                                                             config.patch_size, config.hidden_size,
                                                             rows_product=build.rows_product)})
        head_dim = config.hidden_size // config.num_heads
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        half = head_dim // 2  # each of the row and column positions turns half the rotary frequencies
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float) / half),
                             persistent=False)
        self.blocks = nn.ModuleList([VisionBlock(config, build, f"{prefix}.blocks.{i}") for i in range(config.depth)])
        self.merger = PatchMerger(config.out_hidden_size, config.hidden_size, self.merge, build, f"{prefix}.merger")

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixels: [patches, C * T * P * P] of every image, in order; grids: each image's (t, h, w) in
        patches. Returns the language-model embeddings of every image, [patches / merge^2, out_dim]."""
        dev, unit = pixels.device, self.merge ** 2
        x = self.patch_embed["proj"](pixels)
        n = x.shape[0]
        groups, windows = window_order(grids, self.merge, self.window)
        groups = tensor_to_device(groups, dev)
        rows = (groups[:, None] * unit + torch.arange(unit, device=dev)).flatten()  # patch rows, window order
        positions = tensor_to_device(patch_positions(grids, self.merge), dev)
        freqs = positions[rows, :, None].float() * self.inv_freq  # [N, 2, hd/4]
        freqs = freqs.flatten(1)
        rope = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        x = x[rows]
        full = self._frames(grids)
        for i, block in enumerate(self.blocks):
            x = block(x, full if i in self.full_attention else windows, rope)
        out = self.merger(x)
        return out[torch.argsort(groups)] if n else out

    @staticmethod
    def _frames(grids) -> list[int]:
        """Full attention: each frame of each image attends within itself."""
        return [h * w for t, h, w in grids for _ in range(t)]
