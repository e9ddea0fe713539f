"""Qwen3-VL's vision tower: patch embedding (with bias) plus a learned position embedding resampled
(bilinear) to each image's grid, LayerNorm blocks with full attention over each image and a 2D rotary
embedding, the patch merger, and the DeepStack mergers: the outputs of a few blocks
(`deepstack_visual_indexes`), merged likewise, which the language model adds to its first layers'
hidden states at the image's tokens.

Replicated on every tensor-parallel rank, dense in the model's dtype (as Qwen2.5-VL's tower)."""
import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.layers.linear import ReplicatedLinear
from nanoinfer.layers.model_build import ModelBuild, join
from nanoinfer.models.qwen2_5_vision import PatchEmbed, VisionAttention, patch_positions
from nanoinfer.utils.device_copy import tensor_to_device


class VisionMLP(nn.Module):
    def __init__(self, dim: int, intermediate: int, build: ModelBuild, prefix: str):
        super().__init__()
        self.linear_fc1 = ReplicatedLinear(dim, intermediate, bias=True, build=build, prefix=join(prefix, "linear_fc1"))
        self.linear_fc2 = ReplicatedLinear(intermediate, dim, bias=True, build=build, prefix=join(prefix, "linear_fc2"))

    def forward(self, x):
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, config, build: ModelBuild, prefix: str):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config.hidden_size, config.num_heads, build, join(prefix, "attn"))
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, build, join(prefix, "mlp"))

    def forward(self, x, segments, rope):
        x = x + self.attn(self.norm1(x), segments, rope)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """2x2 patches -> one language-model token; `postshuffle`: the norm runs on the merged vector
    (DeepStack mergers) instead of on each patch."""

    def __init__(self, config, postshuffle: bool, build: ModelBuild, prefix: str):
        super().__init__()
        self.wide = config.hidden_size * config.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.wide if postshuffle else config.hidden_size, eps=1e-6)
        self.linear_fc1 = ReplicatedLinear(self.wide, self.wide, bias=True, build=build,
                                           prefix=join(prefix, "linear_fc1"))
        self.linear_fc2 = ReplicatedLinear(self.wide, config.out_hidden_size, bias=True, build=build,
                                           prefix=join(prefix, "linear_fc2"))

    def forward(self, x):
        x = self.norm(x.view(-1, self.wide)) if self.postshuffle else self.norm(x).view(-1, self.wide)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VLVisionTransformer(nn.Module):
    def __init__(self, config, build: ModelBuild, prefix: str = "visual"):
        super().__init__()
        if config.hidden_act != "gelu_pytorch_tanh":
            raise ValueError(f"vision_config.hidden_act {config.hidden_act!r}: only 'gelu_pytorch_tanh' is implemented")
        self.merge = config.spatial_merge_size
        self.side = int(config.num_position_embeddings ** 0.5)
        self.patch_embed = nn.ModuleDict({"proj": PatchEmbed(config.in_channels, config.temporal_patch_size,
                                                             config.patch_size, config.hidden_size, bias=True,
                                                             rows_product=build.rows_product)})
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        head_dim = config.hidden_size // config.num_heads
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        half = head_dim // 2
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float) / half),
                             persistent=False)
        self.blocks = nn.ModuleList([VisionBlock(config, build, f"{prefix}.blocks.{i}") for i in range(config.depth)])
        self.merger = PatchMerger(config, False, build, f"{prefix}.merger")
        self.deepstack_indexes = list(config.deepstack_visual_indexes)
        self.deepstack_merger_list = nn.ModuleList([
            PatchMerger(config, True, build, f"{prefix}.deepstack_merger_list.{i}")
            for i in range(len(self.deepstack_indexes))])

    def _position_embeddings(self, grids) -> torch.Tensor:
        """The learned side x side table resampled to each image's grid (bilinear, corners aligned),
        in the processor's patch order (2x2 merge groups)."""
        table = self.pos_embed.weight.view(1, self.side, self.side, -1).permute(0, 3, 1, 2).float()
        out = []
        m = self.merge
        for t, h, w in grids:
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]  # [D, h, w]
            grid = grid.view(-1, h // m, m, w // m, m).permute(1, 3, 2, 4, 0).reshape(h * w, -1)
            out.append(grid.repeat(t, 1))
        return torch.cat(out).to(self.pos_embed.weight.dtype)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Every image's embeddings and DeepStack features: [patches / merge^2, 1 + deepstack, out_dim]."""
        x = self.patch_embed["proj"](pixels) + self._position_embeddings(grids)
        freqs = tensor_to_device(patch_positions(grids, self.merge), x.device)[:, :, None].float() * self.inv_freq
        freqs = freqs.flatten(1)
        rope = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        frames = [h * w for t, h, w in grids for _ in range(t)]
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, frames, rope)
            if i in self.deepstack_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_indexes.index(i)](x))
        return torch.stack([self.merger(x), *deepstack], dim=1)
